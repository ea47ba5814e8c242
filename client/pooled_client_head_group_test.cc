// SPDX-License-Identifier: Apache-2.0
// Tests the pooled client's head groups (docs/hosted_head.md "Head groups") against the three
// real replicas of pool_test_fixture.h, which form groups over gloo on 127.0.0.1-3: one pool
// creates a head as a group of the three, every rank's pool sends its Computes and Steps to
// member rank % 3 of HeadInfo::group, and the results equal a one-server head's (127.0.0.4)
// fed the same Computes: the same step counts, the norm and loss to 1e-5, dX within 8 fp32
// ulps of its largest value per step (client/python/tests/test_head_group.py's tolerances).
// Also: the group's export through the pool (every member asked at once) against the
// one-server head's; a member lost named, nothing resent, and the import of the last export
// into a new group of the live members continuing as one server does; a member that says a
// rank is another's (the head created again as another group) is returned, not resent; a
// one-server head created again as a group's is learnt from GetHeadInfo.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "testing/client/pool_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kV = 37, kH = 12, kBT = 9;
constexpr double kDxUlpsPerStep = 8;      // test_head_group.py's DX_ULPS_PER_STEP
constexpr double kMasterUlpsPerStep = 2;  // engine/head_group_step_test's

CreateHeadRequest GroupHead(const std::string& name) {
  CreateHeadRequest r;
  r.name = name;
  r.w = UniformTensor(DType::kF32, {kV, kH}, 71, 0.4f);
  r.bias = UniformTensor(DType::kF32, {kV}, 72, 1.0f);
  r.compute_dtype = DType::kF32;  // the copy is the master, all-gathered: dX shows it
  r.optimizer.kind = Optimizer::kAdamW;
  r.optimizer.lr = 0.01;
  r.optimizer.weight_decay = 0.1;
  return r;
}

// Rank `rank`'s micro-batch of the step at `version` over `world` ranks: random fp32 X and
// targets, dX wanted.
ComputeRequest Batch(const std::string& head, uint64_t version, uint32_t rank, uint32_t world) {
  const uint32_t seed = static_cast<uint32_t>(100 * version + rank);
  ComputeRequest r;
  r.x = UniformTensor(DType::kF32, {kBT, kH}, 500 + seed, 1.5f);
  r.targets = HostTensor::Owned(DType::kI64, {kBT});
  std::mt19937 gen(900 + seed);
  for (int64_t i = 0; i < kBT; ++i) r.targets.mutable_data_as<int64_t>()[i] = gen() % kV;
  r.want.dx = true;
  r.want.dw = false;
  r.head = head;
  r.head_version = version;
  r.rank = rank;
  r.micro_batch = 0;
  r.options.grad_scale = 1.0f / static_cast<float>(world);
  return r;
}

// Max |got - want| in fp32 spacings of want's largest magnitude.
double UlpsOfMax(const HostTensor& got, const HostTensor& want) {
  EXPECT_EQ(got.shape(), want.shape());
  double worst = 0, top = 0;
  const float* g = got.data_as<float>();
  const float* w = want.data_as<float>();
  for (int64_t i = 0; i < want.num_elements(); ++i) {
    top = std::max(top, std::fabs(static_cast<double>(w[i])));
  }
  const float big = static_cast<float>(top);
  const double ulp = std::nextafter(big, INFINITY) - big;
  for (int64_t i = 0; i < want.num_elements(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(g[i]) - w[i]) / ulp);
  }
  return worst;
}

class HeadGroupPoolTest : public PoolTest {
 protected:
  HeadGroupPoolTest() { head_groups_ = true; }

  // world pools, one per rank (pool_ is rank 0's).
  void MakeRanks(uint32_t world) {
    ranks_ = {pool_.get()};
    for (uint32_t r = 1; r < world; ++r) {
      owned_.push_back(NewPool(r));
      ranks_.push_back(owned_.back().get());
    }
  }

