// Hosted heads in the engine (CPU backend, no gRPC): the step's sum equals an accumulator's
// of the same micro-batches bit for bit, the update equals the backend's optimizer step on
// that sum (and the float64 reference within the fp32 table), the barrier, versions,
// idempotency keys, timeouts, skip and clip, export and import, the budget.
#include "engine/heads.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "engine/engine.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/engine_calls.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

constexpr int64_t kBt = 6, kH = 5, kV = 11;

bool Has(const absl::Status& s, absl::StatusCode code, const std::string& text) {
  return s.code() == code && std::string(s.message()).find(text) != std::string::npos;
}

// The micro-batch `seed` of a run: random X and targets over the head's W0 (seed 1).
RandomProblem MicroBatch(uint64_t seed, bool bias) {
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

HeadOptimizer AdamW(bool amsgrad = false) {
  HeadOptimizer o;
  o.kind = OptimizerKind::kAdamW;
  o.lr = 0.05;
  o.weight_decay = 0.1;
  o.bias_weight_decay = 0.02;
  o.amsgrad = amsgrad;
  return o;
}

HeadOptimizer Sgd() {
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
std::string Mismatch(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
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

std::vector<float> Floats(const std::vector<uint8_t>& b) {
  std::vector<float> f(b.size() / 4);
  std::memcpy(f.data(), b.data(), b.size());
  return f;
}

// Two ranks, two micro-batches each, then one Step, three times: the head's sum is the
// accumulator's bit for bit, and the update is the CPU backend's optimizer step applied to
// it (with the head's step count, weight decay per parameter group), bit for bit.
TEST_F(HeadsTest, AStepAppliesTheSummedGradientOnceAsTheOptimizerWould) {
  for (bool bias : {false, true}) {
    for (const HeadOptimizer& opt : {AdamW(), AdamW(true), Sgd()}) {
      const std::string name = absl::StrCat("h", bias, static_cast<int>(opt.kind), opt.amsgrad);
      const std::string oracle = "oracle-" + name;
      ASSERT_TRUE(Create(name, opt, bias).ok());
      std::vector<float> master0 = Floats(Export(name)[0]);
      for (int step = 0; step < 3; ++step) {
        for (uint32_t rank = 0; rank < 2; ++rank) {
          for (uint64_t mb = 0; mb < 2; ++mb) {
            const uint64_t seed = 100 + step * 10 + rank * 2 + mb;
            ComputeOutcome o = Compute(name, step, rank, mb, seed, bias);
            ASSERT_TRUE(o.status.ok()) << o.status;
            EXPECT_TRUE(o.head_added);
            AddToOracle(oracle, seed, bias, name);
          }
        }
        auto sum = e_.FetchGradients(oracle, /*reset=*/true);
        ASSERT_TRUE(sum.ok()) << sum.status();
        std::vector<std::vector<uint8_t>> before = Export(name);
        StepCall call;
        call.head = name;
        call.version = step;
        call.world_size = 2;
        for (auto& r : StepAll(call)) {
          ASSERT_TRUE(r.ok()) << r.status();
          EXPECT_EQ(r->version, static_cast<uint64_t>(step + 1));
          EXPECT_TRUE(r->applied);
          EXPECT_EQ(r->contributions, 4u);
        }
        // The oracle: the backend's step on the export before, with the accumulator's sum.
        auto backend = NewCpuBackend(1);
        std::vector<std::vector<uint8_t>> want = before;
        const int states = opt.states();
        const int64_t nw = kV * kH;
        auto apply = [&](int param, int64_t n, const float* grad, double wd) {
          // Export order: master_w, master_bias, then per state (w, bias), then the copies.
          const int per = bias ? 2 : 1;
          OptimizerTensors ts;
          ts.n = n;
          ts.param = reinterpret_cast<float*>(want[param].data());
          ts.grad = grad;
          float** st[3] = {&ts.state1, &ts.state2, &ts.state3};
          for (int i = 0; i < states; ++i) {
            *st[i] = reinterpret_cast<float*>(want[per + i * per + param].data());
          }
          ts.copy = want[per + states * per + param].data();
          ts.copy_dtype = DType::kBF16;
          OptimizerParams p;
          p.kind = opt.kind;
          p.lr = opt.lr;
          p.weight_decay = wd;
          p.momentum = opt.momentum;
          p.dampening = opt.dampening;
          p.nesterov = opt.nesterov;
          p.momentum_initialised = step > 0;
          p.beta1 = opt.beta1;
          p.beta2 = opt.beta2;
          p.eps = opt.eps;
          p.amsgrad = opt.amsgrad;
          p.step = step + 1;
          ASSERT_TRUE(backend->OptimizerStep(p, ts).ok());
        };
        const float* g = reinterpret_cast<const float*>(sum->data.get());
        apply(0, nw, g, opt.weight_decay);
        if (bias) apply(1, kV, g + nw, opt.bias_weight_decay);
        std::vector<std::vector<uint8_t>> got = Export(name);
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(Mismatch(got[i], want[i]), "") << name << " step " << step << " tensor " << i;
        }
      }
      EXPECT_NE(Floats(Export(name)[0]), master0);  // the steps moved it
    }
  }
}

TEST_F(HeadsTest, ARepeatedKeyIsComputedButNotAddedTwice) {
  ASSERT_TRUE(Create("h", AdamW(), true).ok());
  ComputeOutcome a = Compute("h", 0, 0, 7, 50, true);
  ComputeOutcome b = Compute("h", 0, 0, 7, 50, true);
  ASSERT_TRUE(a.status.ok() && b.status.ok()) << a.status << b.status;
  EXPECT_TRUE(a.head_added);
  EXPECT_FALSE(b.head_added);
  EXPECT_EQ(a.outputs[0].get()[0], b.outputs[0].get()[0]);
  EXPECT_EQ(std::memcmp(a.outputs[0].get(), b.outputs[0].get(), kBt * kH * 2), 0);
  auto info = e_.heads().Info("h", "");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->contributions, 1u);
  ComputeOutcome c = Compute("h", 0, 1, 7, 51, true);  // another rank's micro-batch 7
  EXPECT_TRUE(c.head_added);
}

TEST_F(HeadsTest, VersionsAreCheckedAndTheNextVersionWaitsForTheStep) {
  ASSERT_TRUE(Create("h", Sgd(), false).ok());
  ASSERT_TRUE(Compute("h", 0, 0, 0, 60, false).status.ok());
  ComputeOutcome ahead = Compute("h", 1, 0, 0, 61, false);
  EXPECT_TRUE(Has(ahead.status, absl::StatusCode::kFailedPrecondition, "not reached yet"))
      << ahead.status;
  // Rank 0 calls Step; rank 1 has not yet: rank 0's Compute of version 1 waits.
  std::promise<absl::StatusOr<StepResult>> r0;
  StepCall call{"h", 0, 0, 2};
  e_.heads().Step(call, "", [&](absl::StatusOr<StepResult> s) { r0.set_value(s); });
  std::promise<ComputeOutcome> next;
  {
    RandomProblem rp = MicroBatch(62, false);
    ComputeSpec spec = ComputeSpecFor(rp);
    spec.inputs[static_cast<int>(InputSlot::kW)].present = false;
    spec.head = "h";
    spec.head_version = 1;
    auto plan = e_.Plan(spec);
    ASSERT_TRUE(plan.ok()) << plan.status();
    e_.Run(std::make_shared<const ComputePlan>(*plan), InputBuffersFor(rp, *plan),
           [&](ComputeOutcome o) { next.set_value(std::move(o)); });
  }
  auto waiting = next.get_future();
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  auto info = e_.heads().Info("h", "");
  EXPECT_EQ(info->ranks_waiting, 1u);
  call.rank = 1;
  std::promise<absl::StatusOr<StepResult>> r1;
  e_.heads().Step(call, "", [&](absl::StatusOr<StepResult> s) { r1.set_value(s); });
  auto s0 = r0.get_future().get(), s1 = r1.get_future().get();
  ASSERT_TRUE(s0.ok() && s1.ok()) << s0.status() << s1.status();
  EXPECT_EQ(s0->version, 1u);
  ComputeOutcome o = waiting.get();
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_TRUE(o.head_added);
  EXPECT_EQ(o.head_version, 1u);
  ComputeOutcome old = Compute("h", 0, 0, 1, 63, false);
  EXPECT_TRUE(Has(old.status, absl::StatusCode::kFailedPrecondition, "is at version 1"))
      << old.status;
  // A retried Step of the completed step gets its result again.
  auto again = StepAll(StepCall{"h", 0, 0, 2});
  ASSERT_TRUE(again[0].ok()) << again[0].status();
  EXPECT_EQ(again[0]->version, 1u);
  EXPECT_TRUE(again[0]->replayed);  // so metrics do not count the step twice
  EXPECT_FALSE(s0->replayed);
  EXPECT_EQ(e_.heads().Info("h", "")->version, 1u);
}

// Every rank of a step hears of a disagreement as soon as it is known, not after
// --head_step_timeout (10 minutes here); nothing runs and the step's sum is kept for a Step
// the ranks agree on.
TEST_F(HeadsTest, RanksThatDisagreeAreAllRefusedAtOnce) {
  ASSERT_TRUE(Create("h", AdamW(), false).ok());
  ASSERT_TRUE(Compute("h", 0, 0, 0, 40, false).status.ok());
  ASSERT_TRUE(Compute("h", 0, 1, 0, 41, false).status.ok());
  auto call = [&](StepCall c) {
    auto p = std::make_shared<std::promise<absl::StatusOr<StepResult>>>();
    e_.heads().Step(c, "", [p](absl::StatusOr<StepResult> s) { p->set_value(s); });
    return p->get_future();
  };
  auto answer = [](std::future<absl::StatusOr<StepResult>>& f) {
    if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      return absl::DeadlineExceededError("no answer within 10 s");
    }
    return f.get().status();
  };
  StepCall a{"h", 0, 0, 2};
  a.lr = 0.25;
  StepCall b = a;
  b.rank = 1;
  b.lr = 0.5;
  auto f0 = call(a);
  auto f1 = call(b);  // another lr: both ranks are refused, each naming both argument sets
  for (auto* f : {&f0, &f1}) {
    absl::Status s = answer(*f);
    EXPECT_TRUE(Has(s, absl::StatusCode::kFailedPrecondition, "lr 0.5") &&
                Has(s, absl::StatusCode::kFailedPrecondition, "lr 0.25") &&
                Has(s, absl::StatusCode::kFailedPrecondition, "every rank of a step must agree") &&
                Has(s, absl::StatusCode::kFailedPrecondition, "gradient sum are kept"))
        << s;
  }
  EXPECT_EQ(e_.heads().Info("h", "")->ranks_waiting, 0u);
  // Another world_size, and a version ahead of the head's, the same way.
  f0 = call(a);
  StepCall wide = a;
  wide.rank = 1;
  wide.world_size = 3;
  EXPECT_TRUE(Has(answer(f1 = call(wide)), absl::StatusCode::kFailedPrecondition,
                  "world_size 3"));
  EXPECT_TRUE(Has(answer(f0), absl::StatusCode::kFailedPrecondition, "world_size 3"));
  StepCall ahead = b;
  ahead.lr = a.lr;
  ahead.version = 3;
  f0 = call(a);
  EXPECT_TRUE(Has(answer(f1 = call(ahead)), absl::StatusCode::kFailedPrecondition,
                  "is at version 0, not 3"));
  EXPECT_TRUE(Has(answer(f0), absl::StatusCode::kFailedPrecondition, "is at version 0, not 3"));
  // The other order: the rank ahead calls first, so the rank that arrives later is refused
  // at once, naming it, rather than waiting out the timeout for it.
  EXPECT_TRUE(Has(answer(f1 = call(ahead)), absl::StatusCode::kFailedPrecondition,
                  "is at version 0, not 3"));
  EXPECT_TRUE(Has(answer(f0 = call(a)), absl::StatusCode::kFailedPrecondition,
                  "rank 1 called it with (version 3"));
  // A phase the others do not share.
  StepCall reduce{"h", 0, 0, 2}, apply{"h", 0, 1, 2};
  reduce.phase = StepPhase::kReduce;
  apply.phase = StepPhase::kApply;
  f0 = call(reduce);
  EXPECT_TRUE(Has(answer(f1 = call(apply)), absl::StatusCode::kFailedPrecondition,
                  "before its STEP_REDUCE"));
  EXPECT_TRUE(Has(answer(f0), absl::StatusCode::kFailedPrecondition, "STEP_REDUCE"));
  EXPECT_TRUE(Has(answer(f1 = call(StepCall{"h", 0, 5, 2})), absl::StatusCode::kInvalidArgument,
                  "rank < world_size"));
  // Agreed at last: the kept sum of both Computes is applied.
  StepCall agreed = b;
  agreed.lr = a.lr;
  f0 = call(a);
  f1 = call(agreed);
  for (auto* f : {&f0, &f1}) {
    ASSERT_EQ(f->wait_for(std::chrono::seconds(10)), std::future_status::ready);
    auto r = f->get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->applied);
    EXPECT_EQ(r->contributions, 2u);
    EXPECT_EQ(r->version, 1u);
  }
}

