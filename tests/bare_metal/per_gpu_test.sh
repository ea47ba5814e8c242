#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One lossd per GPU on a host (deploy/bare-metal), without a GPU: lossd-gpus.sh renders each
# instance's device, ports and memory budgets as documented (docs/scale_out.md), refuses bad
# configurations naming the variable, the systemd unit runs it per instance, and two lossd
# processes started by it on the CPU backend with distinct --cuda_device, gRPC and metrics
# ports both serve, each reporting its own budgets (ServerInfo) and only its own calls
# (/metrics); SIGTERM stops both, and an instance that dies is reported while the other serves.
# Args: lossd lossctl lossd-gpus.sh lossd@.service lossd-gpus.env
set -uo pipefail
LOSSD=$(realpath "$1")
LOSSCTL=$(realpath "$2")
LAUNCHER=$(realpath "$3")
UNIT=$(realpath "$4")
EXAMPLE_ENV=$(realpath "$5")
TMP=$(mktemp -d "${TEST_TMPDIR:-/tmp}/per_gpu.XXXXXX")
JUNIT_CLASS=PerGpuLayout
# shellcheck source=tests/bare_metal/junit.sh
. "$(dirname "$0")/junit.sh"

GiB=$((1 << 30))
problems=()
check() {  # what command...: records a problem when the command fails
  local what=$1
  shift
  "$@" >/dev/null 2>&1 || problems+=("$what")
}
finish_case() {  # name message-on-pass
  if [[ ${#problems[@]} -eq 0 ]]; then
    junit_case "$1" passed "$2"
  else
    junit_case "$1" failed "$(printf '%s; ' "${problems[@]}")"
  fi
  problems=()
}
same() { [[ "$1" == "$2" ]] || { echo "got '$1', want '$2'" >&2; return 1; }; }

# --- 1. Rendering: each instance's command, word by word ---------------------------------
cat >"$TMP/two.env" <<EOF
LOSSD_BIN=$LOSSD
LOSSD_GPUS=0,1
LOSSD_DEVICE_SELECT=flag
LOSSD_BACKEND=cpu
LOSSD_PORT_BASE=41000
LOSSD_METRICS_PORT_BASE=41002
LOSSD_HOST_MEMORY_BYTES=$((16 * GiB))
LOSSD_THREADS=1
LOSSD_TICKET_BYTES=150000000
EOF
# 16 GiB shared by 2: admission 16/(4*2) = 2 GiB and pool 16/(8*2) = 1 GiB each; the CPU
# backend's stores 16/(2*2) = 4 GiB each, split 1 : 2 : 4; the tickets as given (none of the
# defaults: 512 MiB here, 128 MiB for the 4 GiB of section 4).
want_common="--address=0.0.0.0
--memory_budget_bytes=$((2 * GiB))
--host_buffer_pool_bytes=$((1 * GiB))
--weight_cache_bytes=$((16 * GiB / 28))
--accumulator_bytes=$((16 * GiB * 2 / 28))
--head_bytes=$((16 * GiB * 4 / 28))
--ticket_bytes=150000000
--threads=1"
for i in 0 1; do
  got=$("$LAUNCHER" --config "$TMP/two.env" argv $i 2>&1)
  want="env
CUDA_DEVICE_ORDER=PCI_BUS_ID
$LOSSD
--backend=cpu
--cuda_device=$i
$(head -1 <<<"$want_common")
--port=$((41000 + i))
--metrics_port=$((41002 + i))
$(tail -n +2 <<<"$want_common")"
  check "instance $i (flag mode) renders $(tr '\n' ' ' <<<"$got")" same "$got" "$want"
done
# Device selection by visibility: CUDA_VISIBLE_DEVICES names the GPU (a UUID too), lossd
# uses the one device it sees.
got=$(LOSSD_GPUS=GPU-8f2a3c1e-0000-4b7d-9a55-1c2d3e4f5a6b,3 LOSSD_BACKEND=cuda \
  LOSSD_HOST_MEMORY_BYTES=$((64 * GiB)) "$LAUNCHER" argv 1 2>&1)
check "visible mode renders CUDA_VISIBLE_DEVICES=3 and --cuda_device=0: $(tr '\n' ' ' <<<"$got")" \
  grep -qx "CUDA_VISIBLE_DEVICES=3" <<<"$got"
check "visible mode: --cuda_device=0" grep -qx -- "--cuda_device=0" <<<"$got"
check "visible mode: port 50052, metrics 9465 by default" \
  grep -qxF -e "--port=50052" <<<"$got"
check "visible mode: metrics 9465" grep -qxF -e "--metrics_port=9465" <<<"$got"
check "CUDA: admission budget min(8 GiB, 64 GiB / 8)" \
  grep -qxF -e "--memory_budget_bytes=$((8 * GiB))" <<<"$got"
check "CUDA: pool min(2 GiB, 64 GiB / 16)" grep -qxF -e "--host_buffer_pool_bytes=$((2 * GiB))" <<<"$got"
check "CUDA: store budgets left to lossd (per device)" bash -c "! grep -q -e --weight_cache_bytes -e --head_bytes <<<'$got'"
got=$(LOSSD_GPUS=GPU-8f2a3c1e-0000-4b7d-9a55-1c2d3e4f5a6b,3 "$LAUNCHER" argv 0 2>&1)
check "a UUID is passed as is" grep -qx "CUDA_VISIBLE_DEVICES=GPU-8f2a3c1e-0000-4b7d-9a55-1c2d3e4f5a6b" <<<"$got"
got=$(LOSSD_GPUS=0,1 LOSSD_HEALTH_PORT_BASE=50151 LOSSD_NUMA_NODES=0,1 LOSSD_HEAD_EXPORT_DIR_BASE=/x \
  LOSSD_EXTRA_FLAGS="--tls_cert=/c.pem --tls_key=/k.pem" "$LAUNCHER" argv 1 2>&1)
for w in --health_port=50152 --head_export_dir=/x/1 --tls_cert=/c.pem --tls_key=/k.pem \
    numactl --cpunodebind=1 --preferred=1; do
  check "renders $w" grep -qxF -e "$w" <<<"$got"
done
# The plan shows the tickets and counts them with the CPU backend's stores, for both.
got=$("$LAUNCHER" --config "$TMP/two.env" plan 2>&1)
check "plan shows --ticket_bytes: $(tr '\n' ' ' <<<"$got")" \
  grep -qF -e "--host_buffer_pool_bytes=$GiB --ticket_bytes=150000000" <<<"$got"
host_sum=$((2 * (3 * GiB + 150000000 + 16 * GiB / 28 + 16 * GiB * 2 / 28 + 16 * GiB * 4 / 28)))
what="admission budgets, buffer pools, tickets and the CPU backend's stores"
check "plan counts both instances' tickets in $host_sum bytes" \
  grep -qF "host memory lossd may hold: $host_sum bytes in all ($what)" <<<"$got"
# Tickets left unset: lossd's 4 GiB capped at 1/16 of an instance's share of the host and, on
# CUDA only, at 1/16 of its device budget.
ticket_default() {  # env assignments...: instance 1's --ticket_bytes
  env LOSSD_GPUS=0,1 "$@" "$LAUNCHER" argv 1 2>&1 | sed -n 's/^--ticket_bytes=//p'
}
check "tickets: min(4 GiB, 64 GiB / 32)" \
  same "$(ticket_default LOSSD_HOST_MEMORY_BYTES=$((64 * GiB)))" $((2 * GiB))
check "tickets: 4 GiB on a 2 TiB host" \
  same "$(ticket_default LOSSD_HOST_MEMORY_BYTES=$((2048 * GiB)))" $((4 * GiB))
check "tickets: 1/16 of an 8 GiB device budget" same "$(ticket_default \
  LOSSD_HOST_MEMORY_BYTES=$((2048 * GiB)) LOSSD_DEVICE_MEMORY_BUDGET_BYTES=$((8 * GiB)))" $((GiB / 2))
check "tickets: the CPU backend has no device budget" same "$(ticket_default LOSSD_BACKEND=cpu \
  LOSSD_HOST_MEMORY_BYTES=$((2048 * GiB)) LOSSD_DEVICE_MEMORY_BUDGET_BYTES=$((8 * GiB)))" $((4 * GiB))
got=$("$LAUNCHER" --config "$TMP/two.env" endpoints node7 2>&1)
check "endpoints: $got" same "$got" "node7:41000,node7:41001"
finish_case RendersEachInstance "device, ports and budgets as documented"

# --- 2. Refusals: each names the variable and the values --------------------------------
refuses() {  # expected-text env-assignments... -- launcher args
  local want=$1 out code
  shift
  local envs=()
  while [[ "$1" != -- ]]; do envs+=("$1"); shift; done
  shift
  out=$(env "${envs[@]}" "$LAUNCHER" "$@" 2>&1)
  code=$?
  [[ $code -eq 2 ]] || { echo "exit $code: $out" >&2; return 1; }
  grep -qF -- "$want" <<<"$out" || { echo "$out" >&2; return 1; }
}
check "overlapping ports" refuses "LOSSD_PORT_BASE=9000 and LOSSD_METRICS_PORT_BASE=9001 overlap" \
  LOSSD_GPUS=0,1 LOSSD_PORT_BASE=9000 LOSSD_METRICS_PORT_BASE=9001 -- plan
check "ports past 65535" refuses "LOSSD_PORT_BASE=65535: 2 instances need ports 65535..65536" \
  LOSSD_GPUS=0,1 LOSSD_PORT_BASE=65535 -- plan
check "instance out of range" refuses "instance must be in [0, 1]" LOSSD_GPUS=0,1 -- argv 2
check "instance not a number" refuses "got 'x'" LOSSD_GPUS=0,1 -- exec x
check "a GPU twice" refuses "LOSSD_GPUS names GPU 1 twice" LOSSD_GPUS=1,1 -- plan
check "a GPU neither index nor UUID" refuses "LOSSD_GPUS: 'gpu1'" LOSSD_GPUS=gpu1 -- plan
check "flag mode with a UUID" refuses "LOSSD_DEVICE_SELECT=flag needs GPU indices" \
  LOSSD_GPUS=GPU-abc LOSSD_DEVICE_SELECT=flag -- plan
check "bad selection" refuses "LOSSD_DEVICE_SELECT must be visible or flag, got 'env'" \
  LOSSD_GPUS=0 LOSSD_DEVICE_SELECT=env -- plan
check "bad backend" refuses "LOSSD_BACKEND must be cuda, cpu or auto, got 'gpu'" \
  LOSSD_GPUS=0 LOSSD_BACKEND=gpu -- plan
check "a budget not a number" refuses "LOSSD_MEMORY_BUDGET_BYTES must be a byte count, got '8G'" \
  LOSSD_GPUS=0 LOSSD_MEMORY_BUDGET_BYTES=8G -- plan
# 2 x (8 + 1.5 GiB + the tickets' default, 16 GiB / 32): 20 GiB.
check "budgets over the host" refuses "2 instances would hold 21474836480 bytes of host memory" \
  LOSSD_GPUS=0,1 LOSSD_HOST_MEMORY_BYTES=$((16 * GiB)) LOSSD_MEMORY_BUDGET_BYTES=$((8 * GiB)) \
  LOSSD_HOST_BUFFER_POOL_BYTES=$((GiB + GiB / 2)) -- plan
# Tickets are host memory too: 2 x (4 + 1 + 4 GiB) = 18 GiB of 16, each setting named.
check "tickets over the host" refuses "2 instances would hold 19327352832 bytes of host memory, \
2 x (LOSSD_MEMORY_BUDGET_BYTES=4294967296 + LOSSD_HOST_BUFFER_POOL_BYTES=1073741824 + \
LOSSD_TICKET_BYTES=4294967296), more than the 17179869184 bytes there are" \
  LOSSD_GPUS=0,1 LOSSD_HOST_MEMORY_BYTES=$((16 * GiB)) LOSSD_MEMORY_BUDGET_BYTES=$((4 * GiB)) \
  LOSSD_HOST_BUFFER_POOL_BYTES=$GiB LOSSD_TICKET_BYTES=$((4 * GiB)) -- plan
# The defaulted tickets too: 2 x (6.5 + 1.25 GiB) fits 16 GiB, their 2 x 512 MiB does not.
check "defaulted tickets over the host" refuses "LOSSD_TICKET_BYTES=536870912), more than the" \
  LOSSD_GPUS=0,1 LOSSD_HOST_MEMORY_BYTES=$((16 * GiB)) \
  LOSSD_MEMORY_BUDGET_BYTES=$((6 * GiB + GiB / 2)) LOSSD_HOST_BUFFER_POOL_BYTES=$((GiB + GiB / 4)) -- plan
check "tickets not a number" refuses "LOSSD_TICKET_BYTES must be a byte count, got '4G'" \
  LOSSD_GPUS=0 LOSSD_TICKET_BYTES=4G -- plan
check "NUMA list of the wrong length" refuses "LOSSD_NUMA_NODES has 1 entries for 2 GPUs" \
  LOSSD_GPUS=0,1 LOSSD_NUMA_NODES=0 -- plan
# On CUDA the stores given and the tickets must fit the device budget: 4 + 8 + 4 GiB of 12.
check "stores over the device budget" refuses "each instance would hold 17179869184 bytes \
against LOSSD_DEVICE_MEMORY_BUDGET_BYTES=12884901888: LOSSD_WEIGHT_CACHE_BYTES=4294967296 + \
LOSSD_ACCUMULATOR_BYTES=8589934592 + LOSSD_HEAD_BYTES=unset + LOSSD_TICKET_BYTES=4294967296" \
  LOSSD_GPUS=0,1 LOSSD_BACKEND=cuda LOSSD_HOST_MEMORY_BYTES=$((512 * GiB)) \
  LOSSD_DEVICE_MEMORY_BUDGET_BYTES=$((12 * GiB)) LOSSD_WEIGHT_CACHE_BYTES=$((4 * GiB)) \
  LOSSD_ACCUMULATOR_BYTES=$((8 * GiB)) LOSSD_TICKET_BYTES=$((4 * GiB)) -- plan
# The same with the tickets lowered fits (the check counts what is held, nothing more).
fits() { env "$@" "$LAUNCHER" plan >/dev/null 2>&1; }
check "stores within the device budget" fits LOSSD_GPUS=0,1 LOSSD_BACKEND=cuda \
  LOSSD_HOST_MEMORY_BYTES=$((512 * GiB)) LOSSD_DEVICE_MEMORY_BUDGET_BYTES=$((12 * GiB)) \
  LOSSD_WEIGHT_CACHE_BYTES=$((4 * GiB)) LOSSD_ACCUMULATOR_BYTES=$((7 * GiB)) \
  LOSSD_TICKET_BYTES=$GiB
finish_case RefusesBadConfigurations "every refusal names its variable"

# --- 2b. Head groups: the group flags per instance, the member list across hosts, sizing ---
got=$(LOSSD_GPUS=0,1 LOSSD_HEAD_GROUP_ADDRESS=10.0.0.11 LOSSD_HEAD_GROUP_TIMEOUT=600s \
  LOSSD_HEAD_GROUP_TOKEN_FILE=/etc/lossd/head-group.token LOSSD_HEAD_GROUP_TLS_CA=/etc/lossd/ca.pem \
  LOSSD_HEAD_GROUP_TLS_CERT=/etc/lossd/member.pem LOSSD_HEAD_GROUP_TLS_KEY=/etc/lossd/member.key \
  LOSSD_EXTRA_FLAGS=--log_format=json "$LAUNCHER" argv 1 2>&1)
check "an instance's group flags, before the extra flags: $(tr '\n' ' ' <<<"$got")" \
  same "$(tail -7 <<<"$got")" "--head_group_address=10.0.0.11
--head_group_timeout=600s
--head_group_token_file=/etc/lossd/head-group.token
--head_group_tls_ca=/etc/lossd/ca.pem
--head_group_tls_cert=/etc/lossd/member.pem
--head_group_tls_key=/etc/lossd/member.key
--log_format=json"
got=$(LOSSD_GPUS=0,1 "$LAUNCHER" argv 0 2>&1)
check "no group flag without LOSSD_HEAD_GROUP_ADDRESS" bash -c "! grep -q -- --head_group <<<'$got'"
got=$("$LAUNCHER" --config "$TMP/two.env" endpoints node1 node2 2>&1)
check "a group's members across two hosts, in order: $got" \
  same "$got" "node1:41000,node1:41001,node2:41000,node2:41001"
# The CPU backend's head store of two.env, 16 GiB x 4/28 each: 18 B a parameter alone (AdamW,
# bf16 copy), 6 + 12/S as a member (S = 2 by default: this host's instances; 16 given).
heads=$((16 * GiB * 4 / 28))
got=$(env LOSSD_HEAD_GROUP_ADDRESS=127.0.0.1 "$LAUNCHER" --config "$TMP/two.env" plan 2>&1)
check "the plan sizes heads for a group of this host's 2: $(tr '\n' ' ' <<<"$got")" grep -qF \
  "holds a head of $((heads / 18)) parameters on one instance, $((heads / 12)) as a member of a group of 2" <<<"$got"
check "the plan counts a member's step and export buffers beside --head_bytes" grep -qF \
  "beside --head_bytes a member holds up to $((heads / 12 * 20)) bytes more for that head" <<<"$got"
check "the plan names the gloo address and the port range" \
  grep -qF "head groups: gloo listeners on 127.0.0.1, ephemeral TCP ports" <<<"$got"
got=$(env LOSSD_HEAD_GROUP_ADDRESS=127.0.0.1 LOSSD_HEAD_GROUP_SIZE=16 "$LAUNCHER" --config "$TMP/two.env" plan 2>&1)
check "the plan sizes heads for LOSSD_HEAD_GROUP_SIZE=16" grep -qF \
  "$((heads * 16 / 108)) as a member of a group of 16 (6 + 12/16 B a parameter)" <<<"$got"
check "a wildcard gloo address" refuses "LOSSD_HEAD_GROUP_ADDRESS=0.0.0.0 is a wildcard" \
  LOSSD_GPUS=0 LOSSD_HEAD_GROUP_ADDRESS=0.0.0.0 -- plan
check "group settings without the address" refuses \
  "LOSSD_HEAD_GROUP_TOKEN_FILE is set but LOSSD_HEAD_GROUP_ADDRESS is not" \
  LOSSD_GPUS=0 LOSSD_HEAD_GROUP_TOKEN_FILE=/t -- plan
check "a timeout that is no duration" refuses \
  "LOSSD_HEAD_GROUP_TIMEOUT must be a duration such as 120s or 2m, got '600'" \
  LOSSD_GPUS=0 LOSSD_HEAD_GROUP_ADDRESS=127.0.0.1 LOSSD_HEAD_GROUP_TIMEOUT=600 -- plan
check "a relative CA path" refuses "LOSSD_HEAD_GROUP_TLS_CA must be an absolute path, got 'ca.pem'" \
  LOSSD_GPUS=0 LOSSD_HEAD_GROUP_ADDRESS=127.0.0.1 LOSSD_HEAD_GROUP_TLS_CA=ca.pem -- plan
check "a client certificate without its key" refuses \
  "LOSSD_HEAD_GROUP_TLS_CERT and LOSSD_HEAD_GROUP_TLS_KEY go together" \
  LOSSD_GPUS=0 LOSSD_HEAD_GROUP_ADDRESS=127.0.0.1 LOSSD_HEAD_GROUP_TLS_CERT=/etc/m.pem -- plan
check "a group of no members" refuses "LOSSD_HEAD_GROUP_SIZE must be a member count of 1 or more, got '0'" \
  LOSSD_GPUS=0 LOSSD_HEAD_GROUP_ADDRESS=127.0.0.1 LOSSD_HEAD_GROUP_SIZE=0 -- plan
# The example's commented block, turned on: lossd@5 of a host of a 16-member group.
sed 's/^#LOSSD_HEAD_GROUP_/LOSSD_HEAD_GROUP_/' "$EXAMPLE_ENV" >"$TMP/group.env"
echo "LOSSD_HOST_MEMORY_BYTES=$((2048 * GiB))" >>"$TMP/group.env"
got=$("$LAUNCHER" --config "$TMP/group.env" argv 5 2>&1 | tail -5 | tr '\n' ' ')
check "the example's group block renders on lossd@5: $got" same "$got" "--head_group_address=10.0.0.11 \
--head_group_timeout=600s --head_group_token_file=/etc/lossd/head-group.token --drain_seconds=30 --log_format=json "
check "the example's group block plans a group of 16" \
  bash -c "'$LAUNCHER' --config '$TMP/group.env' plan | grep -qF 'as a member of a group of 16'"
finish_case RendersHeadGroups "group flags, members across hosts, sizing, refusals"

# --- 3. The systemd unit and the example configuration ----------------------------------
check "ExecStart runs the launcher per instance" grep -qx "ExecStart=/opt/lossd/bin/lossd-gpus.sh exec %i" "$UNIT"
check "EnvironmentFile is the example's path" grep -qx "EnvironmentFile=/etc/lossd/lossd-gpus.env" "$UNIT"
check "the example's header names that path" grep -q "^# /etc/lossd/lossd-gpus.env" "$EXAMPLE_ENV"
stop_s=$(sed -n 's/^TimeoutStopSec=\([0-9]*\)$/\1/p' "$UNIT")
# The drain, then every instance of the example exporting its whole --head_bytes at once onto
# one disk at 2 GB/s, then 10 s to exit.
ex_gpus=$(sed -n 's/^LOSSD_GPUS=//p' "$EXAMPLE_ENV" | tr ',' '\n' | grep -c .)
ex_head=$(sed -n 's/^LOSSD_HEAD_BYTES=//p' "$EXAMPLE_ENV")
stop_need=$((30 + ex_gpus * ex_head / 2000000000 + 10))
check "TimeoutStopSec=$stop_s covers the 30 s drain, $ex_gpus exports of $ex_head bytes and exit" \
  test "${stop_s:-0}" -ge "$stop_need" -a "$ex_gpus" -ge 1 -a "${ex_head:-0}" -gt 0
check "SIGTERM starts the drain" grep -qx "KillSignal=SIGTERM" "$UNIT"
check "one slice for every instance" grep -qx "Slice=lossd.slice" "$UNIT"
# What systemd runs for lossd@5 with the example on a 2 TiB host.
cp "$EXAMPLE_ENV" "$TMP/example.env"
echo "LOSSD_HOST_MEMORY_BYTES=$((2048 * GiB))" >>"$TMP/example.env"
check "the example's plan fits a 2 TiB host" "$LAUNCHER" --config "$TMP/example.env" plan
exec_line=$(sed -n 's/^ExecStart=//p' "$UNIT" | sed 's/%i/5/g')
# shellcheck disable=SC1091
got=$(set -a && . "$TMP/example.env" && set +a && "$LAUNCHER" argv "${exec_line##* }" | tr '\n' ' ')
want="env CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=5 numactl --cpunodebind=1 --preferred=1 \
/opt/lossd/bin/lossd --backend=cuda --cuda_device=0 --address=0.0.0.0 --port=50056 \
--metrics_port=9469 --memory_budget_bytes=68719476736 --host_buffer_pool_bytes=8589934592 \
--device_memory_budget_bytes=128849018880 --weight_cache_bytes=34359738368 \
--accumulator_bytes=34359738368 --head_bytes=34359738368 --ticket_bytes=17179869184 --head_export_dir=/var/lib/lossd/heads/5 \
--drain_seconds=30 --log_format=json "
check "lossd@5 with the example renders: $got" same "$got" "$want"
finish_case UnitRendersEachInstance "lossd@5.service runs GPU 5 on ports 50056 / 9469"

if command -v systemd-analyze >/dev/null 2>&1; then
  mkdir -p "$TMP/units"
  sed -e "s#/opt/lossd/bin/lossd-gpus.sh#$LAUNCHER#" -e "s#/etc/lossd/lossd-gpus.env#$TMP/example.env#" \
    "$UNIT" >"$TMP/units/lossd@.service"
  cp "$(dirname "$UNIT")/lossd.target" "$(dirname "$UNIT")/lossd.slice" "$TMP/units/"
  if out=$(systemd-analyze verify "$TMP/units/lossd@3.service" "$TMP/units/lossd.target" \
      "$TMP/units/lossd.slice" 2>&1); then
    junit_case UnitVerifies passed "systemd-analyze verify"
  elif grep -qi "Failed to .*bus\|Failed to initialize manager\|Operation not permitted" <<<"$out"; then
    junit_case UnitVerifies skipped "systemd-analyze cannot run here: $(head -1 <<<"$out")"
  else
    junit_case UnitVerifies failed "$out"
  fi
else
  junit_case UnitVerifies skipped "no systemd-analyze here"
fi

# --- 4. Two instances on the CPU backend, started by the launcher -------------------------
launcher_pid=""
cleanup() {
  [[ -z "$launcher_pid" ]] || kill -9 "$launcher_pid" 2>/dev/null
  sed -n 's/.* pid \([0-9]*\)$/\1/p' "$TMP/run.err" 2>/dev/null | while read -r p; do
    kill -9 "$p" 2>/dev/null
  done
}
trap cleanup EXIT

free_base() {  # a base port B with B..B+3 free (gRPC B, B+1; metrics B+2, B+3)
  python3 - <<'PY'
import random, socket
for _ in range(200):
    b = random.randrange(20000, 60000)
    socks = []
    try:
        for p in range(b, b + 4):
            s = socket.socket()
            s.bind(("127.0.0.1", p))
            socks.append(s)
    except OSError:
        continue
    finally:
        for s in socks:
            s.close()
    print(b)
    break
PY
}

start_two() {  # base: starts the launcher, waits for both listening lines; 0 when both serve
  sed -e "s/^LOSSD_PORT_BASE=.*/LOSSD_PORT_BASE=$1/" \
    -e "s/^LOSSD_METRICS_PORT_BASE=.*/LOSSD_METRICS_PORT_BASE=$(($1 + 2))/" \
    -e "s/^LOSSD_HOST_MEMORY_BYTES=.*/LOSSD_HOST_MEMORY_BYTES=$((4 * GiB))/" \
    "$TMP/two.env" >"$TMP/run.env"
  # Head groups on, as a host of a one-host group has them (forming a group of lossd
  # processes on 127.0.0.1 is client/python/tests/test_head_group.py's).
  printf '%s\n' LOSSD_HEAD_GROUP_ADDRESS=127.0.0.1 LOSSD_HEAD_GROUP_TIMEOUT=20s >>"$TMP/run.env"
  "$LAUNCHER" --config "$TMP/run.env" run >"$TMP/run.out" 2>"$TMP/run.err" &
  launcher_pid=$!
  local _
  for _ in $(seq 1 600); do  # 60 s: generous on a loaded 2-core machine
    [[ $(grep -c "listening on port" "$TMP/run.out") -eq 2 ]] && return 0
    kill -0 "$launcher_pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -TERM "$launcher_pid" 2>/dev/null
  wait "$launcher_pid" 2>/dev/null
  launcher_pid=""
  return 1
}

base=""
for _ in 1 2 3; do
  base=$(free_base)
  start_two "$base" && break
  base=""
done
if [[ -z "$base" ]]; then
  junit_case TwoInstancesServe failed "the launcher did not start both: $(tail -20 "$TMP/run.err")"
  junit_case InstanceExitReported failed "not started"
  junit_write per_gpu_test
  exit 1
fi

metric() {  # port series: the value of one series on that /metrics port
  curl -fsS "http://127.0.0.1:$1/metrics" | awk -v s="$2" 'index($0, s " ") == 1 { print $2 }'
}
info() {  # port field
  "$LOSSCTL" --target="127.0.0.1:$1" --deadline_seconds=60 info | awk -v k="$2" '$1 == k { print $2 }'
}
declare -A instance_of=()
# 4 GiB shared by 2: admission 4/(4*2) = 512 MiB each; weight cache 4 GiB / 28.
for i in 0 1; do
  port=$((base + i))
  check "instance $i announces gRPC $port and metrics $((base + 2 + i))" \
    grep -q "listening on port $port (backend cpu, .*metrics on port $((base + 2 + i))" "$TMP/run.out"
  check "instance $i serves ServerInfo as the CPU backend" same "$(info "$port" backend)" cpu
  check "instance $i's admission budget" same "$(info "$port" memory_budget)" $((GiB / 2))
  instance_of[$i]=$(info "$port" instance)
  check "instance $i's metrics port reports its budget" \
    same "$(metric $((base + 2 + i)) lossd_memory_budget_bytes)" $((GiB / 2))
  check "instance $i's weight cache budget" \
    same "$(metric $((base + 2 + i)) lossd_weight_cache_budget_bytes)" $((4 * GiB / 28))
  check "instance $i runs with LOSSD_TICKET_BYTES" \
    same "$(metric $((base + 2 + i)) lossd_ticket_budget_bytes)" 150000000
done
check "two distinct instances (${instance_of[0]} ${instance_of[1]})" \
  test -n "${instance_of[0]}" -a "${instance_of[0]}" != "${instance_of[1]}"
check "instance 1 was started with --cuda_device=1" grep -q -- "--cuda_device=1" "$TMP/run.err"
for i in 0 1; do
  p=$(sed -n "s/^lossd-gpus: instance $i (gpu $i) pid \([0-9]*\)$/\1/p" "$TMP/run.err")
  check "instance $i (pid $p) serves with --head_group_address=127.0.0.1" \
    grep -qxF -e --head_group_address=127.0.0.1 <(tr '\0' '\n' <"/proc/${p:-0}/cmdline")
done
# Two Computes on instance 0, one on instance 1: each /metrics counts only its own.
for port in "$base" "$base" $((base + 1)); do
  out=$("$LOSSCTL" --target="127.0.0.1:$port" --deadline_seconds=120 compute --bt=64 --h=32 \
    --v=1000 --dtype=fp32 --seed=$RANDOM 2>&1)
  check "a Compute on $port is served: $out" grep -q "^loss " <<<"$out"
done
ok='lossd_requests_total{code="OK",method="Compute"}'
check "instance 0 counts 2 Computes" same "$(metric $((base + 2)) "$ok")" 2
check "instance 1 counts 1 Compute" same "$(metric $((base + 3)) "$ok")" 1
finish_case TwoInstancesServe "ports $base-$((base + 3)), distinct instances, own calls counted"

# --- 5. One instance killed: reported, the other serves; SIGTERM ends the rest ------------
pid1=$(sed -n 's/^lossd-gpus: instance 1 (gpu 1) pid \([0-9]*\)$/\1/p' "$TMP/run.err")
pid0=$(sed -n 's/^lossd-gpus: instance 0 (gpu 0) pid \([0-9]*\)$/\1/p' "$TMP/run.err")
check "the launcher names both pids ($pid0, $pid1)" test -n "$pid0" -a -n "$pid1"
if [[ -n "$pid1" ]]; then
  kill -9 "$pid1"
  for _ in $(seq 1 100); do
    grep -q "instance 1 (pid $pid1) exited with code 137" "$TMP/run.err" && break
    sleep 0.1
  done
  check "instance 1's exit is reported" grep -q "instance 1 (pid $pid1) exited with code 137" "$TMP/run.err"
fi
check "instance 0 still serves" same "$(info "$base" backend)" cpu
kill -TERM "$launcher_pid"
code=0
timeout 90 tail --pid="$launcher_pid" -f /dev/null || code=124
wait "$launcher_pid" 2>/dev/null || code=$?
launcher_pid=""
check "the launcher exits 1 (one instance failed), got $code" same "$code" 1
check "instance 0 drained and exited 0" grep -q "instance 0 (pid $pid0) exited with code 0" "$TMP/run.err"
check "instance 0 is gone" bash -c "! kill -0 $pid0 2>/dev/null"
finish_case InstanceExitReported "a killed instance is reported, the other drains on SIGTERM"

[[ $JUNIT_FAILED -eq 0 ]] || { echo "--- launcher stderr"; tail -40 "$TMP/run.err"; }
junit_write per_gpu_test
