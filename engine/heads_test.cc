// SPDX-License-Identifier: Apache-2.0
// Hosted heads in the engine (CPU backend, no gRPC): the step's sum equals an accumulator's
// of the same micro-batches bit for bit, the update equals the backend's optimizer step on
// that sum (and the float64 reference within the fp32 table), idempotency keys, export and
// import, the instance a call names, the budget. The Step barrier: head_step_test.
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "testing/heads_test_fixture.h"

namespace lossd {
namespace {

using heads_testing::AdamW;
using heads_testing::Floats;
using heads_testing::Has;
using heads_testing::HeadsTest;
using heads_testing::kBt;
using heads_testing::kH;
using heads_testing::kV;
using heads_testing::MicroBatch;
using heads_testing::Mismatch;
using heads_testing::Sgd;
using heads_testing::SmallHeadsTest;

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

}  // namespace
}  // namespace lossd
