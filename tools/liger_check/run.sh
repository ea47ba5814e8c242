#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs Liger-Kernel's own fused linear cross-entropy tests
# (test/transformers/test_fused_linear_cross_entropy.py of its sdist, unmodified) against lossd's
# Python client: lossd_liger_shim.py starts a lossd server and points Liger's three entry points
# at lossd.nn. Usage: tools/liger_check/run.sh [JUNIT_XML]
# Env: LOSSD_BIN (default: $(bazel info bazel-bin)/service/lossd), LIGER_SDIST (an unpacked sdist
#      folder; default: liger-kernel $LIGER_VERSION, 0.8.5, fetched with pip into
#      ~/.cache/lossd/liger), LOSSD_LIGER_BACKEND (cpu; cuda on a GPU host).
# Needs torch, transformers, pytest and the lossd client's packages (grpcio, protobuf, numpy).
# Where the sdist cannot be fetched it says SKIP, writes a JUnit report with one skipped test
# and exits 0.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
JUNIT=${1:-}
VERSION=${LIGER_VERSION:-0.8.5}
TEST_REL=test/transformers/test_fused_linear_cross_entropy.py

skip() {
  echo "SKIP liger fused linear cross-entropy tests: $1"
  if [[ -n "$JUNIT" ]]; then
    cat >"$JUNIT" <<XML
<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="liger_flce" tests="1" skipped="1" failures="0" errors="0">
<testcase classname="liger_flce" name="test_fused_linear_cross_entropy"><skipped message="$1"/></testcase>
</testsuite></testsuites>
XML
  fi
  exit 0
}

SDIST=${LIGER_SDIST:-}
if [[ -z "$SDIST" ]]; then
  CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/lossd/liger
  SDIST=$CACHE/liger_kernel-$VERSION
  if [[ ! -f "$SDIST/$TEST_REL" ]]; then
    mkdir -p "$CACHE"
    # The source distribution, which carries the tests (the wheel does not); not built.
    python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
      "liger-kernel==$VERSION" -d "$CACHE" >/dev/null 2>&1 || true
    archive=$(ls "$CACHE"/liger_kernel-"$VERSION".tar.gz 2>/dev/null | head -1)
    [[ -n "$archive" ]] || skip "liger-kernel $VERSION's sdist could not be fetched"
    tar -xzf "$archive" -C "$CACHE" || skip "liger-kernel $VERSION's sdist could not be unpacked"
  fi
fi
[[ -f "$SDIST/$TEST_REL" ]] || skip "no $TEST_REL under $SDIST"
python3 -c "import torch, transformers, pytest" 2>/dev/null ||
  skip "torch, transformers or pytest is not installed"

export LOSSD_BIN=${LOSSD_BIN:-$(cd "$ROOT" && bazel info bazel-bin 2>/dev/null)/service/lossd}
[[ -x "$LOSSD_BIN" ]] || { echo "FAIL: no lossd binary at $LOSSD_BIN"; exit 1; }
# Liger's pytest settings put src/ and the sdist's root on the path (its test/ package); the
# shim and the lossd client come first.
export PYTHONPATH="$HERE:$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
cd "$SDIST"
args=(-q -p no:cacheprovider -p lossd_liger_shim -o log_cli=false "$TEST_REL")
[[ -n "$JUNIT" ]] && args+=(--junitxml="$JUNIT")
exec python3 -m pytest "${args[@]}"
