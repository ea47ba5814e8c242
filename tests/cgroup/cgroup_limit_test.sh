#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# lossd in a real 1 GiB memory cgroup (v2, or v1 where the machine has it): the CPU backend's
# defaults follow the limit, so a Compute that needs more than the container holds is refused
# with RESOURCE_EXHAUSTED at once (before, the 8 GiB default admitted it and the kernel
# OOM-killed the process), and the server keeps serving. Where no cgroup can be made (no
# permission, read-only /sys) the case is reported as skipped, not passed.
# Args: lossd lossctl. Runs unsandboxed (tag "local"): it writes under /sys/fs/cgroup.
set -uo pipefail
LOSSD=$(realpath "$1")
LOSSCTL=$(realpath "$2")
XML="${XML_OUTPUT_FILE:-/dev/null}"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
name="lossd_cgroup_test_$$"

report() {  # status (passed|failed|skipped), message
  local body=""
  case "$1" in
    failed) body="<failure message=\"see the log\"/>" ;;
    skipped) body="<skipped message=\"$2\"/>" ;;
  esac
  cat >"$XML" <<XMLEOF
<?xml version="1.0" encoding="UTF-8"?>
<testsuites><testsuite name="cgroup_limit_test" tests="1" failures="$([ "$1" = failed ] && echo 1 || echo 0)">
<testcase classname="CgroupLimitTest" name="RefusesWhatTheContainerCannotHold">$body</testcase>
</testsuite></testsuites>
XMLEOF
  echo "$1: $2"
  [ "$1" != failed ]
  exit $?
}

# Make the cgroup: v2 where the memory controller is on at the root, else v1's memory mount.
cg=""
if grep -qw memory /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null &&
   mkdir "/sys/fs/cgroup/$name" 2>/dev/null; then
  cg="/sys/fs/cgroup/$name"
  echo $((1 << 30)) >"$cg/memory.max" 2>/dev/null || cg=""
  echo 0 >"$cg/memory.swap.max" 2>/dev/null || true
elif [ -d /sys/fs/cgroup/memory ] && mkdir "/sys/fs/cgroup/memory/$name" 2>/dev/null; then
  cg="/sys/fs/cgroup/memory/$name"
  echo $((1 << 30)) >"$cg/memory.limit_in_bytes" 2>/dev/null || cg=""
fi
[ -n "$cg" ] || report skipped "no memory cgroup can be made here"

pid=""
cleanup() {
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
  [ -n "$pid" ] && wait "$pid" 2>/dev/null
  rmdir "$cg" 2>/dev/null
}
trap cleanup EXIT

out="$TMP/lossd.out"
err="$TMP/lossd.err"
sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' sh "$cg" \
  "$LOSSD" --backend=cpu --port=0 --metrics_port=0 >"$out" 2>"$err" &
pid=$!
port=""
for _ in $(seq 1 100); do
  port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$out")
  [ -n "$port" ] && break
  sleep 0.1
done
if [ -z "$port" ]; then
  cat "$err"
  report failed "lossd did not start in the cgroup"
fi
fail=0
check() {  # what, command...
  local what=$1
  shift
  if ! "$@"; then
    echo "FAILED: $what"
    fail=1
  fi
}
check "the start-up log names the cgroup limit" \
  grep -q "host memory 1.00 GiB (cgroup limit, $cg/memory" "$err"
check "the admission budget defaults to a quarter of it" \
  grep -q -- "--memory_budget_bytes=268435456 (default" "$err"

# X 4 MiB, W 512 MiB and dW 512 MiB in fp32: more than the container holds.
big=$("$LOSSCTL" --target="127.0.0.1:$port" compute --bt=1024 --h=1024 --v=131072 \
  --dtype=fp32 --deadline_seconds=120 2>&1)
code=$?
check "the oversized Compute fails" [ "$code" -ne 0 ]
check "with RESOURCE_EXHAUSTED naming the budget: $big" \
  grep -q "RESOURCE_EXHAUSTED.*memory budget" <<<"$big"
check "lossd is still running" kill -0 "$pid"
small=$("$LOSSCTL" --target="127.0.0.1:$port" compute --bt=64 --h=32 --v=1000 --dtype=fp32 \
  --deadline_seconds=60 2>&1)
check "a Compute that fits is still served: $small" grep -q "^loss " <<<"$small"
if [ "$fail" -ne 0 ]; then
  echo "--- lossd stderr:"
  cat "$err"
  report failed "see above"
fi
report passed "refused with RESOURCE_EXHAUSTED in a 1 GiB cgroup and kept serving"
