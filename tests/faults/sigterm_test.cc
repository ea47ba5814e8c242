// SIGTERM during load on the real server binary (//service:lossd, CPU backend, free ports):
// while clients run computes, the process gets SIGTERM. Every call must end OK with the full,
// correct result (bit-identical to the answer before the signal) or fail with UNAVAILABLE or
// CANCELLED; never a partial result presented as complete. The process must exit 0.
#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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

}  // namespace
}  // namespace lossd