// A Step with nothing added moves nothing (torch leaves a parameter without a gradient as it
// is): refused naming the head and the version; a skip still moves past it.
TEST_F(HeadsTest, AStepWithNoContributionsIsRefusedAndMovesNothing) {
  ASSERT_TRUE(Create("h", AdamW(), true).ok());  // weight decay 0.1 on W, 0.02 on the bias
  ASSERT_TRUE(Compute("h", 0, 0, 0, 30, true).status.ok());
  ASSERT_TRUE(StepAll(StepCall{"h", 0, 0, 1})[0].ok());  // the state is not zero any more
  const auto before = Export("h");
  auto full = StepAll(StepCall{"h", 1, 0, 1});
  EXPECT_TRUE(Has(full[0].status(), absl::StatusCode::kFailedPrecondition,
                  "the Step of head 'h' version 1 has no contributions") &&
              Has(full[0].status(), absl::StatusCode::kFailedPrecondition,
                  "redo the step's Computes at version 1 and call Step again, or call Step "
                  "with skip"))
      << full[0].status();
  // Two phases: the reduce reports the empty sum, the apply is refused.
  StepCall reduce{"h", 1, 0, 1}, apply{"h", 1, 0, 1};
  reduce.phase = StepPhase::kReduce;
  apply.phase = StepPhase::kApply;
  auto r = StepAll(reduce);
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  EXPECT_EQ(r[0]->contributions, 0u);
  EXPECT_TRUE(Has(StepAll(apply)[0].status(), absl::StatusCode::kFailedPrecondition,
                  "has no contributions"));
  auto info = e_.heads().Info("h", "");
  EXPECT_EQ(info->version, 1u);
  EXPECT_EQ(info->optimizer_step, 1);
  EXPECT_EQ(Export("h"), before);  // W, the bias, the optimizer state and the copy
  StepCall skip{"h", 1, 0, 1};
  skip.skip = true;
  auto skipped = StepAll(skip);
  ASSERT_TRUE(skipped[0].ok()) << skipped[0].status();
  EXPECT_FALSE(skipped[0]->applied);
  EXPECT_EQ(skipped[0]->version, 2u);
  EXPECT_EQ(e_.heads().Info("h", "")->optimizer_step, 1);
  EXPECT_EQ(Export("h"), before);
  // The step's Computes redone, the Step applies.
  ASSERT_TRUE(Compute("h", 2, 0, 0, 31, true).status.ok());
  auto applied = StepAll(StepCall{"h", 2, 0, 1});
  ASSERT_TRUE(applied[0].ok()) << applied[0].status();
  EXPECT_TRUE(applied[0]->applied);
  EXPECT_EQ(e_.heads().Info("h", "")->optimizer_step, 2);
}