  // One step at `version` on the group (through each rank's pool) and on the reference head,
  // compared; `members`: the group's size.
  void Step(const std::string& group, const std::string& one, uint64_t version,
            size_t members) {
    const uint32_t world = static_cast<uint32_t>(ranks_.size());
    for (uint32_t r = 0; r < world; ++r) {
      absl::StatusOr<ComputeResult> g = ranks_[r]->Compute(Batch(group, version, r, world));
      absl::StatusOr<ComputeResult> o = reference_->Compute(Batch(one, version, r, world));
      ASSERT_TRUE(g.ok()) << g.status();
      ASSERT_TRUE(o.ok()) << o.status();
      EXPECT_NEAR(g->loss, o->loss, 1e-5 * std::fabs(o->loss));
      const double ulps = UlpsOfMax(*g->Find(OutputTensor::kDx), *o->Find(OutputTensor::kDx));
      EXPECT_LE(ulps, kDxUlpsPerStep * (version + 1)) << "rank " << r << " step " << version;
      worst_dx_ = std::max(worst_dx_, ulps);
    }
    // Each member added its own ranks' Computes only.
    for (size_t m = 0; m < members; ++m) {
      absl::StatusOr<HeadInfo> info = MemberClient(static_cast<int>(m))->GetHeadInfo(group);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->contributions, (world - m + members - 1) / members) << "member " << m;
    }
    std::vector<absl::StatusOr<StepResult>> gs(world, absl::UnknownError("")),
        os(world, absl::UnknownError(""));
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < world; ++r) {
      threads.emplace_back([&, r] { gs[r] = ranks_[r]->Step({group, version, r, world}); });
      threads.emplace_back([&, r] { os[r] = reference_->Step({one, version, r, world}); });
    }
    for (std::thread& t : threads) t.join();
    for (uint32_t r = 0; r < world; ++r) {
      ASSERT_TRUE(gs[r].ok()) << gs[r].status();
      ASSERT_TRUE(os[r].ok()) << os[r].status();
      EXPECT_EQ(gs[r]->version, version + 1);
      EXPECT_EQ(gs[r]->applied, os[r]->applied);
      EXPECT_EQ(gs[r]->contributions, os[r]->contributions);
      EXPECT_EQ(gs[r]->contributions, world);
      EXPECT_EQ(gs[r]->tokens, os[r]->tokens);
      EXPECT_NEAR(gs[r]->grad_norm, os[r]->grad_norm, 1e-5 * os[r]->grad_norm);
    }
  }

  // A plain client of replica m (not a pool): what that member says.
  LossClient* MemberClient(int m) {
    if (!members_[m]) {
      ClientOptions co;
      co.target = Endpoint(m);
      co.deadline = absl::Seconds(60);
      members_[m] = *LossClient::Create(co);
    }
    return members_[m].get();
  }

  HeadGroup GroupOf(std::vector<std::string> members, const std::string& id) {
    HeadGroup g;
    g.members = std::move(members);
    g.id = id;
    return g;
  }

  std::vector<PooledClient*> ranks_;
  std::vector<std::unique_ptr<PooledClient>> owned_;
  std::unique_ptr<LossClient> members_[kReplicas];
  double worst_dx_ = 0;
};

class HeadGroupWorldTest : public HeadGroupPoolTest,
                           public ::testing::WithParamInterface<uint32_t> {};

