#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The pipelined hosted head's round on a GPU host (issue 36 item 3): lossd from the bundle
# (tools/bundle/make_bundle.sh) on the CUDA backend with budgets for two big micro-batches in
# flight, then pipeline_bench.py at each shape in SHAPES (depths 1-3, T from 0.25x to 4x the
# head's time, M micro-batches), GPU utilisation sampled every 100 ms beside it (util.csv;
# steps.txt says when each shape ran). The host needs torch; the lossd client and its grpcio /
# protobuf wheels come in WHEEL_DIR (installed with --no-index into a folder of their own).
# Usage: bench/service/pipeline_round.sh BUNDLE_DIR WHEEL_DIR OUT_DIR
# Env: SHAPES (default "2048x4096x128256 8192x4096x128256"), RATIOS (0.25,1,4), TRUNK (auto: a
#      bf16 matmul loop on the trainer's GPU; sleep: a trainer whose GPU is elsewhere), M (8),
#      STEPS (3), T_SHAPE (seconds per shape, 170).
set -uo pipefail
B=$(cd "$1" && pwd); W=$(cd "$2" && pwd); OUT=$(mkdir -p "$3" && cd "$3" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
py=$OUT/py
python3 -m pip install --quiet --no-index --no-deps --target "$py" "$W"/*.whl > "$OUT/pip.log" 2>&1 ||
  { echo "installing the client's wheels failed: $OUT/pip.log"; exit 1; }
export PYTHONPATH=$py${PYTHONPATH:+:$PYTHONPATH}
"$B/lossd" --backend=cuda --cuda_plugin="$B/liblossd_cuda.so" --port=0 --address=127.0.0.1 \
  --metrics_port=0 --max_in_flight=1024 --max_queue=256 --memory_budget_bytes=$((48 << 30)) \
  --weight_cache_bytes=$((8 << 30)) --accumulator_bytes=$((40 << 30)) \
  --host_buffer_pool_bytes=$((8 << 30)) > "$OUT/lossd.log" 2>&1 &
lossd_pid=$!
trap 'kill $lossd_pid ${smi:-} 2>/dev/null' EXIT
for _ in $(seq 60); do grep -qE "listening on port [0-9]+" "$OUT/lossd.log" && break; sleep 1; done
port=$(grep -oE "listening on port [0-9]+" "$OUT/lossd.log" | grep -oE "[0-9]+$" | head -1)
[ -n "$port" ] || { echo "lossd did not start:"; tail -5 "$OUT/lossd.log"; exit 1; }
nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,power.draw --format=csv,noheader \
  -lms 100 > "$OUT/util.csv" 2>/dev/null &
smi=$!
status=0
for shape in ${SHAPES:-2048x4096x128256 8192x4096x128256}; do
  echo "$(date +%s.%N) start $shape" >> "$OUT/steps.txt"
  timeout "${T_SHAPE:-170}" python3 "$HERE/pipeline_bench.py" --server "127.0.0.1:$port" \
    --shape "$shape" --dtype bf16 --micro_batches "${M:-8}" --depths 1,2,3 \
    --ratios "${RATIOS:-0.25,1,4}" --trunk "${TRUNK:-auto}" --steps "${STEPS:-3}" \
    --out "$OUT/$shape" > "$OUT/$shape.log" 2>&1 || status=1
  echo "$(date +%s.%N) end $shape" >> "$OUT/steps.txt"
  tail -25 "$OUT/$shape.log"
done
exit $status