TEST_F(HeadsTest, SkipDropsTheGradientsAndKeepsW) {
  ASSERT_TRUE(Create("h", AdamW(), true).ok());
  auto before = Export("h");
  ASSERT_TRUE(Compute("h", 0, 0, 0, 70, true).status.ok());
  StepCall call{"h", 0, 0, 1};
  call.skip = true;
  auto r = StepAll(call);
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  EXPECT_FALSE(r[0]->applied);
  EXPECT_EQ(r[0]->version, 1u);
  auto info = e_.heads().Info("h", "");
  EXPECT_EQ(info->optimizer_step, 0);
  EXPECT_EQ(info->contributions, 0u);
  EXPECT_EQ(Export("h"), before);
}

TEST_F(HeadsTest, ReduceGivesTheNormAndApplyTakesTheTrainersCoefficient) {
  ASSERT_TRUE(Create("h", Sgd(), true).ok());
  ASSERT_TRUE(Compute("h", 0, 0, 0, 80, true).status.ok());
  AddToOracle("oracle", 80, true);
  auto sum = e_.FetchGradients("oracle", false);
  ASSERT_TRUE(sum.ok());
  double ss = 0;
  for (float g : Floats(std::vector<uint8_t>(sum->data.get(),
                                             sum->data.get() + sum->end))) {
    ss += static_cast<double>(g) * g;
  }
  StepCall reduce{"h", 0, 0, 1};
  reduce.phase = StepPhase::kReduce;
  auto r = StepAll(reduce);
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  EXPECT_FALSE(r[0]->applied);
  EXPECT_EQ(r[0]->version, 0u);
  EXPECT_TRUE(r[0]->finite);
  EXPECT_NEAR(r[0]->grad_norm, std::sqrt(ss), 1e-12 * std::sqrt(ss));
  // The sum is closed between reduce and apply.
  EXPECT_TRUE(Has(Compute("h", 0, 0, 1, 81, true).status, absl::StatusCode::kFailedPrecondition,
                  "closed"));
  StepCall apply{"h", 0, 0, 1};
  apply.phase = StepPhase::kApply;
  apply.clip_coef = 0.25f;
  apply.lr = 0.5;
  auto a = StepAll(apply);
  ASSERT_TRUE(a[0].ok()) << a[0].status();
  EXPECT_TRUE(a[0]->applied);
  EXPECT_EQ(a[0]->clip_coef, 0.25f);
  EXPECT_EQ(a[0]->grad_norm, r[0]->grad_norm);
  EXPECT_EQ(a[0]->version, 1u);
}

