#!/usr/bin/env bash
# Fetches a vLLM source distribution (its tests/ and benchmarks/) from PyPI, checks its sha256
# and unpacks it to $VLLM_CPU_OFFLOAD_CACHE/vllm-VERSION (default ~/.cache/vllm_cpu_offload).
# VERSION is the first argument (default 0.32.0); 0.32.0 and 0.33.0 are known. Reused when
# present. Prints the folder. With VLLM_SDIST_FULL=1 it unpacks the whole tree instead, to
# vllm-VERSION-full (what upstream/*.patch applies to).
set -euo pipefail
VERSION="${1:-0.32.0}"
case "$VERSION" in
  0.32.0)
    SHA256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
    URL_DIR=d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33 ;;
  0.33.0)
    SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
    URL_DIR=f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169 ;;
  *)
    echo "fetch_vllm_sdist.sh: no checksum for vLLM $VERSION; add it to this script" >&2
    exit 1 ;;
esac
URL="https://files.pythonhosted.org/packages/$URL_DIR/vllm-${VERSION}.tar.gz"
CACHE="${VLLM_CPU_OFFLOAD_CACHE:-$HOME/.cache/vllm_cpu_offload}"
DEST="$CACHE/vllm-$VERSION"
MEMBERS=("vllm-$VERSION/tests" "vllm-$VERSION/benchmarks")
if [ "${VLLM_SDIST_FULL:-0}" = 1 ]; then DEST="$CACHE/vllm-$VERSION-full"; MEMBERS=(); fi
if [ -f "$DEST/.complete" ]; then echo "$DEST"; exit 0; fi
mkdir -p "$CACHE"
TARBALL="$CACHE/vllm-$VERSION.tar.gz"
curl -sSfL --retry 3 -m 300 -o "$TARBALL.part" "$URL"
echo "$SHA256  $TARBALL.part" | sha256sum -c --quiet
mv "$TARBALL.part" "$TARBALL"
rm -rf "$DEST"
if [ "${#MEMBERS[@]}" -eq 0 ]; then
  mkdir -p "$DEST"
  tar -xzf "$TARBALL" -C "$DEST" --strip-components=1
else
  tar -xzf "$TARBALL" -C "$CACHE" "${MEMBERS[@]}"
fi
rm -f "$TARBALL"
touch "$DEST/.complete"
echo "$DEST"
