// SPDX-License-Identifier: Apache-2.0
// ShapeOf: the shape-only view of a problem that Backend::WorkspaceBytes plans from.
#include "kernels/backend.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(ShapeOfTest, ReadsShapesAndWhichBuffersArePresent) {
  float f = 0;
  LossProblem p;
  p.bt = 47;
  p.h = 31;
  p.v = 123;
  p.dtype = DType::kF16;
  p.w_memory = Memory::kBackend;
  p.bias = &f;
  p.class_weights = &f;
  p.options.chunk_rows = 5;
  LossOutputs out;
  out.grad_dtype = DType::kF32;
  out.dx = &f;
  out.dw = &f;
  const WorkspaceShape s = ShapeOf(p, out);
  EXPECT_EQ(s.bt, 47);
  EXPECT_EQ(s.h, 31);
  EXPECT_EQ(s.v, 123);
  EXPECT_EQ(s.dtype, DType::kF16);
  EXPECT_EQ(s.grad_dtype, DType::kF32);
  EXPECT_EQ(s.w_memory, Memory::kBackend);
  EXPECT_TRUE(s.has_bias);
  EXPECT_TRUE(s.has_class_weights);
  EXPECT_FALSE(s.has_grad_output);
  EXPECT_FALSE(s.rows_streamed);
  EXPECT_EQ(s.chunk_rows, 5);
  EXPECT_TRUE(s.want_dx);
  EXPECT_EQ(s.dw, GradOut::kWritten);
  EXPECT_EQ(s.db, GradOut::kNone);
}

TEST(ShapeOfTest, AnAccumulatorWinsOverAPlainOutput) {
  float f = 0;
  LossProblem p;
  LossOutputs out;
  out.dw = &f;
  out.dw_accum = &f;
  out.db = &f;
  out.db_accum = &f;
  out.accum_memory = Memory::kBackend;
  const WorkspaceShape s = ShapeOf(p, out);
  EXPECT_EQ(s.dw, GradOut::kAccumulated);
  EXPECT_EQ(s.db, GradOut::kAccumulated);
  EXPECT_EQ(s.accum_memory, Memory::kBackend);
  EXPECT_FALSE(s.want_dx);
}

}  // namespace
}  // namespace lossd
