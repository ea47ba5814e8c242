// SPDX-License-Identifier: Apache-2.0
// Tests ComputeAssembler: parts copied into place from pieces, order and size refusals, and the
// part-by-part NaN/Inf test (element-exact across part boundaries that split an element).
#include "service/compute_assembler.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "engine/engine.h"

namespace lossd {
namespace {

constexpr int64_t kBt = 6, kH = 10;

// A plan that sends x (kBt, kH) bf16 and targets (kBt) int32, and fp32 class weights (3).
std::shared_ptr<const ComputePlan> Plan() {
  auto p = std::make_shared<ComputePlan>();
  p->bt = kBt;
  p->h = kH;
  p->v = 3;
  p->dtype = DType::kBF16;
  p->target_dtype = DType::kI32;
  p->input_bytes[static_cast<int>(InputSlot::kX)] = kBt * kH * 2;
  p->input_bytes[static_cast<int>(InputSlot::kTargets)] = kBt * 4;
  p->input_bytes[static_cast<int>(InputSlot::kClassWeights)] = 3 * 4;
  return p;
}

// Random finite bf16 values (never zero: a nonzero exponent below the all-ones one).
std::vector<uint8_t> FiniteX(uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> x(kBt * kH * 2);
  for (size_t i = 0; i < x.size(); i += 2) {
    const uint16_t bits = static_cast<uint16_t>((gen() & 0x807f) | ((1 + gen() % 250) << 7));
    std::memcpy(&x[i], &bits, 2);
  }
  return x;
}

// Sends `bytes` of `tensor` in parts cut at `cuts` (byte offsets), each part as two pieces
// split in its middle; returns the first refusal.
absl::Status Send(ComputeAssembler& a, v1::TensorId tensor, const std::vector<uint8_t>& bytes,
                  std::vector<uint64_t> cuts) {
  cuts.push_back(bytes.size());
  uint64_t at = 0;
  for (uint64_t end : cuts) {
    const uint64_t n = end - at, half = n / 2;
    const ComputeAssembler::Piece pieces[2] = {{bytes.data() + at, half},
                                               {bytes.data() + at + half, n - half}};
    absl::Status s = a.Accept(tensor, at, pieces, n);
    if (!s.ok()) return s;
    at = end;
  }
  return absl::OkStatus();
}

std::vector<uint8_t> Targets() {
  std::vector<uint8_t> t(kBt * 4);
  for (int64_t i = 0; i < kBt; ++i) {
    const int32_t v = static_cast<int32_t>(i % 3);
    std::memcpy(&t[i * 4], &v, 4);
  }
  return t;
}

std::vector<uint8_t> ClassWeights(float middle) {
  const float w[3] = {0.5f, middle, 2.0f};
  std::vector<uint8_t> b(sizeof(w));
  std::memcpy(b.data(), w, sizeof(w));
  return b;
}

TEST(ComputeAssemblerTest, PiecesLandInPlaceAcrossOddPartBoundaries) {
  for (bool check : {false, true}) {
    ComputeAssembler a(Plan(), 1 << 20, UINT64_MAX, check);
    const std::vector<uint8_t> x = FiniteX(1);
    // Cuts at odd offsets split bf16 elements between parts.
    ASSERT_TRUE(Send(a, v1::TENSOR_X, x, {1, 7, 8, 33, 101}).ok());
    ASSERT_TRUE(Send(a, v1::TENSOR_TARGETS, Targets(), {5}).ok());
    EXPECT_FALSE(a.CheckComplete().ok());  // class weights missing
    ASSERT_TRUE(Send(a, v1::TENSOR_CLASS_WEIGHTS, ClassWeights(1.0f), {}).ok());
    ASSERT_TRUE(a.CheckComplete().ok());
    EXPECT_EQ(a.finite_checked(), check);
    EXPECT_EQ(a.bytes_received(), x.size() + kBt * 4 + 12);
    const uint8_t* got = (*a.buffers())[static_cast<int>(InputSlot::kX)].get();
    EXPECT_EQ(std::memcmp(got, x.data(), x.size()), 0);
  }
}

TEST(ComputeAssemblerTest, NonFiniteXIsRefusedByThePartThatCompletesTheElement) {
  struct Case {
    uint16_t bits;
    const char* kind;
  };
  for (const Case c : {Case{0x7fc0, "nan"}, Case{0xff80, "inf"}, Case{0x7f81, "nan"}}) {
    std::vector<uint8_t> x = FiniteX(2);
    const int64_t row = 4, col = 7, elem = row * kH + col;
    std::memcpy(&x[elem * 2], &c.bits, 2);
    ComputeAssembler a(Plan(), 1 << 20, UINT64_MAX, /*check_finite=*/true);
    // The first cut ends inside the bad element: that part passes, the next one is refused.
    const uint64_t cut = elem * 2 + 1;
    const ComputeAssembler::Piece first[1] = {{x.data(), cut}};
    ASSERT_TRUE(a.Accept(v1::TENSOR_X, 0, first, cut).ok());
    const ComputeAssembler::Piece rest[1] = {{x.data() + cut, x.size() - cut}};
    absl::Status s = a.Accept(v1::TENSOR_X, cut, rest, x.size() - cut);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(), std::string("x contains a non-finite value (") + c.kind +
                               ") at [4, 7]; lossd refuses NaN and Inf inputs (--check_finite)");
  }
}

TEST(ComputeAssemblerTest, WithoutCheckFiniteNonFiniteBytesAreCopiedAsTheyAre) {
  std::vector<uint8_t> x = FiniteX(3);
  const uint16_t nan = 0x7fc0;
  std::memcpy(&x[10], &nan, 2);
  ComputeAssembler a(Plan(), 1 << 20);
  ASSERT_TRUE(Send(a, v1::TENSOR_X, x, {9}).ok());
  EXPECT_FALSE(a.finite_checked());
  EXPECT_EQ(std::memcmp((*a.buffers())[0].get(), x.data(), x.size()), 0);
}

TEST(ComputeAssemblerTest, NonFiniteClassWeightIsRefusedWithItsIndex) {
  ComputeAssembler a(Plan(), 1 << 20, UINT64_MAX, /*check_finite=*/true);
  absl::Status s = Send(a, v1::TENSOR_CLASS_WEIGHTS, ClassWeights(NAN), {6});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("class_weights contains a non-finite value (nan) at [1]"),
            std::string::npos)
      << s;
}

