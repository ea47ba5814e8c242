// SPDX-License-Identifier: Apache-2.0
// The kernel benchmark's command-line flags, defined once (kernel_flags.cc) and read by each
// measurement. Declarations only: what each flag does is written beside its definition.
#ifndef LOSSD_BENCH_KERNEL_KERNEL_FLAGS_H_
#define LOSSD_BENCH_KERNEL_KERNEL_FLAGS_H_

#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, shapes);
ABSL_DECLARE_FLAG(int, runs);
ABSL_DECLARE_FLAG(int, warmup);
ABSL_DECLARE_FLAG(std::string, budgets_mib);
ABSL_DECLARE_FLAG(std::string, schedules);
ABSL_DECLARE_FLAG(std::string, ce_cols);
ABSL_DECLARE_FLAG(double, ce_softcap);
ABSL_DECLARE_FLAG(double, ce_smoothing);
ABSL_DECLARE_FLAG(bool, ce_only);
ABSL_DECLARE_FLAG(std::string, side_sms);
ABSL_DECLARE_FLAG(std::string, host_io);
ABSL_DECLARE_FLAG(std::string, csv);
ABSL_DECLARE_FLAG(bool, autotune);
ABSL_DECLARE_FLAG(bool, ref_exp);
ABSL_DECLARE_FLAG(int, ref_exp_sample);
ABSL_DECLARE_FLAG(int, gemm_ws_mib);
ABSL_DECLARE_FLAG(std::string, algo_ranks);
ABSL_DECLARE_FLAG(std::string, bt_sweep);
ABSL_DECLARE_FLAG(double, energy_seconds);
ABSL_DECLARE_FLAG(bool, check_fp64);
ABSL_DECLARE_FLAG(int, algo_sweep);

#endif  // LOSSD_BENCH_KERNEL_KERNEL_FLAGS_H_
