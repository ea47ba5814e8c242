// SPDX-License-Identifier: Apache-2.0
// What kinds_bench measured for one kind at one shape, and the markdown table and notes it
// prints from those rows. Plain data and text, no device code.
#ifndef LOSSD_BENCH_KERNEL_KINDS_TABLE_H_
#define LOSSD_BENCH_KERNEL_KINDS_TABLE_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace lossd {
namespace bench {

struct KindRow {
  int64_t bt = 0, h = 0, v = 0;
  std::string kind;
  int64_t chunk_rows = 0;
  int schedule = 0;
  double floor_ms = 0, tuned_floor_ms = 0, ms = 0, flop = 0;
  uint64_t workspace = 0;
  int64_t measured_extra = 0;
  double row_mean = 0;
};

// Distill's extra device memory goal at (8192, 4096, 128256).
inline constexpr int64_t kDistillGoalBytes = int64_t{1} << 30;

// The table's rows, one line each, under its header; then the floor's note and, for distill at
// (8192, 4096, 128256), its memory goal.
inline void PrintKindRows(const std::vector<KindRow>& rows) {
  std::printf("| BT, H, V | kind | C | schedule | floor | tuned floor | fused | fused / floor "
              "| fused / tuned floor | TFLOP/s | workspace | peak extra (measured) | row mean "
              "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const KindRow& r : rows) {
    std::printf("| %lld, %lld, %lld | %s | %lld | %s | %.2f ms | %.2f ms | %.2f ms | %.3fx | "
                "%.3fx | %.0f | %.0f MiB | %.0f MiB | %.4f |\n",
                static_cast<long long>(r.bt), static_cast<long long>(r.h),
                static_cast<long long>(r.v), r.kind.c_str(),
                static_cast<long long>(r.chunk_rows), r.schedule == 0 ? "rows" : "columns",
                r.floor_ms, r.tuned_floor_ms, r.ms, r.ms / r.floor_ms, r.ms / r.tuned_floor_ms,
                r.flop / (r.ms * 1e9), r.workspace / 1048576.0, r.measured_extra / 1048576.0,
                r.row_mean);
  }
  std::printf("\nfloor: the kind's GEMMs unchunked (logits, dX, dW; distill adds the teacher's "
              "logits), 6 BT H V flops (distill 2 BT V (3 H + Ht)); row mean: cross_entropy the "
              "row loss, logprob and policy log p(target), distill the row divergence\n");
  for (const KindRow& r : rows) {
    if (r.kind == "distill" && r.bt == 8192 && r.h == 4096 && r.v == 128256) {
      std::printf("distill extra device memory at (8192, 4096, 128256): %.0f MiB measured, "
                  "%.0f MiB planned; goal <= 1024 MiB: %s\n",
                  r.measured_extra / 1048576.0, r.workspace / 1048576.0,
                  r.measured_extra <= kDistillGoalBytes ? "met" : "NOT met");
    }
  }
}

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_KINDS_TABLE_H_
