// SPDX-License-Identifier: Apache-2.0
// The fixture of the C++ client's tests against the in-process fake lossd service
// (testing/client/fake_loss_service.h) over real loopback gRPC, and their random test tensors
// (every tensor distinct, so an echo that mixes tensors up shows). Test-only; never linked into
// the client.
#ifndef LOSSD_TESTING_CLIENT_LOSSD_CLIENT_FIXTURE_H_
#define LOSSD_TESTING_CLIENT_LOSSD_CLIENT_FIXTURE_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/host_tensor.h"
#include "client/lossd_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "testing/client/fake_loss_service.h"

namespace lossd {
namespace client {

// Random bytes: every test tensor is distinct, so an echo that mixes tensors up shows.
inline ByteVector RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  ByteVector b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(gen());
  return b;
}

inline HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  const size_t n = *TensorByteSize(dtype, shape);
  return HostTensor::FromBytes(dtype, std::move(shape), RandomBytes(n, seed));
}

inline HostTensor Targets(int64_t bt, int64_t v, uint32_t seed) {
  std::mt19937 gen(seed);
  HostTensor t = HostTensor::Owned(DType::kI64, {bt});
  for (int64_t i = 0; i < bt; ++i) t.mutable_data_as<int64_t>()[i] = gen() % v;
  return t;
}

inline bool SameBytes(const HostTensor& a, const HostTensor& b) {
  return a.num_bytes() == b.num_bytes() && std::memcmp(a.data(), b.data(), a.num_bytes()) == 0;
}

class LossClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(-1);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  ClientOptions Options() {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", port_);
    o.deadline = absl::Seconds(30);
    return o;
  }

  std::unique_ptr<LossClient> Client(const ClientOptions& o) {
    auto c = LossClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // A small bf16 request with inline weights.
  ComputeRequest SmallRequest(int64_t bt = 6, int64_t h = 5, int64_t v = 7) {
    ComputeRequest r;
    r.x = RandomTensor(DType::kBF16, {bt, h}, 1);
    r.w = RandomTensor(DType::kBF16, {v, h}, 2);
    r.targets = Targets(bt, v, 3);
    r.want.lse = true;
    r.want.predictions = true;
    return r;
  }

  FakeLossService fake_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_TESTING_CLIENT_LOSSD_CLIENT_FIXTURE_H_
