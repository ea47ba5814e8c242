#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs CUTLASS's C++ headers (the nvidia-cutlass 4.2.0.0 wheel, which carries cute/ and
# cutlass/ under cutlass_library/source/include) into a known folder for @cutlass
# (third_party/cutlass). Only the sm_90a experiments need it; the default build and CI do not.
#
# Usage: tools/setup_cutlass.sh [WHEEL]   (WHEEL: a local .whl; else pip fetches the pinned one)
# Folder: $LOSSD_CUTLASS_DIR, default ~/.cache/lossd/nvidia-cutlass-4.2.0.0 (the same default
# third_party/cutlass/cutlass_configure.bzl reads).
set -euo pipefail

VERSION=4.2.0.0
DIR="${LOSSD_CUTLASS_DIR:-$HOME/.cache/lossd/nvidia-cutlass-$VERSION}"
if [[ -f "$DIR/cutlass_library/source/include/cute/tensor.hpp" ]]; then
  echo "setup_cutlass: CUTLASS $VERSION headers already in $DIR"
  exit 0
fi
SRC="${1:-nvidia-cutlass==$VERSION}"
# --no-deps: only the headers are wanted, not the Python packages the wheel depends on.
python3 -m pip install --quiet --no-deps --target "$DIR" "$SRC"
[[ -f "$DIR/cutlass_library/source/include/cute/tensor.hpp" ]] ||
  { echo "setup_cutlass: $SRC has no cutlass_library/source/include" >&2; exit 1; }
echo "setup_cutlass: CUTLASS $VERSION headers in $DIR; run 'bazel sync --configure' if Bazel saw none before"
