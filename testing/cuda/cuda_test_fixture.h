// SPDX-License-Identifier: Apache-2.0
// What the CUDA backend's GPU tests share (cuda_backend_test, cuda_backend_api_test,
// cuda_backend_stream_test): one backend per test binary, the fixture that skips without a
// GPU, and the shapes and option sets of their problems. Test-only; never runs a Compute.
#ifndef LOSSD_TESTING_CUDA_CUDA_TEST_FIXTURE_H_
#define LOSSD_TESTING_CUDA_CUDA_TEST_FIXTURE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "testing/cuda/gpu_test_util.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {

// One backend per test binary: creating a cuBLASLt handle and streams per test is slow.
inline CudaBackend* SharedBackend() {
  static CudaBackend* backend = [] {
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(CudaBackendOptions{});
    return b.ok() ? b->release() : nullptr;
  }();
  return backend;
}

class CudaTest : public testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    backend_ = SharedBackend();
    ASSERT_NE(backend_, nullptr);
  }
  CudaBackend* backend_ = nullptr;
};

struct Shape {
  const char* name;
  int64_t bt, h, v;
};

const Shape kShapes[] = {
    {"tiny", 4, 8, 16},
    {"odd", 47, 31, 123},
    {"medium", 300, 96, 1000},
};

const OptionCase kOptions[] = {
    {"mean"},
    {"sum_smooth_weights", Reduction::kSum, 0.1f, 0, 0, false, true},
    {"none_gradout_zloss_softcap", Reduction::kNone, 0, 1e-3f, 5.0f, false, false, true},
    {"mean_all", Reduction::kMean, 0.1f, 1e-4f, 4.0f, true, true, false, 0.3, 0,
     DType::kI32},
    {"chunked_bias_ignore", Reduction::kMean, 0, 0, 0, true, false, false, 0.2, 7},
    {"grad_f32", Reduction::kSum, 0.05f, 0, 0, true, false, false, 0.1, 0, DType::kI64,
     true},
    {"accumulate", Reduction::kMean, 0, 1e-4f, 0, true, true, false, 0.1, 16, DType::kI64,
     false, true},
    // Class weights of about 1e-6 (normalised to sum to about 1 over a large vocabulary): the
    // stored fp16 gradient cw_t (p - [j == t]) underflowed until the weights' scale went into
    // the GEMMs' alpha.
    {"mean_tiny_weights_smooth", Reduction::kMean, 0.1f, 0, 0, false, true, false, 0.1, 0,
     DType::kI64, false, false, 1e-6},
    // The same weights with a z-loss, which does not shrink with them: dividing the weights
    // out of that part of G too would push fp16 past its range.
    {"sum_tiny_weights_zloss", Reduction::kSum, 0, 5e-2f, 0, false, true, false, 0.1, 0,
     DType::kI64, false, false, 1e-6},
    // Weights of both signs (torch.randn's): mean divides by their sum, whatever its sign.
    {"mean_signed_weights_smooth", Reduction::kMean, 0.1f, 1e-4f, 0, true, true, false, 0.1, 0,
     DType::kI64, false, false, 1, true},
    // Liger's use_token_scaling: each row's loss, z-loss and gradient times its p_t.
    {"mean_token_scaling_all", Reduction::kMean, 0.1f, 1e-3f, 5.0f, true, true, false, 0.2, 0,
     DType::kI64, false, false, 1, false, true},
    {"none_token_scaling_gradout_chunked", Reduction::kNone, 0, 1e-3f, 0, true, false, true,
     0.2, 7, DType::kI64, true, false, 1, false, true},
};
constexpr int kNumOptions = static_cast<int>(sizeof(kOptions) / sizeof(kOptions[0]));

// grad_scale 1 for reduction none (the per-row losses scale by grad_output), 0.7 otherwise.
inline RandomProblemSpec MakeSpec(const Shape& s, const OptionCase& o, DType dtype, uint64_t seed) {
  return SpecOf(s.bt, s.h, s.v, dtype, o, o.reduction == Reduction::kNone ? 1.0f : 0.7f, seed);
}

// Options of a backend whose chunk schedule is `schedule`, never chosen per problem.
inline CudaBackendOptions FixedSchedule(Schedule schedule) {
  CudaBackendOptions bo;
  bo.schedule = schedule;
  bo.auto_schedule = false;
  return bo;
}

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_TESTING_CUDA_CUDA_TEST_FIXTURE_H_
