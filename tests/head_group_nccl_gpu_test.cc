// SPDX-License-Identifier: Apache-2.0
// A head group's communicator on the CUDA plugin's NCCL, through the engine's side of it
// (ConnectBackendComm: the id handed through the group's store, the arrival marks, the step's
// values staged through device memory), with one member on one GPU: the same code path as
// S > 1, whose collectives leave one member's data as it was. Needs NCCL's library
// (LOSSD_NCCL_LIBRARY, else libnccl.so.2). GPU only.
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/head_group.h"
#include "gtest/gtest.h"
#include "kernels/plugin_loader.h"

namespace lossd {
namespace {

class HeadGroupNcclGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> b = LoadCudaBackend("", DefaultCudaOptions());
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
    absl::Status nccl = backend_->CommAvailable();
    ASSERT_TRUE(nccl.ok()) << nccl << " (set LOSSD_NCCL_LIBRARY to NCCL's libnccl.so.2)";
    store_ = std::make_shared<MemoryGroupStore>();
    group_.members = {"this-gpu:50051"};
    group_.member = 0;
    group_.id = "nccl-gpu-test";
  }

  // n random fp32 values (never zeros) in device memory, and their host copy.
  std::unique_ptr<BackendBuffer> Random(int64_t n, uint64_t seed, std::vector<float>* host) {
    std::mt19937_64 g(seed);
    std::uniform_real_distribution<float> u(0.5f, 2.0f);
    host->resize(n);
    for (float& f : *host) f = (g() & 1) ? u(g) : -u(g);
    absl::StatusOr<std::unique_ptr<BackendBuffer>> buf = backend_->Allocate(n * sizeof(float));
    EXPECT_TRUE(buf.ok()) << buf.status();
    if (!buf.ok()) return nullptr;
    EXPECT_TRUE(backend_->CopyToBackend(**buf, 0, host->data(), n * sizeof(float)).ok());
    return *std::move(buf);
  }

  std::vector<float> Read(const BackendBuffer& buf, int64_t n) {
    std::vector<float> out(n);
    EXPECT_TRUE(backend_->CopyFromBackend(buf, 0, out.data(), n * sizeof(float)).ok());
    return out;
  }

  std::unique_ptr<Backend> backend_;
  std::shared_ptr<MemoryGroupStore> store_;
  HeadGroup group_;
};

TEST_F(HeadGroupNcclGpuTest, OneMembersCollectivesKeepItsDataAndLeaveTheStoreEmpty) {
  absl::StatusOr<std::shared_ptr<HeadComm>> comm =
      ConnectBackendComm(*backend_, store_, group_, absl::Seconds(60));
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->size(), 1u);
  EXPECT_EQ((*comm)->member(), 0u);
  for (int64_t n : {int64_t{1} << 20, int64_t{1000003}}) {
    std::vector<float> want;
    std::unique_ptr<BackendBuffer> buf = Random(n, n, &want);
    ASSERT_NE(buf, nullptr);
    absl::Status s = (*comm)->ReduceScatter(static_cast<float*>(buf->data()), n);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(std::memcmp(Read(*buf, n).data(), want.data(), n * sizeof(float)), 0) << n;
    s = (*comm)->AllGather(buf->data(), n, sizeof(float));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(std::memcmp(Read(*buf, n).data(), want.data(), n * sizeof(float)), 0) << n;
    // The compute copy's all-gather is of 2-byte elements.
    s = (*comm)->AllGather(buf->data(), 2 * n, 2);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(std::memcmp(Read(*buf, n).data(), want.data(), n * sizeof(float)), 0) << n;
  }
  const std::vector<double> mine = {1.5, -2.25, 3e10, 0.1};
  absl::StatusOr<std::vector<double>> all = (*comm)->AllGatherValues(mine);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(*all, mine);
  ASSERT_TRUE((*comm)->Barrier().ok());
  EXPECT_EQ((*comm)->AbortReason(), "");
  comm->reset();  // its last arrival mark goes with it
  EXPECT_EQ(store_->size(), 0u) << "the id, the join mark and the arrival marks are gone";
}

TEST_F(HeadGroupNcclGpuTest, AnAbortedCommunicatorRefusesEveryLaterCallNamingWhy) {
  absl::StatusOr<std::shared_ptr<HeadComm>> comm =
      ConnectBackendComm(*backend_, store_, group_, absl::Seconds(60));
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<float> host;
  std::unique_ptr<BackendBuffer> buf = Random(4096, 1, &host);
  ASSERT_NE(buf, nullptr);
  (*comm)->Abort("a peer was lost in this test");
  EXPECT_EQ((*comm)->AbortReason(), "a peer was lost in this test");
  absl::Status s = (*comm)->ReduceScatter(static_cast<float*>(buf->data()), 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("a peer was lost in this test"), std::string::npos) << s;
  EXPECT_FALSE((*comm)->AllGatherValues({1.0}).ok());
  // A second group (a new id) forms on the same GPU after it.
  group_.id = "nccl-gpu-test-2";
  absl::StatusOr<std::shared_ptr<HeadComm>> again =
      ConnectBackendComm(*backend_, store_, group_, absl::Seconds(60));
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE((*again)->Barrier().ok());
}

}  // namespace
}  // namespace lossd