TEST_P(HeadGroupWorldTest, EachRankGoesToItsMemberAndMatchesOneServer) {
  MakeRanks(GetParam());
  CreateHeadRequest req = GroupHead("g");
  req.group = GroupOf(Endpoints(), "group-a");
  absl::StatusOr<CreateHeadResult> made = pool_->CreateHead(req);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_TRUE(made->created);
  EXPECT_EQ(made->head.group.members, Endpoints());
  EXPECT_EQ(made->head.group.member, 0u);
  EXPECT_EQ(made->head.group.id, "group-a");
  for (int m = 0; m < kReplicas; ++m) {  // every member holds it, with its own index
    absl::StatusOr<HeadInfo> info = MemberClient(m)->GetHeadInfo("g");
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->group.member, static_cast<uint32_t>(m));
  }
  CreateHeadRequest one = GroupHead("one");
  ASSERT_TRUE(reference_->CreateHead(one).ok());
  for (uint64_t k = 0; k < 3; ++k) Step("g", "one", k, kReplicas);
  std::printf("pool, group of 3, %u ranks vs one server: worst dX %.2f ulps of max\n",
              GetParam(), worst_dx_);

  // The group's export through a rank's pool (every member asked at once) against the one
  // server's: master and moments within 2 ulps of max per step.
  absl::StatusOr<HeadExport> got = ranks_.back()->ExportHead("g");
  absl::StatusOr<HeadExport> want = reference_->ExportHead("one");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(got->spec.version, 3u);
  for (HeadTensor t : {HeadTensor::kMasterW, HeadTensor::kMasterBias, HeadTensor::kExpAvgW,
                       HeadTensor::kExpAvgSqW}) {
    EXPECT_LE(UlpsOfMax(got->tensors.at(t), want->tensors.at(t)), kMasterUlpsPerStep * 3)
        << HeadTensorName(t);
  }
  ASSERT_TRUE(pool_->DropHead("g").ok());
  for (int m = 0; m < kReplicas; ++m) {
    EXPECT_EQ(MemberClient(m)->GetHeadInfo("g").status().code(), absl::StatusCode::kNotFound);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, HeadGroupWorldTest, ::testing::Values(3u, 6u));

TEST_F(HeadGroupPoolTest, ALostMemberIsNamedAndANewGroupContinues) {
  MakeRanks(3);
  CreateHeadRequest req = GroupHead("g");
  req.group = GroupOf(Endpoints(), "group-b");
  ASSERT_TRUE(pool_->CreateHead(req).ok());
  ASSERT_TRUE(reference_->CreateHead(GroupHead("one")).ok());
  Step("g", "one", 0, kReplicas);
  absl::StatusOr<HeadExport> last = pool_->ExportHead("g");  // the last export: version 1
  ASSERT_TRUE(last.ok()) << last.status();

  Stop(2);
  const PoolCounters before = ranks_[2]->counters();
  absl::StatusOr<ComputeResult> lost = ranks_[2]->Compute(Batch("g", 1, 2, 3));
  ASSERT_EQ(lost.status().code(), absl::StatusCode::kAborted) << lost.status();
  EXPECT_THAT(lost.status().message(),
              HasSubstr(absl::StrCat("member 2 (", Endpoint(2),
                                     ") of its group 'group-b' is unreachable")));
  EXPECT_THAT(lost.status().message(),
              HasSubstr("Import the head's last export into a new group: rank 0 calls "
                        "ImportHead(export) with a HeadGroup of the live members"));
  const PoolCounters after = ranks_[2]->counters();
  EXPECT_EQ(after.heads_lost, before.heads_lost + 1);
  for (int m = 0; m < 2; ++m) {  // never sent to another member
    EXPECT_EQ(after.calls.count(Endpoint(m)) ? after.calls.at(Endpoint(m)) : 0,
              before.calls.count(Endpoint(m)) ? before.calls.at(Endpoint(m)) : 0);
  }
  absl::StatusOr<StepResult> step = ranks_[2]->Step({"g", 1, 2, 3});
  EXPECT_EQ(step.status().code(), absl::StatusCode::kAborted) << step.status();

  // The recovery: rank 0 drops what is left and imports the last export into a new group of
  // the two live members; every rank's GetHeadInfo learns it; the step is redone.
  ASSERT_TRUE(pool_->DropHead("g").ok());
  absl::StatusOr<CreateHeadResult> moved =
      pool_->ImportHead(*last, GroupOf({Endpoint(0), Endpoint(1)}, "group-c"));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->head.version, 1u);
  for (PooledClient* p : ranks_) {
    absl::StatusOr<HeadInfo> info = p->GetHeadInfo("g");
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->group.id, "group-c");
    EXPECT_EQ(info->group.size(), 2u);
  }
  for (uint64_t k = 1; k < 3; ++k) Step("g", "one", k, 2);
}

