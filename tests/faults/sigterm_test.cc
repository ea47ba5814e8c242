// SPDX-License-Identifier: Apache-2.0
// SIGTERM during load on the real server binary (//service:lossd, CPU backend, free ports):
// while clients run computes, the process gets SIGTERM. Every call must end OK with the full,
// correct result (bit-identical to the answer before the signal) or fail with UNAVAILABLE or
// CANCELLED; never a partial result presented as complete. The process must exit 0.
// With --head_export_dir, the hosted heads outlive the process: exported on drain, imported
// by the next one.
#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"
#include "testing/server_harness.h"

namespace lossd {
namespace {

using testing_harness::ComputeReply;
using testing_harness::HeaderFor;
using testing_harness::PartsFor;
using testing_harness::RunCompute;

std::string ServerBinary() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return std::string(srcdir ? srcdir : ".") + "/" + (workspace ? workspace : "lossd") +
         "/service/lossd";
}

// The server as a child process; its stdout is read for the port it picked.
class ServerProcess {
 public:
  bool Start(const std::vector<std::string>& args) {
    int out[2];
    if (pipe(out) != 0) return false;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      std::vector<char*> argv;
      const std::string bin = ServerBinary();
      argv.push_back(const_cast<char*>(bin.c_str()));
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(bin.c_str(), argv.data());
      std::perror("execv");
      _exit(127);
    }
    close(out[1]);
    // "lossd 0.1.0 listening on port N ..." within 30 s.
    std::string line;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    while (std::chrono::steady_clock::now() < until) {
      char c;
      ssize_t n = read(out[0], &c, 1);
      if (n == 1) {
        if (c == '\n') break;
        line.push_back(c);
      } else if (n == 0) {
        break;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    stdout_fd_ = out[0];
    const size_t at = line.find("listening on port ");
    if (at == std::string::npos) {
      ADD_FAILURE() << "the server did not say its port; first line: '" << line << "'";
      return false;
    }
    port_ = std::atoi(line.c_str() + at + std::strlen("listening on port "));
    return port_ > 0;
  }

  void Signal(int sig) { kill(pid_, sig); }

  // The exit status, or -1 when it has not exited within `seconds`.
  int WaitExit(double seconds) {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(static_cast<int>(seconds * 1000));
    while (std::chrono::steady_clock::now() < until) {
      int status = 0;
      pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        if (WIFEXITED(status)) return WEXITSTATUS(status);
        return 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (stdout_fd_ >= 0) close(stdout_fd_);
  }

  int port() const { return port_; }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  int stdout_fd_ = -1;
};

TEST(SigtermTest, InFlightComputesFinishOrFailCleanlyAndTheProcessExitsZero) {
  ServerProcess server;
  ASSERT_TRUE(server.Start({"--backend=cpu", "--port=0", "--address=127.0.0.1",
                            "--metrics_port=0", "--threads=2", "--drain_seconds=20"}));
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server.port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Loss::NewStub(channel);

  // One problem whose compute takes tens of milliseconds, so that calls are in flight (some
  // uploading, some computing, some sending) when the signal comes.
  RandomProblemSpec s;
  s.bt = 128;
  s.h = 64;
  s.v = 3000;
  s.seed = 17;
  s.ignore_fraction = 0.1;
  RandomProblem rp = RandomProblem::Make(s);
  const v1::ComputeHeader header = HeaderFor(rp);
  const std::vector<v1::ComputeRequest> parts = PartsFor(rp, 64 << 10);

  // The answer, checked against the float64 reference once; every later OK must equal it.
  ComputeReply want = RunCompute(*stub, header, parts);
  ASSERT_TRUE(testing_harness::ReplyMatchesReference(rp, want, s.dtype));

  std::atomic<bool> signalled{false};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::map<std::string, int> outcomes;  // "before|after:CODE"
  std::vector<std::string> problems;
  auto client = [&]() {
    // Each client its own channel: a draining server closes connections one by one.
    auto ch = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server.port()),
                                  grpc::InsecureChannelCredentials());
    auto st = v1::Loss::NewStub(ch);
    for (int i = 0; i < 1000 && !stop.load(); ++i) {
      const bool after = signalled.load();
      ComputeReply r = RunCompute(*st, header, parts, 30);
      const grpc::StatusCode code = r.status.error_code();
      std::lock_guard<std::mutex> lock(mu);
      outcomes[absl::StrCat(after || signalled.load() ? "after:" : "before:", code)]++;
      if (code == grpc::StatusCode::OK) {
        if (r.summary.loss() != want.summary.loss() || r.tensors != want.tensors) {
          problems.push_back("an OK reply differs from the answer (partial or wrong result)");
        }
      } else if (code != grpc::StatusCode::UNAVAILABLE && code != grpc::StatusCode::CANCELLED) {
        problems.push_back(absl::StrCat("unexpected status ", code, ": ",
                                        r.status.error_message()));
      } else if (!after && !signalled.load()) {
        problems.push_back(absl::StrCat("status ", code, " before the signal: ",
                                        r.status.error_message()));
      }
      if (code != grpc::StatusCode::OK && signalled.load()) return;  // the server is gone
    }
  };
  std::vector<std::thread> clients;
  for (int i = 0; i < 6; ++i) clients.emplace_back(client);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  signalled.store(true);
  server.Signal(SIGTERM);
  const int exit_code = server.WaitExit(60);
  stop.store(true);
  for (auto& t : clients) t.join();

