// SPDX-License-Identifier: Apache-2.0
// A hosted head served by a group of S engines in this process (threads), over gloo TCP on
// 127.0.0.1, against one engine's head on the same contributions: rank r's Computes and Step
// go to member r % S; at Step the members reduce-scatter the sum, update their slices and
// all-gather the compute copy.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/head_group.h"
#include "testing/gloo_backend_comm.h"
#include "testing/heads_test_fixture.h"

namespace lossd {
namespace heads_testing {
namespace {

using Results = std::vector<absl::StatusOr<StepResult>>;

// A member's (or the one engine's) head as fp32 host vectors: its master slice, the compute
// copy's bytes whole.
struct HeadState {
  std::vector<float> master_w, master_b;
  std::vector<uint8_t> copy_w, copy_b;
  int64_t lo_w = 0, lo_b = 0;
};

HeadState StateOf(Engine& e, const std::string& name) {
  auto head = e.heads().Get(name, "");
  EXPECT_TRUE(head.ok()) << head.status();
  Head& h = **head;
  absl::MutexLock lock(&h.grad->mu);
  HeadState s;
  auto floats = [](HeadParam& p) {
    const float* f = static_cast<const float*>(p.master->data());
    return std::vector<float>(f, f + p.slice.n());
  };
  s.master_w = floats(h.w);
  s.lo_w = h.w.slice.lo;
  const uint8_t* cw = static_cast<const uint8_t*>(h.copy->w->data());
  s.copy_w.assign(cw, cw + h.copy->w->size());
  if (h.has_bias) {
    s.master_b = floats(h.bias);
    s.lo_b = h.bias.slice.lo;
    const uint8_t* cb = static_cast<const uint8_t*>(h.copy->bias->data());
    s.copy_b.assign(cb, cb + h.copy->bias->size());
  }
  return s;
}

class HeadGroupStepTest : public HeadsTest {
 protected:
  // S member engines of one group (a fresh id each time: a new group), gloo timeout `timeout`.
  // device: each member's backend is a GlooBackedDevice, so the group runs on the backend's
  // own collectives (the path NCCL takes on the CUDA backend), picked by ConnectHeadGroup.
  void MakeGroup(uint32_t S, absl::Duration timeout = absl::Seconds(20), bool device = false) {
    members_.clear();
    devices_.clear();
    group_.members.clear();
    for (uint32_t m = 0; m < S; ++m) group_.members.push_back(absl::StrCat("member-", m));
    group_.id = absl::StrCat("group-", ++groups_made_);
    auto store = std::make_shared<MemoryGroupStore>();
    auto device_comms = std::make_shared<MemoryGroupStore>();
    for (uint32_t m = 0; m < S; ++m) {
      EngineOptions o;
      o.head_connect_group = [store, timeout](const HeadGroup& g, Backend* memory_of) {
        GlooOptions go;
        go.timeout = timeout;
        return ConnectHeadGroup(memory_of, store, g, go);
      };
      std::unique_ptr<Backend> b = NewCpuBackend(1);
      if (device) {
        auto d = std::make_unique<GlooBackedDevice>(std::move(b), device_comms);
        devices_.push_back(d.get());
        b = std::move(d);
      }
      members_.push_back(std::make_unique<Engine>(std::move(b), o));
    }
  }

