#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The service benchmark in one run: loopback ceilings (net_ceiling), then a lossd started here
# (free ports, budgets sized for W = 128256 x 4096 bf16 and 16 clients) measured end to end
# (service_bench), then lossd stopped. Writes into OUT_DIR: ceilings.txt/.log, lossd.log,
# lossd_metrics.txt (its /metrics at the end), host.txt, service_bench.log and
# service_bench.md (the report, also printed last).
#
# On a GPU host, from the bundle folder (binaries beside lib/):
#   ./run_service_bench.sh [OUT_DIR]                 (default: $OUT, else ./service_bench_out)
# Locally, CPU backend, tiny shapes, a minute or two:
#   bench/service/run_service_bench.sh --quick --bazel_bin="$(bazel info bazel-bin)" /tmp/sb
# Options: --quick, --backend=cpu|cuda (default cuda; --quick: cpu), --bin_dir=DIR (binaries,
# default the script's folder), --bazel_bin=DIR (binaries in Bazel's layout), and anything after
# `--` goes to service_bench (e.g. -- --modes=accum --runs=7). $LOSSD_ARGS: extra lossd flags.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
QUICK=0
BACKEND=""
BIN_DIR="$HERE"
BAZEL_BIN=""
OUT_DIR="${OUT:-$PWD/service_bench_out}"
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --backend=*) BACKEND="${1#*=}" ;;
    --bin_dir=*) BIN_DIR="${1#*=}" ;;
    --bazel_bin=*) BAZEL_BIN="${1#*=}" ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) OUT_DIR="$1" ;;
  esac
  shift
done
if [ -n "$BAZEL_BIN" ]; then
  LOSSD="$BAZEL_BIN/service/lossd"
  NET="$BAZEL_BIN/bench/service/net_ceiling"
  BENCH="$BAZEL_BIN/bench/service/service_bench"
else
  LOSSD="$BIN_DIR/lossd"
  NET="$BIN_DIR/net_ceiling"
  BENCH="$BIN_DIR/service_bench"
fi
for b in "$LOSSD" "$NET" "$BENCH"; do
  [ -x "$b" ] || { echo "missing binary: $b" >&2; exit 2; }
done
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
[ -n "$BACKEND" ] || { [ $QUICK = 1 ] && BACKEND=cpu || BACKEND=cuda; }

if [ $QUICK = 1 ]; then
  CEIL_ARGS=(--bytes=$((64 << 20)) --runs=2)
  BENCH_ARGS=(--shapes=64x64x1000,32x64x1000 "--clients=1,2|1,2,3" --runs=2 --transfer_runs=2
              --busy_clients=2 --part_bytes=16384 --deadline_s=120)
  SERVER_ARGS=(--memory_budget_bytes=$((1 << 30)) --weight_cache_bytes=$((256 << 20))
               --accumulator_bytes=$((256 << 20)) --threads=2)
  BENCH_TIMEOUT=300
else
  # 16 clients x 2 GiB fp32 accumulators; W by handle (1 GiB) plus the transfer tests' uploads;
  # up to ~8 inline Computes (W, X, dX, dW host copies + device workspace) admitted at once.
  # The pool of freed host buffers keeps 8 GiB (default 2): 16 clients' X and dX (64 MiB
  # each) and a few inline W / dW (1 GiB each) stay mapped between calls instead of
  # page-faulting again.
  CEIL_ARGS=(--bytes=$((2 << 30)) --runs=3)
  BENCH_ARGS=(--budget_s=300)
  SERVER_ARGS=(--memory_budget_bytes=$((48 << 30)) --weight_cache_bytes=$((8 << 30))
               --accumulator_bytes=$((40 << 30)) --max_accumulators=64
               --host_buffer_pool_bytes=$((8 << 30)))
  BENCH_TIMEOUT=390
fi

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$p" 2>/dev/null
  done
  PIDS=()
}
trap cleanup EXIT INT TERM

# Waits (up to $3 s) for a line matching regex $2 in file $1 and prints it.
wait_line() {
  for _ in $(seq 1 $(($3 * 5))); do
    l=$(grep -m1 -E "$2" "$1" 2>/dev/null) && { echo "$l"; return 0; }
    sleep 0.2
  done
  return 1
}

rc=0
echo "== ceilings ($(date -u +%H:%M:%S))"
"$NET" --serve > "$OUT_DIR/net_ceiling_server.log" 2>&1 &
PIDS+=($!)
l=$(wait_line "$OUT_DIR/net_ceiling_server.log" "serving tcp=" 20) || {
  echo "net_ceiling --serve did not start:" >&2; cat "$OUT_DIR/net_ceiling_server.log" >&2; exit 1; }
TCP_PORT=$(sed -E 's/.*tcp=([0-9]+).*/\1/' <<< "$l")
GRPC_PORT=$(sed -E 's/.*grpc=([0-9]+).*/\1/' <<< "$l")
timeout 150 "$NET" --client --tcp_port="$TCP_PORT" --grpc_port="$GRPC_PORT" \
  --out="$OUT_DIR/ceilings.txt" "${CEIL_ARGS[@]}" 2>&1 | tee "$OUT_DIR/ceilings.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "net_ceiling --client failed" >&2; rc=1; }
cleanup

# A free port for /metrics (scraped at the end: the receive/queue/compute/send phases).
METRICS_PORT=0
if command -v python3 >/dev/null; then
  METRICS_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null || echo 0)
fi
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv; nproc; free -g; } > "$OUT_DIR/host.txt" 2>&1

echo "== lossd ($BACKEND, $(date -u +%H:%M:%S))"
"$LOSSD" --backend="$BACKEND" --port=0 --address=127.0.0.1 --metrics_address=127.0.0.1 \
  --metrics_port="$METRICS_PORT" \
  --max_in_flight=1024 --max_queue=256 --drain_seconds=5 "${SERVER_ARGS[@]}" ${LOSSD_ARGS:-} \
  > "$OUT_DIR/lossd.log" 2>&1 &
PIDS+=($!)
l=$(wait_line "$OUT_DIR/lossd.log" "listening on port [0-9]+" 90) || {
  echo "lossd did not start:" >&2; cat "$OUT_DIR/lossd.log" >&2; exit 1; }
echo "$l"
PORT=$(sed -E 's/.*listening on port ([0-9]+).*/\1/' <<< "$l")

echo "== service_bench ($(date -u +%H:%M:%S))"
timeout "$BENCH_TIMEOUT" "$BENCH" --target="127.0.0.1:$PORT" --ceilings="$OUT_DIR/ceilings.txt" \
  --out="$OUT_DIR/service_bench.md" "${BENCH_ARGS[@]}" "${EXTRA[@]}" \
  > "$OUT_DIR/service_bench.stdout" 2> "$OUT_DIR/service_bench.log"
code=$?
[ $code = 0 ] || { echo "service_bench exited $code (log: $OUT_DIR/service_bench.log)" >&2; rc=1; }
if [ "$METRICS_PORT" != 0 ]; then
  python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$METRICS_PORT/metrics', timeout=10).read().decode())" \
    > "$OUT_DIR/lossd_metrics.txt" 2>&1 || echo "could not scrape /metrics" >&2
fi
tail -5 "$OUT_DIR/service_bench.log"
cleanup
echo "== done ($(date -u +%H:%M:%S)); lossd log tail:"
tail -3 "$OUT_DIR/lossd.log"
echo
cat "$OUT_DIR/service_bench.md" 2>/dev/null || cat "$OUT_DIR/service_bench.stdout"
exit $rc