  EXPECT_EQ(exit_code, 0) << "lossd did not exit 0 after SIGTERM (-1: still running)";
  std::string summary;
  int ok_before = 0;
  for (const auto& [k, n] : outcomes) {
    summary += absl::StrCat(k, "=", n, " ");
    if (k == "before:0") ok_before = n;
  }
  EXPECT_GT(ok_before, 0) << "no compute finished before the signal: " << summary;
  for (const std::string& p : problems) ADD_FAILURE() << p;
  std::printf("outcomes (code 0 = OK, 1 = CANCELLED, 14 = UNAVAILABLE): %s\n", summary.c_str());
}

// A hosted head's state as ExportHead streams it, by tensor id (empty on failure).
std::map<int, std::string> ExportAll(v1::Loss::Stub& stub, const std::string& head,
                                     v1::ExportHeader* header) {
  grpc::ClientContext ctx;
  v1::ExportHeadRequest r;
  r.set_head(head);
  auto reader = stub.ExportHead(&ctx, r);
  v1::ExportHeadResponse m;
  std::map<int, std::string> out;
  while (reader->Read(&m)) {
    if (m.has_header()) *header = m.header();
    if (m.has_part()) out[m.part().tensor()] += m.part().data();
  }
  const grpc::Status s = reader->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  return s.ok() ? out : std::map<int, std::string>{};
}

TEST(SigtermTest, HeadsAreExportedOnDrainAndImportedByTheNextProcess) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/heads";
  std::filesystem::remove_all(dir);
  const std::vector<std::string> args = {"--backend=cpu", "--port=0", "--address=127.0.0.1",
                                         "--metrics_port=0", "--threads=2",
                                         "--drain_seconds=1", "--head_export_dir=" + dir};
  RandomProblemSpec s;
  s.bt = 47, s.h = 31, s.v = 123;
  s.dtype = DType::kF32;
  s.seed = 23;
  RandomProblem rp = RandomProblem::Make(s);
  std::map<int, std::string> before;
  v1::ExportHeader before_header;
  {
    ServerProcess server;
    ASSERT_TRUE(server.Start(args));
    auto stub = v1::Loss::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", server.port()), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::CreateHeadResponse created;
    auto stream = stub->CreateHead(&ctx, &created);
    v1::CreateHeadRequest r;
    v1::HeadHeader* h = r.mutable_header();
    h->set_name("run:1/head");
    h->mutable_w()->set_dtype(v1::DTYPE_FP32);
    h->mutable_w()->add_shape(s.v);
    h->mutable_w()->add_shape(s.h);
    h->set_compute_dtype(v1::DTYPE_FP32);
    h->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
    stream->Write(r);
    v1::CreateHeadRequest part;
    part.mutable_part()->set_tensor(v1::TENSOR_HEAD_MASTER_W);
    part.mutable_part()->set_data(rp.w.data(), rp.w.size());
    stream->Write(part);
    stream->WritesDone();
    const grpc::Status cs = stream->Finish();
    ASSERT_TRUE(cs.ok()) << cs.error_message();
    v1::ComputeHeader ch = HeaderFor(rp);
    ch.clear_w();
    ch.mutable_outputs()->set_dw(false);
    ch.mutable_outputs()->set_db(false);
    ch.set_head("run:1/head");
    ASSERT_TRUE(RunCompute(*stub, ch, PartsFor(rp, 4096, false)).status.ok());
    grpc::ClientContext sctx;
    v1::StepRequest step;
    step.set_head("run:1/head");
    step.set_world_size(1);
    v1::StepResponse stepped;
    ASSERT_TRUE(stub->Step(&sctx, step, &stepped).ok());
    ASSERT_EQ(stepped.version(), 1u);
    before = ExportAll(*stub, "run:1/head", &before_header);
    ASSERT_FALSE(before.empty());
    server.Signal(SIGTERM);
    EXPECT_EQ(server.WaitExit(60), 0);
  }
  const std::string file = dir + "/run%3A1%2Fhead.lossd-head";
  ASSERT_TRUE(std::filesystem::exists(file)) << "no export in " << dir;

  ServerProcess next;
  ASSERT_TRUE(next.Start(args));
  auto stub = v1::Loss::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", next.port()),
                                                    grpc::InsecureChannelCredentials()));
  EXPECT_FALSE(std::filesystem::exists(file)) << "an imported file is deleted";
  grpc::ClientContext ctx;
  v1::HeadRequest r;
  r.set_head("run:1/head");
  v1::HeadInfo info;
  const grpc::Status is = stub->GetHeadInfo(&ctx, r, &info);
  ASSERT_TRUE(is.ok()) << is.error_message();
  EXPECT_EQ(info.version(), 1u);
  EXPECT_EQ(info.optimizer_step(), 1);
  EXPECT_NE(info.instance(), before_header.instance()) << "a new process, a new instance";
  // A rank still naming the instance before the restart is told the head is here.
  grpc::ClientContext sctx;
  v1::StepRequest step;
  step.set_head("run:1/head");
  step.set_version(1);
  step.set_world_size(1);
  step.set_head_instance(before_header.instance());
  v1::StepResponse stepped;
  const grpc::Status ss = stub->Step(&sctx, step, &stepped);
  EXPECT_EQ(ss.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(ss.error_message().find(absl::StrCat(
                "head 'run:1/head' is here: this server imported it as it started, from the "
                "export instance '", before_header.instance(), "' wrote as it stopped "
                "(--head_export_dir), at version 1")),
            std::string::npos)
      << ss.error_message();
  EXPECT_NE(ss.error_message().find("call HeadInfo (head_info)"), std::string::npos);
  v1::ExportHeader after_header;
  EXPECT_EQ(ExportAll(*stub, "run:1/head", &after_header), before);
  next.Signal(SIGTERM);
  EXPECT_EQ(next.WaitExit(60), 0);
}

}  // namespace
}  // namespace lossd
