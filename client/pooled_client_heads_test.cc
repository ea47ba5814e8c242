// SPDX-License-Identifier: Apache-2.0
// Tests the pooled client's hosted heads against three real replicas (pool_test_fixture.h):
// two ranks (two pools, as two trainer processes) train a head on its rendezvous home; its
// replica is stopped (or restarted) mid-step; both ranks hear an error naming rank 0 as the
// importer, nothing is sent into the head elsewhere, rank 0 imports the last export on the
// next replica (the restarted one is passed over), the other finds it with GetHeadInfo, the step is
// redone, and the head equals a single server's that never failed, byte for byte; a pool
// meeting the head afterwards finds it where it moved.
#include <string>
#include <thread>
#include <vector>

#include "testing/client/pool_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

constexpr char kHead[] = "lm";

CreateHeadRequest NewHead() {
  CreateHeadRequest r;
  r.name = kHead;
  r.w = UniformTensor(DType::kF32, {kPoolV, kPoolH}, 31, 0.5f);
  r.bias = UniformTensor(DType::kF32, {kPoolV}, 32, 0.5f);
  r.optimizer.kind = Optimizer::kSgd;
  r.optimizer.lr = 0.05;
  return r;
}

// Rank `rank`'s micro-batch `mb` of the step at `version` (2 ranks: grad_scale 1/2).
ComputeRequest HeadBatch(uint64_t version, uint32_t rank, uint64_t mb) {
  ComputeRequest r = PoolMicroBatch(static_cast<uint32_t>(300 + 10 * version + 4 * rank + mb));
  r.head = kHead;
  r.head_version = version;
  r.rank = rank;
  r.micro_batch = mb;
  r.options.grad_scale = 0.5f;
  return r;
}

// Both ranks' Steps at once (a barrier); their statuses.
template <typename Client>
std::vector<absl::Status> StepBoth(Client* c0, Client* c1, uint64_t version) {
  std::vector<absl::Status> out(2);
  std::thread t([&] { out[1] = c1->Step({kHead, version, 1, 2}).status(); });
  out[0] = c0->Step({kHead, version, 0, 2}).status();
  t.join();
  return out;
}

// Two micro-batches per rank at `version`, then the Step: one uninterrupted step.
template <typename Client>
void WholeStep(Client* c0, Client* c1, uint64_t version) {
  for (uint64_t mb = 0; mb < 2; ++mb) {
    ASSERT_TRUE(c0->Compute(HeadBatch(version, 0, mb)).ok());
    ASSERT_TRUE(c1->Compute(HeadBatch(version, 1, mb)).ok());
  }
  for (const absl::Status& s : StepBoth(c0, c1, version)) ASSERT_TRUE(s.ok()) << s;
}

class HeadLossTest : public PoolTest, public ::testing::WithParamInterface<bool> {};

