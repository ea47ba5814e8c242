// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's optimizer step and sum of squares (GPU host only). The step must equal
// the CPU backend's bit for bit: both run kernels/optimizer_math.h's code, one IEEE
// round-to-nearest operation at a time (the device through __fmul_rn and friends, so no FMA;
// sqrt and division correctly rounded on both), and the CPU backend is itself checked against
// the float64 oracle (kernels/cpu/optimizer_step_test). The exception is a NaN's payload and
// sign, which the two processors make differently: with non-finite data only NaN-ness is
// compared. Reruns must be bit-identical; the sum of squares is within a stated bound of a
// double loop.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/optimizer_reference.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/optimizer.h"
#include "testing/cuda/gpu_test_util.h"
#include "testing/optimizer_cases.h"

namespace lossd {
namespace cuda {
namespace {

std::unique_ptr<CudaBackend>& Gpu() {
  static std::unique_ptr<CudaBackend>* gpu = [] {
    auto* b = new std::unique_ptr<CudaBackend>();
    if (HaveGpu()) {
      absl::StatusOr<std::unique_ptr<CudaBackend>> made = CudaBackend::Create({});
      if (made.ok()) *b = std::move(*made);
    }
    return b;
  }();
  return *gpu;
}

#define REQUIRE_GPU()                                       \
  do {                                                      \
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";               \
    ASSERT_NE(Gpu(), nullptr) << "CudaBackend::Create failed"; \
  } while (0)

// One parameter's buffers on the device, uploaded from (and read back into) host buffers.
class DeviceParam {
 public:
  // `offset` elements in front of every tensor: an offset of 1 misaligns the pointers, so the
  // kernel's scalar path runs instead of its 16-byte one.
  static std::unique_ptr<DeviceParam> Upload(Backend& gpu, const OptimizerBuffers& b,
                                             const std::vector<float>& grad, int64_t offset = 0,
                                             size_t copy_elem = 4) {
    auto d = std::unique_ptr<DeviceParam>(new DeviceParam);
    d->offset_ = offset;
    d->copy_at_ = offset * copy_elem;
    const size_t bytes = static_cast<size_t>(b.n) * 4;
    for (auto [dst, src] : {std::pair<std::unique_ptr<BackendBuffer>*, const void*>{
                                &d->param_, b.param.data()},
                            {&d->grad_, grad.data()}, {&d->s1_, b.state1.data()},
                            {&d->s2_, b.state2.data()}, {&d->s3_, b.state3.data()},
                            {&d->copy_, b.copy.data()}}) {
      absl::StatusOr<std::unique_ptr<BackendBuffer>> buf = gpu.Allocate(bytes + offset * 4);
      if (!buf.ok()) {
        ADD_FAILURE() << buf.status();
        return nullptr;
      }
      *dst = std::move(*buf);
      const uint64_t at = dst == &d->copy_ ? d->copy_at_ : offset * 4;
      const absl::Status s = gpu.CopyToBackend(**dst, at, src, bytes);
      if (!s.ok()) {
        ADD_FAILURE() << s;
        return nullptr;
      }
    }
    return d;
  }

  void SetGrad(Backend& gpu, const std::vector<float>& grad) {
    ASSERT_TRUE(gpu.CopyToBackend(*grad_, offset_ * 4, grad.data(), grad.size() * 4).ok());
  }

  OptimizerTensors Tensors(const OptimizerCase& c, int64_t n) {
    OptimizerTensors t;
    t.n = n;
    t.param = static_cast<float*>(param_->data()) + offset_;
    t.grad = static_cast<const float*>(grad_->data()) + offset_;
    t.state1 = static_cast<float*>(s1_->data()) + offset_;
    t.state2 = static_cast<float*>(s2_->data()) + offset_;
    t.state3 = static_cast<float*>(s3_->data()) + offset_;
    // The copy's element is 2 or 4 bytes: offset by elements of its own dtype (Upload's).
    t.copy = c.copy ? static_cast<char*>(copy_->data()) + copy_at_ : nullptr;
    t.copy_dtype = c.copy_dtype;
    return t;
  }

  void Download(Backend& gpu, OptimizerBuffers* b) {
    const size_t bytes = static_cast<size_t>(b->n) * 4;
    const uint64_t at = offset_ * 4;
    ASSERT_TRUE(gpu.CopyFromBackend(*param_, at, b->param.data(), bytes).ok());
    ASSERT_TRUE(gpu.CopyFromBackend(*s1_, at, b->state1.data(), bytes).ok());
    ASSERT_TRUE(gpu.CopyFromBackend(*s2_, at, b->state2.data(), bytes).ok());
    ASSERT_TRUE(gpu.CopyFromBackend(*s3_, at, b->state3.data(), bytes).ok());
    ASSERT_TRUE(gpu.CopyFromBackend(*copy_, copy_at_, b->copy.data(), bytes).ok());
  }

 private:
  DeviceParam() = default;
  int64_t offset_ = 0;
  uint64_t copy_at_ = 0;
  std::unique_ptr<BackendBuffer> param_, grad_, s1_, s2_, s3_, copy_;
};

// Elements whose bits differ, and the first such index ("" when none).
std::string BitDiff(const char* what, const void* a, const void* b, int64_t n, size_t width) {
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(static_cast<const char*>(a) + i * width,
                    static_cast<const char*>(b) + i * width, width) != 0) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  return bad == 0 ? "" : absl::StrCat(what, ": ", bad, " of ", n, " differ, first at ", first);
}

std::string AllBitDiffs(const OptimizerCase& c, const OptimizerBuffers& gpu,
                        const OptimizerBuffers& cpu) {
  const int64_t n = cpu.n;
  return absl::StrCat(BitDiff("param", gpu.param.data(), cpu.param.data(), n, 4),
                      BitDiff("state1", gpu.state1.data(), cpu.state1.data(), n, 4),
                      BitDiff("state2", gpu.state2.data(), cpu.state2.data(), n, 4),
                      BitDiff("state3", gpu.state3.data(), cpu.state3.data(), n, 4),
                      BitDiff("copy", gpu.copy.data(), cpu.copy.data(), n,
                              c.copy ? DTypeSize(c.copy_dtype) : 4));
}

class CudaOptimizerStepTest
    : public ::testing::TestWithParam<std::tuple<OptimizerCase, int64_t, int64_t>> {};

TEST_P(CudaOptimizerStepTest, EqualsTheCpuBackendBitForBit) {
  REQUIRE_GPU();
  const OptimizerCase& c = std::get<0>(GetParam());
  const int64_t n = std::get<1>(GetParam());
  std::unique_ptr<Backend> cpu = NewCpuBackend(4);
  OptimizerBuffers on_cpu = RandomOptimizerBuffers(c, n, 71 + n);
  OptimizerBuffers on_gpu = on_cpu;
  const int64_t offset = std::get<2>(GetParam());
  std::unique_ptr<DeviceParam> dev = DeviceParam::Upload(
      *Gpu(), on_gpu, RandomGradient(n, 1), offset, c.copy ? DTypeSize(c.copy_dtype) : 4);
  ASSERT_NE(dev, nullptr);
  for (int k = 0; k < kOptimizerSteps; ++k) {
    SCOPED_TRACE(absl::StrCat("step ", k));
    const OptimizerParams p = ParamsAtStep(c.params, k);
    const std::vector<float> grad = RandomGradient(n, 500 * k + n);
    dev->SetGrad(*Gpu(), grad);
    ASSERT_TRUE(Gpu()->OptimizerStep(p, dev->Tensors(c, n)).ok());
    ASSERT_TRUE(cpu->OptimizerStep(p, HostTensors(c, on_cpu, grad.data())).ok());
    dev->Download(*Gpu(), &on_gpu);
    EXPECT_EQ(CountNan(on_cpu.param), 0);
    EXPECT_EQ(AllBitDiffs(c, on_gpu, on_cpu), "");
  }
}

std::vector<std::tuple<OptimizerCase, int64_t, int64_t>> Matrix() {
  std::vector<std::tuple<OptimizerCase, int64_t, int64_t>> out;
  const std::vector<OptimizerCase> cases = AllOptimizerCases();
  for (size_t k = 0; k < cases.size(); ++k) {
    const OptimizerCase& c = cases[k];
    // Aligned tensors take the four-wide kernels, and every n here leaves a tail of 1-3 for
    // their scalar loop. (1 << 22) + 5 elements take more than one pass of their grid-stride
    // loop (4096 blocks of 256 threads, 4 elements each): every fourth case, since the CPU
    // step it is compared with takes seconds at that size. Offset by one element, the scalar
    // kernels run: (1 << 20) + 3 is more than one pass of theirs.
    for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{1031}}) out.emplace_back(c, n, 0);
    if (k % 4 == 0) out.emplace_back(c, (int64_t{1} << 22) + 5, 0);
    for (const int64_t n : {int64_t{7}, (int64_t{1} << 20) + 3}) out.emplace_back(c, n, 1);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, CudaOptimizerStepTest, ::testing::ValuesIn(Matrix()),
    [](const ::testing::TestParamInfo<std::tuple<OptimizerCase, int64_t, int64_t>>& info) {
      return absl::StrCat(std::get<0>(info.param).name, "_n", std::get<1>(info.param),
                          std::get<2>(info.param) != 0 ? "_unaligned" : "");
    });

// A value's class for non-finite comparisons: NaN (any payload), or its exact bits.
bool SameOrBothNan(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0;
}

TEST(CudaOptimizerNonFiniteTest, InfAndNanGradientsGoThroughAsOnTheCpu) {
  REQUIRE_GPU();
  const int64_t n = 4099;
  std::unique_ptr<Backend> cpu = NewCpuBackend(2);
  for (const OptimizerCase& c : AllOptimizerCases()) {
    SCOPED_TRACE(c.name);
    std::vector<float> grad = RandomGradient(n, 9);
    grad[0] = std::numeric_limits<float>::infinity();
    grad[1] = -std::numeric_limits<float>::infinity();
    grad[2] = std::numeric_limits<float>::quiet_NaN();
    grad[n - 1] = 3e38f;  // its square overflows fp32: v becomes Inf
    OptimizerBuffers on_cpu = RandomOptimizerBuffers(c, n, 10), on_gpu = on_cpu;
    std::unique_ptr<DeviceParam> dev = DeviceParam::Upload(*Gpu(), on_gpu, grad);
    ASSERT_NE(dev, nullptr);
    ASSERT_TRUE(Gpu()->OptimizerStep(c.params, dev->Tensors(c, n)).ok());
    ASSERT_TRUE(cpu->OptimizerStep(c.params, HostTensors(c, on_cpu, grad.data())).ok());
    dev->Download(*Gpu(), &on_gpu);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      bad += !SameOrBothNan(on_gpu.param[i], on_cpu.param[i]) ||
             !SameOrBothNan(on_gpu.state1[i], on_cpu.state1[i]) ||
             !SameOrBothNan(on_gpu.state2[i], on_cpu.state2[i]) ||
             !SameOrBothNan(on_gpu.state3[i], on_cpu.state3[i]) ||
             (c.copy && !SameOrBothNan(LoadAsFloat(on_gpu.copy.data(), c.copy_dtype, i),
                                       LoadAsFloat(on_cpu.copy.data(), c.copy_dtype, i)));
    }
    EXPECT_EQ(bad, 0);
    EXPECT_TRUE(std::isnan(on_gpu.param[2]));  // a NaN gradient poisons its parameter
  }
}

TEST(CudaOptimizerDeterminismTest, RerunsAreBitIdentical) {
  REQUIRE_GPU();
  const int64_t n = (int64_t{1} << 22) + 17;
  for (const OptimizerCase& c : AllOptimizerCases()) {
    SCOPED_TRACE(c.name);
    const std::vector<float> grad = RandomGradient(n, 12);
    OptimizerBuffers first = RandomOptimizerBuffers(c, n, 11), second = first;
    for (OptimizerBuffers* b : {&first, &second}) {
      std::unique_ptr<DeviceParam> dev = DeviceParam::Upload(*Gpu(), *b, grad);
      ASSERT_NE(dev, nullptr);
      ASSERT_TRUE(Gpu()->OptimizerStep(ParamsAtStep(c.params, 0), dev->Tensors(c, n)).ok());
      dev->Download(*Gpu(), b);
    }
    EXPECT_EQ(CountNan(first.param), 0);
    EXPECT_EQ(AllBitDiffs(c, first, second), "");
  }
}

// The device sum adds in another order than the index-order loop: any order of n
// non-negative terms (each product exact in double) is within 2(n-1) * 2^-53 * sum of it.
double SumBound(double sum, int64_t n) { return 2.0 * (n - 1) * std::ldexp(1.0, -53) * sum; }

absl::StatusOr<double> DeviceSum(const std::vector<float>& x) {
  const size_t bytes = x.size() * 4;
  absl::StatusOr<std::unique_ptr<BackendBuffer>> buf = Gpu()->Allocate(bytes == 0 ? 4 : bytes);
  if (!buf.ok()) return buf.status();
  if (absl::Status s = Gpu()->CopyToBackend(**buf, 0, x.data(), bytes); !s.ok()) return s;
  return Gpu()->SumOfSquares(static_cast<const float*>((*buf)->data()), x.size());
}

TEST(CudaSumOfSquaresTest, MatchesADoubleLoopAndRerunsBitIdentically) {
  REQUIRE_GPU();
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1031}, int64_t{262145},
                          (int64_t{1} << 25) + 3}) {
    SCOPED_TRACE(n);
    const std::vector<float> x = RandomGradient(n, 80 + n);
    const absl::StatusOr<double> got = DeviceSum(x);
    ASSERT_TRUE(got.ok()) << got.status();
    const double want = ReferenceSumOfSquares(x.data(), n);
    EXPECT_LE(std::fabs(*got - want), SumBound(want, n)) << *got << " vs " << want;
    if (n > 0) {
      EXPECT_GT(*got, 0);
    }
    const absl::StatusOr<double> again = DeviceSum(x);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(std::memcmp(&*got, &*again, sizeof(double)), 0);
  }
}

TEST(CudaSumOfSquaresTest, InfAndNanPropagate) {
  REQUIRE_GPU();
  const int64_t n = 300001;
  std::vector<float> x = RandomGradient(n, 4);
  x[n - 1] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(*DeviceSum(x), std::numeric_limits<double>::infinity());
  x[12345] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(*DeviceSum(x)));
  x[n - 1] = 3e38f;  // squares past fp32's range stay finite in double
  x[12345] = 3e38f;
  const double big = 3e38f;
  EXPECT_NEAR(*DeviceSum(x), 2 * big * big, 1e-12 * big * big);
}

TEST(CudaSumOfSquaresTest, RefusesBadArguments) {
  REQUIRE_GPU();
  EXPECT_EQ(Gpu()->SumOfSquares(nullptr, 5).status().code(), absl::StatusCode::kInvalidArgument);
  OptimizerTensors t;
  t.n = 4;  // AdamW without buffers
  EXPECT_EQ(Gpu()->OptimizerStep(OptimizerParams(), t).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
