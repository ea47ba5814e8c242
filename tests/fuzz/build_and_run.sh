#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the lossd fuzz targets with clang (libFuzzer + ASan + UBSan) straight from the repo's
# sources and the system's libraries, replays every committed regression input, then fuzzes
# each target for a bounded time from the committed seed corpus.
#
# Usage: tests/fuzz/build_and_run.sh [XML_DIR]
#   XML_DIR             where fuzz.xml (JUnit) goes; default /tmp/lossd_fuzz/xml
# Environment:
#   FUZZ_SECONDS        fuzzing time per target (default 60; 0 = replay only)
#   FUZZ_RUNS           instead of a time: this many inputs per target with a fixed seed
#                       (FUZZ_SEED, default 1), so a run is repeatable (CI uses this)
#   FUZZ_TARGETS        targets to run (default: compute_stream options put_weights)
#   FUZZ_BUILD_DIR      objects, binaries, working corpora, crash files (default /tmp/lossd_fuzz)
#   FUZZ_REGEN_SEEDS=1  rewrite tests/fuzz/corpus with seed_writer before running
# Prints one "FUZZ PASS|FAIL <target> ..." line per target and exits non-zero on any failure.
# A crash leaves its input under $FUZZ_BUILD_DIR/artifacts/<target>/; copy it into
# tests/fuzz/regressions/<target>/ so that it is replayed here and by //tests/fuzz:fuzz_replay_test.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
XML_DIR="${1:-/tmp/lossd_fuzz/xml}"
SECONDS_PER_TARGET="${FUZZ_SECONDS:-60}"
TARGETS="${FUZZ_TARGETS:-compute_stream options put_weights}"
BUILD="${FUZZ_BUILD_DIR:-/tmp/lossd_fuzz}"
CXX="${FUZZ_CXX:-clang++}"
JOBS="${FUZZ_JOBS:-2}"

mkdir -p "$XML_DIR" "$BUILD/gen" "$BUILD/obj" "$BUILD/bin"

command -v "$CXX" >/dev/null || { echo "FUZZ FAIL build: $CXX not found (apt-get install clang)"; exit 1; }

# --- Build ---------------------------------------------------------------------------------
/usr/bin/protoc -I"$ROOT/proto" --cpp_out="$BUILD/gen" "$ROOT/proto/lossd/v1/lossd.proto" || {
  echo "FUZZ FAIL build: protoc"; exit 1; }

PKGS="protobuf grpc++ openblas gtest absl_status absl_statusor absl_strings absl_str_format \
absl_synchronization absl_time absl_hash absl_raw_hash_set"
CFLAGS_PKG="$(pkg-config --cflags $PKGS)"
# gloo (engine/head_group.cc) ships no .pc file: linked by name, as @system//:gloo does.
LIBS_PKG="$(pkg-config --libs $PKGS) -lgloo"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-sanitize=vptr"
CXXFLAGS="-std=c++17 -O1 -g -fno-omit-frame-pointer $SAN -I$ROOT -I$BUILD/gen $CFLAGS_PKG"

