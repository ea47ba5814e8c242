// SPDX-License-Identifier: Apache-2.0
// lossctl's two-phase log-prob against the real server (engine + CPU backend in the test
// process): `compute --kind=logprob --keep_ms` prints a ticket, `compute --ticket --dlogp`
// writes the gradients the one-phase `compute --kind=logprob --dlogp` writes, bit for bit; the
// flags a backward may not give are refused, and a consumed ticket is NOT_FOUND.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/host_tensor.h"
#include "client/npy.h"
#include "gtest/gtest.h"
#include "testing/server_harness.h"

namespace lossd {
namespace {

using client::HostTensor;

constexpr int64_t kBt = 13, kH = 10, kV = 29;

struct Result {
  int code = -1;
  std::string output;  // stdout and stderr
};

HostTensor RandomF32(std::vector<int64_t> shape, uint32_t seed) {
  HostTensor t = HostTensor::Owned(DType::kF32, std::move(shape));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.5f, 1.5f);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.mutable_data_as<float>()[i] = u(gen);
  return t;
}

class LossctlTwoPhaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/two_phase");
    ASSERT_EQ(std::system(("rm -rf " + dir_ + " && mkdir -p " + dir_).c_str()), 0);
    ASSERT_TRUE(client::WriteNpy(Path("x.npy"), RandomF32({kBt, kH}, 1)).ok());
    ASSERT_TRUE(client::WriteNpy(Path("w.npy"), RandomF32({kV, kH}, 2)).ok());
    ASSERT_TRUE(client::WriteNpy(Path("dlogp.npy"), RandomF32({kBt}, 3)).ok());
    HostTensor targets = HostTensor::Owned(DType::kI64, {kBt});
    std::mt19937 gen(4);
    for (int64_t i = 0; i < kBt; ++i) targets.mutable_data_as<int64_t>()[i] = gen() % kV;
    ASSERT_TRUE(client::WriteNpy(Path("targets.npy"), targets).ok());
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Inputs() const {
    return absl::StrCat("--kind=logprob --temperature=0.9 --x=", Path("x.npy"),
                        " --w=", Path("w.npy"), " --targets=", Path("targets.npy"));
  }

  Result Lossctl(const std::string& args) {
    const std::string cmd = absl::StrCat("client/lossctl --target=127.0.0.1:", h_.port(),
                                         " --deadline_seconds=30 ", args, " 2>&1");
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

  // The bytes of <dir>/<sub>/<name>.npy, empty where it cannot be read.
  std::string Bytes(const std::string& sub, const std::string& name) const {
    auto t = client::ReadNpy(Path(absl::StrCat(sub, "/", name, ".npy")));
    EXPECT_TRUE(t.ok()) << sub << "/" << name << ": " << t.status();
    if (!t.ok()) return "";
    return std::string(reinterpret_cast<const char*>(t->data()), t->num_bytes());
  }

  testing_harness::Harness h_;
  std::string dir_;
};

TEST_F(LossctlTwoPhaseTest, TheBackwardWritesTheOnePhaseGradients) {
  Result fwd = Lossctl(absl::StrCat("compute ", Inputs(), " --keep_ms=60000 --want=entropy",
                                    " --out_dir=", Path("fwd")));
  ASSERT_EQ(fwd.code, 0) << fwd.output;
  const size_t at = fwd.output.find("ticket      ");
  ASSERT_NE(at, std::string::npos) << fwd.output;
  const size_t begin = at + std::strlen("ticket      ");
  const std::string ticket = fwd.output.substr(begin, fwd.output.find(' ', begin) - begin);
  ASSERT_EQ(ticket.rfind("t-", 0), 0u) << fwd.output;
  EXPECT_NE(fwd.output.find("lossctl compute --ticket=" + ticket), std::string::npos);

  // What the ticket holds may not be given again.
  Result with_x = Lossctl(absl::StrCat("compute --ticket=", ticket, " --dlogp=",
                                       Path("dlogp.npy"), " --x=", Path("x.npy")));
  EXPECT_EQ(with_x.code, 1) << with_x.output;
  EXPECT_NE(with_x.output.find("with --x: a backward sends only --dlogp"), std::string::npos)
      << with_x.output;

  Result back = Lossctl(absl::StrCat("compute --ticket=", ticket, " --dlogp=",
                                     Path("dlogp.npy"), " --want=dx,dw --out_dir=",
                                     Path("back")));
  ASSERT_EQ(back.code, 0) << back.output;
  Result one = Lossctl(absl::StrCat("compute ", Inputs(), " --dlogp=", Path("dlogp.npy"),
                                    " --want=dx,dw,entropy --out_dir=", Path("one")));
  ASSERT_EQ(one.code, 0) << one.output;
  for (const char* name : {"dx", "dw", "logp", "scalars_loss_zloss_accuracy"}) {
    const std::string b = Bytes("back", name);
    EXPECT_FALSE(b.empty()) << name;
    EXPECT_EQ(b, Bytes("one", name)) << name;
  }
  EXPECT_EQ(Bytes("fwd", "logp"), Bytes("one", "logp"));
  EXPECT_EQ(Bytes("fwd", "entropy"), Bytes("one", "entropy"));

  Result again = Lossctl(absl::StrCat("compute --ticket=", ticket, " --dlogp=",
                                      Path("dlogp.npy")));
  EXPECT_EQ(again.code, 1) << again.output;
  EXPECT_NE(again.output.find("was consumed by its backward"), std::string::npos)
      << again.output;
}

}  // namespace
}  // namespace lossd
