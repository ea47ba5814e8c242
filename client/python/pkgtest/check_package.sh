#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the lossd sdist from the checkout, a wheel from that sdist alone, installs the wheel
# into a fresh virtual environment of PYTHON (default python3) and runs smoke.py in it against
# a live lossd. Fails if any of it writes into the checkout (build/, *.egg-info, a descriptor).
# Usage: client/python/pkgtest/check_package.sh LOSSD_BINARY [CONSTRAINTS_FILE]
# Env: PYTHON, KEEP_DIST=DIR (copy the sdist and wheel there). Needs pip's access to the index
# (the build installs setuptools and grpcio-tools in its own environment), and `build`.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PKG=$(dirname "$HERE")
ROOT=$(cd "$PKG/../.." && pwd)
BIN=$1
CONSTRAINTS=${2:-}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Files the build could leave: untracked or ignored ones (edits to tracked files are not its).
state() {
  git -C "$ROOT" status --porcelain --ignored --untracked-files=all -- client/python proto |
    grep -E '^(\?\?|!!)' | grep -v '/__pycache__/' || true
}
before=$(state)

"$PY" -m build --sdist --outdir "$WORK/dist" "$PKG" > "$WORK/sdist.log" 2>&1 ||
  { tail -30 "$WORK/sdist.log"; exit 1; }
sdist=$(ls "$WORK"/dist/lossd-*.tar.gz)
# (Listings are saved before grep: grep -q would close the pipe early and fail pipefail.)
tar -tzf "$sdist" > "$WORK/sdist.txt"
grep -q '/proto/lossd/v1/lossd.proto$' "$WORK/sdist.txt" || { echo "sdist lacks the proto"; exit 1; }
# The wheel from the sdist alone, unpacked far from the checkout (no proto/ above it).
mkdir "$WORK/unpacked"
tar -xzf "$sdist" -C "$WORK/unpacked"
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK"/unpacked/lossd-* > "$WORK/wheel.log" 2>&1 ||
  { tail -30 "$WORK/wheel.log"; exit 1; }
wheel=$(ls "$WORK"/dist/lossd-*.whl)
"$PY" -m zipfile -l "$wheel" > "$WORK/wheel.txt"
grep -q 'lossd/v1/lossd.binpb' "$WORK/wheel.txt" || { echo "wheel lacks the descriptor"; exit 1; }
"$PY" -m zipfile -e "$wheel" "$WORK/whl"
grep -q '^License-Expression: Apache-2.0$' "$WORK"/whl/lossd-*.dist-info/METADATA ||
  { echo "no SPDX License-Expression in the wheel's METADATA"; exit 1; }

"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --only-binary=grpcio,numpy \
  ${CONSTRAINTS:+-c "$CONSTRAINTS"} "$wheel"
(cd "$WORK" && "$WORK/venv/bin/python" "$HERE/smoke.py" "$BIN")

after=$(state)
if [[ "$before" != "$after" ]]; then
  echo "the build wrote into the checkout:"
  diff <(echo "$before") <(echo "$after") || true
  exit 1
fi
if [[ -n "${KEEP_DIST:-}" ]]; then mkdir -p "$KEEP_DIST" && cp "$sdist" "$wheel" "$KEEP_DIST/"; fi
echo "check_package: OK ($(basename "$wheel") from $(basename "$sdist"))"
