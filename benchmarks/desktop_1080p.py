"""The real-desktop run at real size, measured: `dart run examples/desktop-1080p.yaml` on the checkpoint its header
names (written first when missing: `dart model init --arch qwen2.5-vl-3b --layers 2 --vision-blocks 2`), then what
its trajectories cost the bus against the same trajectories with their prompt images inline
(``benchmarks/trajectory_bytes.py``).

Random weights never succeed, so the run keeps zero-variance groups (``data.grouping.drop_zero_variance``
false, as the example's header says). ``--set KEY=VALUE`` passes more ``DART_...`` overrides (e.g.
``DART_ROLLOUT__ENGINE__DEVICE=cpu``); ``--config`` runs another config (the tests' short form,
``examples/smoke-desktop-1080p.yaml``, with ``--no-init``). ``--narrow`` writes the checkpoint at widths two CPU
cores run (:func:`narrowed`: the processor, tokenizer, vocabulary and layer counts of the real-width cut, so every
prompt, answer and message has its shapes and sizes) and runs the engine and the trainer on the CPU in float32:
the example's figures on a machine without a GPU, in about 65 minutes on 2 cores.

Usage::

    python benchmarks/desktop_1080p.py [--config FILE] [--model DIR [--narrow] | --no-init] [--out DIR]
        [--set KEY=VALUE ...]

Prints the run's figures; the last line is one JSON object (the summary's figures, the bus bytes, the phases).
``--out`` also gets ``summary.json``, ``bytes.json``, the tails of the services' logs (``service-logs.txt``) and
the run's largest and median stored image; a failed run leaves its logs' tails and images there too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import trajectory_bytes

ROOT = Path(__file__).resolve().parents[1]
KEPT = (
    "versions_published",
    "engine_weight_updates",
    "trajectories_produced",
    "trajectories_stored",
    "trajectories_lost",
    "mean_steps_per_trajectory",
    "max_steps_per_trajectory",
    "bus_bytes_per_trajectory",
    "largest_trajectory_message_bytes",
    "rl_seconds",
    "total_seconds",
    "trajectories_per_minute",
    "env_utilization",
    "engine_utilization",
    "trainer_utilization",
    "gpu",
    "placement",
    "config_warnings",
    "service_exit_codes",
    "error",
)


CPU = (("DEVICE", "cpu"), ("DTYPE", "float32"))
"""The engine's and the trainer's settings with ``--narrow``."""


def init_model(path: Path, *, narrow: bool = False) -> float:
    """Write the example's checkpoint into ``path`` (``narrow``: at :func:`narrowed`'s widths, in float32);
    returns the seconds it took."""
    began = time.monotonic()
    if narrow:
        from dart.policy.architectures import get_architecture
        from dart.policy.random_init import write_checkpoint

        write_checkpoint(
            path, narrowed(get_architecture("qwen2.5-vl-3b").cut(layers=2, vision_blocks=2)), dtype="float32"
        )
    else:
        cmd = [sys.executable, "-m", "dart.cli", "model", "init", "--arch", "qwen2.5-vl-3b", "--layers", "2"]
        subprocess.run([*cmd, "--vision-blocks", "2", str(path)], check=True, cwd=ROOT)
    return round(time.monotonic() - began, 1)


def narrowed(arch: Any) -> Any:
    """``arch`` (a Qwen2.5-VL size) at widths two CPU cores run fast: 256 wide with one 128-wide head pair, a
    128-wide vision tower. The processor, the tokenizer, the vocabulary and the layer counts stay, so the
    prompts, the answers a random policy draws and every message the run sends have the real-width cut's
    shapes and sizes; only the arithmetic shrinks."""
    vision = replace(arch.vision, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256)
    return replace(
        arch,
        name=f"{arch.name}-narrow",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=2,
        num_key_value_heads=1,
        vision=vision,
    )


def run(config: Path, runs_root: Path, overrides: dict[str, str]) -> dict[str, Any]:
    """``dart run config``; its summary (the last stdout line). A failed run exits with its output's tail."""
    env = {**os.environ, "DART_RUN__RUNS_ROOT": str(runs_root), **overrides}
    done = subprocess.run(
        [sys.executable, "-m", "dart.cli", "run", str(config)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"dart run exited {done.returncode}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def keep_samples(run_dir: Path, out: Path) -> None:
    """The tails of the services' logs (one file), the run's largest and median stored image, into ``out``."""
    tails = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        tails.append(f"==> {log.name} <==\n" + "".join(log.read_text(errors="replace").splitlines(True)[-100:]))
    (out / "service-logs.txt").write_text("\n".join(tails))
    images = sorted((run_dir / "artifacts").rglob("*.png"), key=lambda p: p.stat().st_size)
    if images:
        shutil.copy(images[-1], out / "largest-image.png")
        shutil.copy(images[len(images) // 2], out / "median-image.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "desktop-1080p.yaml")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "qwen2.5-vl-3b-2l")
    parser.add_argument("--no-init", action="store_true", help="the config needs no checkpoint written")
    parser.add_argument("--narrow", action="store_true", help="write the checkpoint at CPU widths (see narrowed)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a DART_... override")
    args = parser.parse_args()
    overrides = {"DART_DATA__GROUPING__DROP_ZERO_VARIANCE": "false"}
    if args.narrow:
        overrides |= {f"DART_{part}__{key}": value for part in ("ROLLOUT__ENGINE", "TRAIN") for key, value in CPU}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("DART_"):
            parser.error(f"--set {item!r}: expected DART_SECTION__KEY=VALUE")
        overrides[key] = value
    phases: dict[str, float] = {}
    if not args.no_init and not (args.model / "config.json").is_file():
        phases["model_init_s"] = init_model(args.model, narrow=args.narrow)
        print(f"checkpoint written to {args.model} in {phases['model_init_s']} s")
    if not args.no_init:
        overrides.setdefault("DART_MODEL__PATH", str(args.model))
    runs_root = Path(tempfile.mkdtemp(prefix="desktop-1080p-"))
    began = time.monotonic()
    try:
        summary = run(args.config, runs_root, overrides)
    except SystemExit:
        if args.out is not None:  # what the services said, for the failed run too
            args.out.mkdir(parents=True, exist_ok=True)
            for run_dir in runs_root.iterdir():
                keep_samples(run_dir, args.out)
        raise
    phases["dart_run_s"] = round(time.monotonic() - began, 1)
    run_dir = Path(summary["run_dir"])
    figures = trajectory_bytes.measure(run_dir)
    print(
        f"{summary['versions_published']} versions, {summary['trajectories_stored']} trajectories stored, "
        f"{summary['trajectories_lost']} lost, {summary['mean_steps_per_trajectory']} steps each on average"
    )
    for form in ("by_reference", "by_reference_json", "prompt_images_inline", "all_inline"):
        f = figures[form]
        print(
            f"{form}: mean {f['mean_bytes']:,} B, largest {f['max_bytes']:,} B per trajectory, "
            f"{f['over_bus_limit']} of {figures['trajectories']} over the bus limit"
        )
    result = {
        "config": str(args.config),
        **{k: summary.get(k) for k in KEPT},
        "bytes": figures,
        "phases": phases,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        (args.out / "bytes.json").write_text(json.dumps(figures, indent=1))
        keep_samples(run_dir, args.out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
