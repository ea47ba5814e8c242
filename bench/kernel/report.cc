// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/report.h"

#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "bench/kernel/kernel_flags.h"

namespace lossd {
namespace bench {
namespace {

// One configuration's line of the table, and of the CSV when `csv` is open.
void PrintFused(const Row& r, const Row::Fused& f, FILE* csv) {
  const double flop = 6.0 * r.bt * r.h * r.v;
  std::printf("| %lld, %lld, %lld | %.2f ms | %.2f ms | %s%llu MiB | %lld | %s | %.2f ms | "
              "%.3fx | %.3fx | %.0f | %.0f MiB | %.0f MiB | %s | %.4f | %s |\n",
              static_cast<long long>(r.bt), static_cast<long long>(r.h),
              static_cast<long long>(r.v), f.floor_ms, f.tuned_floor_ms,
              f.is_default ? "default, " : "", static_cast<unsigned long long>(f.budget >> 20),
              static_cast<long long>(f.chunk_rows),
              f.schedule == 0   ? "rows"
              : f.schedule == 2 ? absl::StrFormat("whole batch, %d blocks", f.blocks).c_str()
                                : (f.side_sms > 0 ? absl::StrFormat("columns, dW on %d SMs",
                                                                  f.side_sms)
                                                : std::string("columns"))
                                    .c_str(),
              f.ms, f.ms / f.floor_ms, f.ms / f.tuned_floor_ms,
              flop / (f.ms * 1e-3) / 1e12, f.workspace / 1048576.0,
              f.measured_extra / 1048576.0, r.deterministic ? "yes" : "NO", r.mean_loss,
              f.gemms_ms > 0 ? absl::StrFormat("%.2f ms", f.gemms_ms).c_str() : "");
  if (csv != nullptr) {
    std::fprintf(csv,
                 "%lld,%lld,%lld,%.4f,%.4f,%llu,%lld,%d,%d,%.4f,%.4f,%.1f,%.1f,%.1f,%d,%.5f\n",
                 static_cast<long long>(r.bt), static_cast<long long>(r.h),
                 static_cast<long long>(r.v), f.floor_ms, f.tuned_floor_ms,
                 static_cast<unsigned long long>(f.budget >> 20),
                 static_cast<long long>(f.chunk_rows), f.schedule, f.side_sms, f.ms,
                 f.ms / f.floor_ms,
                 flop / (f.ms * 1e-3) / 1e12, f.workspace / 1048576.0,
                 f.measured_extra / 1048576.0, r.deterministic ? 1 : 0, r.mean_loss);
  }
}

// The shape's summary line: the floor's rate and its parts alone.
void PrintShapeSummary(const Row& r) {
  const double flop = 6.0 * r.bt * r.h * r.v;
  // The first configuration's floor; the whole-batch GEMMs only where that layout was timed.
  const double floor_ms = r.fused.empty() ? 0 : r.fused.front().floor_ms;
  std::printf("| %lld, %lld, %lld | floor %.0f TFLOP/s; chunked GEMMs alone %.2f ms, "
              "CE kernels alone %.2f ms (%s; two-pass kernel %.2f ms)%s | | | | | | | | | | | "
              "| |\n",
              static_cast<long long>(r.bt), static_cast<long long>(r.h),
              static_cast<long long>(r.v), floor_ms > 0 ? flop / (floor_ms * 1e-3) / 1e12 : 0.0,
              r.gemms_ms, r.ce_ms,
              r.ce_cluster > 0
                  ? absl::StrFormat("one-read, %d blocks a row", r.ce_cluster).c_str()
                  : "two-pass",
              r.ce_two_pass_ms,
              r.whole_gemms_ms > 0
                  ? absl::StrFormat(", whole-batch GEMMs alone %.2f ms", r.whole_gemms_ms).c_str()
                  : "");
}

}  // namespace

void PrintTable(const cudaDeviceProp& prop, const std::vector<Row>& rows, bool ref_exp) {
  std::printf("GPU: %s (%d SMs), fwd+bwd bf16, median of %d runs after %d warm-up; fused "
              "path: %s\n\n",
              prop.name, prop.multiProcessorCount, absl::GetFlag(FLAGS_runs),
              absl::GetFlag(FLAGS_warmup),
              ref_exp ? "reference-exp (no pass over the logits)"
                      : "logits GEMM + cross-entropy kernel");
  std::printf("| BT, H, V | 3-GEMM floor | tuned floor | budget | C | schedule | fused "
              "| fused / floor | fused / tuned floor "
              "| TFLOP/s | workspace | measured extra | deterministic | mean loss "
              "| chunked GEMMs alone |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  FILE* csv = nullptr;
  if (!absl::GetFlag(FLAGS_csv).empty()) {
    csv = std::fopen(absl::GetFlag(FLAGS_csv).c_str(), "w");
    if (csv != nullptr) {
      std::fprintf(csv,
                   "bt,h,v,floor_ms,tuned_floor_ms,budget_mib,chunk_rows,schedule,side_sms,"
                   "fused_ms,ratio,tflops,workspace_mib,measured_extra_mib,deterministic,"
                   "mean_loss\n");
    }
  }
  for (const Row& r : rows) {
    for (const Row::Fused& f : r.fused) PrintFused(r, f, csv);
    PrintShapeSummary(r);
  }
  if (csv != nullptr) std::fclose(csv);
}

bool PrintAccuracy(const std::vector<Row>& rows) {
  // The accuracy bar for bf16 inputs: dX and dW at bf16 level (relative norm error
  // about 3e-3 at most), the loss within 1e-5 relative.
  constexpr double kGradRelNorm = 3e-3, kLossRel = 1e-5;
  bool accurate = true;
  bool any_checked = false;
  for (const Row& r : rows) any_checked = any_checked || r.checked_fp64;
  if (any_checked) {
    std::printf("\nAgainst the float64 reference (DGEMMs on the device, same inputs; the "
                "worst over the schedules timed at the first budget):\n\n"
                "| BT, H, V | float64 loss | loss rel. error | dX rel. norm error | "
                "dW rel. norm error | within (%.0e, %.0e) |\n|---|---|---|---|---|---|\n",
                kGradRelNorm, kLossRel);
  }
  for (const Row& r : rows) {
    if (!r.checked_fp64) continue;
    const bool ok = r.fp64.loss_rel <= kLossRel && r.fp64.dx_rel_norm <= kGradRelNorm &&
                    r.fp64.dw_rel_norm <= kGradRelNorm;
    accurate = accurate && ok;
    std::printf("| %lld, %lld, %lld | %.6f | %.2e | %.2e | %.2e | %s |\n",
                static_cast<long long>(r.bt), static_cast<long long>(r.h),
                static_cast<long long>(r.v), r.fp64.ref_loss, r.fp64.loss_rel,
                r.fp64.dx_rel_norm, r.fp64.dw_rel_norm, ok ? "yes" : "NO");
  }
  return accurate;
}

}  // namespace bench
}  // namespace lossd
