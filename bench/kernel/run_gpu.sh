#!/usr/bin/env bash
# Runs on a GPU host from inside the bundle (tools/bundle/make_bundle.sh): every GPU test, the
# kernel benchmark and the naive PyTorch baseline. Logs go to a temporary folder and are packed
# into $1/gpu-logs.tar.gz; a short summary is printed last.
# Usage: ./run_gpu.sh OUT_DIR   (env BENCH_ARGS / TORCH_ARGS / GTEST_ARGS pass extra flags)
set -uo pipefail
OUTDIR=${1:-.}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")"
LOG=$(mktemp -d)
rc=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
  > "$LOG/gpu.txt" 2>&1
cat BUNDLE_INFO >> "$LOG/gpu.txt" 2>/dev/null
cat "$LOG/gpu.txt"
for t in plugin_exposer_test ce_kernels_test cuda_backend_test; do
  [ -x "./$t" ] || { echo "$t: absent"; continue; }
  timeout 400 "./$t" --gtest_output="xml:$LOG/$t.xml" ${GTEST_ARGS:-} > "$LOG/$t.log" 2>&1
  code=$?
  [ $code -eq 0 ] || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]" "$LOG/$t.log" | head -40
  echo "$t: exit $code"
done
if [ -x ./bench_kernel ]; then
  ./bench_kernel --csv="$LOG/bench.csv" ${BENCH_ARGS:-} > "$LOG/bench.log" 2>&1 || rc=1
fi
if command -v python3 >/dev/null; then
  python3 torch_baseline.py --csv "$LOG/torch.csv" ${TORCH_ARGS:-} > "$LOG/torch.log" 2>&1 || rc=1
fi
tar -C "$LOG" -czf "$OUTDIR/gpu-logs.tar.gz" .
echo "== test totals =="
for x in "$LOG"/*.xml; do
  [ -e "$x" ] || continue
  head -3 "$x" | grep -o '<testsuites [^>]*' | sed "s|<testsuites|$(basename "$x" .xml):|"
done
echo "== bench =="
cat "$LOG/bench.log" 2>/dev/null | tail -25
echo "== torch =="
cat "$LOG/torch.log" 2>/dev/null | tail -10
exit $rc