TEST_P(HeadLossTest, NamesTheImportingRankAndTheRedoneStepMatchesOneServer) {
  const bool restart = GetParam();
  std::unique_ptr<PooledClient> rank1 = NewPool(1);
  PooledClient* rank0 = pool_.get();
  const std::vector<std::string> order = Order(HeadKey(kHead));
  const int home = IndexOf(order[0]);
  // Either way the head is imported on the next replica: the one that lost it is passed
  // over (by both clients, so every rank looks for it there).
  const std::string import_on = order[1];

  const CreateHeadRequest create = NewHead();
  absl::StatusOr<CreateHeadResult> made = rank0->CreateHead(create);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->head.instance, absl::StrCat("replica", home + 1, "-", home));
  WholeStep(rank0, rank1.get(), 0);
  absl::StatusOr<HeadExport> checkpoint = rank0->ExportHead(kHead);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ASSERT_EQ(checkpoint->spec.version, 1u);

  // Step 2 begins; its replica goes away after one micro-batch of each rank.
  ASSERT_TRUE(rank0->Compute(HeadBatch(1, 0, 0)).ok());
  ASSERT_TRUE(rank1->Compute(HeadBatch(1, 1, 0)).ok());
  restart ? Restart(home) : Stop(home);
  for (PooledClient* c : {rank1.get(), rank0}) {
    absl::StatusOr<ComputeResult> got = c->Compute(HeadBatch(1, c == rank0 ? 0 : 1, 1));
    ASSERT_EQ(got.status().code(), absl::StatusCode::kAborted) << got.status();
    const std::string m(got.status().message());
    EXPECT_THAT(m, HasSubstr(absl::StrCat("head 'lm' was on replica ", order[0])));
    EXPECT_THAT(m, HasSubstr(restart ? "restarted" : "is unreachable"));
    EXPECT_THAT(m, HasSubstr("Rank 0 imports the head from its last export"));
    // Until found again, every call into it fails so; nothing reached another replica.
    EXPECT_EQ(c->Step({kHead, 1, 0, 2}).status().code(), absl::StatusCode::kAborted);
    EXPECT_EQ(c->counters().heads_lost, 1u);
  }
  for (int i = 0; i < kReplicas; ++i) {
    if (servers_[i]) EXPECT_EQ(EngineOf(i).heads().count(), 0u) << Endpoint(i);
  }
  // Rank 1 looks before rank 0 has imported: not there yet, and told who imports it.
  absl::StatusOr<HeadInfo> early = rank1->GetHeadInfo(kHead);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(early.status().message()), HasSubstr("rank 0 imports it"));

  absl::StatusOr<CreateHeadResult> imported = rank0->ImportHead(*checkpoint);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->head.version, 1u);
  EXPECT_EQ(rank0->ReplicaOf(HeadKey(kHead)), import_on);
  absl::StatusOr<HeadInfo> info = rank1->GetHeadInfo(kHead);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version, 1u);
  EXPECT_EQ(rank1->ReplicaOf(HeadKey(kHead)), import_on);
  EXPECT_EQ(rank0->counters().moves, 1u);
  EXPECT_EQ(rank1->counters().moves, 1u);
  EXPECT_EQ(Logged(absl::StrCat("'head:lm' moved from replica ", order[0], " to ", order[1])),
            2);  // once in each pool

  WholeStep(rank0, rank1.get(), 1);  // the redone step
  absl::StatusOr<HeadExport> got = rank0->ExportHead(kHead);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->spec.version, 2u);

  // A trainer meeting the head only now finds it where it moved, with no error (streaming
  // the export: every byte of the master W arrives, equal to the whole export's).
  std::unique_ptr<PooledClient> late = NewPool(0);
  std::string master;
  absl::StatusOr<HeadExport> seen = late->ExportHeadTo(
      kHead, [](const HeadExport&) { return absl::OkStatus(); },
      [&](HeadTensor t, uint64_t offset, const uint8_t* data, size_t size) {
        if (t == HeadTensor::kMasterW) {
          EXPECT_EQ(offset, master.size());
          master.append(reinterpret_cast<const char*>(data), size);
        }
        return absl::OkStatus();
      });
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(seen->spec.version, 2u);
  const HostTensor& got_master = got->tensors.at(HeadTensor::kMasterW);
  EXPECT_EQ(master, std::string(reinterpret_cast<const char*>(got_master.data()),
                                got_master.num_bytes()));
  EXPECT_EQ(late->ReplicaOf(HeadKey(kHead)), import_on);
  EXPECT_EQ(late->counters().heads_lost, 0u);

  // The same two steps on one server that never failed.
  ASSERT_TRUE(reference_->CreateHead(create).ok());
  WholeStep(reference_.get(), reference_.get(), 0);
  WholeStep(reference_.get(), reference_.get(), 1);
  absl::StatusOr<HeadExport> want = reference_->ExportHead(kHead);
  ASSERT_TRUE(want.ok()) << want.status();
  for (HeadTensor t : {HeadTensor::kMasterW, HeadTensor::kMasterBias}) {
    EXPECT_EQ(PoolMismatch(&got->tensors.at(t), &want->tensors.at(t)), "") << HeadTensorName(t);
  }
  EXPECT_TRUE(rank0->DropHead(kHead).ok());
}

INSTANTIATE_TEST_SUITE_P(StoppedOrRestarted, HeadLossTest, ::testing::Bool());

