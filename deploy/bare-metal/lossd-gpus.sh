#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One lossd per GPU on one host: renders each instance's command line (device, ports, memory
# budgets) from one configuration, starts one instance (systemd's lossd@.service calls
# `exec I`) or all of them (`run`, for hosts or containers without systemd), and prints the
# endpoint list clients give their replica pool. docs/scale_out.md explains every choice.
#
#   lossd-gpus.sh [--config FILE] plan          the instances and their budgets, checked
#   lossd-gpus.sh [--config FILE] argv I        instance I's command, one word per line
#   lossd-gpus.sh [--config FILE] exec I        replaces itself with instance I
#   lossd-gpus.sh [--config FILE] run           starts every instance, forwards SIGTERM/SIGINT
#   lossd-gpus.sh [--config FILE] endpoints [HOST...]   "HOST:port,HOST:port,...": this host's
#                                               instances, or those of every HOST in order (the
#                                               member list of a head group across hosts)
#
# Configuration: environment variables (a --config file is sourced first; systemd reads the
# same file as its EnvironmentFile). Instance I drives the I-th entry of LOSSD_GPUS.
#   LOSSD_BIN                 lossd binary (/opt/lossd/bin/lossd)
#   LOSSD_GPUS                GPUs, comma-separated indices or UUIDs (every GPU nvidia-smi lists)
#   LOSSD_DEVICE_SELECT       visible: CUDA_VISIBLE_DEVICES=<gpu> and --cuda_device=0 (default);
#                             flag: --cuda_device=<gpu index>, every GPU visible
#   LOSSD_BACKEND             cuda (default), cpu or auto
#   LOSSD_ADDRESS             listen address (0.0.0.0)
#   LOSSD_PORT_BASE           gRPC port of instance 0; instance I gets base + I (50051)
#   LOSSD_METRICS_PORT_BASE   /metrics port of instance 0 (9464); 0 = no metrics endpoint
#   LOSSD_HEALTH_PORT_BASE    plaintext health port of instance 0 (0 = none; with TLS)
#   LOSSD_HOST_MEMORY_BYTES   host memory all instances share (MemTotal, or the cgroup limit)
#   LOSSD_MEMORY_BUDGET_BYTES, LOSSD_HOST_BUFFER_POOL_BYTES   per instance (default: the
#                             lossd defaults, capped at a 1/(4N) and 1/(8N) share of the host)
#   LOSSD_DEVICE_MEMORY_BUDGET_BYTES   per instance, CUDA (unset: no budget of its own)
#   LOSSD_WEIGHT_CACHE_BYTES, LOSSD_ACCUMULATOR_BYTES, LOSSD_HEAD_BYTES   per instance
#                             (unset: lossd's per-device defaults on CUDA; on the CPU backend,
#                             whose stores are host memory, a 1/(2N) share in lossd's ratio)
#   LOSSD_TICKET_BYTES        per instance, two-phase tickets (host memory, page-locked on CUDA;
#                             default: lossd's 4 GiB, capped at 1/(16N) of the host and, on
#                             CUDA, at 1/16 of LOSSD_DEVICE_MEMORY_BUDGET_BYTES)
#   LOSSD_THREADS             CPU backend threads per instance (default: cores / N)
#   LOSSD_HEAD_EXPORT_DIR_BASE   hosted heads exported on drain to BASE/I (unset: none)
#   LOSSD_NUMA_NODES          comma-separated NUMA node per instance: numactl binds CPUs and
#                             prefers that node's memory (unset: no binding)
#   LOSSD_EXTRA_FLAGS         more lossd flags for every instance (TLS, tokens, logging)
# Head groups (one hosted head served by several instances, docs/hosted_head.md "Head groups"):
#   LOSSD_HEAD_GROUP_ADDRESS  turns them on: the address each instance's gloo listener binds
#                             (--head_group_address; an ephemeral port) and the other members
#                             dial: 127.0.0.1 for groups of this host's instances alone, the
#                             host's own routable address for groups across hosts (unset: off)
#   LOSSD_HEAD_GROUP_TIMEOUT  --head_group_timeout, e.g. 120s (unset: --head_step_timeout)
#   LOSSD_HEAD_GROUP_TOKEN_FILE, LOSSD_HEAD_GROUP_TLS_CA   absolute paths: the bearer token and
#                             the CA roots an instance presents to / verifies member 0 with
#   LOSSD_HEAD_GROUP_TLS_CERT, LOSSD_HEAD_GROUP_TLS_KEY    absolute paths: the client certificate
#                             and key an instance presents to a member 0 that asks for one
#   LOSSD_HEAD_GROUP_SIZE     members of the largest group these instances serve (default: N);
#                             only for the plan's sizing of LOSSD_HEAD_BYTES
set -euo pipefail

