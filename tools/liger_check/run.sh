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
TEST_REL=test/transformers/test_fused_linear_cross_entropy.py

# shellcheck source=liger_sdist.sh
source "$HERE/liger_sdist.sh"
skip() { liger_skip "liger fused linear cross-entropy tests" liger_flce "$JUNIT" "$1"; }

liger_sdist "$TEST_REL" || skip "$LIGER_WHY"
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
