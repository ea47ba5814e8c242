#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs on a GPU host from inside the bundle (tools/bundle/make_bundle.sh): every GPU test, the
# kernel benchmark, the optimizer step's benchmark, the loss kinds' benchmark and the naive
# PyTorch baselines. Writes into OUT_DIR gpu.txt, one log per test binary (and
# per_gpu_gpu_test.log), bench.log/.csv, gpu_clocks.csv, optimizer_bench.log, kinds_bench.log,
# torch.log and kinds_torch.log, and prints a short summary last.
# Usage: ./run_gpu.sh OUT_DIR   (env BENCH_ARGS / TORCH_ARGS / KINDS_ARGS / KINDS_TORCH_ARGS /
# GTEST_ARGS pass extra flags)
set -uo pipefail
OUTDIR=$(mkdir -p "${1:-.}" && cd "${1:-.}" && pwd)
cd "$(dirname "$0")"
rc=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  cat BUNDLE_INFO
} > "$OUTDIR/gpu.txt" 2>&1
cat "$OUTDIR/gpu.txt"
for t in plugin_exposer_test plugin_compute_test ce_kernels_test nonfinite_test cuda_backend_test \
    cuda_backend_api_test cuda_backend_stream_test sticky_error_test optimizer_test \
    row_loss_test row_loss_paths_test two_phase_gpu_test ref_exp_test policy_sequence_test; do
  [ -x "./$t" ] || { echo "$t: absent"; continue; }
  timeout "${TEST_TIMEOUT:-200}" "./$t" ${GTEST_ARGS:-} > "$OUTDIR/$t.log" 2>&1
  code=$?
  [ $code -eq 0 ] || rc=1
  grep -E "^\[  FAILED  \]" "$OUTDIR/$t.log" | head -30
  echo "$t: exit $code; $(grep -E '^\[==========\] [0-9]+ tests? from .* ran' "$OUTDIR/$t.log" | tail -1);" \
    "$(grep -E '^\[  PASSED  \]' "$OUTDIR/$t.log" | tail -1)"
done
# One lossd per GPU (tests/bare_metal): two instances on GPUs 0 and 1; skipped with one GPU.
if [ -x ./per_gpu_gpu_test.sh ] && [ -x ./lossd ] && [ -x ./lossctl ]; then
  timeout "${TEST_TIMEOUT:-200}" ./per_gpu_gpu_test.sh ./lossd ./lossctl ./lossd-gpus.sh \
    ./liblossd_cuda.so > "$OUTDIR/per_gpu_gpu_test.log" 2>&1 || rc=1
  echo "per_gpu_gpu_test: $(grep -E '^(passed|failed|skipped):' "$OUTDIR/per_gpu_gpu_test.log" | tr '\n' ' ')"
fi
if [ -x ./bench_kernel ]; then
  # The SM clock, power and throttle reasons every 200 ms while the benchmark runs: the H200
  # runs these GEMMs at its power cap, where the clock, not the kernels, can decide a ratio.
  q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active
  nvidia-smi --query-gpu="$q" --format=csv,noheader -lms 200 > "$OUTDIR/gpu_clocks.csv" 2>/dev/null &
  smi=$!
  timeout "${BENCH_TIMEOUT:-400}" ./bench_kernel --csv="$OUTDIR/bench.csv" ${BENCH_ARGS:-} \
    > "$OUTDIR/bench.log" 2>&1 || rc=1
  kill "$smi" 2>/dev/null
fi
if [ -x ./optimizer_bench ]; then
  timeout "${BENCH_TIMEOUT:-400}" ./optimizer_bench > "$OUTDIR/optimizer_bench.log" 2>&1 || rc=1
fi
if [ -x ./kinds_bench ]; then
  timeout "${BENCH_TIMEOUT:-400}" ./kinds_bench ${KINDS_ARGS:-} > "$OUTDIR/kinds_bench.log" 2>&1 || rc=1
fi
if command -v python3 >/dev/null; then
  PYTHONUNBUFFERED=1 timeout "${TORCH_TIMEOUT:-150}" python3 torch_baseline.py \
    --csv "$(mktemp)" ${TORCH_ARGS:-} > "$OUTDIR/torch.log" 2>&1 || rc=1
  if [ -f ./kinds_torch_baseline.py ]; then
    PYTHONUNBUFFERED=1 timeout "${TORCH_TIMEOUT:-150}" python3 kinds_torch_baseline.py \
      ${KINDS_TORCH_ARGS:-} > "$OUTDIR/kinds_torch.log" 2>&1 || rc=1
  fi
fi
echo "== bench =="
tail -25 "$OUTDIR/bench.log" 2>/dev/null
echo "== optimizer step =="
cat "$OUTDIR/optimizer_bench.log" 2>/dev/null
echo "== torch =="
tail -10 "$OUTDIR/torch.log" 2>/dev/null
echo "== loss kinds =="
grep -E '^(\||distill extra|logprob two-phase)' "$OUTDIR/kinds_bench.log" 2>/dev/null
echo "== loss kinds, naive torch =="
grep -E '^\|' "$OUTDIR/kinds_torch.log" 2>/dev/null
exit $rc
