// SPDX-License-Identifier: Apache-2.0
// GPU tests of the CUDA backend's interface around a Compute: weights and accumulators
// already on the device, the non-finite statistics, an all-ignored and an empty batch, bad
// input, out-of-memory (and serving on after it), and what Info reports.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference.h"
#include "kernels/cuda/fused_loss.h"
#include "testing/cuda/cuda_test_fixture.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {
namespace {

// Weights, bias and the accumulators already on the device (the server's cached weights and
// per-step accumulators), two micro-batches added into the same accumulator.
TEST_F(CudaTest, DeviceWeightsAndAccumulators) {
  OptionCase o{"dev", Reduction::kMean, 0.05f, 0, 0, true, false, false, 0.1, 0};
  RandomProblem rp = RandomProblem::Make(MakeSpec({"dev", 64, 256, 2048}, o, DType::kBF16, 21));
  LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  auto w = backend_->Allocate(rp.w.size());
  auto bias = backend_->Allocate(rp.bias.size());
  auto dw = backend_->Allocate(p.v * p.h * 4);
  auto db = backend_->Allocate(p.v * 4);
  ASSERT_TRUE(w.ok() && bias.ok() && dw.ok() && db.ok());
  ASSERT_TRUE(backend_->CopyToBackend(**w, 0, rp.w.data(), rp.w.size()).ok());
  ASSERT_TRUE(backend_->CopyToBackend(**bias, 0, rp.bias.data(), rp.bias.size()).ok());
  ASSERT_TRUE(backend_->Zero(**dw).ok());
  ASSERT_TRUE(backend_->Zero(**db).ok());
  LossProblem pd = p;
  pd.w = (*w)->data();
  pd.bias = (*bias)->data();
  pd.w_memory = Memory::kBackend;
  HostOutputs out(p, DType::kBF16, /*want_grads=*/true, /*accumulate=*/true);
  LossOutputs lo = out.outputs();
  lo.dw_accum = static_cast<float*>((*dw)->data());
  lo.db_accum = static_cast<float*>((*db)->data());
  lo.accum_memory = Memory::kBackend;
  for (int step = 0; step < 2; ++step) {
    out.Poison();
    ASSERT_TRUE(backend_->Compute(pd, lo, nullptr).ok());
    EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, [&] {
      LossOutputs only = out.outputs();
      only.dw_accum = nullptr;
      only.db_accum = nullptr;
      return only;
    }()));
  }
  // The accumulators hold twice the reference gradient.
  std::vector<float> dw_host(p.v * p.h), db_host(p.v);
  ASSERT_TRUE(backend_->CopyFromBackend(**dw, 0, dw_host.data(), dw_host.size() * 4).ok());
  ASSERT_TRUE(backend_->CopyFromBackend(**db, 0, db_host.data(), db_host.size() * 4).ok());
  std::vector<double> ref2(ref.dw.size()), got(dw_host.begin(), dw_host.end());
  for (size_t k = 0; k < ref.dw.size(); ++k) ref2[k] = 2 * ref.dw[k];
  const Tolerance tol = ToleranceFor(DType::kBF16, DType::kF32);
  const double bound = 2 * tol.logit_u * rp.stats().rms_row_abs_max + tol.logit_u + tol.grad_u +
                       tol.fp32_rel;
  CompareResult r = CompareRelNorm("dw_accum x2", ref2, got, bound);
  EXPECT_TRUE(r.ok()) << r.ToString();
  std::vector<double> dbr(ref.db.size()), dbg(db_host.begin(), db_host.end());
  for (size_t k = 0; k < ref.db.size(); ++k) dbr[k] = 2 * ref.db[k];
  r = CompareRelNorm("db_accum x2", dbr, dbg, bound);
  EXPECT_TRUE(r.ok()) << r.ToString();
}

