// SPDX-License-Identifier: Apache-2.0
// Times CpuBackend::Compute (forward + backward, all outputs) on random inputs and prints
// seconds and achieved GFLOP/s against the 6 BT H V FLOPs of the three GEMMs (distill: 8, with
// the teacher's logits GEMM at the student's hidden size).
// Usage: cpu_bench [BT H V [dtype(bf16|fp16|fp32) [threads [reps [chunk_rows
//                  [kind(cross_entropy|logprob|policy|policy_seq|distill) [S]]]]]]]
// policy_seq: sequence-level importance sampling over sequences of S rows (default 512):
// one pass over the logits where chunk_rows is a multiple of S, else two.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

int main(int argc, char** argv) {
  using lossd::DType;
  const int64_t bt = argc > 1 ? std::atoll(argv[1]) : 2048;
  const int64_t h = argc > 2 ? std::atoll(argv[2]) : 1024;
  const int64_t v = argc > 3 ? std::atoll(argv[3]) : 32000;
  const std::string dt = argc > 4 ? argv[4] : "bf16";
  const int threads = argc > 5 ? std::atoi(argv[5]) : 0;
  const int reps = argc > 6 ? std::atoi(argv[6]) : 3;
  const int64_t chunk = argc > 7 ? std::atoll(argv[7]) : 0;
  const std::string kind = argc > 8 ? argv[8] : "cross_entropy";
  const DType dtype = dt == "fp32" ? DType::kF32 : dt == "fp16" ? DType::kF16 : DType::kBF16;

  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> x(bt * h * lossd::DTypeSize(dtype)), w(v * h * lossd::DTypeSize(dtype));
  for (int64_t k = 0; k < bt * h; ++k) lossd::StoreFromFloat(x.data(), dtype, k, normal(rng));
  const float ws = 2.0f / std::sqrt(static_cast<float>(h));
  for (int64_t k = 0; k < v * h; ++k) lossd::StoreFromFloat(w.data(), dtype, k, ws * normal(rng));
  std::vector<int64_t> targets(bt);
  std::uniform_int_distribution<int64_t> any(0, v - 1);
  for (int64_t& t : targets) t = any(rng);

  lossd::LossProblem p;
  p.bt = bt;
  p.h = h;
  p.v = v;
  p.dtype = dtype;
  p.x = x.data();
  p.w = w.data();
  p.targets = targets.data();
  p.options.chunk_rows = chunk;
  // The other kinds' per-token inputs (random, in [-1, 1)) and the teacher (X and W reused).
  std::vector<float> per_token(bt);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (float& e : per_token) e = unit(rng);
  if (kind == "logprob") {
    p.kind = lossd::LossKind::kLogprob;
    p.dlogp = p.dentropy = per_token.data();
  } else if (kind == "policy" || kind == "policy_seq") {
    p.kind = lossd::LossKind::kPolicy;
    p.advantages = per_token.data();
    if (kind == "policy_seq") {
      const int64_t seq = argc > 9 ? std::atoll(argv[9]) : 512;
      if (seq <= 0 || bt % seq != 0) {
        std::fprintf(stderr, "S=%lld must divide BT\n", static_cast<long long>(seq));
        return 2;
      }
      p.policy.sequences = bt / seq;
      p.policy.importance_sampling = lossd::ImportanceSampling::kSequence;
    }
  } else if (kind == "distill") {
    p.kind = lossd::LossKind::kDistill;
    p.teacher_h = h;
    p.teacher_x = x.data();
    p.teacher_w = w.data();
  } else if (kind != "cross_entropy") {
    std::fprintf(stderr, "unknown kind %s\n", kind.c_str());
    return 2;
  }
  std::vector<uint8_t> dx(bt * h * lossd::DTypeSize(dtype)), dw(v * h * lossd::DTypeSize(dtype));
  std::vector<float> lse(bt);
  float loss = 0;
  lossd::LossOutputs out;
  out.grad_dtype = dtype;
  out.loss = &loss;
  out.lse = lse.data();
  out.dx = dx.data();
  out.dw = dw.data();
  std::vector<float> logp(bt), entropy(bt);
  if (p.kind == lossd::LossKind::kLogprob || p.kind == lossd::LossKind::kPolicy) out.logp = logp.data();
  if (p.kind == lossd::LossKind::kLogprob) out.entropy = entropy.data();

  std::unique_ptr<lossd::Backend> backend = lossd::NewCpuBackend(threads);
  const int used = static_cast<lossd::CpuBackend*>(backend.get())->threads();
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    lossd::LossStats stats;
    const auto t0 = std::chrono::steady_clock::now();
    const std::clock_t c0 = std::clock();
    absl::Status st = backend->Compute(p, out, &stats);
    const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok()) {
      std::fprintf(stderr, "Compute failed: %s\n", st.ToString().c_str());
      return 1;
    }
    times.push_back(s);
    std::printf("rep %d: %.3f s wall, %.3f s CPU (chunk %lld rows, workspace %.0f MiB), loss %.5f\n", r, s, cpu,
                static_cast<long long>(stats.chunk_rows), stats.peak_extra_bytes / 1048576.0,
                loss);
  }
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  const double flops = (kind == "distill" ? 8.0 : 6.0) * bt * h * v;
  std::printf("%s BT=%lld H=%lld V=%lld %s threads=%d: median %.3f s, %.1f GFLOP/s\n",
              kind.c_str(), static_cast<long long>(bt), static_cast<long long>(h),
              static_cast<long long>(v), dt.c_str(), used, med, flops / med / 1e9);
  return 0;
}