TEST_F(HeadsTest, ExportThenImportContinuesBitForBit) {
  for (const HeadOptimizer& opt : {AdamW(true), Sgd()}) {
    const std::string a = absl::StrCat("a", static_cast<int>(opt.kind)), b = a + "-copy";
    ASSERT_TRUE(Create(a, opt, true).ok());
    ASSERT_TRUE(Compute(a, 0, 0, 0, 90, true).status.ok());
    ASSERT_TRUE(StepAll(StepCall{a, 0, 0, 1})[0].ok());
    // Import a's export as b.
    auto x = e_.heads().Export(a, 1, 0, 0, "");
    ASSERT_TRUE(x.ok()) << x.status();
    HeadSpec spec = HeadStore::SpecOf(x->head);
    spec.name = b;
    auto c = e_.heads().BeginCreate(spec, "");
    ASSERT_TRUE(c.ok() && c->pending) << c.status();
    uint64_t at = 0;
    for (const auto& [t, bytes] : x->tensors) {
      if (t != HeadTensor::kCopyW && t != HeadTensor::kCopyBias) {
        ASSERT_TRUE(e_.heads().WriteCreate(*c->pending, t, 0, x->data.get() + at, bytes).ok());
      }
      at += bytes;
    }
    ASSERT_TRUE(e_.heads().CommitCreate(std::move(c->pending)).ok());
    // Importing the same export again changes nothing.
    auto again = e_.heads().BeginCreate(spec, "");
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(again->existing.has_value());
    // One more step of each with the same micro-batch: equal, bit for bit.
    for (const std::string& n : {a, b}) {
      ASSERT_TRUE(Compute(n, 1, 0, 0, 91, true).status.ok());
      ASSERT_TRUE(StepAll(StepCall{n, 1, 0, 1})[0].ok());
    }
    EXPECT_EQ(Export(a), Export(b));
    spec.version = 7;
    EXPECT_TRUE(Has(e_.heads().BeginCreate(spec, "").status(), absl::StatusCode::kAlreadyExists,
                    "differs"));
  }
}