// A finite problem whose gradients overflow fp32 (grad_scale 3e38, reduction sum): the stats
// name exactly the outputs holding a NaN or Inf, as a scan of the returned bytes finds them,
// for returned gradients and for a device accumulator; an ordinary problem reports none.
TEST_F(CudaTest, OverflowingGradientsAreReported) {
  auto compute = [this](const LossProblem& p, const LossOutputs& o, LossStats* stats) {
    return backend_->Compute(p, o, stats);
  };
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    RandomProblemSpec spec = ShapeSpec(48, 64, 301, dtype);
    spec.bias = true;
    spec.options.reduction = Reduction::kSum;
    ASSERT_NO_FATAL_FAILURE(ExpectOverflowingGradientsReported(compute, spec));

    // Into a device accumulator, finite before: the bits describe its sum.
    const RandomProblem ordinary = RandomProblem::Make(spec);
    spec.options.grad_scale = 3e38f;
    const RandomProblem huge = RandomProblem::Make(spec);
    const LossProblem p = huge.problem();
    LossStats stats;
    auto dw = backend_->Allocate(p.v * p.h * 4);
    auto db = backend_->Allocate(p.v * 4);
    ASSERT_TRUE(dw.ok() && db.ok());
    ASSERT_TRUE(backend_->Zero(**dw).ok());
    ASSERT_TRUE(backend_->Zero(**db).ok());
    LossOutputs lo;
    lo.grad_dtype = dtype;
    lo.dw_accum = static_cast<float*>((*dw)->data());
    lo.db_accum = static_cast<float*>((*db)->data());
    lo.accum_memory = Memory::kBackend;
    ASSERT_TRUE(backend_->Compute(ordinary.problem(), lo, &stats).ok());
    EXPECT_EQ(stats.nonfinite, 0u) << DTypeName(dtype);
    ASSERT_TRUE(backend_->Compute(p, lo, &stats).ok());
    std::vector<float> db_host(p.v);
    ASSERT_TRUE(backend_->CopyFromBackend(**db, 0, db_host.data(), p.v * 4).ok());
    EXPECT_EQ(stats.nonfinite,
              kNonFiniteDw | (HasNonFinite(db_host.data(), DType::kF32, p.v) ? kNonFiniteDb : 0u))
        << DTypeName(dtype);
  }
}

TEST_F(CudaTest, EveryTargetIgnoredGivesZeros) {
  OptionCase o{"ign", Reduction::kMean, 0.1f, 1e-3f, 0, true, true, false, 1.0, 0};
  RandomProblem rp = RandomProblem::Make(MakeSpec({"i", 12, 16, 50}, o, DType::kBF16, 4));
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs out(p, DType::kBF16);
  ASSERT_TRUE(backend_->Compute(p, out.outputs(), nullptr).ok());
  EXPECT_EQ(out.loss[0], 0.0f);
  EXPECT_EQ(out.tokens, 0);
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()));
}

TEST_F(CudaTest, EmptyBatch) {
  RandomProblem rp = RandomProblem::Make(MakeSpec({"e", 1, 16, 50}, {"e"}, DType::kF32, 4));
  LossProblem p = rp.problem();
  p.bt = 0;
  HostOutputs out(p, DType::kF32);
  ASSERT_TRUE(backend_->Compute(p, out.outputs(), nullptr).ok());
  EXPECT_EQ(out.loss[0], 0.0f);
  EXPECT_EQ(out.tokens, 0);
  for (size_t k = 0; k < out.dw.size(); ++k) ASSERT_EQ(out.dw[k], 0) << k;
}

TEST_F(CudaTest, BadInputIsInvalidArgument) {
  RandomProblem rp = RandomProblem::Make(MakeSpec({"b", 8, 16, 50}, {"b"}, DType::kBF16, 4));
  HostOutputs out(rp.problem(), DType::kBF16);
  // The backend assumes a valid problem: a bad one is refused by the validation it is handed
  // through (testing/test_util.h), as the engine hands it every problem.
  LossProblem p = rp.problem();
  p.h = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateThenCompute(*backend_, p, out.outputs(), nullptr)));
  p = rp.problem();
  rp.targets[3] = 50;
  p = rp.problem();
  absl::Status st = ValidateThenCompute(*backend_, p, out.outputs(), nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("targets[3]"), std::string::npos) << st;
  rp.targets[3] = 1;
  p = rp.problem();
  LossOutputs lo = out.outputs();
  lo.grad_dtype = DType::kI32;
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateThenCompute(*backend_, p, lo, nullptr)));
  p.options.label_smoothing = 2.0f;
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateThenCompute(*backend_, p, out.outputs(), nullptr)));
  EXPECT_TRUE(backend_->Info().healthy);
}