TEST_F(HeadGroupPoolTest, AMemberNamingAnotherIsReturnedNotResent) {
  MakeRanks(2);
  CreateHeadRequest req = GroupHead("g");
  req.group = GroupOf(Endpoints(), "group-d");
  ASSERT_TRUE(pool_->CreateHead(req).ok());
  ASSERT_TRUE(ranks_[1]->GetHeadInfo("g").ok());  // rank 1 learns group-d: member 1
  // Another trainer creates the head again as another group, members in another order.
  std::unique_ptr<PooledClient> other = NewPool(0);
  ASSERT_TRUE(other->DropHead("g").ok());
  req.group = GroupOf({Endpoint(1), Endpoint(0), Endpoint(2)}, "group-e");
  ASSERT_TRUE(other->CreateHead(req).ok());

  const PoolCounters before = ranks_[1]->counters();
  absl::StatusOr<ComputeResult> r = ranks_[1]->Compute(Batch("g", 0, 1, 2));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(r.status().message(),
              HasSubstr(absl::StrCat("this pool sent rank 1 to member 1 (", Endpoint(1),
                                     "), members[1 % 3] of group 'group-d'")));
  EXPECT_THAT(r.status().message(),
              HasSubstr(absl::StrCat("go to member 1 (", Endpoint(0), ", rank % 3)")));
  EXPECT_THAT(r.status().message(), HasSubstr("call GetHeadInfo('g') to learn the group again"));
  const PoolCounters after = ranks_[1]->counters();
  for (int m : {0, 2}) {
    EXPECT_EQ(after.calls.count(Endpoint(m)) ? after.calls.at(Endpoint(m)) : 0,
              before.calls.count(Endpoint(m)) ? before.calls.at(Endpoint(m)) : 0);
  }
  absl::StatusOr<HeadInfo> info = ranks_[1]->GetHeadInfo("g");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->group.id, "group-e");
  EXPECT_TRUE(ranks_[1]->Compute(Batch("g", 0, 1, 2)).ok());
}

// A pool that placed one server's head learns the group from GetHeadInfo once another
// trainer has created the head again as a group's, and routes by it from then on.
TEST_F(HeadGroupPoolTest, AOneServerHeadCreatedAgainAsAGroupIsLearnt) {
  MakeRanks(2);
  ASSERT_TRUE(ranks_[1]->CreateHead(GroupHead("s")).ok());
  const std::string placed = ranks_[1]->ReplicaOf(HeadKey("s"));
  ASSERT_FALSE(placed.empty());
  // Rank 1's member in the new group is another replica than the one its pool placed.
  std::vector<std::string> members = Endpoints();
  if (members[1] == placed) std::swap(members[0], members[1]);
  ASSERT_TRUE(pool_->DropHead("s").ok());
  CreateHeadRequest req = GroupHead("s");
  req.group = GroupOf(members, "group-f");
  ASSERT_TRUE(pool_->CreateHead(req).ok());

  absl::StatusOr<HeadInfo> info = ranks_[1]->GetHeadInfo("s");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->group.id, "group-f");
  absl::StatusOr<ComputeResult> r = ranks_[1]->Compute(Batch("s", 0, 1, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  for (int m = 0; m < kReplicas; ++m) {  // added on rank 1's member only
    absl::StatusOr<HeadInfo> on = MemberClient(m)->GetHeadInfo("s");
    ASSERT_TRUE(on.ok()) << on.status();
    EXPECT_EQ(on->contributions, Endpoint(m) == members[1] ? 1u : 0u) << Endpoint(m);
  }
}

TEST_F(HeadGroupPoolTest, GroupArgumentsAreChecked) {
  CreateHeadRequest req = GroupHead("g");
  req.group = GroupOf({Endpoint(0), "10.9.9.9:1"}, "x");
  absl::StatusOr<CreateHeadResult> r = pool_->CreateHead(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("group.members[1] '10.9.9.9:1' is not one of this pool's replicas"));
  req.group = GroupOf(Endpoints(), "");
  r = pool_->CreateHead(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("group.id is empty"));
  // A one-member "group" is one server's head on that member.
  req.group = GroupOf({Endpoint(1)}, "solo");
  r = pool_->CreateHead(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->head.group.size(), 0u);
  EXPECT_EQ(pool_->ReplicaOf(HeadKey("g")), Endpoint(1));
}

}  // namespace
}  // namespace client
}  // namespace lossd
