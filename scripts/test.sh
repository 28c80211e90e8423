#!/usr/bin/env bash
# The test command: lint, type check, then every test on real vLLM (CPU platform).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY="${VENV:-.venv}/bin/python"
"$PY" -m ruff check vllm_cpu_offload vllm_cpu_offload_hook.py setup.py tests benchmarks
"$PY" -m mypy vllm_cpu_offload vllm_cpu_offload_hook.py
set +e
"$PY" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "no tests ran"; exit 1; fi
exit "$rc"