// The head's replica restarts between steps (empty, alive, another instance). One rank's pool
// meets the loss in a Compute; the other's has not when it imports: it must not create a
// second head on the restarted replica, but import where the first rank's error said, so
// that one head exists and the redone step completes. Both orders: rank 1 meets the loss and
// rank 0 imports unaware, or rank 0 meets it and imports and rank 1 imports unaware.
class HeadRestartTest : public PoolTest, public ::testing::WithParamInterface<bool> {};

TEST_P(HeadRestartTest, EveryRankImportsOnOneHomeWhicheverMeetsTheLossFirst) {
  const bool rank0_first = GetParam();
  std::unique_ptr<PooledClient> rank1 = NewPool(1);
  PooledClient* rank0 = pool_.get();
  const std::vector<std::string> order = Order(HeadKey(kHead));
  const int home = IndexOf(order[0]);
  const CreateHeadRequest create = NewHead();
  ASSERT_TRUE(rank0->CreateHead(create).ok());
  WholeStep(rank0, rank1.get(), 0);  // both pools have placed the head on its home
  absl::StatusOr<HeadExport> checkpoint = rank0->ExportHead(kHead);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  Restart(home);

  PooledClient* first = rank0_first ? rank0 : rank1.get();
  absl::StatusOr<ComputeResult> met = first->Compute(HeadBatch(1, rank0_first ? 0 : 1, 0));
  ASSERT_EQ(met.status().code(), absl::StatusCode::kAborted) << met.status();
  EXPECT_THAT(std::string(met.status().message()),
              HasSubstr(absl::StrCat("ImportHead, which goes to replica ", order[1])));

  absl::StatusOr<CreateHeadResult> by0 = rank0->ImportHead(*checkpoint);
  ASSERT_TRUE(by0.ok()) << by0.status();
  ASSERT_EQ(rank0->ReplicaOf(HeadKey(kHead)), order[1]);
  EXPECT_TRUE(by0->created);
  absl::StatusOr<CreateHeadResult> by1 = rank1->ImportHead(*checkpoint);
  ASSERT_TRUE(by1.ok()) << by1.status();
  ASSERT_EQ(rank1->ReplicaOf(HeadKey(kHead)), order[1]);
  EXPECT_FALSE(by1->created);  // the same head, imported once
  EXPECT_EQ(EngineOf(home).heads().count(), 0u);
  EXPECT_EQ(EngineOf(IndexOf(order[1])).heads().count(), 1u);
  EXPECT_EQ(EngineOf(IndexOf(order[2])).heads().count(), 0u);
  for (PooledClient* c : {rank0, rank1.get()}) {
    EXPECT_EQ(c->counters().heads_lost, 1u);  // met once: by the Compute or at the import
    EXPECT_EQ(c->counters().moves, 1u);
  }

  WholeStep(rank0, rank1.get(), 1);  // the redone step completes, on one head
  absl::StatusOr<HeadExport> got = rank1->ExportHead(kHead);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(reference_->CreateHead(create).ok());
  WholeStep(reference_.get(), reference_.get(), 0);
  WholeStep(reference_.get(), reference_.get(), 1);
  absl::StatusOr<HeadExport> want = reference_->ExportHead(kHead);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(got->spec.version, 2u);
  EXPECT_EQ(PoolMismatch(&got->tensors.at(HeadTensor::kMasterW),
                         &want->tensors.at(HeadTensor::kMasterW)), "");
}

INSTANTIATE_TEST_SUITE_P(WhicheverRankMeetsTheLossFirst, HeadRestartTest, ::testing::Bool());

TEST_F(PoolTest, AnUnreachableHeadReplicaAtCreationCreatesItOnTheNext) {
  const std::vector<std::string> order = Order(HeadKey(kHead));
  Stop(IndexOf(order[0]));
  absl::StatusOr<CreateHeadResult> made = pool_->CreateHead(NewHead());
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(pool_->ReplicaOf(HeadKey(kHead)), order[1]);
  EXPECT_EQ(EngineOf(IndexOf(order[1])).heads().count(), 1u);
  EXPECT_EQ(pool_->counters().heads_lost, 0u);  // nothing was there to lose
}

}  // namespace
}  // namespace client
}  // namespace lossd