die() {
  echo "lossd-gpus: $*" >&2
  exit 2
}

if [[ "${1:-}" == "--config" ]]; then
  [[ $# -ge 2 && -r "$2" ]] || die "--config needs a readable file, got '${2:-}'"
  set -a
  # shellcheck disable=SC1090
  . "$2"
  set +a
  shift 2
fi

GiB=$((1 << 30))
BIN=${LOSSD_BIN:-/opt/lossd/bin/lossd}
SELECT=${LOSSD_DEVICE_SELECT:-visible}
BACKEND=${LOSSD_BACKEND:-cuda}
ADDRESS=${LOSSD_ADDRESS:-0.0.0.0}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# The GPUs: the configured list, else every GPU nvidia-smi lists.
gpus_csv=${LOSSD_GPUS:-}
if [[ -z "$gpus_csv" ]]; then
  command -v nvidia-smi >/dev/null 2>&1 ||
    die "LOSSD_GPUS is not set and nvidia-smi is not here to list the GPUs; set LOSSD_GPUS=0,1,..."
  gpus_csv=$(nvidia-smi --query-gpu=index --format=csv,noheader | tr -d ' ' | paste -sd, -)
  [[ -n "$gpus_csv" ]] || die "nvidia-smi lists no GPU; set LOSSD_GPUS"
fi
IFS=, read -r -a GPUS <<<"$gpus_csv"
N=${#GPUS[@]}
[[ $N -ge 1 ]] || die "LOSSD_GPUS is empty"
declare -A seen=()
for g in "${GPUS[@]}"; do
  [[ "$g" =~ ^[0-9]+$ || "$g" =~ ^(GPU|MIG)-[0-9A-Za-z-]+$ ]] ||
    die "LOSSD_GPUS: '$g' is neither a GPU index nor a GPU-/MIG- UUID (LOSSD_GPUS=$gpus_csv)"
  [[ -z "${seen[$g]:-}" ]] || die "LOSSD_GPUS names GPU $g twice (LOSSD_GPUS=$gpus_csv)"
  seen[$g]=1
done
case "$SELECT" in
  visible) ;;
  flag)
    for g in "${GPUS[@]}"; do
      is_uint "$g" || die "LOSSD_DEVICE_SELECT=flag needs GPU indices; '$g' is a UUID (use visible)"
    done ;;
  *) die "LOSSD_DEVICE_SELECT must be visible or flag, got '$SELECT'" ;;
esac
case "$BACKEND" in cuda | cpu | auto) ;; *) die "LOSSD_BACKEND must be cuda, cpu or auto, got '$BACKEND'" ;; esac

