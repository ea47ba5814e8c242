#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a GPU host, from the repository root: lossd's kernel benchmark and the in-process anchors
# (bench/kernel/anchors_bench.py), each op in its own process, timed back to back, and one
# table of every call made so far on this host.
#
# The anchors' wheels (made by bench/kernel/anchor_parts.py) are more than one transfer, so
# they come in parts over several calls made while the host stays up: each call stages the
# parts it carries (ANCHOR_PARTS/part*/) and the bundle (ANCHOR_BUNDLE) under ANCHOR_ROOT,
# which outlives the call; installs every wheel set that is now complete (pip --no-deps
# --target, then a tree's pieces rejoined, checked against sets.txt's sha256 and unpacked over
# it); then runs ANCHOR_OPS in order, each in its own process with its set's PYTHONPATH, each
# stopped when the call's time (ANCHOR_BUDGET_S) runs out, a shape it did not reach marked so.
#
# Ops: lossd (bench_kernel of the bundle, default configuration: --budgets_mib=0
# --schedules=0) and anchors_bench.py's: floor, naive, liger_triton (set liger_py),
# liger_cute (set liger), quack and quack_scaled (set quack). An op whose set is not complete
# yet is skipped and said so.
#
# Writes under OUT_DIR: anchors_table.md (the side-by-side table of all calls so far, then
# each anchor's errors), anchors_all.csv, anchors.log (this call) and anchors_results.tar.gz
# (every call's raw logs and CSVs).
# Usage: bench/kernel/run_anchors.sh OUT_DIR
# Env: ANCHOR_OPS (default "floor lossd naive liger_triton liger_cute quack quack_scaled"),
#   ANCHOR_SHAPES (default 8192x4096x128256,8192x2304x256000,16384x4096x128256),
#   ANCHOR_ARGS (more anchors_bench.py flags), BENCH_ARGS (more bench_kernel flags),
#   ANCHOR_PARTS (default .anchors), ANCHOR_BUNDLE (default dist/lossd-bundle.tar.xz),
#   ANCHOR_ROOT (default /tmp/anchors), ANCHOR_BUDGET_S (default 560),
#   ANCHOR_DEVICE (cuda; cpu checks the script on a machine without a GPU).
set -uo pipefail
OUTDIR=$(mkdir -p "${1:?usage: run_anchors.sh OUT_DIR}" && cd "$1" && pwd)
cd "$(dirname "$0")/../.."
OPS=${ANCHOR_OPS:-floor lossd naive liger_triton liger_cute quack quack_scaled}
SHAPES=${ANCHOR_SHAPES:-8192x4096x128256,8192x2304x256000,16384x4096x128256}
PARTS=${ANCHOR_PARTS:-.anchors}
BUNDLE=${ANCHOR_BUNDLE:-dist/lossd-bundle.tar.xz}
ROOT=${ANCHOR_ROOT:-/tmp/anchors}
BUDGET=${ANCHOR_BUDGET_S:-560}
DEVICE=${ANCHOR_DEVICE:-cuda}
PY=${PYTHON:-python3}
START=$SECONDS
mkdir -p "$ROOT/stage" "$ROOT/results"
n=1
while [ -e "$ROOT/results/call$n" ]; do n=$((n + 1)); done
CALL=call$n
RES=$ROOT/results/$CALL
mkdir -p "$RES"
SETS_TXT=$ROOT/stage/sets.txt

say() { echo "[$((SECONDS - START))s] $*"; }

# 1. This call's parts and bundle, kept under ROOT for the calls after it.
stage() {
  local d
  for d in "$PARTS"/part*/; do
    [ -d "$d" ] || continue
    cp -f "$d"* "$ROOT/stage/" && say "staged $d: $(ls "$d" | wc -l) files, $(du -sh "$d" | cut -f1)"
  done
  if [ -f "$BUNDLE" ]; then
    rm -rf "$ROOT/lb" && mkdir -p "$ROOT/lb" && xz -dc "$BUNDLE" | tar -xf - -C "$ROOT/lb" &&
      say "bundle: $(sed -n 2p "$ROOT/lb/lossd-bundle/BUNDLE_INFO" 2>/dev/null)"
  fi
}

# 2. Every set that is complete and not yet installed.
set_names() { [ -f "$SETS_TXT" ] && awk '!/^#/ && NF {print $1}' "$SETS_TXT" | uniq; }
set_lines() { awk -v s="$1" '$1 == s' "$SETS_TXT"; }

# Prints what the set still lacks (nothing when it is complete).
set_missing() {
  local kind file sha pieces i
  while read -r _ kind file sha pieces; do
    if [ "$kind" = wheel ]; then
      [ -f "$ROOT/stage/$file" ] || echo -n "$file "
    else
      for ((i = 0; i < pieces; i++)); do
        [ -f "$ROOT/stage/$file.$(printf %02d $i)" ] || echo -n "$file.$(printf %02d $i) "
      done
    fi
  done < <(set_lines "$1")
}

