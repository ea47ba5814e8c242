#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One measured round on a GPU host from the bundle (tools/bundle/make_bundle.sh): the GPU's
# clocks, power, temperature and throttle reasons every 100 ms beside every step (steps.txt
# says when each began), then the steps named in STEPS, in order:
#   tests   the GPU tests (one log each, tests.txt the counts)
#   default bench_kernel at the three reference shapes as the backend plans them on this device
#           (device_tuning.h: the path and the default chunk rows), at DEFAULT_BUDGETS
#   ref     bench_kernel at the three reference shapes, the reference-exp path, at the budgets
#           in REF_BUDGETS (MiB; 0 = the backend's default)
#   other   the same for the other path (logits GEMM + cross-entropy kernel) at OTHER_BUDGETS
#   sample  bench_kernel, reference-exp path, default budget, at each --ref_exp_sample in SAMPLES
#   fused   cutlass_fused_bench (per-phase times, everything in the same rounds)
#   wide    cutlass_fused_bench at logits of standard deviation 40 (the overflow redo's cost)
# Usage: bench/kernel/h100_round.sh BUNDLE_DIR OUT_DIR
set -uo pipefail
B=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd)
cd "$B"
SHAPES=${SHAPES:-8192x4096x128256,8192x2304x256000,16384x4096x128256}
RUNS=${RUNS:-10}
step() { echo "$(date +%s.%N) $*" | tee -a "$OUT/steps.txt"; }
{ nvidia-smi; nvidia-smi -q -d POWER,CLOCK,PERFORMANCE; cat BUNDLE_INFO; } > "$OUT/gpu.txt" 2>&1
q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active
nvidia-smi --query-gpu="$q" --format=csv,noheader -lms 100 > "$OUT/clocks.csv" 2>/dev/null &
smi=$!
for s in ${STEPS:-ref other sample fused wide}; do
  case $s in
    tests)
      # nccl_comm_test needs NCCL: torch's where LOSSD_NCCL_LIBRARY is unset (kernels/cuda/README.md).
      if [ -z "${LOSSD_NCCL_LIBRARY:-}" ]; then
        nccl=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
        [ -f "$nccl/lib/libnccl.so.2" ] && export LOSSD_NCCL_LIBRARY=$nccl/lib/libnccl.so.2
      fi
      echo "LOSSD_NCCL_LIBRARY=${LOSSD_NCCL_LIBRARY:-}" >> "$OUT/tests.txt"
      for t in plugin_exposer_test plugin_compute_test ce_kernels_test nonfinite_test \
          cuda_backend_test cuda_backend_api_test cuda_backend_stream_test sticky_error_test \
          optimizer_test row_loss_test row_loss_paths_test two_phase_gpu_test ref_exp_test \
          policy_sequence_test nccl_comm_test head_group_nccl_gpu_test; do
        [ -x "./$t" ] || { echo "$t: absent" >> "$OUT/tests.txt"; continue; }
        step "test $t"
        timeout "${T_TEST:-150}" "./$t" > "$OUT/$t.log" 2>&1; code=$?
        echo "$t: exit $code; $(grep -E '^\[==========\] [0-9]+ tests? from .* ran' "$OUT/$t.log" | tail -1)" \
          "$(grep -E '^\[  (PASSED|SKIPPED) +\] [0-9]' "$OUT/$t.log" | tr '\n' ' ')" \
          "$(grep -E '^\[  FAILED  \] [0-9]+ test' "$OUT/$t.log")" >> "$OUT/tests.txt"
        grep -E '^\[  FAILED  \] [A-Za-z]' "$OUT/$t.log" | sort -u | head -20 >> "$OUT/tests.txt"
      done ;;
    default)
      step "bench_kernel device defaults budgets ${DEFAULT_BUDGETS:-0}"
      timeout "${T_DEFAULT:-150}" ./bench_kernel --shapes="$SHAPES" --runs="$RUNS" --warmup=2 \
        --schedules=0 --budgets_mib="${DEFAULT_BUDGETS:-0}" \
        --csv="$OUT/bench_default.csv" > "$OUT/bench_default.log" 2>&1 ;;
    ref)
      step "bench_kernel ref_exp=true budgets ${REF_BUDGETS:-0,1300,2700,5000}"
      timeout "${T_REF:-200}" ./bench_kernel --shapes="$SHAPES" --runs="$RUNS" --warmup=2 \
        --schedules=0 --budgets_mib="${REF_BUDGETS:-0,1300,2700,5000}" --ref_exp=true \
        --csv="$OUT/bench_ref.csv" > "$OUT/bench_ref.log" 2>&1 ;;
    other)
      step "bench_kernel ref_exp=false budgets ${OTHER_BUDGETS:-0,2700}"
      timeout "${T_OTHER:-100}" ./bench_kernel --shapes="$SHAPES" --runs="$RUNS" --warmup=2 \
        --schedules=0 --budgets_mib="${OTHER_BUDGETS:-0,2700}" --ref_exp=false \
        --check_fp64=false --csv="$OUT/bench_other.csv" > "$OUT/bench_other.log" 2>&1 ;;
    sample)
      for n in ${SAMPLES:-256 64}; do
        step "bench_kernel ref_exp_sample=$n budgets ${SAMPLE_BUDGETS:-0}"
        timeout "${T_SAMPLE:-60}" ./bench_kernel --shapes="$SHAPES" --runs="$RUNS" --warmup=2 \
          --schedules=0 --budgets_mib="${SAMPLE_BUDGETS:-0}" --ref_exp_sample="$n" \
          --check_fp64=false > "$OUT/bench_sample$n.log" 2>&1
      done ;;
    fused)
      step "cutlass_fused_bench"
      timeout "${T_FUSED:-110}" ./cutlass_fused_bench --shapes="$SHAPES" --runs="$RUNS" \
        --warmup=2 --side_sms_list=0 > "$OUT/fused.log" 2>&1 ;;
    wide)
      step "cutlass_fused_bench logit_scale=20"
      timeout "${T_WIDE:-60}" ./cutlass_fused_bench --shapes=8192x4096x128256 --logit_scale=20 \
        --runs="$RUNS" --warmup=2 --side_sms_list=0 > "$OUT/fused_wide.log" 2>&1 ;;
  esac
done
step "end"
kill $smi
