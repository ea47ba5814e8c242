// SPDX-License-Identifier: Apache-2.0
// The fixture of lossctl's tests (lossctl_test.cc, lossctl_heads_test.cc): a fake lossd over
// real gRPC, lossctl run as a child process against it, and a scratch directory per test.
#ifndef LOSSD_TESTING_CLIENT_LOSSCTL_TEST_FIXTURE_H_
#define LOSSD_TESTING_CLIENT_LOSSCTL_TEST_FIXTURE_H_

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/host_tensor.h"
#include "client/npy.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "testing/client/fake_loss_service.h"

namespace lossd {
namespace client {
namespace lossctl_testing {

using ::testing::HasSubstr;

struct Result {
  int code = -1;
  std::string output;  // stdout and stderr
};

inline HostTensor RandomF32(std::vector<int64_t> shape, uint32_t seed) {
  HostTensor t = HostTensor::Owned(DType::kF32, std::move(shape));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.mutable_data_as<float>()[i] = u(gen);
  return t;
}

inline bool SameBytes(const HostTensor& a, const HostTensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), a.num_bytes()) == 0;
}

class LossctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    ASSERT_EQ(std::system(("rm -rf " + dir_ + " && mkdir -p " + dir_).c_str()), 0);
  }
  void TearDown() override {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  // lossctl's exit code and its stdout, with stderr merged in unless `stdout_only` (what a
  // script piping --json to a parser reads).
  Result Lossctl(const std::string& args, bool stdout_only = false) {
    const std::string cmd =
        absl::StrCat("client/lossctl --target=127.0.0.1:", port_, " --deadline_seconds=30 ", args,
                     stdout_only ? " 2>/dev/null" : " 2>&1");
    Result r;
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) return r;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
    const int status = pclose(p);
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return r;
  }

  std::string Path(const std::string& name) { return dir_ + "/" + name; }

  // `lossctl args` exits 1 and says `message` (a substring of its output).
  void ExpectFails(const std::string& args, const std::string& message) {
    Result r = Lossctl(args);
    EXPECT_EQ(r.code, 1) << "lossctl " << args << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(message)) << "lossctl " << args;
  }

  // compute from x.npy and w.npy (V = 6) with --dtype=bf16: X and W go as bf16 (the fake
  // echoes X as dX, so dX is X rounded to bf16).
  void ExpectSentAsBf16(const HostTensor& x) {
    HostTensor t = HostTensor::Owned(DType::kI64, {x.dim(0)});
    for (int64_t i = 0; i < x.dim(0); ++i) t.mutable_data_as<int64_t>()[i] = i % 6;
    ASSERT_TRUE(WriteNpy(Path("t.npy"), t).ok());
    Result r = Lossctl(absl::StrCat("compute --x=", Path("x.npy"), " --w=", Path("w.npy"),
                                    " --targets=", Path("t.npy"),
                                    " --dtype=bf16 --want=dx --out_dir=", Path("out")));
    ASSERT_EQ(r.code, 0) << r.output;
    HostTensor dx = Read("out/dx.npy");
    ASSERT_EQ(dx.dtype(), DType::kBF16);
    ASSERT_EQ(dx.num_elements(), x.num_elements());
    for (int64_t i = 0; i < x.num_elements(); ++i) {
      EXPECT_EQ(dx.data_as<uint16_t>()[i], FloatToBf16(x.data_as<float>()[i])) << i;
    }
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.w().dtype(), v1::DTYPE_BF16);
  }

  HostTensor Read(const std::string& name) {
    absl::StatusOr<HostTensor> t = ReadNpy(Path(name));
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : HostTensor();
  }

  FakeLossService fake_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string dir_;
};


}  // namespace lossctl_testing
}  // namespace client
}  // namespace lossd

#endif  // LOSSD_TESTING_CLIENT_LOSSCTL_TEST_FIXTURE_H_
