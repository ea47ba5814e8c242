// SPDX-License-Identifier: Apache-2.0
// The fixture of the hosted heads' engine tests (heads_test: the store, the update, export
// and import; head_step_test: the Step barrier): an engine on the CPU backend, a head over a
// random W0, Computes of random micro-batches into it, every rank's Step at once, exports as
// host bytes. Test-only; never linked into the server.
#ifndef LOSSD_TESTING_HEADS_TEST_FIXTURE_H_
#define LOSSD_TESTING_HEADS_TEST_FIXTURE_H_

#include <cstring>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "engine/engine.h"
#include "engine/heads.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/engine_calls.h"
#include "testing/test_util.h"

namespace lossd {
namespace heads_testing {

inline constexpr int64_t kBt = 6, kH = 5, kV = 11;

inline bool Has(const absl::Status& s, absl::StatusCode code, const std::string& text) {
  return s.code() == code && std::string(s.message()).find(text) != std::string::npos;
}

// The micro-batch `seed` of a run: random X and targets over the head's W0 (seed 1).
inline RandomProblem MicroBatch(uint64_t seed, bool bias) {
  RandomProblemSpec s;
  s.bt = kBt;
  s.h = kH;
  s.v = kV;
  s.bias = bias;
  s.ignore_fraction = 0.2;
  s.seed = seed;
  RandomProblem rp = RandomProblem::Make(s);
  s.seed = 1;
  RandomProblem w0 = RandomProblem::Make(s);
  rp.w = w0.w;
  rp.bias = w0.bias;
  rp.RecomputeStats();
  return rp;
}

inline HeadOptimizer AdamW(bool amsgrad = false) {
  HeadOptimizer o;
  o.kind = OptimizerKind::kAdamW;
  o.lr = 0.05;
  o.weight_decay = 0.1;
  o.bias_weight_decay = 0.02;
  o.amsgrad = amsgrad;
  return o;
}

inline HeadOptimizer Sgd() {
  HeadOptimizer o;
  o.kind = OptimizerKind::kSgd;
  o.lr = 0.1;
  o.weight_decay = 0.01;
  o.momentum = 0.9;
  o.nesterov = true;
  return o;
}

class HeadsTest : public ::testing::Test {
 protected:
  explicit HeadsTest(EngineOptions o = {}) : e_(NewCpuBackend(2), Options(o)) {}
  static EngineOptions Options(EngineOptions o) { return o; }

  // A head over W0 (bf16, so the master is its upcast and the copy W0 itself).
  absl::StatusOr<HeadSummary> Create(const std::string& name, HeadOptimizer opt, bool bias) {
    RandomProblem w0 = MicroBatch(1, bias);
    HeadSpec spec;
    spec.name = name;
    spec.v = kV;
    spec.h = kH;
    spec.has_bias = bias;
    spec.master_dtype = DType::kBF16;
    spec.compute_dtype = DType::kBF16;
    spec.optimizer = opt;
    auto c = e_.heads().BeginCreate(spec, "");
    if (!c.ok()) return c.status();
    if (c->existing) return *c->existing;
    absl::Status s = e_.heads().WriteCreate(*c->pending, HeadTensor::kMasterW, 0, w0.w.data(),
                                            w0.w.size());
    if (s.ok() && bias) {
      s = e_.heads().WriteCreate(*c->pending, HeadTensor::kMasterBias, 0, w0.bias.data(),
                                 w0.bias.size());
    }
    if (!s.ok()) return s;
    return e_.heads().CommitCreate(std::move(c->pending));
  }

  ComputeOutcome Compute(const std::string& head, uint64_t version, uint32_t rank,
                         uint64_t mb, uint64_t seed, bool bias) {
    RandomProblem rp = MicroBatch(seed, bias);
    ComputeSpec spec = ComputeSpecFor(rp);
    spec.inputs[static_cast<int>(InputSlot::kW)].present = false;
    spec.options.grad_scale = 0.5f;  // 1 / world_size, as DDP averages
    spec.head = head;
    spec.head_version = version;
    spec.rank = rank;
    spec.micro_batch = mb;
    auto plan = e_.Plan(spec);
    if (!plan.ok()) {
      ComputeOutcome o;
      o.status = plan.status();
      return o;
    }
    return RunSync(e_, *plan, InputBuffersFor(rp, *plan));
  }