TEST_F(HeadsTest, ARangeOfAnOlderVersionIsRefused) {
  ASSERT_TRUE(Create("h", AdamW(), false).ok());
  ASSERT_TRUE(e_.heads().CheckExport("h", 0, 0, 16, "").ok());
  ASSERT_TRUE(Compute("h", 0, 0, 0, 20, false).status.ok());
  ASSERT_TRUE(StepAll(StepCall{"h", 0, 0, 1})[0].ok());
  EXPECT_TRUE(Has(e_.heads().Export("h", 0, 16, 32, "").status(),
                  absl::StatusCode::kFailedPrecondition, "export again"));
  EXPECT_TRUE(Has(e_.heads().Export("h", 1, 0, 1u << 30, "").status(),
                  absl::StatusCode::kInvalidArgument, "not a non-empty byte range"));
}

TEST_F(HeadsTest, ABadSpecIsRefusedNamingTheField) {
  HeadOptimizer o = Sgd();
  o.dampening = 0.5;
  EXPECT_TRUE(Has(Create("h", o, false).status(), absl::StatusCode::kInvalidArgument,
                  "nesterov"));
  o = AdamW();
  o.beta2 = 1.0;
  EXPECT_TRUE(Has(Create("h", o, false).status(), absl::StatusCode::kInvalidArgument,
                  "optimizer.beta2"));
  EXPECT_TRUE(Has(Create("bad name", AdamW(), false).status(),
                  absl::StatusCode::kInvalidArgument, "head.name"));
  EXPECT_EQ(e_.heads().count(), 0u);
  EXPECT_EQ(e_.heads().bytes(), 0u);
}