# Ports: base + I for each of the three, every range inside [1, 65535] and no two overlapping.
port_base() {  # variable default allow_zero
  local v=${!1:-$2}
  is_uint "$v" || die "$1 must be a port number, got '$v'"
  if [[ "$v" -eq 0 ]]; then
    [[ "$3" == yes ]] || die "$1 must be in [1, $((65536 - N))], got 0"
  elif [[ "$v" -gt $((65536 - N)) ]]; then
    die "$1=$v: $N instances need ports $v..$((v + N - 1)), past 65535"
  fi
  echo "$v"
}
PORT=$(port_base LOSSD_PORT_BASE 50051 no)
METRICS=$(port_base LOSSD_METRICS_PORT_BASE 9464 yes)
HEALTH=$(port_base LOSSD_HEALTH_PORT_BASE 0 yes)
overlap() {  # name1 base1 name2 base2
  [[ "$2" -eq 0 || "$4" -eq 0 ]] && return 0
  if [[ "$2" -lt $(($4 + N)) && "$4" -lt $(($2 + N)) ]]; then
    die "$1=$2 and $3=$4 overlap: $N instances take $2..$(($2 + N - 1)) and $4..$(($4 + N - 1))"
  fi
}
overlap LOSSD_PORT_BASE "$PORT" LOSSD_METRICS_PORT_BASE "$METRICS"
overlap LOSSD_PORT_BASE "$PORT" LOSSD_HEALTH_PORT_BASE "$HEALTH"
overlap LOSSD_METRICS_PORT_BASE "$METRICS" LOSSD_HEALTH_PORT_BASE "$HEALTH"

# Host memory all instances share: MemTotal, or the tightest memory.max on the path from this
# process's cgroup to the root where lower (the rule lossd applies to itself,
# kernels/host_memory.h). Under systemd that finds a limit on lossd.slice, which all instances
# share; a MemoryMax= on one instance's unit would be a per-instance limit: set
# LOSSD_HOST_MEMORY_BYTES instead there.
host_memory() {
  local total cg limit
  total=$(($(awk '/^MemTotal:/ { print $2 }' /proc/meminfo) * 1024))
  cg=$(awk -F: '$1 == "0" { print $3 }' /proc/self/cgroup 2>/dev/null || true)
  while [[ -n "$cg" ]]; do
    limit=$(cat "/sys/fs/cgroup${cg%/}/memory.max" 2>/dev/null || true)
    if is_uint "$limit" && [[ "$limit" -lt "$total" ]]; then total=$limit; fi
    [[ "$cg" != / ]] || break
    cg=$(dirname "$cg")
  done
  echo "$total"
}
HOST=${LOSSD_HOST_MEMORY_BYTES:-$(host_memory)}
if ! is_uint "$HOST" || [[ "$HOST" -eq 0 ]]; then
  die "LOSSD_HOST_MEMORY_BYTES must be a positive byte count, got '$HOST'"
fi

min() { if [[ "$1" -lt "$2" ]]; then echo "$1"; else echo "$2"; fi; }
bytes() {  # variable derived-default (empty: the flag is left out)
  local v=${!1:-$2}
  [[ -z "$v" ]] || is_uint "$v" || die "$1 must be a byte count, got '$v'"
  echo "$v"
}
# lossd's defaults (8 GiB, 2 GiB) capped at this instance's share of lossd's own fractions.
MEMORY_BUDGET=$(bytes LOSSD_MEMORY_BUDGET_BYTES "$(min $((8 * GiB)) $((HOST / (4 * N))))")
POOL=$(bytes LOSSD_HOST_BUFFER_POOL_BYTES "$(min $((2 * GiB)) $((HOST / (8 * N))))")
DEVICE_BUDGET=$(bytes LOSSD_DEVICE_MEMORY_BUDGET_BYTES "")
# Stores: on CUDA they are device memory, one device each, and lossd fits its defaults to it;
# on the CPU backend they are host memory, so each instance gets 1/(2N) of it (lossd alone
# would take half of the host in each instance), split like the defaults 4 : 8 : 16 GiB.
store_default() {  # sevenths of the share, the default's cap
  [[ "$BACKEND" == cpu ]] || return 0
  min "$2" $((HOST * $1 / (14 * N)))
}
WEIGHTS=$(bytes LOSSD_WEIGHT_CACHE_BYTES "$(store_default 1 $((4 * GiB)))")
ACCUMS=$(bytes LOSSD_ACCUMULATOR_BYTES "$(store_default 2 $((8 * GiB)))")
HEADS=$(bytes LOSSD_HEAD_BYTES "$(store_default 4 $((16 * GiB)))")
# Two-phase tickets keep each kept forward's X and targets in host memory (page-locked on
# CUDA) until its backward. Each instance is one lossd on one GPU, so lossd's own default
# (4 GiB: 64 forwards of 64 MiB, BT=8192 x H=4096 bf16, between logp and dlogp) is sized
# for it; capped at 1/16 of the instance's share of the host, the share lossd itself gives
# tickets (its four store defaults, 4 : 8 : 16 : 4 GiB, fill half of its memory). On CUDA the
# same 1/16 of a device budget, as lossd would scale it: a ticket's inline W is device memory,
# and a --ticket_bytes given to lossd is checked as it is while its store defaults shrink.
ticket_default() {
  local t
  t=$(min $((4 * GiB)) $((HOST / (16 * N))))
  if [[ "$BACKEND" != cpu && "${DEVICE_BUDGET:-0}" -gt 0 ]]; then t=$(min "$t" $((DEVICE_BUDGET / 16))); fi
  echo "$t"
}
TICKETS=$(bytes LOSSD_TICKET_BYTES "$(ticket_default)")
THREADS=""
if [[ "$BACKEND" == cpu ]]; then
  THREADS=$(bytes LOSSD_THREADS "$(( $(nproc) / N > 0 ? $(nproc) / N : 1 ))")