  // The same micro-batch's dW (and db) added into a plain accumulator: the oracle of the sum.
  // W and the bias are the head's compute copy now (its export's last tensors), else W0.
  void AddToOracle(const std::string& acc, uint64_t seed, bool bias,
                   const std::string& head = "") {
    RandomProblem rp = MicroBatch(seed, bias);
    if (!head.empty()) {
      std::vector<std::vector<uint8_t>> x = Export(head);
      rp.w = x[x.size() - (bias ? 2 : 1)];
      if (bias) rp.bias = x.back();
      rp.RecomputeStats();
    }
    ComputeSpec spec = ComputeSpecFor(rp);
    if (bias) {
      TensorDesc& b = spec.inputs[static_cast<int>(InputSlot::kBias)];
      b.present = true;
      b.dtype = rp.spec().dtype;
      b.shape = {kV};
    }
    spec.options.grad_scale = 0.5f;
    spec.accumulator = acc;
    auto plan = e_.Plan(spec);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto in = InputBuffersFor(rp, *plan);
    if (bias) {
      auto& b = (*in)[static_cast<int>(InputSlot::kBias)];
      b = NewHostBuffer(rp.bias.size());
      std::memcpy(b.get(), rp.bias.data(), rp.bias.size());
    }
    ComputeOutcome o = RunSync(e_, *plan, in);
    ASSERT_TRUE(o.status.ok()) << o.status;
  }

  // Every rank calls Step at once; returns each rank's answer.
  std::vector<absl::StatusOr<StepResult>> StepAll(StepCall call) {
    std::vector<std::promise<absl::StatusOr<StepResult>>> p(call.world_size);
    for (uint32_t r = 0; r < call.world_size; ++r) {
      StepCall c = call;
      c.rank = r;
      e_.heads().Step(c, "", [&p, r](absl::StatusOr<StepResult> s) { p[r].set_value(s); });
    }
    std::vector<absl::StatusOr<StepResult>> out;
    for (auto& x : p) out.push_back(x.get_future().get());
    return out;
  }

  // The export's tensors as fp32 host vectors (the copy as raw bytes).
  std::vector<std::vector<uint8_t>> Export(const std::string& name) {
    auto x = e_.heads().Export(name, std::nullopt, 0, 0, "");
    EXPECT_TRUE(x.ok()) << x.status();
    std::vector<std::vector<uint8_t>> out;
    uint64_t at = 0;
    for (const auto& [t, bytes] : x->tensors) {
      out.emplace_back(x->data.get() + at, x->data.get() + at + bytes);
      at += bytes;
    }
    return out;
  }

  Engine e_;
};

// "" when equal; else how many 4-byte words differ and the first, as floats.
inline std::string Mismatch(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got == want) return "";
  if (got.size() != want.size()) return absl::StrCat("sizes ", got.size(), " vs ", want.size());
  size_t n = 0, first = 0;
  for (size_t i = 0; i + 4 <= got.size(); i += 4) {
    if (std::memcmp(&got[i], &want[i], 4) != 0 && n++ == 0) first = i;
  }
  float g, w;
  std::memcpy(&g, &got[first], 4);
  std::memcpy(&w, &want[first], 4);
  return absl::StrCat(n, " of ", got.size() / 4, " words differ; first at word ", first / 4,
                      ": ", g, " vs ", w);
}

inline std::vector<float> Floats(const std::vector<uint8_t>& b) {
  std::vector<float> f(b.size() / 4);
  std::memcpy(f.data(), b.data(), b.size());
  return f;
}

class SmallHeadsTest : public HeadsTest {
 protected:
  static EngineOptions Small() {
    EngineOptions o;
    o.head_bytes = 1500;  // one (11, 5) AdamW head with a bias holds 66 * 18 = 1188 bytes
    o.head_step_timeout = absl::Milliseconds(300);
    return o;
  }
  SmallHeadsTest() : HeadsTest(Small()) {}
};

}  // namespace heads_testing
}  // namespace lossd

#endif  // LOSSD_TESTING_HEADS_TEST_FIXTURE_H_
