#!/usr/bin/env bash
# On a CUDA machine (vLLM not needed): the transfer tests (every backend's start-up on a
# restored tier among them: tests/kernels/test_restored_tier_start_up.py), then the
# transfer benchmark on an unpinned host buffer (bounce copier against torch copies) and
# with every copier, staged ones at several chunk sizes. Logs and
# JSON go to $OUT (or benchmarks/results). One run of this is the whole GPU check of the transfer engine.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv \
    | tee "$out/gpu.txt"
"$PY" -m pytest -q -p no:cacheprovider tests/kernels tests/unit/test_transfer_engine.py \
    tests/unit/test_host_buffer.py tests/unit/test_kv_layout.py tests/unit/test_bounce_copy.py \
    2>&1 | tee "$out/gpu_tests.log"
# An unpinned tier (a --swap-space-path on a disk file system): bounce copier vs torch copies.
"$PY" benchmarks/transfer.py --reps 5 --ids scattered --layouts lbhnc flash --shapes llama3-8b \
    --unpinned --out "$out/transfer_gpu_unpinned.json" 2>&1 | tee "$out/gpu_transfer_unpinned.log"
"$PY" benchmarks/transfer.py --reps 9 --ids scattered --layouts lbhnc \
    --staged-chunks 4 8 16 --out "$out/transfer_gpu_staged.json" 2>&1 | tee "$out/gpu_transfer.log"