fi
NUMA=()
if [[ -n "${LOSSD_NUMA_NODES:-}" ]]; then
  IFS=, read -r -a NUMA <<<"$LOSSD_NUMA_NODES"
  [[ ${#NUMA[@]} -eq $N ]] ||
    die "LOSSD_NUMA_NODES has ${#NUMA[@]} entries for $N GPUs (LOSSD_NUMA_NODES=$LOSSD_NUMA_NODES)"
  for n in "${NUMA[@]}"; do is_uint "$n" || die "LOSSD_NUMA_NODES: '$n' is not a node number"; done
  [[ "${1:-}" == argv || "${1:-}" == plan ]] || command -v numactl >/dev/null 2>&1 ||
    die "LOSSD_NUMA_NODES is set but numactl is not installed"
fi

# Head groups: every instance gets the same gloo address (a member of another host dials it),
# which must be one a peer can dial, never a wildcard.
GROUP_ADDRESS=${LOSSD_HEAD_GROUP_ADDRESS:-}
GROUP_TIMEOUT=${LOSSD_HEAD_GROUP_TIMEOUT:-}
GROUP_TOKEN=${LOSSD_HEAD_GROUP_TOKEN_FILE:-}
GROUP_CA=${LOSSD_HEAD_GROUP_TLS_CA:-}
GROUP_CERT=${LOSSD_HEAD_GROUP_TLS_CERT:-}
GROUP_KEY=${LOSSD_HEAD_GROUP_TLS_KEY:-}
if [[ -z "$GROUP_ADDRESS" ]]; then
  for v in LOSSD_HEAD_GROUP_TIMEOUT LOSSD_HEAD_GROUP_TOKEN_FILE LOSSD_HEAD_GROUP_TLS_CA \
      LOSSD_HEAD_GROUP_TLS_CERT LOSSD_HEAD_GROUP_TLS_KEY; do
    [[ -z "${!v:-}" ]] ||
      die "$v is set but LOSSD_HEAD_GROUP_ADDRESS is not: head groups are off without it"
  done
else
  [[ "$GROUP_ADDRESS" =~ ^[0-9A-Za-z._:-]+$ ]] ||
    die "LOSSD_HEAD_GROUP_ADDRESS must be a host name or an IP address, got '$GROUP_ADDRESS'"
  case "$GROUP_ADDRESS" in
    0.0.0.0 | :: | "[::]")
      die "LOSSD_HEAD_GROUP_ADDRESS=$GROUP_ADDRESS is a wildcard: the other members dial this address; give 127.0.0.1 (one host) or the host's routable address" ;;
  esac
fi
[[ -z "$GROUP_TIMEOUT" || "$GROUP_TIMEOUT" =~ ^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$ ]] ||
  die "LOSSD_HEAD_GROUP_TIMEOUT must be a duration such as 120s or 2m, got '$GROUP_TIMEOUT'"
for v in LOSSD_HEAD_GROUP_TOKEN_FILE LOSSD_HEAD_GROUP_TLS_CA LOSSD_HEAD_GROUP_TLS_CERT \
    LOSSD_HEAD_GROUP_TLS_KEY; do
  [[ -z "${!v:-}" || "${!v}" == /* ]] || die "$v must be an absolute path, got '${!v}'"
done
if [[ -n "$GROUP_CERT" && -z "$GROUP_KEY" ]] || [[ -z "$GROUP_CERT" && -n "$GROUP_KEY" ]]; then
  die "LOSSD_HEAD_GROUP_TLS_CERT and LOSSD_HEAD_GROUP_TLS_KEY go together"
fi
GROUP_SIZE=${LOSSD_HEAD_GROUP_SIZE:-$N}
if ! is_uint "$GROUP_SIZE" || [[ "$GROUP_SIZE" -lt 1 ]]; then
  die "LOSSD_HEAD_GROUP_SIZE must be a member count of 1 or more, got '$GROUP_SIZE'"
fi

check_instance() {  # I
  if ! is_uint "$1" || [[ "$1" -ge $N ]]; then
    die "instance must be in [0, $((N - 1))] (one per entry of LOSSD_GPUS=$gpus_csv), got '$1'"
  fi
}

# Instance I's command, one word per line: env assignments, numactl, lossd and its flags.
argv() {
  local i=$1 g=${GPUS[$1]} device
  echo env
  # CUDA numbers GPUs fastest first unless told otherwise; nvidia-smi numbers them by PCI bus.
  echo CUDA_DEVICE_ORDER=PCI_BUS_ID
  if [[ "$SELECT" == visible ]]; then
    echo "CUDA_VISIBLE_DEVICES=$g"
    device=0
  else
    device=$g
  fi
  if [[ ${#NUMA[@]} -gt 0 ]]; then
    printf '%s\n' numactl "--cpunodebind=${NUMA[$i]}" "--preferred=${NUMA[$i]}"
  fi
  echo "$BIN"
  echo "--backend=$BACKEND"
  echo "--cuda_device=$device"
  echo "--address=$ADDRESS"
  echo "--port=$((PORT + i))"
  if [[ "$METRICS" -eq 0 ]]; then echo "--metrics_port=0"; else echo "--metrics_port=$((METRICS + i))"; fi
  [[ "$HEALTH" -eq 0 ]] || echo "--health_port=$((HEALTH + i))"
  echo "--memory_budget_bytes=$MEMORY_BUDGET"
  echo "--host_buffer_pool_bytes=$POOL"
  [[ -z "$DEVICE_BUDGET" ]] || echo "--device_memory_budget_bytes=$DEVICE_BUDGET"
  [[ -z "$WEIGHTS" ]] || echo "--weight_cache_bytes=$WEIGHTS"
  [[ -z "$ACCUMS" ]] || echo "--accumulator_bytes=$ACCUMS"
  [[ -z "$HEADS" ]] || echo "--head_bytes=$HEADS"
  echo "--ticket_bytes=$TICKETS"
  [[ -z "$THREADS" ]] || echo "--threads=$THREADS"
  [[ -z "${LOSSD_HEAD_EXPORT_DIR_BASE:-}" ]] || echo "--head_export_dir=$LOSSD_HEAD_EXPORT_DIR_BASE/$i"
  [[ -z "$GROUP_ADDRESS" ]] || echo "--head_group_address=$GROUP_ADDRESS"
  [[ -z "$GROUP_TIMEOUT" ]] || echo "--head_group_timeout=$GROUP_TIMEOUT"
  [[ -z "$GROUP_TOKEN" ]] || echo "--head_group_token_file=$GROUP_TOKEN"
  [[ -z "$GROUP_CA" ]] || echo "--head_group_tls_ca=$GROUP_CA"
  [[ -z "$GROUP_CERT" ]] || echo "--head_group_tls_cert=$GROUP_CERT"
  [[ -z "$GROUP_KEY" ]] || echo "--head_group_tls_key=$GROUP_KEY"
  local extra
  for extra in ${LOSSD_EXTRA_FLAGS:-}; do echo "$extra"; done
}

# Host memory the instances may hold together: admission budgets, buffer pools and tickets,
# plus the stores where the CPU backend keeps them in host memory. Refused when over the
# host's, naming each setting and its value. Tickets are counted whole (an inline W's copy is
# device memory on CUDA), as lossd counts them against its stores.
HOST_PER=$((MEMORY_BUDGET + POOL + TICKETS))
HOST_PER_WHAT="LOSSD_MEMORY_BUDGET_BYTES=$MEMORY_BUDGET + LOSSD_HOST_BUFFER_POOL_BYTES=$POOL + LOSSD_TICKET_BYTES=$TICKETS"
HOST_SUM_WHAT="admission budgets, buffer pools and tickets"
if [[ "$BACKEND" == cpu ]]; then
  HOST_PER=$((HOST_PER + ${WEIGHTS:-0} + ${ACCUMS:-0} + ${HEADS:-0}))
  HOST_PER_WHAT="$HOST_PER_WHAT + LOSSD_WEIGHT_CACHE_BYTES=${WEIGHTS:-0} + LOSSD_ACCUMULATOR_BYTES=${ACCUMS:-0} + LOSSD_HEAD_BYTES=${HEADS:-0}"
  HOST_SUM_WHAT="admission budgets, buffer pools, tickets and the CPU backend's stores"
fi
HOST_SUM=$((HOST_PER * N))
[[ "$HOST_SUM" -le "$HOST" ]] ||
  die "$N instances would hold $HOST_SUM bytes of host memory, $N x ($HOST_PER_WHAT), more than the $HOST bytes there are; lower them or set LOSSD_HOST_MEMORY_BYTES"
# On CUDA the stores and the tickets are held against the device budget, as lossd checks at
# start (service/store_budgets.cc): the stores given here and the tickets must fit it (lossd
# fits the stores left unset to what remains). Refused here, before any instance starts.
if [[ "$BACKEND" != cpu && "${DEVICE_BUDGET:-0}" -gt 0 ]]; then
  DEVICE_SUM=$(( ${WEIGHTS:-0} + ${ACCUMS:-0} + ${HEADS:-0} + TICKETS ))
  [[ "$DEVICE_SUM" -le "$DEVICE_BUDGET" ]] ||
    die "each instance would hold $DEVICE_SUM bytes against LOSSD_DEVICE_MEMORY_BUDGET_BYTES=$DEVICE_BUDGET: LOSSD_WEIGHT_CACHE_BYTES=${WEIGHTS:-unset} + LOSSD_ACCUMULATOR_BYTES=${ACCUMS:-unset} + LOSSD_HEAD_BYTES=${HEADS:-unset} + LOSSD_TICKET_BYTES=$TICKETS, all held in device memory between requests; lower them or raise the budget"
fi

plan() {
  echo "$N instances, backend $BACKEND, devices by $SELECT, host memory $HOST bytes"
  local i
  for ((i = 0; i < N; i++)); do
    echo "instance $i: gpu ${GPUS[$i]}, port $((PORT + i))$([[ "$METRICS" -eq 0 ]] ||
      echo ", metrics $((METRICS + i))")$([[ "$HEALTH" -eq 0 ]] || echo ", health $((HEALTH + i))")"
  done
  echo "per instance: --memory_budget_bytes=$MEMORY_BUDGET --host_buffer_pool_bytes=$POOL --ticket_bytes=$TICKETS"
  echo "host memory lossd may hold: $HOST_SUM bytes in all ($HOST_SUM_WHAT), of $HOST"
  [[ -z "$GROUP_ADDRESS" ]] || plan_groups
}

# What a head group changes (docs/hosted_head.md "Memory per member"): a member keeps 1/S of
# the fp32 master and the optimizer state (ZeRO-1) but the whole gradient sum and compute
# copy. With AdamW and a bf16 copy a parameter takes 4 + 4 + 2 + 8 = 18 B on one server and
# 6 + 12 / S B on each of S members, so --head_bytes holds 3 S / (S + 2) times the head.
# Beside --head_bytes a member holds, for its largest head, gloo's two receive buffers of the
# fp32 gradient while a step reduce-scatters (8 B a parameter) and an export's gather of the
# whole master and AdamW state (12 B) until the head's version moves: 20 B a parameter at
# most (host memory on the CPU backend).
plan_groups() {
  local ports
  ports=$(tr -s '\t ' ' ' </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo "?")
  echo "head groups: gloo listeners on $GROUP_ADDRESS, ephemeral TCP ports ($ports here: net.ipv4.ip_local_port_range); every member dials member 0's gRPC port and every other member's listener"
  if [[ -n "$HEADS" ]]; then
    local params=$((HEADS * GROUP_SIZE / (6 * GROUP_SIZE + 12)))
    echo "head sizing (AdamW, bf16 copy): --head_bytes=$HEADS holds a head of $((HEADS / 18)) parameters on one instance, $params as a member of a group of $GROUP_SIZE (6 + 12/$GROUP_SIZE B a parameter)"
    echo "beside --head_bytes a member holds up to $((params * 20)) bytes more for that head while a step reduce-scatters with an export's gather kept (20 B a parameter; host memory on the CPU backend), not in the sums above"
  fi
}

run_all() {
  local pids=() i
  for ((i = 0; i < N; i++)); do
    mapfile -t cmd < <(argv "$i")
    "${cmd[@]}" &
    pids+=($!)
    echo "lossd-gpus: instance $i (gpu ${GPUS[$i]}) pid ${pids[$i]}" >&2
  done
  stop() {
    echo "lossd-gpus: $1: stopping every instance" >&2
    local p
    for p in "${pids[@]}"; do
      [[ -z "$p" ]] || kill -TERM "$p" 2>/dev/null || true
    done
  }
  trap 'stop SIGTERM' TERM
  trap 'stop SIGINT' INT
  # Each instance's exit is reported; the others keep serving (clients' pools move the keys
  # of the one that is gone). Waits until every instance has exited.
  local status=0 left=$N code
  while [[ $left -gt 0 ]]; do
    for ((i = 0; i < N; i++)); do
      [[ -n "${pids[$i]}" ]] || continue
      kill -0 "${pids[$i]}" 2>/dev/null && continue
      code=0
      wait "${pids[$i]}" || code=$?
      echo "lossd-gpus: instance $i (pid ${pids[$i]}) exited with code $code" >&2
      [[ $code -eq 0 ]] || status=1
      pids[i]=""
      left=$((left - 1))
    done
    [[ $left -eq 0 ]] || sleep 0.5 || true
  done
  return $status
}

case "${1:-}" in
  plan) plan ;;
  argv)
    check_instance "${2:-}"
    argv "$2" ;;
  exec)
    check_instance "${2:-}"
    mapfile -t cmd < <(argv "$2")
    exec "${cmd[@]}" ;;
  run) plan >&2 && run_all ;;
  endpoints)
    # Several hosts (each with this configuration): their instances in the order given, the
    # member list of a group across them (member m = the m-th endpoint).
    shift
    [[ $# -gt 0 ]] || set -- "$(hostname -f 2>/dev/null || hostname)"
    sep=""
    for host in "$@"; do
      for ((i = 0; i < N; i++)); do printf '%s%s:%d' "$sep" "$host" $((PORT + i)); sep=,; done
    done
    echo ;;
  *) die "usage: lossd-gpus.sh [--config FILE] plan | argv I | exec I | run | endpoints [HOST...]" ;;
esac