// A call naming the instance whose export this server imported as it started
// (--head_export_dir) is told that the head is here and what to call, not to import it.
TEST_F(HeadsTest, ACallNamingTheInstanceAHeadWasImportedFromIsToldItIsHere) {
  HeadSpec spec;
  spec.name = "h";
  spec.v = kV;
  spec.h = kH;
  spec.optimizer = Sgd();
  spec.version = 3;
  spec.exported_by = "before-restart";
  auto c = e_.heads().BeginCreate(spec, "");
  ASSERT_TRUE(c.ok() && c->pending) << c.status();
  std::vector<float> w(kV * kH, 0.5f);
  ASSERT_TRUE(e_.heads().WriteCreate(*c->pending, HeadTensor::kMasterW, 0, w.data(),
                                     w.size() * 4).ok());
  ASSERT_TRUE(e_.heads().CommitCreate(std::move(c->pending)).ok());
  ASSERT_TRUE(Create("created-here", Sgd(), false).ok());
  EXPECT_TRUE(e_.heads().CheckInstance("h", "", "f", "").ok());
  // A Compute naming the old instance.
  RandomProblem rp = MicroBatch(10, false);
  ComputeSpec cs = ComputeSpecFor(rp);
  cs.inputs[static_cast<int>(InputSlot::kW)].present = false;
  cs.head = "h";
  cs.head_version = 3;
  cs.head_instance = "before-restart";
  const absl::Status s = e_.Plan(cs).status();
  EXPECT_TRUE(Has(s, absl::StatusCode::kFailedPrecondition,
                  "header.head_instance 'before-restart' is not this server") &&
              Has(s, absl::StatusCode::kFailedPrecondition,
                  "head 'h' is here: this server imported it as it started, from the export "
                  "instance 'before-restart' wrote as it stopped (--head_export_dir), at "
                  "version 3") &&
              Has(s, absl::StatusCode::kFailedPrecondition, "call HeadInfo (head_info)"))
      << s;
  EXPECT_EQ(std::string(s.message()).find("import its last export"), std::string::npos) << s;
  // Another instance, a head created here, a head not here: not "imported".
  EXPECT_TRUE(Has(e_.heads().CheckInstance("h", "elsewhere", "f", ""),
                  absl::StatusCode::kFailedPrecondition,
                  "lived on server instance 'elsewhere'; a head of that name is here (version "
                  "3)"));
  EXPECT_TRUE(Has(e_.heads().CheckInstance("created-here", "before-restart", "f", ""),
                  absl::StatusCode::kFailedPrecondition, "a head of that name is here"));
  EXPECT_TRUE(Has(e_.heads().CheckInstance("gone", "before-restart", "f", ""),
                  absl::StatusCode::kFailedPrecondition,
                  "head 'gone' lives on server instance 'before-restart'"));
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

TEST_F(SmallHeadsTest, HeadsDrawOnTheirOwnBudgetAndComeBackWhenDropped) {
  ASSERT_TRUE(Create("a", AdamW(), true).ok());
  EXPECT_EQ(e_.heads().bytes(), 66u * 18);
  EXPECT_TRUE(Has(Create("b", AdamW(), true).status(), absl::StatusCode::kResourceExhausted,
                  "--head_bytes=1500"));
  ASSERT_TRUE(e_.heads().Drop("a", "").ok());
  EXPECT_EQ(e_.heads().bytes(), 0u);
  EXPECT_TRUE(Create("b", AdamW(), true).ok());
  EXPECT_TRUE(Has(Compute("a", 0, 0, 0, 1, true).status, absl::StatusCode::kNotFound, "'a'"));
}

TEST_F(SmallHeadsTest, ARankThatNeverArrivesTimesTheStepOut) {
  ASSERT_TRUE(Create("h", AdamW(), false).ok());
  auto before = Export("h");
  ASSERT_TRUE(Compute("h", 0, 0, 0, 5, false).status.ok());
  std::promise<absl::StatusOr<StepResult>> r0;
  e_.heads().Step(StepCall{"h", 0, 0, 3}, "",
                  [&](absl::StatusOr<StepResult> s) { r0.set_value(s); });
  auto s = r0.get_future().get();
  EXPECT_TRUE(Has(s.status(), absl::StatusCode::kDeadlineExceeded, "waiting for ranks 1, 2"))
      << s.status();
  DrainExecutor(e_);
  auto info = e_.heads().Info("h", "");
  EXPECT_EQ(info->version, 0u);
  EXPECT_EQ(info->contributions, 0u);  // dropped
  EXPECT_EQ(Export("h"), before);
  EXPECT_TRUE(Compute("h", 0, 0, 0, 5, false).head_added);  // the step starts over
}

}  // namespace
}  // namespace lossd
