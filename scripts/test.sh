#!/usr/bin/env bash
# The test command: lint, type check, then every test on real vLLM (CPU platform). With no
# arguments it then runs vLLM 0.32.0's own test suite with the plugin loaded
# (tests/vllm_suite) and the package against vLLM 0.33.0 (scripts/test_vllm033.sh).
# Arguments go to pytest and run only what they name. Each stage prints its minutes: CI's
# budget is 90 minutes; a fresh clone's full run took 55 minutes on a 2-vCPU AMX Xeon
# (2026-12-03), the last landing's 4,940 s on CI's machine.
set -euo pipefail
cd "$(dirname "$0")/.."
stage_start=$SECONDS
took() {
  echo "== $1: $(((SECONDS - stage_start) / 60)) min $(((SECONDS - stage_start) % 60)) s" \
    "(total $((SECONDS / 60)) min)"
  stage_start=$SECONDS
}
bash scripts/setup_env.sh
PY="${VENV:-.venv}/bin/python"
"$PY" -m ruff check vllm_cpu_offload vllm_cpu_offload_hook.py setup.py tests benchmarks scripts
"$PY" -m mypy vllm_cpu_offload vllm_cpu_offload_hook.py tests scripts
took "set-up, ruff and mypy"
# The whole suite runs in two pytest-xdist processes, a test file to each at a time (its
# module-scoped engines and servers stay in one process): most of an end-to-end test is
# one core's work (a server's start-up, Python imports, waits on HTTP), so two files at
# once fill CI's two cores.
PARALLEL=()
if [ "$#" -eq 0 ]; then PARALLEL=(-n 2 --dist loadfile); fi
set +e
"$PY" -m pytest -q -p no:cacheprovider --durations=40 "${PARALLEL[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "no tests ran"; exit 1; fi
if [ "$rc" -ne 0 ] || [ "$#" -gt 0 ]; then exit "$rc"; fi
took "pytest on vLLM 0.32.0"
echo "== vLLM 0.32.0's own tests, plugin loaded"
"$PY" -m tests.vllm_suite.run
took "vLLM 0.32.0's own tests"
echo "== vLLM 0.33.0"
bash scripts/test_vllm033.sh
took "vLLM 0.33.0"
echo "== the upstream series on vLLM 0.33.0"
bash scripts/test_upstream.sh
took "the upstream series"
