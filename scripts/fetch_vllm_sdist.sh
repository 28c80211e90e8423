#!/usr/bin/env bash
# Fetches vLLM 0.32.0's source distribution (its tests/ and benchmarks/) from PyPI, checks its
# sha256 and unpacks it to $VLLM_CPU_OFFLOAD_CACHE/vllm-0.32.0 (default ~/.cache/vllm_cpu_offload).
# Reused when present. Prints the folder.
set -euo pipefail
VERSION=0.32.0
SHA256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
URL="https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-${VERSION}.tar.gz"
CACHE="${VLLM_CPU_OFFLOAD_CACHE:-$HOME/.cache/vllm_cpu_offload}"
DEST="$CACHE/vllm-$VERSION"
if [ -f "$DEST/.complete" ]; then echo "$DEST"; exit 0; fi
mkdir -p "$CACHE"
TARBALL="$CACHE/vllm-$VERSION.tar.gz"
curl -sSfL --retry 3 -m 300 -o "$TARBALL.part" "$URL"
echo "$SHA256  $TARBALL.part" | sha256sum -c --quiet
mv "$TARBALL.part" "$TARBALL"
rm -rf "$DEST"
tar -xzf "$TARBALL" -C "$CACHE" "vllm-$VERSION/tests" "vllm-$VERSION/benchmarks"
rm -f "$TARBALL"
touch "$DEST/.complete"
echo "$DEST"
