#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Quick start, command 2: installs what is missing and runs every test that runs without a
# GPU: the Bazel tests (GPU tests, tagged `gpu`, are built but skipped), the Python client
# tests against a live server, the Prometheus test, the manifest checks and a bounded fuzz
# run. Ends with one line "N passed, N failed, N skipped" summed over every JUnit report.
set -uo pipefail
cd "$(dirname "$0")/.."
LOSSD_SETUP_TEST_EXTRAS=1 tools/setup.sh || exit 1

reports="$(mktemp -d)"
status=0

# 1. C++: every target built (CUDA code compiled where the toolkit exists), GPU tests skipped.
bazel build //... || status=1
bazel test //... --config=nogpu --test_output=errors || status=1
testlogs="$(bazel info bazel-testlogs)"
i=0
while IFS= read -r -d '' xml; do
  cp "$xml" "$reports/bazel_$((i++)).xml"
done < <(find -L "$testlogs" -name test.xml -print0)
gpu_skipped=$(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null | wc -l)

# 2. Python client and Prometheus tests (they start the lossd binary built above).
if [[ -x tests/python_and_prometheus.sh ]]; then
  LOSSD_BIN="$(bazel info bazel-bin)/service/lossd" LOSSCTL_BIN="$(bazel info bazel-bin)/client/lossctl" \
    tests/python_and_prometheus.sh "$reports" || status=1
fi

# 3. Fuzzing: a bounded, repeatable run per target (fixed seed and input count) plus a replay
#    of every committed seed and regression, built with clang, ASan and UBSan.
FUZZ_RUNS="${FUZZ_RUNS:-1000000}" FUZZ_SEED="${FUZZ_SEED:-1}" \
  bash tests/fuzz/build_and_run.sh "$reports" || status=1

python3 tools/test_summary.py --skipped-targets "$gpu_skipped" "$reports"/*.xml || status=1
exit $status
