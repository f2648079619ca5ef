#!/usr/bin/env bash
# Build DART's container images from the lock file: dart:<tag> (every package, the `dart` command)
# and dart-env:<tag> (dart-env without torch, plus Chromium, Xvfb and the desktop programs).
#
#   scripts/build-images.sh [--base IMAGE | --local-base] [--offline-infra] [--tag TAG]
#
#   --base IMAGE      base image (default python:3.11-slim-bookworm, from a registry)
#   --local-base      make the base here instead (mmdebstrap + docker import; no registry needed)
#   --offline-infra   also build dart-postgres:<tag> and dart-prometheus:<tag> from Debian packages,
#                     for deploy/docker-compose.offline.yml where no registry is reachable
#   --tag TAG         image tag (default: the workspace version)
#
# deploy/build/ (ignored by git) holds every third-party wheel the lock pins, downloaded here with the
# lock's hashes (pip inside a build may not reach an index; wheels already there are reused), and the
# DART packages' wheels. It is served on loopback while the images build, so no wheel is copied into
# the daemon: each image's venv is one layer. The build context is deploy/build/context (one script).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE="python:3.11-slim-bookworm"
LOCAL_BASE=0
OFFLINE_INFRA=0
TAG="$(sed -n 's/^version = "\(.*\)"/\1/p' packages/dart-protocol/pyproject.toml)"
while [ $# -gt 0 ]; do
    case "$1" in
        --base) BASE="$2"; shift 2 ;;
        --local-base) LOCAL_BASE=1; shift ;;
        --offline-infra) OFFLINE_INFRA=1; shift ;;
        --tag) TAG="$2"; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
DOCKER="${DOCKER:-docker}"
OUT=deploy/build
step() { echo "[build-images $(date +%H:%M:%S)] $*"; }

if [ "$LOCAL_BASE" = 1 ]; then
    BASE="dart-base:bookworm"
    if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
        step "making $BASE (mmdebstrap bookworm minbase + python3)"
        command -v mmdebstrap >/dev/null || { echo "error: --local-base needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
        mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm - \
            | "$DOCKER" import - "$BASE"
    fi
fi

step "wheels for the lock file into $OUT"
rm -rf "$OUT/dist" "$OUT/context" "$OUT"/*/dist
uv build --quiet --all-packages --wheel --out-dir "$OUT/dist"
# Per image: the locked third-party dependencies of its top package with their hashes, those wheels
# (pip evaluates the lock's markers here, so the host's Python must be the images': 3.11 on linux
# x86_64), and the DART wheels it installs. No pip cache: the wheels directory is the cache.
declare -A TOP=([dart]=dart-cli [env]=dart-env)
declare -A OWN=([dart]="dart_protocol dart_runtime dart_policy dart_env dart_rollout dart_data dart_train dart_embedded dart_cli" [env]="dart_protocol dart_runtime dart_env")
for image in env dart; do
    mkdir -p "$OUT/$image/third-party" "$OUT/$image/dist"
    uv export --quiet --frozen --no-dev --no-emit-workspace --package "${TOP[$image]}" -o "$OUT/$image/requirements.txt"
    # pip is the workspace's (locked in the dev group); its "Location ... is ignored" warnings about a
    # machine's local find-links are noise here.
    { uv run --frozen python -m pip download --quiet --disable-pip-version-check --no-cache-dir --no-deps \
        --only-binary=:all: --require-hashes -r "$OUT/$image/requirements.txt" -d "$OUT/$image/third-party" 2>&1 1>&3 \
        | { grep -v "^WARNING: Location '" || true; } >&2; } 3>&1
    for pkg in ${OWN[$image]}; do
        cp "$OUT/dist/${pkg}-"*.whl "$OUT/$image/dist/"
    done
done
mkdir -p "$OUT/context"
cp deploy/install-venv.sh "$OUT/context/"

# The wheel server: loopback only, for as long as this script runs. The builds use the host's network
# so that their RUN steps reach it.
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
python3 -m http.server "$PORT" --bind 127.0.0.1 --directory "$OUT" >"$OUT/wheel-server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
WHEELS="http://127.0.0.1:$PORT"
for _ in $(seq 100); do
    python3 -c "import urllib.request; urllib.request.urlopen('$WHEELS/dart/requirements.txt', timeout=2)" 2>/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { echo "error: the wheel server exited:" >&2; cat "$OUT/wheel-server.log" >&2; exit 1; }
    sleep 0.1
done

BUILD_ARGS=(--network host --build-arg "BASE=$BASE" --build-arg "WHEELS=$WHEELS")
step "building dart-env:$TAG (base $BASE)"
"$DOCKER" build --quiet -f deploy/Dockerfile --target env "${BUILD_ARGS[@]}" -t "dart-env:$TAG" "$OUT/context"
step "building dart:$TAG"
"$DOCKER" build --quiet -f deploy/Dockerfile --target dart "${BUILD_ARGS[@]}" -t "dart:$TAG" "$OUT/context"
if [ "$OFFLINE_INFRA" = 1 ]; then
    for target in postgres prometheus; do
        step "building dart-$target:$TAG (Debian packages)"
        "$DOCKER" build --quiet -f deploy/offline/Dockerfile --target "$target" --build-arg "BASE=$BASE" \
            -t "dart-$target:$TAG" deploy/offline
    done
fi
# Untagged images of these builds are not kept: those the new tags replaced.
"$DOCKER" image prune --force --filter label=org.dart.built-by=build-images >/dev/null
step "done: dart:$TAG dart-env:$TAG"
