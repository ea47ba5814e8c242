// SPDX-License-Identifier: Apache-2.0
// The fixture of the pool's end-to-end tests: three real lossd servers (engine, CPU backend,
// gRPC) in the test process on 127.0.0.1, .2 and .3 with one port, as three replicas behind a
// name would be, plus a fourth on 127.0.0.4 (never in the pool) that computes the
// single-server reference. Replicas are stopped and restarted (a new instance) at will.
#ifndef LOSSD_TESTING_CLIENT_POOL_TEST_FIXTURE_H_
#define LOSSD_TESTING_CLIENT_POOL_TEST_FIXTURE_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <arpa/inet.h>

#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/host_tensor.h"
#include "client/lossd_client.h"
#include "client/pooled_client.h"
#include "client/rendezvous.h"
#include "client/two_phase_logprob.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/client/test_tensors.h"
#include "testing/server_harness.h"

namespace lossd {
namespace client {

inline constexpr int64_t kPoolV = 53, kPoolH = 20, kPoolBT = 11;  // nothing a multiple of 8
inline constexpr int kReplicas = 3;

// A micro-batch: random X and targets (one row ignored); dX wanted, dW not.
inline ComputeRequest PoolMicroBatch(uint32_t seed) {
  ComputeRequest r;
  r.x = UniformTensor(DType::kBF16, {kPoolBT, kPoolH}, 1000 + seed, 2.0f);
  r.targets = HostTensor::Owned(DType::kI64, {kPoolBT});
  std::mt19937 gen(2000 + seed);
  for (int64_t i = 0; i < kPoolBT; ++i) r.targets.mutable_data_as<int64_t>()[i] = gen() % kPoolV;
  r.targets.mutable_data_as<int64_t>()[2] = -100;
  r.want.dx = true;
  r.want.dw = false;
  return r;
}

// "" when equal byte for byte; else what differs.
inline std::string PoolMismatch(const HostTensor* got, const HostTensor* want) {
  if (got == nullptr || want == nullptr) return got == want ? "" : "one of them is missing";
  if (got->shape() != want->shape() || got->dtype() != want->dtype()) {
    return absl::StrCat(got->DebugString(), " vs ", want->DebugString());
  }
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want->num_bytes(); ++i) {
    if (got->data()[i] != want->data()[i] && bad++ == 0) first = i;
  }
  return bad == 0 ? "" : absl::StrCat(bad, " bytes differ, first at ", first);
}

// A hosted head of plain SGD without momentum: its update is lr times the summed gradient, so
// a micro-batch added twice (or not at all) shows in W, not only in the step's norm. Random
// fp32 W (seed `seed`) and bias (seed + 1).
inline CreateHeadRequest PoolSgdHead(const std::string& name, uint32_t seed) {
  CreateHeadRequest r;
  r.name = name;
  r.w = UniformTensor(DType::kF32, {kPoolV, kPoolH}, seed, 0.5f);
  r.bias = UniformTensor(DType::kF32, {kPoolV}, seed + 1, 0.5f);
  r.optimizer.kind = Optimizer::kSgd;
  r.optimizer.lr = 0.05;
  return r;
}

// A logprob backward's random upstream gradients for micro-batch `seed`, owned; View() lends
// them to a TwoPhaseLogprob backward.
struct PoolLogprobGrads {
  HostTensor dlogp, dentropy;
  LogprobGradients View() const {
    return {HostTensor::View(DType::kF32, dlogp.shape(), dlogp.data()),
            HostTensor::View(DType::kF32, dentropy.shape(), dentropy.data())};
  }
};
inline PoolLogprobGrads PoolLogprobGradientsOf(uint32_t seed) {
  return {UniformTensor(DType::kF32, {kPoolBT}, 300 + seed, 1.0f),
          UniformTensor(DType::kF32, {kPoolBT}, 400 + seed, 1.0f)};
}

class PoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = SharedFreePort();
    ASSERT_GT(port_, 0) << "no port free on 127.0.0.1-4";
    for (int i = 0; i < kReplicas; ++i) Start(i);
    testing_harness::HarnessOptions ro;
    ro.host = "127.0.0.4";
    ro.port = port_;
    ro.engine.instance = "reference";
    reference_server_ = std::make_unique<testing_harness::Harness>(ro);
    ASSERT_TRUE(reference_server_->started());
    ClientOptions co;
    co.target = absl::StrCat("127.0.0.4:", port_);
    co.deadline = absl::Seconds(120);
    reference_ = *LossClient::Create(co);
    pool_ = NewPool();
    ASSERT_NE(pool_, nullptr);
  }

  // A pool over the three replicas (one per trainer process in real life); `edit` changes
  // its options last.
  std::unique_ptr<PooledClient> NewPool(uint32_t rank = 0,
                                        std::function<void(PoolOptions*)> edit = nullptr) {
    PoolOptions o;
    o.rank = rank;
    o.targets = absl::StrCat(Endpoint(0), ",", Endpoint(1), ",", Endpoint(2));
    o.client.deadline = absl::Seconds(120);  // generous: a loaded 2-core machine
    o.client.part_bytes = 1000;              // every tensor travels in several parts
    o.probe_deadline = absl::Seconds(30);    // a live replica must never look lost
    o.now = [this] {
      absl::MutexLock lock(&log_mu_);
      return absl::Now() + skew_;
    };
    o.log = [this](const std::string& line) {
      absl::MutexLock lock(&log_mu_);
      log_.push_back(line);
    };
    if (edit) edit(&o);
    absl::StatusOr<std::unique_ptr<PooledClient>> p = PooledClient::Create(o);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }

  std::string Endpoint(int i) const { return absl::StrCat("127.0.0.", i + 1, ":", port_); }
  int IndexOf(const std::string& endpoint) const {
    for (int i = 0; i < kReplicas; ++i) {
      if (Endpoint(i) == endpoint) return i;
    }
    ADD_FAILURE() << "not a replica: " << endpoint;
    return 0;
  }
  std::vector<std::string> Endpoints() const { return {Endpoint(0), Endpoint(1), Endpoint(2)}; }
  std::vector<std::string> Order(const std::string& key) const {
    return RendezvousOrder(key, Endpoints());
  }
  // A head name whose replica is not where the pool's stateless calls go first, so a call
  // the pool sent by its default route instead of to the head would be seen.
  std::string HeadAwayFromRank0() const {
    for (int n = 0;; ++n) {
      const std::string name = absl::StrCat("lm-", n);
      if (Order(HeadKey(name)).front() != Order(RankKey(0)).front()) return name;
    }
  }

  void Start(int i) {
    testing_harness::HarnessOptions o;
    o.host = absl::StrCat("127.0.0.", i + 1);
    o.port = port_;
    o.engine.instance = absl::StrCat("replica", i + 1, "-", generation_++);
    if (head_groups_) {  // lossd --head_group_address=<its host> (gloo listens there)
      o.head_group_address = o.host;
      o.head_group_timeout = absl::Seconds(20);
    }
    servers_[i] = std::make_unique<testing_harness::Harness>(o);
    ASSERT_TRUE(servers_[i]->started());
  }
  // As a SIGKILL does: the server and all it held are gone.
  void Stop(int i) { servers_[i].reset(); }
  void Restart(int i) {
    Stop(i);
    Start(i);
  }
  Engine& EngineOf(int i) { return servers_[i]->engine(); }

  // Moves every pool's clock on (down_for, reresolve_period) without waiting.
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&log_mu_);
    skew_ += d;
  }

  // Log lines holding `what`.
  int Logged(const std::string& what) {
    absl::MutexLock lock(&log_mu_);
    int n = 0;
    for (const std::string& l : log_) n += absl::StrContains(l, what) ? 1 : 0;
    return n;
  }

  // One port free on 127.0.0.1 to .4 (checked by binding each), so that the replicas differ
  // only in their address.
  static int SharedFreePort() {
    for (int attempt = 0; attempt < 20; ++attempt) {
      int fds[4];
      int port = 0;
      bool ok = true;
      for (int i = 0; i < 4; ++i) {
        fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(static_cast<uint16_t>(port));
        inet_pton(AF_INET, absl::StrCat("127.0.0.", i + 1).c_str(), &a.sin_addr);
        if (bind(fds[i], reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
          ok = false;
          for (int j = 0; j <= i; ++j) close(fds[j]);
          break;
        }
        if (i == 0) {
          socklen_t len = sizeof(a);
          getsockname(fds[0], reinterpret_cast<sockaddr*>(&a), &len);
          port = ntohs(a.sin_port);
        }
      }
      if (!ok) continue;
      for (int fd : fds) close(fd);
      return port;
    }
    return 0;
  }

  int port_ = 0;
  int generation_ = 0;
  bool head_groups_ = false;  // set before SetUp: the replicas form head groups
  std::unique_ptr<testing_harness::Harness> servers_[kReplicas];
  std::unique_ptr<testing_harness::Harness> reference_server_;
  std::unique_ptr<LossClient> reference_;
  absl::Mutex log_mu_;
  std::vector<std::string> log_;
  absl::Duration skew_ = absl::ZeroDuration();
  std::unique_ptr<PooledClient> pool_;  // before the servers' end: it calls nothing then
};

// PoolTest with weights W (bf16, V x H) put on the reference server (reference_handle_), and
// names for the same W put in a pool on the replica a test wants.
class PoolWeightsTest : public PoolTest {
 protected:
  void SetUp() override {
    PoolTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    w_ = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 9, 0.5f);
    absl::StatusOr<PutWeightsResult> put = reference_->PutWeights(w_, nullptr);
    ASSERT_TRUE(put.ok()) << put.status();
    reference_handle_ = put->handle;
  }

  // A weights name whose replica is `i`, put in `pool`.
  std::string WeightsOn(PooledClient& pool, int i) {
    for (int n = 0;; ++n) {
      const std::string name = absl::StrCat("w-", n);
      if (Order(WeightsKey(name)).front() != Endpoint(i)) continue;
      EXPECT_TRUE(pool.PutWeights(name, w_, nullptr).ok());
      return name;
    }
  }

  HostTensor w_;
  std::string reference_handle_;
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_TESTING_CLIENT_POOL_TEST_FIXTURE_H_