install_set() {
  local set=$1 site=$ROOT/site-$1 kind file sha pieces i w wheels=()
  rm -rf "$site" && mkdir -p "$site"
  while read -r _ kind file sha pieces; do
    [ "$kind" = wheel ] || continue
    echo "$sha  $ROOT/stage/$file" | sha256sum -c --quiet - || return 1
    wheels+=("$ROOT/stage/$file")
  done < <(set_lines "$set")
  # One pip call for all the set's wheels: they share top-level folders, which a second
  # --target install into the same folder would skip or replace.
  if ! PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"; then
    say "pip failed for $set; unpacking its wheels instead (none has a .data folder)"
    for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$site" || return 1; done
  fi
  while read -r _ kind file sha pieces; do
    [ "$kind" = tree ] || continue
    for ((i = 0; i < pieces; i++)); do cat "$ROOT/stage/$file.$(printf %02d $i)"; done \
      > "$ROOT/joined"
    echo "$sha  $ROOT/joined" | sha256sum -c --quiet - || { say "$file: sha256 differs"; return 1; }
    xz -dc "$ROOT/joined" | tar -xf - -C "$site" || return 1
    rm -f "$ROOT/joined"
  done < <(set_lines "$set")
  touch "$site/.complete"
}

install_complete_sets() {
  local set missing
  for set in $(set_names); do
    if [ -f "$ROOT/site-$set/.complete" ]; then say "set $set: installed earlier"; continue; fi
    missing=$(set_missing "$set")
    if [ -n "$missing" ]; then say "set $set: waits for $missing"; continue; fi
    if install_set "$set"; then
      say "set $set: installed ($(du -sh "$ROOT/site-$set" | cut -f1))"
    else
      say "set $set: install FAILED"
      rm -rf "$ROOT/site-$set"
    fi
  done
}

# 3. The ops, in order, each in its own process within what is left of the budget.
set_of() {
  case "$1" in
    liger_triton) echo liger_py ;;
    liger_cute) echo liger ;;
    quack | quack_scaled) echo quack ;;
    *) echo "" ;;
  esac
}

run_lossd() {
  local left=$1 dir=$ROOT/lb/lossd-bundle rc
  [ -x "$dir/bench_kernel" ] || { say "lossd: no bundle staged (carry $BUNDLE)"; return; }
  (cd "$dir" && timeout -k 10 "$left" ./bench_kernel --shapes="$SHAPES" --budgets_mib=0 \
    --schedules=0 --csv="$RES/bench.csv" ${BENCH_ARGS:-} > "$RES/bench.log" 2>&1)
  rc=$?
  say "lossd: exit $rc ($(grep -c . "$RES/bench.csv" 2>/dev/null || echo 0) CSV lines)"
  grep -E '^\| [0-9]' "$RES/bench.log" | head -12
  [ $rc -eq 0 ] || tail -5 "$RES/bench.log"
}

run_op() {
  local op=$1 left=$2 set site pypath="" rc
  set=$(set_of "$op")
  if [ -n "$set" ]; then
    site=$ROOT/site-$set
    [ -f "$site/.complete" ] || { say "$op: skipped, set $set not installed yet"; return; }
    pypath=$site:$site/nvidia_cutlass_dsl/dsl_packages
  fi
  local common=(--op "$op" --shapes "$SHAPES" --csv "$RES/anchors.csv" --label "$CALL")
  env -u LIGER_KERNEL_IMPL PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    QUACK_CACHE_DIR="$ROOT/quack_cache" timeout -k 10 "$left" \
    "$PY" bench/kernel/anchors_bench.py "${common[@]}" --device "$DEVICE" ${ANCHOR_ARGS:-} \
    > "$RES/$op.log" 2>&1
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    "$PY" bench/kernel/anchors_bench.py "${common[@]}" \
      --mark_missing "stopped at the call's time limit (${left}s left for it)"
  fi
  say "$op: exit $rc"
  grep -E '^  [a-z_]+ [0-9]+x' "$RES/$op.log" | cut -c1-400
}

run_ops() {
  local op left
  for op in $OPS; do
    left=$((BUDGET - (SECONDS - START) - 20))
    if [ $left -lt 30 ]; then say "$op: skipped, ${left}s left of the budget"; continue; fi
    case "$op" in
      lossd) run_lossd "$left" ;;
      floor | naive | liger_triton | liger_cute | quack | quack_scaled) run_op "$op" "$left" ;;
      *) say "unknown op '$op' in ANCHOR_OPS" ;;
    esac
  done
}

# 4. The table of every call so far, and the raw results.
report() {
  "$PY" bench/kernel/anchors_table.py --csv "$OUTDIR/anchors_all.csv" "$ROOT"/results/call* \
    > "$OUTDIR/anchors_table.md"
  tar -C "$ROOT/results" -czf "$OUTDIR/anchors_results.tar.gz" .
  say "done; the table of calls so far:"
  cat "$OUTDIR/anchors_table.md"
}

main() {
  say "$CALL on $(hostname): ops '$OPS', shapes $SHAPES, budget ${BUDGET}s"
  command -v nvidia-smi > /dev/null &&
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  "$PY" -V
  stage
  install_complete_sets
  run_ops
  report
}

main 2>&1 | tee -a "$OUTDIR/anchors.log"