# Our code gets coverage instrumentation; the generated protobuf code does not (it would only
# lead the fuzzer into protobuf's own parser, which is not ours to test).
# Every library of core/, engine/ and the CPU backend (new files join by themselves: a list kept
# by hand missed them twice), plus what the fuzzers use from the other layers.
# Library sources only: tests, benchmarks and any other program (a file defining main, such as
# kernels/cpu/reference_cases.cc) would clash with libFuzzer's main.
LAYER_SRCS=$(cd "$ROOT" && ls core/*.cc engine/*.cc kernels/cpu/*.cc | grep -v -e '_test\.cc$' -e '_bench\.cc$' |
  while read -r f; do grep -q '^int main(' "$f" || echo "$f"; done)
SRCS_COVERED="$LAYER_SRCS kernels/host_memory.cc kernels/optimizer_check.cc kernels/policy_rows.cc
wire/part_codec.cc service/wire_convert.cc service/compute_assembler.cc
testing/test_util.cc testing/match_reference.cc testing/trickle_rows.cc tests/fuzz/fuzz_env.cc
tests/fuzz/compute_stream_fuzzer.cc tests/fuzz/options_fuzzer.cc tests/fuzz/put_weights_fuzzer.cc"

compile() {  # src obj extra-flags...
  local src="$1" obj="$2"; shift 2
  if [[ "$obj" -nt "$src" && -z "${FUZZ_REBUILD:-}" ]]; then return 0; fi
  "$CXX" $CXXFLAGS "$@" -c "$src" -o "$obj"
}
export -f compile
export CXX CXXFLAGS

build_failed=0
OBJS=()
{
  echo "$BUILD/gen/lossd/v1/lossd.pb.cc $BUILD/obj/lossd.pb.o"
  for s in $SRCS_COVERED; do
    echo "$ROOT/$s $BUILD/obj/$(echo "$s" | tr / _).o -fsanitize=fuzzer-no-link"
  done
} > "$BUILD/compile_list"
# Headers change objects too: rebuild everything when any header under the tree is newer.
newest_header=$(find "$ROOT/core" "$ROOT/wire" "$ROOT/kernels" "$ROOT/engine" "$ROOT/service" "$ROOT/client" "$ROOT/testing" "$ROOT/tests/fuzz" -name '*.h' -newer "$BUILD/obj/.stamp" 2>/dev/null | head -1)
if [[ ! -e "$BUILD/obj/.stamp" || -n "$newest_header" ]]; then export FUZZ_REBUILD=1; fi
if ! xargs -P "$JOBS" -L 1 bash -c 'compile "$@"' _ < "$BUILD/compile_list"; then
  build_failed=1
fi
touch "$BUILD/obj/.stamp"
while read -r _ obj _; do OBJS+=("$obj"); done < "$BUILD/compile_list"

declare -A ENTRY=([compute_stream]=ComputeStreamOneInput [options]=OptionsOneInput
                  [put_weights]=PutWeightsOneInput)
if [[ $build_failed == 0 ]]; then
  for t in $TARGETS; do
    "$CXX" $CXXFLAGS -fsanitize=fuzzer-no-link -DLOSSD_FUZZ_ENTRY="lossd::fuzz::${ENTRY[$t]}" \
      -c "$ROOT/tests/fuzz/fuzz_entry.cc" -o "$BUILD/obj/entry_$t.o" &&
    "$CXX" $CXXFLAGS -fsanitize=fuzzer "${OBJS[@]}" "$BUILD/obj/entry_$t.o" $LIBS_PKG -lpthread \
      -o "$BUILD/bin/${t}_fuzzer" || build_failed=1
  done
fi
if [[ "${FUZZ_REGEN_SEEDS:-0}" == 1 && $build_failed == 0 ]]; then
  "$CXX" $CXXFLAGS -fsanitize=fuzzer-no-link "$ROOT/tests/fuzz/seed_writer.cc" "${OBJS[@]}" \
    $LIBS_PKG -lpthread -o "$BUILD/bin/seed_writer" &&
  rm -rf "$ROOT/tests/fuzz/corpus" && "$BUILD/bin/seed_writer" "$ROOT/tests/fuzz/corpus" ||
  { echo "FUZZ FAIL seeds: seed_writer"; exit 1; }
fi

# --- Run -------------------------------------------------------------------------------------
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:symbolize=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
cases=()   # "name|status|seconds|message"
failures=0

xml_escape() { sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/"/\&quot;/g'; }

for t in $TARGETS; do
  bin="$BUILD/bin/${t}_fuzzer"
  if [[ $build_failed != 0 || ! -x "$bin" ]]; then
    echo "FUZZ FAIL $t: build failed"
    cases+=("build_$t|fail|0|the fuzz target did not build")
    failures=$((failures + 1))
    continue
  fi
  # Replay: every committed regression and seed input, no fuzzing.
  replay_files=$(find "$ROOT/tests/fuzz/regressions/$t" "$ROOT/tests/fuzz/corpus/$t" -type f 2>/dev/null | sort)
  start=$(date +%s)
  if [[ -n "$replay_files" ]] && ! "$bin" -runs=0 $replay_files > "$BUILD/replay_$t.log" 2>&1; then
    # -runs=0 still executes every named file once.
    msg=$(grep -m1 -E "lossd fuzz finding|ERROR: AddressSanitizer|runtime error|deadly signal" "$BUILD/replay_$t.log")
    echo "FUZZ FAIL replay_$t: $msg (log $BUILD/replay_$t.log)"
    cases+=("replay_$t|fail|$(( $(date +%s) - start ))|$msg")
    failures=$((failures + 1))
  else
    n=$(echo "$replay_files" | grep -c . || true)
    echo "FUZZ PASS replay_$t: $n committed inputs"
    cases+=("replay_$t|pass|$(( $(date +%s) - start ))|")
  fi
  [[ "$SECONDS_PER_TARGET" == 0 ]] && continue
  # Fuzz: a fresh working corpus seeded from the committed one; crashes go to artifacts/.
  work="$BUILD/work/$t"
  rm -rf "$work"
  mkdir -p "$work" "$BUILD/artifacts/$t"
  start=$(date +%s)
  if [[ -n "${FUZZ_RUNS:-}" ]]; then
    budget=(-runs="$FUZZ_RUNS" -seed="${FUZZ_SEED:-1}")
  else
    budget=(-max_total_time="$SECONDS_PER_TARGET")
  fi
  "$bin" "${budget[@]}" -timeout=30 -rss_limit_mb=4096 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$BUILD/artifacts/$t/" "$work" \
    "$ROOT/tests/fuzz/corpus/$t" > "$BUILD/fuzz_$t.log" 2>&1
  rc=$?
  execs=$(grep -m1 "stat::number_of_executed_units" "$BUILD/fuzz_$t.log" | awk '{print $2}')
  rate=$(grep -m1 "stat::average_exec_per_sec" "$BUILD/fuzz_$t.log" | awk '{print $2}')
  cov=$(grep -E "^#[0-9]+" "$BUILD/fuzz_$t.log" | tail -1 | grep -o "cov: [0-9]*" || true)
  if [[ $rc != 0 ]]; then
    msg=$(grep -m1 -E "lossd fuzz finding|ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error|deadly signal|timeout" "$BUILD/fuzz_$t.log")
    art=$(grep -m1 -o "Test unit written to .*" "$BUILD/fuzz_$t.log" | sed 's/Test unit written to //')
    echo "FUZZ FAIL $t: $msg; input $art (log $BUILD/fuzz_$t.log)"
    cases+=("fuzz_$t|fail|$(( $(date +%s) - start ))|$msg; input $art")
    failures=$((failures + 1))
  else
    echo "FUZZ PASS $t: ${execs:-?} execs in $(( $(date +%s) - start )) s (${rate:-?} exec/s, ${cov:-cov ?})"
    cases+=("fuzz_$t|pass|$(( $(date +%s) - start ))|")
  fi
done

# --- JUnit XML ------------------------------------------------------------------------------
{
  echo '<?xml version="1.0" encoding="UTF-8"?>'
  echo "<testsuites tests=\"${#cases[@]}\" failures=\"$failures\">"
  echo "  <testsuite name=\"lossd_fuzz\" tests=\"${#cases[@]}\" failures=\"$failures\">"
  for c in "${cases[@]}"; do
    IFS='|' read -r name status secs msg <<< "$c"
    if [[ $status == pass ]]; then
      echo "    <testcase name=\"$name\" classname=\"lossd_fuzz\" time=\"$secs\"/>"
    else
      m=$(echo "$msg" | xml_escape)
      echo "    <testcase name=\"$name\" classname=\"lossd_fuzz\" time=\"$secs\"><failure message=\"$m\"/></testcase>"
    fi
  done
  echo "  </testsuite>"
  echo "</testsuites>"
} > "$XML_DIR/fuzz.xml"
echo "fuzz: ${#cases[@]} cases, $failures failed; JUnit XML in $XML_DIR/fuzz.xml"
[[ $failures == 0 ]]