  // The head on every member at once (each member's commit waits for the others').
  std::vector<absl::Status> CreateOnGroup(const std::string& name, HeadOptimizer opt, bool bias) {
    const uint32_t S = members_.size();
    std::vector<absl::Status> out(S);
    std::vector<std::thread> threads;
    for (uint32_t m = 0; m < S; ++m) {
      threads.emplace_back([&, m] {
        RandomProblem w0 = MicroBatch(1, bias);
        HeadSpec spec;
        spec.name = name;
        spec.v = kV;
        spec.h = kH;
        spec.has_bias = bias;
        spec.master_dtype = DType::kBF16;
        spec.compute_dtype = DType::kBF16;
        spec.optimizer = opt;
        spec.group = group_;
        spec.group.member = m;
        HeadStore& hs = members_[m]->heads();
        auto c = hs.BeginCreate(spec, "");
        if (!c.ok()) { out[m] = c.status(); return; }
        absl::Status s = hs.WriteCreate(*c->pending, HeadTensor::kMasterW, 0, w0.w.data(),
                                        w0.w.size());
        if (s.ok() && bias) {
          s = hs.WriteCreate(*c->pending, HeadTensor::kMasterBias, 0, w0.bias.data(),
                             w0.bias.size());
        }
        if (s.ok()) s = hs.CommitCreate(std::move(c->pending)).status();
        out[m] = s;
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  // Rank r's micro-batches of step k, on its member and on the one engine.
  void ComputeStep(const std::string& name, uint64_t version, uint32_t world, int k, bool bias) {
    const uint32_t S = members_.size();
    for (uint32_t r = 0; r < world; ++r) {
      for (uint64_t mb = 0; mb < 2; ++mb) {
        const uint64_t seed = 1000 * k + 10 * r + mb + 2;
        ComputeOutcome one = Compute(name, version, r, mb, seed, bias);
        ASSERT_TRUE(one.status.ok()) << one.status;
        ComputeOutcome got = ComputeOn(*members_[r % S], name, version, r, mb, seed, bias);
        ASSERT_TRUE(got.status.ok()) << "rank " << r << ": " << got.status;
      }
    }
  }

  ComputeOutcome ComputeOn(Engine& e, const std::string& head, uint64_t version, uint32_t rank,
                           uint64_t mb, uint64_t seed, bool bias) {
    RandomProblem rp = MicroBatch(seed, bias);
    ComputeSpec spec = ComputeSpecFor(rp);
    spec.inputs[static_cast<int>(InputSlot::kW)].present = false;
    spec.options.grad_scale = 0.5f;
    spec.head = head;
    spec.head_version = version;
    spec.rank = rank;
    spec.micro_batch = mb;
    auto plan = e.Plan(spec);
    if (!plan.ok()) {
      ComputeOutcome o;
      o.status = plan.status();
      return o;
    }
    return RunSync(e, *plan, InputBuffersFor(rp, *plan));
  }

  // Every rank's Step, each on its member, at once; `skip_member` sends none for its ranks.
  Results StepGroup(StepCall call, int skip_member = -1) {
    const uint32_t S = members_.size();
    std::vector<std::promise<absl::StatusOr<StepResult>>> p(call.world_size);
    std::vector<bool> sent(call.world_size, false);
    for (uint32_t r = 0; r < call.world_size; ++r) {
      if (static_cast<int>(r % S) == skip_member) continue;
      StepCall c = call;
      c.rank = r;
      sent[r] = true;
      members_[r % S]->heads().Step(
          c, "", [&p, r](absl::StatusOr<StepResult> s) { p[r].set_value(s); });
    }
    Results out;
    for (uint32_t r = 0; r < call.world_size; ++r) {
      if (sent[r]) out.push_back(p[r].get_future().get());
    }
    return out;
  }

  // The members' master slices and compute copies against the one engine's head: the masters
  // within `ulps` fp32 ulps of the tensor's largest magnitude (the reduction order differs:
  // members sum their ranks, then gloo's halving-doubling sums the members), the copies the
  // cast of those masters (so within one bf16 ulp where a master lands near a rounding edge).
  void ExpectMatchesOneEngine(const std::string& name, double ulps) {
    HeadState one = StateOf(e_, name);
    double worst = 0;  // ulps of the tensor's largest magnitude, for the log
    auto check = [&](const std::vector<float>& want_all, const std::vector<float>& got,
                     int64_t lo, const char* what) {
      float max_abs = 0;
      for (float f : want_all) max_abs = std::max(max_abs, std::fabs(f));
      const double ulp = std::ldexp(1.0, std::ilogb(max_abs) - 23);
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], want_all[lo + i], ulps * ulp) << what << " element " << lo + i;
        worst = std::max(worst, std::fabs(got[i] - want_all[lo + i]) / ulp);
      }
    };
    for (auto& m : members_) {
      HeadState s = StateOf(*m, name);
      check(one.master_w, s.master_w, s.lo_w, "master_w");
      check(one.master_b, s.master_b, s.lo_b, "master_b");
      ASSERT_EQ(s.copy_w.size(), one.copy_w.size());
    }
    std::cout << name << ": the members' masters are within " << worst
              << " ulps of the one engine's (largest magnitude's ulp)\n";
    // Every member holds the same compute copy, bit for bit.
    HeadState first = StateOf(*members_[0], name);
    for (auto& m : members_) {
      HeadState s = StateOf(*m, name);
      EXPECT_EQ(s.copy_w, first.copy_w);
      EXPECT_EQ(s.copy_b, first.copy_b);
    }
  }

  std::vector<std::unique_ptr<Engine>> members_;
  std::vector<GlooBackedDevice*> devices_;  // members_' backends, where MakeGroup(device)
  HeadGroup group_;
  int groups_made_ = 0;
};

TEST_F(HeadGroupStepTest, ThreeMembersAndSixRanksMatchOneEngineAdamWClipSkip) {
  const bool bias = true;
  MakeGroup(3);
  ASSERT_TRUE(Create("h", AdamW(), bias).ok());
  for (const absl::Status& s : CreateOnGroup("h", AdamW(), bias)) ASSERT_TRUE(s.ok()) << s;
  StepCall call;
  call.head = "h";
  call.world_size = 6;
  for (int k = 0; k < 3; ++k) {
    call.version = k;
    call.max_norm = 0.05;  // small enough to clip
    call.skip = (k == 1);  // the middle step is skipped everywhere
    ComputeStep("h", k, 6, k, bias);
    Results one = StepAll(call);
    Results got = StepGroup(call);
    ASSERT_EQ(got.size(), 6u);
    for (auto& r : got) {
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_TRUE(one[0].ok()) << one[0].status();
      EXPECT_EQ(r->version, one[0]->version);
      EXPECT_EQ(r->applied, one[0]->applied);
      EXPECT_EQ(r->contributions, one[0]->contributions);
      EXPECT_EQ(r->tokens, one[0]->tokens);
      EXPECT_NEAR(r->grad_norm, one[0]->grad_norm, 1e-6 * one[0]->grad_norm);
      EXPECT_NEAR(r->clip_coef, one[0]->clip_coef, 1e-6);
      EXPECT_EQ(r->grad_norm, got[0]->grad_norm);  // every member computed the same norm
    }
    if (!call.skip) EXPECT_LT(one[0]->clip_coef, 1.0f) << "the test means to clip";
  }
  ExpectMatchesOneEngine("h", 2 * 3);
}

// The same group on a backend's own collectives (as the CUDA backend's NCCL): the gradient's
// reduce-scatter and the copy's all-gather run on the backend's buffers, the step's values
// through its staging buffer; the results match the one engine's as gloo's do.
TEST_F(HeadGroupStepTest, ABackendsOwnCollectivesServeTheGroupAlike) {
  const bool bias = true;
  MakeGroup(3, absl::Seconds(20), /*device=*/true);
  ASSERT_TRUE(Create("d", AdamW(), bias).ok());
  for (const absl::Status& s : CreateOnGroup("d", AdamW(), bias)) ASSERT_TRUE(s.ok()) << s;
  for (GlooBackedDevice* d : devices_) EXPECT_EQ(d->connects(), 1);
  StepCall call;
  call.head = "d";
  call.world_size = 4;
  for (int k = 0; k < 3; ++k) {
    call.version = k;
    call.max_norm = 0.05;
    ComputeStep("d", k, 4, k, bias);
    Results one = StepAll(call);
    Results got = StepGroup(call);
    ASSERT_EQ(got.size(), 4u);
    ASSERT_TRUE(one[0].ok()) << one[0].status();
    for (auto& r : got) {
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->applied);
      EXPECT_EQ(r->contributions, one[0]->contributions);
      EXPECT_EQ(r->tokens, one[0]->tokens);
      EXPECT_NEAR(r->grad_norm, one[0]->grad_norm, 1e-6 * one[0]->grad_norm);
      EXPECT_EQ(r->grad_norm, got[0]->grad_norm);
    }
    EXPECT_LT(one[0]->clip_coef, 1.0f) << "the test means to clip";
  }
  ExpectMatchesOneEngine("d", 2 * 3);
  // No other communicator was formed for the steps: every collective ran on the device's.
  for (GlooBackedDevice* d : devices_) EXPECT_EQ(d->connects(), 1);
}

// A device backend that cannot form its collectives (no NCCL library) refuses a group's
// create before any tensor is uploaded, naming the backend and why.
TEST_F(HeadGroupStepTest, ABackendWithoutCollectivesRefusesAGroupAtOnce) {
  MakeGroup(2, absl::Seconds(20), /*device=*/true);
  devices_[0]->set_unavailable(true);
  HeadSpec spec;
  spec.name = "n";
  spec.v = kV;
  spec.h = kH;
  spec.master_dtype = DType::kBF16;
  spec.compute_dtype = DType::kBF16;
  spec.optimizer = Sgd();
  spec.group = group_;
  auto c = members_[0]->heads().BeginCreate(spec, "");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_NE(c.status().message().find("gloo-backed-device backend"), std::string::npos)
      << c.status();
  EXPECT_NE(c.status().message().find("the test's collectives are off"), std::string::npos)
      << c.status();
}

TEST_F(HeadGroupStepTest, TwoMembersAndThreeRanksSgdMatchOneEngineAndRepeatBitForBit) {
  const bool bias = false;
  std::vector<HeadState> runs;
  for (int run = 0; run < 2; ++run) {
    MakeGroup(2);
    ASSERT_TRUE(Create(absl::StrCat("s", run), Sgd(), bias).ok());
    for (const absl::Status& s : CreateOnGroup(absl::StrCat("s", run), Sgd(), bias)) {
      ASSERT_TRUE(s.ok()) << s;
    }
    StepCall call;
    call.head = absl::StrCat("s", run);
    call.world_size = 3;
    for (int k = 0; k < 3; ++k) {
      call.version = k;
      call.lr = 0.2 / (k + 1);  // a schedule
      ComputeStep(call.head, k, 3, k, bias);
      Results one = StepAll(call);
      for (auto& r : StepGroup(call)) {
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_TRUE(r->applied);
        EXPECT_EQ(r->contributions, 6u);
        EXPECT_NEAR(r->grad_norm, one[0]->grad_norm, 1e-6 * one[0]->grad_norm);
      }
    }
    ExpectMatchesOneEngine(call.head, 2 * 3);
    runs.push_back(StateOf(*members_[1], call.head));
  }
  // The same contributions in the same order: the same bytes.
  EXPECT_EQ(runs[0].master_w, runs[1].master_w);
  EXPECT_EQ(runs[0].copy_w, runs[1].copy_w);
}

// A one-server head's export (master and AdamW state after two steps) imported into a group
// of 3: each member keeps its slices of the master and the state; the next step matches the
// one-server head's.
TEST_F(HeadGroupStepTest, AnExportOfOneServerImportsIntoAGroupAndContinues) {
  const bool bias = true;
  ASSERT_TRUE(Create("x", AdamW(), bias).ok());
  MakeGroup(3);
  StepCall call;
  call.head = "x";
  call.world_size = 3;
  for (int k = 0; k < 2; ++k) {
    for (uint32_t r = 0; r < 3; ++r) {
      ASSERT_TRUE(Compute("x", k, r, 0, 300 + 10 * k + r, bias).status.ok());
    }
    call.version = k;
    ASSERT_TRUE(StepAll(call)[0].ok());
  }
  auto x = e_.heads().Export("x", std::nullopt, 0, 0, "");
  ASSERT_TRUE(x.ok()) << x.status();
  std::vector<absl::Status> made(3);
  std::vector<std::thread> threads;
  for (uint32_t m = 0; m < 3; ++m) {
    threads.emplace_back([&, m] {
      HeadSpec spec = HeadStore::SpecOf(x->head);
      spec.group = group_;
      spec.group.member = m;
      HeadStore& hs = members_[m]->heads();
      auto c = hs.BeginCreate(spec, "");
      if (!c.ok()) { made[m] = c.status(); return; }
      uint64_t at = 0;
      for (const auto& [t, bytes] : x->tensors) {
        if (t != HeadTensor::kCopyW && t != HeadTensor::kCopyBias && made[m].ok()) {
          made[m] = hs.WriteCreate(*c->pending, t, 0, x->data.get() + at, bytes);
        }
        at += bytes;
      }
      if (made[m].ok()) made[m] = hs.CommitCreate(std::move(c->pending)).status();
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : made) ASSERT_TRUE(s.ok()) << s;
  ExpectMatchesOneEngine("x", 0);  // imported: every member's slice is the export's, exactly
  call.version = 2;
  ComputeStep("x", 2, 3, 2, bias);
  Results one = StepAll(call);
  for (auto& r : StepGroup(call)) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->version, 3u);
    EXPECT_NEAR(r->grad_norm, one[0]->grad_norm, 1e-6 * one[0]->grad_norm);
  }
  ExpectMatchesOneEngine("x", 2);
  // The group's export, asked of every member at once: one whole head, the same bytes from
  // each member, whose master and state are the members' parts (their slices) side by side.
  std::vector<absl::StatusOr<HeadExportRange>> whole;  // move-only: one by one
  for (uint32_t m = 0; m < 3; ++m) whole.emplace_back(absl::UnknownError("not run"));
  std::vector<std::thread> exporters;
  for (uint32_t m = 0; m < 3; ++m) {
    exporters.emplace_back([&, m] {
      whole[m] = members_[m]->heads().Export("x", std::nullopt, 0, 0, "");
    });
  }
  for (auto& t : exporters) t.join();
  for (uint32_t m = 0; m < 3; ++m) {
    ASSERT_TRUE(whole[m].ok()) << whole[m].status();
    EXPECT_EQ(whole[m]->head.version, 3u);
    ASSERT_EQ(whole[m]->end, whole[0]->end);
    EXPECT_EQ(std::memcmp(whole[m]->data.get(), whole[0]->data.get(), whole[0]->end), 0) << m;
  }
  uint64_t at = 0;
  for (const auto& [t, bytes] : whole[0]->tensors) {
    if (t == HeadTensor::kCopyW || t == HeadTensor::kCopyBias) break;  // the copies come last
    const int64_t n = static_cast<int64_t>(bytes / 4);
    for (uint32_t m = 0; m < 3; ++m) {
      auto part = members_[m]->heads().Export("x", std::nullopt, 0, 0, "",
                                              HeadExportScope::kMemberPart);
      ASSERT_TRUE(part.ok()) << part.status();
      uint64_t in_part = 0;  // t's first byte in the part
      for (const auto& [pt, pbytes] : part->tensors) {
        if (pt == t) break;
        in_part += pbytes;
      }
      const HeadSlice s = HeadSliceOf(n, m, 3);
      EXPECT_EQ(std::memcmp(whole[0]->data.get() + at + s.lo * 4,
                            part->data.get() + in_part, s.n() * 4), 0)
          << HeadTensorName(t) << " member " << m;
    }
    at += bytes;
  }
}

TEST_F(HeadGroupStepTest, AMemberWhoseRanksNeverStepIsNamedAndNothingIsApplied) {
  MakeGroup(3, absl::Seconds(1));
  for (const absl::Status& s : CreateOnGroup("f", AdamW(), true)) ASSERT_TRUE(s.ok()) << s;
  for (uint32_t r = 0; r < 3; ++r) {
    ComputeOutcome o = ComputeOn(*members_[r], "f", 0, r, 0, 7 + r, true);
    ASSERT_TRUE(o.status.ok()) << o.status;
  }
  HeadState before = StateOf(*members_[0], "f");
  StepCall call;
  call.head = "f";
  call.world_size = 3;
  Results got = StepGroup(call, /*skip_member=*/2);
  ASSERT_EQ(got.size(), 2u);
  for (auto& r : got) {
    EXPECT_TRUE(Has(r.status(), absl::StatusCode::kUnavailable,
                    "member 2 (member-2) never arrived"))
        << r.status();
    EXPECT_TRUE(Has(r.status(), absl::StatusCode::kUnavailable, "into a new group"))
        << r.status();
  }
  HeadState after = StateOf(*members_[0], "f");
  EXPECT_EQ(after.master_w, before.master_w);
  EXPECT_EQ(after.copy_w, before.copy_w);
  // The head refuses from then on: a retried step is never applied.
  call.rank = 0;
  std::promise<absl::StatusOr<StepResult>> p;
  members_[0]->heads().Step(call, "", [&p](absl::StatusOr<StepResult> s) { p.set_value(s); });
  absl::StatusOr<StepResult> again = p.get_future().get();
  // It says which group, which collective, who never arrived and what to do, on every call.
  // (Members 0 and 1 time out on their own clocks: member 0 may first hear that member 1
  // left, "member 1 (member-1) left the group before (...)", before naming member 2.)
  const std::string why = absl::StrCat(
      "head 'f' of head group '", group_.id, "' refuses every call: the all-gather of the "
      "step's arguments and norms of head group '", group_.id, "' failed on member 0 "
      "(member-0): ");
  const std::string who = "member 2 (member-2) never arrived";
  const std::string what = "drop it and import its last export into a new group";
  for (const std::string& want : {why, who, what}) {
    EXPECT_TRUE(Has(again.status(), absl::StatusCode::kFailedPrecondition, want))
        << again.status();
  }
  ComputeOutcome o = ComputeOn(*members_[0], "f", 0, 0, 1, 11, true);
  for (const std::string& want : {why, who, what}) {
    EXPECT_TRUE(Has(o.status, absl::StatusCode::kFailedPrecondition, want)) << o.status;
  }
  auto e = members_[0]->heads().Export("f", std::nullopt, 0, 0, "",
                                       HeadExportScope::kMemberPart);
  EXPECT_TRUE(Has(e.status(), absl::StatusCode::kFailedPrecondition, why)) << e.status();
  EXPECT_TRUE(Has(e.status(), absl::StatusCode::kFailedPrecondition, who)) << e.status();
  EXPECT_EQ(StateOf(*members_[0], "f").master_w, before.master_w);
}

TEST_F(HeadGroupStepTest, ARankAtTheWrongMemberIsToldWhichMemberServesIt) {
  MakeGroup(2);
  for (const absl::Status& s : CreateOnGroup("w", Sgd(), false)) ASSERT_TRUE(s.ok()) << s;
  ComputeOutcome o = ComputeOn(*members_[0], "w", 0, 1, 0, 5, false);
  EXPECT_TRUE(Has(o.status, absl::StatusCode::kFailedPrecondition,
                  "rank 1's Computes and Steps go to member 1 (member-1, rank % 2)"))
      << o.status;
  StepCall call;
  call.head = "w";
  call.world_size = 1;
  std::promise<absl::StatusOr<StepResult>> p;
  members_[0]->heads().Step(call, "", [&p](absl::StatusOr<StepResult> s) { p.set_value(s); });
  EXPECT_TRUE(Has(p.get_future().get().status(), absl::StatusCode::kFailedPrecondition,
                  "world_size must be >= 2, got 1"));
}

TEST_F(HeadGroupStepTest, AGroupNeedsATransportAndAValidSpec) {
  HeadSpec spec;
  spec.name = "g";
  spec.v = kV;
  spec.h = kH;
  spec.optimizer = Sgd();
  spec.group.members = {"a:1", "b:1"};
  spec.group.id = "x";
  auto c = e_.heads().BeginCreate(spec, "");  // e_ has no connect_group
  EXPECT_TRUE(Has(c.status(), absl::StatusCode::kFailedPrecondition, "forms no head groups"))
      << c.status();
  spec.group.member = 2;
  c = e_.heads().BeginCreate(spec, "");
  EXPECT_TRUE(Has(c.status(), absl::StatusCode::kInvalidArgument,
                  "head.group needs 1 to 1024 members and member < their count, got 2 members, "
                  "member 2"))
      << c.status();
  spec.group.member = 0;
  spec.group.id = "";
  c = e_.heads().BeginCreate(spec, "");
  EXPECT_TRUE(Has(c.status(), absl::StatusCode::kInvalidArgument, "head.group.id must be"))
      << c.status();
}

}  // namespace
}  // namespace heads_testing
}  // namespace lossd
