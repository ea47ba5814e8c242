// SPDX-License-Identifier: Apache-2.0
// GPU test, in a process of its own: after a sticky device error (a trap in a kernel) the
// CUDA backend reports itself unhealthy, and every entry point answers UNAVAILABLE at once
// instead of calling into the broken context and failing INTERNAL. The context cannot be
// repaired within the process, so nothing else may run in this binary after the fault.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference.h"
#include "testing/cuda/device_fault.h"
#include "testing/cuda/gpu_test_util.h"
#include "testing/test_util.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

namespace lossd {
namespace cuda {
namespace {

void ExpectUnavailable(const absl::Status& s, const std::string& call) {
  EXPECT_TRUE(absl::IsUnavailable(s)) << call << ": " << s;
  EXPECT_NE(s.message().find("sticky error"), std::string::npos) << call << ": " << s;
  EXPECT_NE(s.message().find(call), std::string::npos) << call << ": " << s;
}

TEST(StickyErrorTest, EveryCallAfterADeviceFaultIsUnavailable) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  absl::StatusOr<std::unique_ptr<CudaBackend>> created = CudaBackend::Create({});
  ASSERT_TRUE(created.ok()) << created.status();
  CudaBackend& backend = **created;

  // Healthy first: a buffer goes up and comes back, and a Compute matches the reference.
  absl::StatusOr<std::unique_ptr<BackendBuffer>> buf = backend.Allocate(4096);
  ASSERT_TRUE(buf.ok()) << buf.status();
  std::vector<uint8_t> up(4096), down(4096, 0xFF);
  for (size_t i = 0; i < up.size(); ++i) up[i] = static_cast<uint8_t>(i * 37 + 11);
  ASSERT_TRUE(backend.CopyToBackend(**buf, 0, up.data(), up.size()).ok());
  ASSERT_TRUE(backend.CopyFromBackend(**buf, 0, down.data(), down.size()).ok());
  ASSERT_EQ(up, down);
  RandomProblemSpec spec;
  spec.bt = 24, spec.h = 32, spec.v = 100, spec.seed = 5;
  RandomProblem rp = RandomProblem::Make(spec);
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs out(p, DType::kBF16);
  ASSERT_TRUE(backend.Compute(p, out.outputs(), nullptr).ok());
  ASSERT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()));
  ASSERT_TRUE(backend.Info().healthy);

  // The fault: from here on every CUDA call in this process fails.
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const cudaError_t fault = TrapOnDevice(stream);
  ASSERT_TRUE(IsStickyCudaError(fault)) << cudaGetErrorName(fault);

  // The first call to meet it finds out: INTERNAL, saying the device is in a sticky error
  // state, and the backend marks itself unhealthy (the server's health follows).
  out.Poison();
  absl::Status first = backend.Compute(p, out.outputs(), nullptr);
  EXPECT_TRUE(absl::IsInternal(first)) << first;
  EXPECT_NE(first.message().find("sticky error"), std::string::npos) << first;
  EXPECT_FALSE(backend.Info().healthy);

  // Every later call is refused at once, naming itself: a client may go to another replica.
  ExpectUnavailable(backend.Compute(p, out.outputs(), nullptr), "Compute");
  ExpectUnavailable(backend.CopyToBackend(**buf, 0, up.data(), up.size()), "copy to the device");
  ExpectUnavailable(backend.CopyFromBackend(**buf, 0, down.data(), down.size()),
                    "copy from the device");
  ExpectUnavailable(backend.Zero(**buf), "zeroing a buffer");
  absl::StatusOr<std::unique_ptr<BackendBuffer>> more = backend.Allocate(4096);
  ASSERT_FALSE(more.ok());
  ExpectUnavailable(more.status(), "allocation");
  EXPECT_FALSE(backend.Info().healthy);
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
