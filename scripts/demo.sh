#!/usr/bin/env bash
# The main job: the long-document QA comparison (prefix caching alone vs --enable-cpu-offload)
# on the locally generated model; prints the table, writes JSON and a plot to
# benchmarks/results/. Arguments go to benchmarks/long_document_qa.py (e.g. --docs 16).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
"${VENV:-.venv}/bin/python" benchmarks/long_document_qa.py "$@"
