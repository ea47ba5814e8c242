# SPDX-License-Identifier: Apache-2.0
# Sourced by run.sh and run_rl.sh: finds Liger-Kernel's unpacked sdist, which carries its tests
# (the wheel does not), and writes the skipped JUnit report where it cannot.
# liger_sdist TEST_REL: sets SDIST to the folder holding TEST_REL ($LIGER_SDIST, else
# liger-kernel $LIGER_VERSION, 0.8.5, fetched with pip into ~/.cache/lossd/liger, not built);
# where it cannot, sets LIGER_WHY and returns 1.
# liger_skip SUITE CASE JUNIT REASON: says SKIP, writes a JUnit report (when JUNIT is set) with
# one skipped case, and exits 0.

liger_skip() {
  local suite=$1 case=$2 junit=$3 reason=$4
  echo "SKIP $suite: $reason"
  if [[ -n "$junit" ]]; then
    cat >"$junit" <<XML
<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="$case" tests="1" skipped="1" failures="0" errors="0">
<testcase classname="$case" name="$case"><skipped message="$reason"/></testcase>
</testsuite></testsuites>
XML
  fi
  exit 0
}

liger_sdist() {  # TEST_REL -> SDIST, or LIGER_WHY and status 1
  local test_rel=$1 version=${LIGER_VERSION:-0.8.5}
  SDIST=${LIGER_SDIST:-}
  if [[ -z "$SDIST" ]]; then
    local cache=${XDG_CACHE_HOME:-$HOME/.cache}/lossd/liger archive
    SDIST=$cache/liger_kernel-$version
    if [[ ! -f "$SDIST/$test_rel" ]]; then
      mkdir -p "$cache"
      python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
        "liger-kernel==$version" -d "$cache" >/dev/null 2>&1 || true
      archive=$(ls "$cache"/liger_kernel-"$version".tar.gz 2>/dev/null | head -1)
      [[ -n "$archive" ]] || { LIGER_WHY="liger-kernel $version's sdist could not be fetched"; return 1; }
      tar -xzf "$archive" -C "$cache" ||
        { LIGER_WHY="liger-kernel $version's sdist could not be unpacked"; return 1; }
    fi
  fi
  [[ -f "$SDIST/$test_rel" ]] || { LIGER_WHY="no $test_rel under $SDIST"; return 1; }
}