TEST(ComputeAssemblerTest, RefusesOutOfOrderOversizedAndUnsentParts) {
  ComputeAssembler a(Plan(), 16, /*max_parts=*/4, /*check_finite=*/true);
  const std::vector<uint8_t> x = FiniteX(4);
  const ComputeAssembler::Piece big[1] = {{x.data(), 17}};
  EXPECT_NE(a.Accept(v1::TENSOR_X, 0, big, 17).message().find("more than --max_part_bytes=16"),
            std::string::npos);
  const ComputeAssembler::Piece p[1] = {{x.data(), 8}};
  EXPECT_NE(a.Accept(v1::TENSOR_X, 8, p, 8).message().find("starts at byte offset 8 but 0"),
            std::string::npos);
  EXPECT_NE(a.Accept(v1::TENSOR_W, 0, p, 8).message().find("header does not send w inline"),
            std::string::npos);
  EXPECT_TRUE(a.Accept(v1::TENSOR_X, 0, p, 8).ok());  // the 4th part: at the limit
  EXPECT_NE(a.Accept(v1::TENSOR_X, 8, p, 8).message().find("more than --max_parts_per_request"),
            std::string::npos);
}

// The typed entry point (the fuzzer's) gives the same bytes as the pieces one.
TEST(ComputeAssemblerTest, TypedPartsAreAcceptedToo) {
  ComputeAssembler a(Plan(), 1 << 20, UINT64_MAX, /*check_finite=*/true);
  const std::vector<uint8_t> x = FiniteX(5);
  v1::TensorPart part;
  part.set_tensor(v1::TENSOR_X);
  part.set_data(std::string(x.begin(), x.end()));
  ASSERT_TRUE(a.Accept(part).ok());
  EXPECT_EQ(std::memcmp((*a.buffers())[0].get(), x.data(), x.size()), 0);
}

}  // namespace
}  // namespace lossd
