#!/usr/bin/env bash
# The test command: lint, type check, then every test on real vLLM (CPU platform). With no
# arguments it then runs vLLM 0.32.0's own test suite with the plugin loaded
# (tests/vllm_suite), the package against vLLM 0.33.0 (scripts/test_vllm033.sh) and its
# upstream form, the patch series against vLLM 0.32.0 (scripts/test_upstream.sh).
# Arguments go to pytest and run only what they name.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY="${VENV:-.venv}/bin/python"
"$PY" -m ruff check vllm_cpu_offload vllm_cpu_offload_hook.py setup.py tests benchmarks \
  scripts/make_upstream_series.py
"$PY" -m mypy vllm_cpu_offload vllm_cpu_offload_hook.py
set +e
"$PY" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "no tests ran"; exit 1; fi
if [ "$rc" -ne 0 ] || [ "$#" -gt 0 ]; then exit "$rc"; fi
echo "== vLLM 0.32.0's own tests, plugin loaded"
"$PY" -m tests.vllm_suite.run
echo "== vLLM 0.33.0"
bash scripts/test_vllm033.sh
echo "== the upstream form: patch series against vLLM 0.32.0"
bash scripts/test_upstream.sh
