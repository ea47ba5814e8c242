#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One lossd per GPU on a host of two GPUs or more: lossd-gpus.sh starts two CUDA instances on
# GPUs 0 and 1, once selecting the device by CUDA_VISIBLE_DEVICES and once by --cuda_device;
# each serves a Compute on the CUDA backend, each reports its own device budget and the
# launcher's --ticket_bytes, and the driver shows one process on each of the two GPUs (not
# two on one). With fewer than two GPUs every case reports itself skipped, never passed.
# Args: lossd lossctl lossd-gpus.sh liblossd_cuda.so   (Bazel: tag gpu; the bundle's
# run_gpu.sh runs it as ./per_gpu_gpu_test.sh ./lossd ./lossctl ./lossd-gpus.sh ./liblossd_cuda.so)
set -uo pipefail
LOSSD=$(realpath "$1")
LOSSCTL=$(realpath "$2")
LAUNCHER=$(realpath "$3")
PLUGIN=$(realpath "$4")
TMP=$(mktemp -d "${TEST_TMPDIR:-/tmp}/per_gpu_gpu.XXXXXX")
JUNIT_CLASS=PerGpuOnGpus
# shellcheck source=tests/bare_metal/junit.sh
. "$(dirname "$0")/junit.sh"
MODES=(visible flag)

skip_all() {
  local m
  for m in "${MODES[@]}"; do junit_case "TwoGpus_${m}" skipped "$1"; done
  junit_write per_gpu_gpu_test
  exit 0
}
command -v nvidia-smi >/dev/null 2>&1 || skip_all "no nvidia-smi: not a GPU host"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[[ "$gpus" -ge 2 ]] || skip_all "needs 2 GPUs; this host has ${gpus:-0}"

GiB=$((1 << 30))
problems=()
check() {
  local what=$1
  shift
  "$@" >/dev/null 2>&1 || problems+=("$what")
}
same() { [[ "$1" == "$2" ]] || { echo "got '$1', want '$2'" >&2; return 1; }; }

# Compute processes the driver lists on the GPU of this nvidia-smi index (by PCI bus id, the
# order CUDA_DEVICE_ORDER=PCI_BUS_ID gives CUDA too). Counted, not matched by pid: inside a
# container the driver may report host pids.
apps_on() {
  local bus
  bus=$(nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader | awk -F', ' -v i="$1" '$1 == i { print $2 }')
  nvidia-smi --query-compute-apps=gpu_bus_id --format=csv,noheader | grep -ciF "$bus"
}

launcher_pid=""
cleanup() {
  [[ -z "$launcher_pid" ]] || kill -9 "$launcher_pid" 2>/dev/null
  cat "$TMP"/*.err 2>/dev/null | sed -n 's/.* pid \([0-9]*\)$/\1/p' | while read -r p; do
    kill -9 "$p" 2>/dev/null
  done
}
trap cleanup EXIT

base=$(python3 -c 'import random; print(random.randrange(20000, 60000))')
for mode in "${MODES[@]}"; do
  before0=$(apps_on 0)
  before1=$(apps_on 1)
  cat >"$TMP/$mode.env" <<EOF
LOSSD_BIN=$LOSSD
LOSSD_GPUS=0,1
LOSSD_DEVICE_SELECT=$mode
LOSSD_BACKEND=cuda
LOSSD_PORT_BASE=$base
LOSSD_METRICS_PORT_BASE=$((base + 2))
LOSSD_MEMORY_BUDGET_BYTES=$((2 * GiB))
LOSSD_HOST_BUFFER_POOL_BYTES=$((GiB / 2))
LOSSD_DEVICE_MEMORY_BUDGET_BYTES=$((8 * GiB))
LOSSD_EXTRA_FLAGS="--cuda_plugin=$PLUGIN"
EOF
  "$LAUNCHER" --config "$TMP/$mode.env" run >"$TMP/$mode.out" 2>"$TMP/$mode.err" &
  launcher_pid=$!
  for _ in $(seq 1 1200); do  # 120 s: CUDA start-up
    [[ $(grep -c "listening on port" "$TMP/$mode.out") -eq 2 ]] && break
    kill -0 "$launcher_pid" 2>/dev/null || break
    sleep 0.1
  done
  for i in 0 1; do
    port=$((base + i))
    check "instance $i serves on the CUDA backend ($mode)" \
      grep -q "listening on port $port (backend cuda" "$TMP/$mode.out"
    out=$("$LOSSCTL" --target="127.0.0.1:$port" --deadline_seconds=120 compute --bt=512 --h=256 \
      --v=4096 --dtype=bf16 --seed=$RANDOM 2>&1)
    check "a Compute on instance $i runs on CUDA: $out" grep -q "^backend *cuda" <<<"$out"
    got=$(curl -fsS "http://127.0.0.1:$((base + 2 + i))/metrics" |
      awk '$1 == "lossd_gpu_memory_budget_bytes" { print $2 }')
    check "instance $i reports its device budget ($got)" same "$got" "$((8 * GiB))"
    # The launcher's --ticket_bytes (1/16 of the device budget, unless the host is small)
    # reaches the CUDA instance as given.
    want=$("$LAUNCHER" --config "$TMP/$mode.env" argv "$i" | sed -n 's/^--ticket_bytes=//p')
    got=$(curl -fsS "http://127.0.0.1:$((base + 2 + i))/metrics" |
      awk '$1 == "lossd_ticket_budget_bytes" { print $2 }')
    check "instance $i runs with the launcher's --ticket_bytes=$want ($got)" \
      test -n "$want" -a "$got" = "$want"
  done
  after0=$(apps_on 0)
  after1=$(apps_on 1)
  check "one more process on GPU 0 ($before0 -> $after0)" same "$after0" $((before0 + 1))
  check "one more process on GPU 1 ($before1 -> $after1)" same "$after1" $((before1 + 1))
  kill -TERM "$launcher_pid"
  code=0
  wait "$launcher_pid" || code=$?
  launcher_pid=""
  check "both drained and exited 0 (launcher exit $code)" same "$code" 0
  if [[ ${#problems[@]} -eq 0 ]]; then
    junit_case "TwoGpus_${mode}" passed "GPU 0 and GPU 1, one instance each"
  else
    junit_case "TwoGpus_${mode}" failed "$(printf '%s; ' "${problems[@]}")"
    tail -20 "$TMP/$mode.err"
  fi
  problems=()
  base=$((base + 4))
done
junit_write per_gpu_gpu_test
