#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Smoke test of a CPU-only lossd image (deploy/image/build_cpu_image.sh makes one): starts it
# with podman, runs `lossctl compute` against it (the image's lossctl, and the host's where
# LOSSCTL names one), reads /metrics, checks it runs as uid 10001, then stops it with SIGTERM
# and expects exit code 0 (the graceful drain). Prints PASS/FAIL per check.
#   deploy/image/smoke_cpu_image.sh [IMAGE]        (default localhost/lossd:cpu)
# Env: LOSSCTL (a host lossctl binary), PODMAN_RUN_FLAGS (as build_cpu_image.sh).
set -uo pipefail
IMAGE=${1:-localhost/lossd:cpu}
read -r -a RUN_FLAGS <<< "${PODMAN_RUN_FLAGS:---runtime=runc --ulimit nofile=16384:16384 --ulimit nproc=4096:4096}"
PODMAN=(podman --cgroup-manager=cgroupfs)
NAME=lossd-smoke-$$
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port)
MPORT=$(free_port)
failed=0
check() {  # name command...
  local name=$1
  shift
  if out=$("$@" 2>&1); then
    echo "PASS $name"
  else
    echo "FAIL $name"
    sed 's/^/    /' <<< "$out" | tail -20
    failed=$((failed + 1))
  fi
}
cleanup() { "${PODMAN[@]}" rm -f "$NAME" > /dev/null 2>&1 || true; }
trap cleanup EXIT

# Host networking: free loopback ports, no port mapping.
"${PODMAN[@]}" run -d "${RUN_FLAGS[@]}" --name "$NAME" --network=host "$IMAGE" \
  --address=127.0.0.1 --port="$PORT" --metrics_address=127.0.0.1 --metrics_port="$MPORT" \
  --backend=cpu --drain_seconds=5 > /dev/null || { echo "FAIL start"; exit 1; }

lossctl_in() { "${PODMAN[@]}" exec "$NAME" /opt/lossd/bin/lossctl "$@"; }
ready() {
  for _ in $(seq 60); do
    lossctl_in info --target="127.0.0.1:$PORT" > /dev/null 2>&1 &&
      { lossctl_in info --target="127.0.0.1:$PORT"; return 0; }
    sleep 1
  done
  "${PODMAN[@]}" logs "$NAME" | tail -20
  return 1
}
compute() {  # lossctl...: a random bf16 Compute; the loss must be a finite number
  local out
  out=$("$@" compute --target="127.0.0.1:$PORT" --bt=256 --h=64 --v=1000 --dtype=bf16) || return 1
  echo "$out"
  python3 -c 'import math,re,sys; m=re.search(r"^loss +(\S+)$", sys.stdin.read(), re.M); sys.exit(0 if m and math.isfinite(float(m.group(1))) else 1)' <<< "$out"
}
metrics() {  # the Computes so far were counted OK, and build_info says the CPU backend
  python3 - "$MPORT" "$1" <<'PY'
import re, sys, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=10).read().decode()
ok = [l for l in text.splitlines() if l.startswith("lossd_requests_total{")
      and 'method="Compute"' in l and 'code="OK"' in l]
assert ok and float(ok[0].split()[-1]) == float(sys.argv[2]), ok
info = re.search(r'^lossd_build_info\{([^}]*)\} 1$', text, re.M)
assert info and 'backend="cpu"' in info.group(1), "build_info"
assert "outside a git checkout" not in info.group(1), "the image does not know its commit"
assert re.search(r"^process_start_time_seconds \d", text, re.M), "process metrics"
print(ok[0])
PY
}
uid() { [[ $("${PODMAN[@]}" exec "$NAME" id -u) == 10001 ]]; }
graceful_stop() {
  "${PODMAN[@]}" stop -t 30 "$NAME" > /dev/null || return 1
  local code
  code=$("${PODMAN[@]}" inspect --format '{{.State.ExitCode}}' "$NAME")
  echo "exit code $code"
  "${PODMAN[@]}" logs "$NAME" 2>&1 | tail -3
  [[ $code == 0 ]]
}

check "lossd serves (lossctl info from the image)" ready
check "lossctl compute (the image's lossctl)" compute lossctl_in
computes=1
if [[ -n "${LOSSCTL:-}" ]]; then
  check "lossctl compute (the host's $LOSSCTL)" compute "$LOSSCTL"
  computes=2
fi
check "/metrics: $computes Compute OK, build_info (backend cpu, a commit), process metrics" metrics "$computes"
check "runs as uid 10001" uid
check "SIGTERM drains and exits 0" graceful_stop
echo "smoke_cpu_image: $failed failed"
[[ $failed -eq 0 ]]
