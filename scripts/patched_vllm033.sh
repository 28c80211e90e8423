#!/usr/bin/env bash
# Usage: scripts/patched_vllm033.sh PATCH_DIR OUT_DIR
#
# vLLM 0.33.0 with a patch series applied, importable without touching the installed
# vLLM: the patches PATCH_DIR/0*.patch are applied in order with `git am` to vLLM
# 0.33.0's source distribution (OUT_DIR/tree), and the vllm/*.py files the series adds
# or changes are overlaid on a tree of links to the 0.33.0 environment's vllm package
# (OUT_DIR/overlay/vllm), as scripts/test_upstream.sh does, but all patches at once and
# with nothing blocked: this package (the plugin) stays importable beside the patched
# vLLM, so the two can be measured side by side. Prints the overlay's folder; put it
# first on PYTHONPATH and run the 0.33.0 environment's Python with
# VLLM_TARGET_DEVICE=cpu:
#
#   OVERLAY="$(bash scripts/patched_vllm033.sh upstream .cache/patched-vllm033)"
#   PYTHONPATH="$OVERLAY:$PWD" VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python ...
#
# VENV033 names the 0.33.0 environment (default .venv-vllm033; made by
# `VLLM033_CPU_KERNELS=1 bash scripts/setup_vllm033_env.sh`, which this script does not
# run: it never changes an environment). Reused when OUT_DIR was built from the same
# patches and environment; a different series rebuilds it.
set -euo pipefail
if [ "$#" -ne 2 ]; then
  echo "usage: $0 PATCH_DIR OUT_DIR (e.g. $0 upstream .cache/patched-vllm033)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
REPO="$PWD"
abs() { case "$1" in /*) echo "$1" ;; *) echo "$REPO/$1" ;; esac; }
PATCH_DIR="$(abs "$1")"
OUT="$(abs "$2")"
VERSION=0.33.0
VENV033="$(abs "${VENV033:-.venv-vllm033}")"
PY033="$VENV033/bin/python"

shopt -s nullglob
PATCHES=("$PATCH_DIR"/0*.patch)
shopt -u nullglob
if [ "${#PATCHES[@]}" -eq 0 ]; then
  echo "patched_vllm033.sh: no 0*.patch in $PATCH_DIR; pass the series' folder (upstream)" >&2
  exit 2
fi
SITE_VLLM="$("$PY033" -c 'import importlib.metadata as m, importlib.util as u; assert m.version("vllm") == "0.33.0"; print(u.find_spec("vllm").submodule_search_locations[0])' 2>/dev/null)" || {
  echo "patched_vllm033.sh: $PY033 has no vLLM 0.33.0; set VENV033 or run VLLM033_CPU_KERNELS=1 bash scripts/setup_vllm033_env.sh" >&2
  exit 2
}
if [ ! -e "$SITE_VLLM/_C.abi3.so" ]; then
  echo "patched_vllm033.sh: $VENV033 has no CPU kernels (vllm/_C.abi3.so); run VLLM033_CPU_KERNELS=1 bash scripts/setup_vllm033_env.sh" >&2
  exit 2
fi

# What the overlay is made of: the patches' bytes and the environment's vllm package.
STAMP="$( (sha256sum "${PATCHES[@]}" | awk '{print $1}'; echo "$SITE_VLLM") | sha256sum | cut -c1-16)"
if [ -f "$OUT/.complete" ] && [ "$(cat "$OUT/.complete")" = "$STAMP" ]; then
  echo "$OUT/overlay"
  exit 0
fi

SDIST="$(VLLM_SDIST_FULL=1 bash scripts/fetch_vllm_sdist.sh "$VERSION")"
rm -rf "$OUT"
mkdir -p "$OUT"
TREE="$OUT/tree"
cp -a "$SDIST" "$TREE"
rm -f "$TREE/.complete"
git_() {
  GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1 GIT_AUTHOR_NAME=ci GIT_AUTHOR_EMAIL=ci@localhost \
    GIT_COMMITTER_NAME=ci GIT_COMMITTER_EMAIL=ci@localhost git -C "$TREE" "$@"
}
git_ init -q -b main
git_ add -A -f
git_ commit -q --no-verify -m "vLLM $VERSION"
git_ tag base
for patch in "${PATCHES[@]}"; do
  if ! git_ am -q --keep-non-patch "$patch" >&2; then
    echo "patched_vllm033.sh: $(basename "$patch") does not apply to vLLM $VERSION" >&2
    exit 1
  fi
done

# The wheel's vllm package as a tree of links; the series' vllm/ files replace theirs
# (with their byte-compiled forms, which would be the wheel's), files it deletes go.
OVERLAY="$OUT/overlay"
mkdir -p "$OVERLAY"
cp -as "$SITE_VLLM" "$OVERLAY/vllm"
pyc_of() { echo "$(dirname "$OVERLAY/$1")/__pycache__/$(basename "$1" .py)"; }
mapfile -t CHANGED < <(git_ diff --name-only --diff-filter=AM base HEAD -- 'vllm/*.py')
mapfile -t DELETED < <(git_ diff --name-only --diff-filter=D base HEAD -- 'vllm/*.py')
for f in "${DELETED[@]}"; do rm -f "$OVERLAY/$f" "$(pyc_of "$f")".*.pyc; done
OVERLAID=()
for f in "${CHANGED[@]}"; do
  rm -f "$OVERLAY/$f" "$(pyc_of "$f")".*.pyc
  mkdir -p "$(dirname "$OVERLAY/$f")"
  cp "$TREE/$f" "$OVERLAY/$f"
  OVERLAID+=("$OVERLAY/$f")
done
if [ "${#OVERLAID[@]}" -gt 0 ]; then "$PY033" -m compileall -q "${OVERLAID[@]}" >/dev/null; fi
git_ log --reverse --format='%s' base..HEAD > "$OUT/series.txt"
printf '%s\n' "${CHANGED[@]}" > "$OUT/overlaid.txt"
echo "$STAMP" > "$OUT/.complete"
echo "$OVERLAY"
