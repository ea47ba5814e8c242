#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs Liger-Kernel's own GRPO and JSD loss tests (test/chunked_loss/test_grpo_loss.py and
# test_jsd_loss.py of its sdist, unmodified) against lossd.rl: lossd_liger_rl_shim.py starts a
# lossd server and points Liger's GRPO and JSD entry points at lossd.rl's; a case asking for
# what lossd does not build reports itself skipped with the reason, one where lossd differs on
# purpose is a strict xfail with it. Usage: tools/liger_check/run_rl.sh [JUNIT_XML]
# Env: LOSSD_BIN, LIGER_SDIST, LOSSD_LIGER_BACKEND as run.sh's; LIGER_RL_SELECT (pytest -k;
#      default: every case but the (8, 128, 1024, 4096) shape of test_correctness and
#      test_functional_correctness, which alone take about 2 of a full run's 4 minutes on 2
#      cores; the (1, 4096, 256, 5000) cases still exercise the chunking; "" runs all 1676).
# Needs torch, transformers, pytest and the lossd client's packages. Where the sdist cannot be
# fetched it says SKIP, writes a JUnit report with one skipped test and exits 0.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
JUNIT=${1:-}
TESTS=(test/chunked_loss/test_grpo_loss.py test/chunked_loss/test_jsd_loss.py)
SELECT=${LIGER_RL_SELECT-not 8-128-1024-4096}

# shellcheck source=liger_sdist.sh
source "$HERE/liger_sdist.sh"
skip() { liger_skip "liger GRPO and JSD loss tests" liger_rl "$JUNIT" "$1"; }

for t in "${TESTS[@]}"; do
  liger_sdist "$t" || skip "$LIGER_WHY"
done
python3 -c "import torch, transformers, pytest" 2>/dev/null ||
  skip "torch, transformers or pytest is not installed"

export LOSSD_BIN=${LOSSD_BIN:-$(cd "$ROOT" && bazel info bazel-bin 2>/dev/null)/service/lossd}
[[ -x "$LOSSD_BIN" ]] || { echo "FAIL: no lossd binary at $LOSSD_BIN"; exit 1; }
# As run.sh: the shims and the lossd client first, then Liger's src/ and the sdist's root.
export PYTHONPATH="$HERE:$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
cd "$SDIST"
# -rsx lists every skip and xfail with its reason.
args=(-q -rsx -p no:cacheprovider -p lossd_liger_rl_shim -o log_cli=false "${TESTS[@]}")
[[ -n "$SELECT" ]] && args+=(-k "$SELECT")
[[ -n "$JUNIT" ]] && args+=(--junitxml="$JUNIT")
exec python3 -m pytest "${args[@]}"
