// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/kernel_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, shapes,
          "1024x1024x32000,8192x4096x128256,8192x2304x256000,16384x4096x128256,"
          "32768x4096x128256",
          "comma-separated BTxHxV");
ABSL_FLAG(int, runs, 20, "timed runs per measurement (median reported)");
ABSL_FLAG(int, warmup, 3, "untimed runs first");
ABSL_FLAG(std::string, budgets_mib, "0,1024",
          "chunk budgets (MiB) to time the fused op at; 0 = the backend's default for the shape "
          "(DefaultChunkBudget); Nr = chunks of N rows");
ABSL_FLAG(std::string, schedules, "0,1,2",
          "schedules to time (0 row halves, 1 column halves, 2 the whole-batch layout where it "
          "applies)");
ABSL_FLAG(std::string, ce_cols, "",
          "also time the one-read CE kernel with at most these many columns a block (comma "
          "list), beside its default, and a device copy of the same bytes");
ABSL_FLAG(double, ce_softcap, 0,
          "softcap for the CE kernels timed alone (--ce_only and the CE summary; 0: off)");
ABSL_FLAG(double, ce_smoothing, 0,
          "label smoothing for the CE kernels timed alone (--ce_only and the CE summary; 0: off)");
ABSL_FLAG(bool, ce_only, false,
          "time only the cross-entropy kernels (both of them) at each shape's first-budget chunks");
ABSL_FLAG(std::string, side_sms, "",
          "SM targets for the dW GEMMs to time with the column-halves schedule");
ABSL_FLAG(std::string, host_io, "",
          "BTxHxV: also time CudaBackend::Compute with host tensors (fresh W each call, dX and "
          "bf16 dW back)");
ABSL_FLAG(std::string, csv, "", "also write the results as CSV to this file");
ABSL_FLAG(bool, autotune, true,
          "time cuBLASLt's candidates for the fused op's GEMMs on first use (the backend's "
          "default); the floor is timed both ways");
ABSL_FLAG(bool, ref_exp, true,
          "true: plan row chunks for the reference-exp path where the engine has it (its budget "
          "grows by the path's buffers, DefaultRefExpBudget); false: the logits GEMM + "
          "cross-entropy kernel path. Not given: the device's default as the backend takes it "
          "(kernels/cuda/device_tuning.h: the other path with 4096-row default chunks on an "
          "H100)");
ABSL_FLAG(int, ref_exp_sample, 1024,
          "vocabulary rows the reference-exp path's reference samples (1 to 1024): its C x n "
          "GEMM a chunk");
ABSL_FLAG(int, gemm_ws_mib, 4, "cuBLASLt workspace per stream (MiB) for the fused op's GEMMs");
ABSL_FLAG(std::string, algo_ranks, "0,0,0",
          "cuBLASLt heuristic rank for the fused op's logits, dX and dW GEMMs");
ABSL_FLAG(std::string, bt_sweep, "",
          "HxV:BT,BT,...: also time the fused op (autotuned, default budget) on a fresh engine "
          "at each BT in turn, as a trainer with a moving BT calls it: the first call (with "
          "whatever tuning it does) against the median of the calls after it");
ABSL_FLAG(double, energy_seconds, 0,
          "> 0: also measure the energy (NVML's counter) of the floor, the tuned floor, the "
          "fused op, the chunked GEMMs alone, the CE kernels alone and a device copy of the CE's "
          "bytes, each run back to back for this many seconds after as long a warm-up, at the "
          "first budget and schedule of each shape");
ABSL_FLAG(bool, check_fp64, true,
          "check the fused op's loss, dX and dW at each shape against a float64 reference "
          "computed on the device (DGEMMs), after the timing");
ABSL_FLAG(int, algo_sweep, 0,
          "> 0: also time each GEMM of the floor and of the first budget's chunks alone at "
          "heuristic ranks 0..N-1 and workspaces 4 and 32 MiB (which algorithm pays)");
