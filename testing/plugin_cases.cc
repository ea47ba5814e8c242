// SPDX-License-Identifier: Apache-2.0
#include "testing/plugin_cases.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/status_macros.h"
#include "gtest/gtest.h"

namespace lossd {

OptionCase CombinedOptions(Reduction reduction, int64_t chunk_rows, bool grad_f32) {
  OptionCase c;
  c.name = "combined";
  c.reduction = reduction;
  c.eps = 0.1f;
  c.zs = 1e-4f;
  c.cap = 30.0f;
  c.bias = true;
  c.weights = true;
  c.grad_output = reduction == Reduction::kNone;
  c.ignore = 0.2;
  c.chunk_rows = chunk_rows;
  c.grad_f32 = grad_f32;
  return c;
}

WorkspaceShape BiasedShape(int64_t bt, int64_t h, int64_t v, DType dtype, GradOut dw,
                           int64_t chunk_rows) {
  WorkspaceShape s;
  s.bt = bt;
  s.h = h;
  s.v = v;
  s.dtype = dtype;
  s.grad_dtype = dtype;
  s.has_bias = true;
  s.want_dx = true;
  s.chunk_rows = chunk_rows;
  s.dw = dw;
  s.db = dw;
  return s;
}

absl::StatusOr<LossProblem> WithWeightsInBackend(Backend& backend, const LossProblem& p,
                                                 std::unique_ptr<BackendBuffer>* buffer) {
  const size_t wb = p.v * p.h * DTypeSize(p.dtype), bb = p.v * DTypeSize(p.dtype);
  LOSSD_ASSIGN_OR_RETURN(*buffer, backend.Allocate(wb + bb));
  LOSSD_RETURN_IF_ERROR(backend.CopyToBackend(**buffer, 0, p.w, wb));
  LOSSD_RETURN_IF_ERROR(backend.CopyToBackend(**buffer, wb, p.bias, bb));
  LossProblem placed = p;
  placed.w = (*buffer)->data();
  placed.bias = static_cast<const uint8_t*>((*buffer)->data()) + wb;
  placed.w_memory = Memory::kBackend;
  return placed;
}

absl::Status PlaceForBoth(Backend& direct, Backend& plugin, const LossProblem& p, bool resident,
                          ProblemForBoth* both) {
  if (!resident) {
    both->direct = both->plugin = p;
    return absl::OkStatus();
  }
  LOSSD_ASSIGN_OR_RETURN(both->direct, WithWeightsInBackend(direct, p, &both->direct_w));
  LOSSD_ASSIGN_OR_RETURN(both->plugin, WithWeightsInBackend(plugin, p, &both->plugin_w));
  return absl::OkStatus();
}

void ExpectSameStats(const LossStats& got, const LossStats& want, const std::string& where) {
  EXPECT_EQ(got.peak_extra_bytes, want.peak_extra_bytes) << where;
  EXPECT_EQ(got.chunk_rows, want.chunk_rows) << where;
  EXPECT_EQ(got.nonfinite, want.nonfinite) << where;
}

void ExpectRowsRefusalCrossesBack(Backend& direct, Backend& plugin, const LossProblem& p) {
  TrickleRows::Spec ts;
  ts.fail_after = 3;
  ts.failure = absl::InvalidArgumentError("test: the rows were refused");
  TrickleRows direct_rows(p, ts), plugin_rows(p, ts);
  HostOutputs want(p, DType::kBF16), got(p, DType::kBF16);
  const absl::Status refused = direct.Compute(direct_rows.Streamed(p), want.outputs(), nullptr);
  ASSERT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_EQ(plugin.Compute(plugin_rows.Streamed(p), got.outputs(), nullptr), refused);
}

}  // namespace lossd
