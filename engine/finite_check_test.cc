// SPDX-License-Identifier: Apache-2.0
// The --check_finite test: the first NaN or Inf of a range is named by its index in the
// whole tensor, wherever it lies in the blocks or the tail, for every float dtype.
#include "engine/finite_check.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

// A range check reports the tensor's own index, whatever range it was given.
TEST(CheckFiniteElementsTest, ChecksOnlyItsRangeAndNamesTheGlobalIndex) {
  std::vector<float> t(40);
  for (size_t i = 0; i < t.size(); ++i) t[i] = 0.25f + static_cast<float>(i);
  t[5] = INFINITY;
  t[27] = NAN;
  const auto* p = reinterpret_cast<const uint8_t*>(t.data());
  EXPECT_TRUE(CheckFiniteElements(p, DType::kF32, 6, 21, "x", 8).ok());  // [6, 27)
  absl::Status s = CheckFiniteElements(p, DType::kF32, 20, 20, "x", 8);
  EXPECT_EQ(s.message(), "x contains a non-finite value (nan) at [3, 3]; lossd refuses NaN and "
                         "Inf inputs (--check_finite)");
  s = CheckFiniteElements(p, DType::kF32, 5, 1, "bias", 0);
  EXPECT_EQ(s.message(), "bias contains a non-finite value (inf) at [5]; lossd refuses NaN and "
                         "Inf inputs (--check_finite)");
  EXPECT_TRUE(CheckFiniteElements(p, DType::kI32, 0, 40, "targets", 0).ok());  // not floats
}

// The check works in fixed blocks plus a tail: one bad element is found wherever it lies,
// for every dtype, in ranges of any length and start.
TEST(CheckFiniteElementsTest, FindsOneBadElementAnywhereInBlocksAndTail) {
  constexpr int kN = 1100;  // over four 256-element bf16 blocks and a tail
  struct Case {
    DType dtype;
    uint32_t one, bad;  // bits of a finite value and of a non-finite one
  };
  for (const Case c : {Case{DType::kBF16, 0x3f80, 0xff81}, Case{DType::kF16, 0x3c00, 0x7c00},
                       Case{DType::kF32, 0x3f800000, 0x7fc00000}}) {
    const size_t es = DTypeSize(c.dtype);
    std::vector<uint8_t> t(kN * es + 1);  // + 1: a misaligned start below
    uint8_t* base = t.data() + 1;
    auto put = [&](int i, uint32_t bits) { std::memcpy(base + i * es, &bits, es); };
    for (int i = 0; i < kN; ++i) put(i, c.one);
    EXPECT_TRUE(CheckFiniteElements(base, c.dtype, 0, kN, "x", 0).ok());
    for (int bad : {0, 1, 255, 256, 511, 700, 1023, 1024, 1099}) {
      put(bad, c.bad);
      absl::Status s = CheckFiniteElements(base, c.dtype, 0, kN, "x", 0);
      EXPECT_NE(s.message().find(absl::StrCat("at [", bad, "]")), std::string::npos)
          << DTypeName(c.dtype) << " " << bad << ": " << s;
      // A range that ends just before it, or starts just after it, passes.
      EXPECT_TRUE(CheckFiniteElements(base, c.dtype, 0, bad, "x", 0).ok()) << bad;
      EXPECT_TRUE(CheckFiniteElements(base, c.dtype, bad + 1, kN - bad - 1, "x", 0).ok()) << bad;
      put(bad, c.one);
    }
  }
}

}  // namespace
}  // namespace lossd
