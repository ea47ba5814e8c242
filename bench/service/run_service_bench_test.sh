#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the whole service benchmark in --quick mode (CPU backend, tiny shapes) against the
# built lossd and checks that it ends cleanly with a complete report: every section, every
# transfer and point without an error, and a pass/fail verdict for every target.
set -uo pipefail
ROOT="${TEST_SRCDIR:?}/lossd"
OUT="${TEST_TMPDIR:?}/out"
"$ROOT/bench/service/run_service_bench.sh" --quick --bazel_bin="$ROOT" "$OUT" > "$OUT.txt" 2>&1
rc=$?
fail() { echo "FAIL: $*"; cat "$OUT.txt"; exit 1; }
[ $rc = 0 ] || fail "run_service_bench.sh exited $rc"
MD="$OUT/service_bench.md"
[ -s "$MD" ] || fail "no report"
for section in "## Loopback ceilings" "## Server compute time" "## End to end per micro-batch" "## Targets"; do
  grep -q "^$section" "$MD" || fail "section '$section' missing"
done
for key in tcp_up_1 tcp_down_1 tcp_up_4 tcp_down_4 grpc_up_1 grpc_down_1 grpc_up_4 grpc_down_4; do
  v=$(sed -n "s/^$key=//p" "$OUT/ceilings.txt")
  awk -v v="$v" 'BEGIN { exit !(v > 0) }' || fail "ceiling $key is '$v'"
done
# 6 transfers, 3 modes x (2 + 3) client counts + the busy point = 16 points.
n=$(grep -cE '^\| (PutWeights|FetchGradients)' "$MD")
[ "$n" = 6 ] || fail "expected 6 transfer rows, got $n"
n=$(grep -cE '^\| \([0-9]+, [0-9]+, [0-9]+\) \| (W inline|W by handle|handle \+ accumulator)' "$MD")
[ "$n" = 16 ] || fail "expected 16 end-to-end rows, got $n"
# The last column of these rows is the error: it must be empty.
grep -E '^\| (PutWeights|FetchGradients)|^\| \([0-9, ]+\) \| (W inline|W by handle|handle \+ accumulator)' "$MD" |
  grep -vE '\|  \|$' && fail "a row reports an error"
grep -q "MISSING" "$MD" && fail "a target lacks its measurement"
grep -qE "^targets: [0-9]+ passed, [0-9]+ failed or missing$" "$MD" || fail "no target summary"
echo "PASS"