TEST_F(CudaTest, OutOfMemoryIsResourceExhaustedAndTheBackendKeepsServing) {
  // More than the device has.
  const BackendInfo before = backend_->Info();
  ASSERT_GT(before.memory_total_bytes, 0u);
  auto huge = backend_->Allocate(before.memory_total_bytes * 2);
  ASSERT_FALSE(huge.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(huge.status())) << huge.status();
  // A budget smaller than the problem.
  CudaBackendOptions small;
  small.memory_budget_bytes = 1 << 20;
  auto tight = CudaBackend::Create(small);
  ASSERT_TRUE(tight.ok());
  RandomProblem rp = RandomProblem::Make(MakeSpec({"o", 64, 64, 4000}, {"o"}, DType::kF32, 4));
  const LossProblem p = rp.problem();
  HostOutputs out(p, DType::kF32);
  // 1 GiB freed into the device's pool, which keeps it ...
  { ASSERT_TRUE(backend_->Allocate(1ull << 30).ok()); }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const uint64_t kept = backend_->Info().memory_used_bytes;
  absl::Status st = (*tight)->Compute(p, out.outputs(), nullptr);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_GT((*tight)->WorkspaceBytes(ShapeOf(p, out.outputs())), small.memory_budget_bytes);
  // ... until a request runs out of memory: then the pool gives back what it does not use.
  EXPECT_LE(backend_->Info().memory_used_bytes + (512ull << 20), kept)
      << "the pool kept its unused memory after an out-of-memory";
  // Both keep serving.
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  out.Poison();
  ASSERT_TRUE(backend_->Compute(p, out.outputs(), nullptr).ok());
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()));
  EXPECT_TRUE(backend_->Info().healthy);
  EXPECT_TRUE((*tight)->Info().healthy);
}

TEST_F(CudaTest, InfoReportsTheDevice) {
  const BackendInfo info = backend_->Info();
  EXPECT_EQ(info.name, "cuda");
  EXPECT_FALSE(info.device.empty());
  EXPECT_GT(info.memory_total_bytes, 0u);
  EXPECT_GT(info.memory_used_bytes, 0u);
  EXPECT_TRUE(info.healthy);
  // What it holds follows its buffers (the caching pool keeps freed memory, which `used`
  // still counts), and its budget is the option's.
  CudaBackendOptions o;
  o.memory_budget_bytes = 256u << 20;
  auto b = CudaBackend::Create(o);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Info().memory_budget_bytes, o.memory_budget_bytes);
  const uint64_t held = (*b)->Info().memory_held_bytes;
  {
    auto buf = (*b)->Allocate(64u << 20);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_GE((*b)->Info().memory_held_bytes, held + (64u << 20));
  }
  EXPECT_EQ((*b)->Info().memory_held_bytes, held);
  EXPECT_EQ(backend_->Info().memory_budget_bytes, 0u);  // the fixture's: none
}

// Info names the path Create chose and its chunk rows (ServerInfo.compute_path).
TEST_F(CudaTest, InfoNamesTheActivePath) {
  CudaBackendOptions o;
  o.ref_exp = RefExpChoice::kOff;
  o.default_chunk_rows = 1024;
  auto off = CudaBackend::Create(o);
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ((*off)->Info().compute_path, "row-chunk, 1024-row chunks");
  o.ref_exp = RefExpChoice::kOn;
  auto on = CudaBackend::Create(o);
  ASSERT_TRUE(on.ok()) << on.status();
  // On where the plugin has the CUTLASS GEMM and the device is sm_90; row-chunk elsewhere.
  EXPECT_EQ((*on)->Info().compute_path,
            (*on)->ref_exp()
                ? "reference-exp for bf16 cross-entropy (row-chunk otherwise), 1024-row chunks"
                : "row-chunk, 1024-row chunks");
  o.chunk_budget_bytes = 256u << 20;
  auto budget = CudaBackend::Create(o);
  ASSERT_TRUE(budget.ok()) << budget.status();
  EXPECT_EQ((*budget)->Info().compute_path,
            (*budget)->ref_exp()
                ? "reference-exp for bf16 cross-entropy (row-chunk otherwise), chunks of a 256 "
                  "MiB budget"
                : "row-chunk, chunks of a 256 MiB budget");
  // The shared backend's: the device's own default.
  const std::string mine = backend_->Info().compute_path;
  EXPECT_EQ(mine.rfind(backend_->ref_exp() ? "reference-exp" : "row-chunk", 0), 0u) << mine;
  EXPECT_NE(mine.find(absl::StrCat(", ", backend_->default_chunk_rows(), "-row chunks")),
            std::string::npos)
      << mine;
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
