// SPDX-License-Identifier: Apache-2.0
// The drain's order, seen from outside the real binary (//service:lossd, CPU backend): after
// SIGTERM, /readyz answers 503 and gRPC health says NOT_SERVING on the main port and on
// --health_port at once, while a call on a new connection is still served through
// --shutdown_grace; only then does the port close; the process exits 0. A load balancer that
// follows the probes drops the server before it refuses a call.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/lossd/v1/lossd.grpc.pb.h"

namespace lossd {
namespace {

using Clock = std::chrono::steady_clock;

std::string ServerBinary() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return std::string(srcdir ? srcdir : ".") + "/" + (workspace ? workspace : "lossd") +
         "/service/lossd";
}

// A port free on loopback now (the kernel's pick, let go at once).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  socklen_t n = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &n);
  close(fd);
  return ntohs(sa.sin_port);
}

// The number after `key` in `line` ("metrics on port 123" -> 123), 0 where it is missing.
int NumberAfter(const std::string& line, const std::string& key) {
  const size_t at = line.find(key);
  int n = 0;
  if (at == std::string::npos) return 0;
  const size_t from = at + key.size();
  const size_t to = line.find_first_not_of("0123456789", from);
  return absl::SimpleAtoi(line.substr(from, to - from), &n) ? n : 0;
}

// lossd as a child process; its stdout's first line gives the ports.
class Lossd {
 public:
  bool Start(const std::vector<std::string>& args) {
    int out[2];
    if (pipe(out) != 0) return false;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      const std::string bin = ServerBinary();
      std::vector<char*> argv{const_cast<char*>(bin.c_str())};
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(bin.c_str(), argv.data());
      _exit(127);
    }
    close(out[1]);
    std::string line;
    for (char c; read(out[0], &c, 1) == 1 && c != '\n';) line.push_back(c);
    stdout_fd_ = out[0];  // kept open: a write to a closed pipe would kill lossd
    port_ = NumberAfter(line, "listening on port ");
    metrics_port_ = NumberAfter(line, "metrics on port ");
    health_port_ = NumberAfter(line, "health on port ");
    if (port_ == 0 || metrics_port_ == 0 || health_port_ == 0) {
      ADD_FAILURE() << "lossd's first line names no ports: '" << line << "'";
      return false;
    }
    return true;
  }
  void Signal(int sig) { kill(pid_, sig); }
  // The exit status, or -1 when it has not exited within `seconds`.
  int WaitExit(int seconds) {
    const auto until = Clock::now() + std::chrono::seconds(seconds);
    while (Clock::now() < until) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  ~Lossd() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (stdout_fd_ >= 0) close(stdout_fd_);
  }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  int health_port() const { return health_port_; }

 private:
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  int port_ = 0, metrics_port_ = 0, health_port_ = 0;
};

// A channel with a connection of its own (gRPC shares connections between channels to the
// same address unless told not to): a call on it shows whether the listener still accepts.
std::shared_ptr<grpc::Channel> NewConnection(int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials(), args);
}

// grpc.health.v1 Check for "" on `port`: 1 SERVING, 2 NOT_SERVING, -1 no answer.
int Health(int port) {
  grpc::GenericStub stub(NewConnection(port));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1), response;
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  if (!status.ok()) return -1;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // HealthCheckResponse: field 1 (status), a varint: 08 <status>; nothing at all is UNKNOWN.
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0;
}

// A Loss call (ServerInfo) on a new connection; its status.
grpc::Status ServerInfoCall(int port) {
  auto stub = lossd::v1::Loss::NewStub(NewConnection(port));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  lossd::v1::ServerInfoRequest request;
  lossd::v1::ServerInfoResponse response;
  return stub->ServerInfo(&ctx, request, &response);
}

// Whether a TCP connection to the port on loopback is accepted.
bool Accepts(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
  close(fd);
  return ok;
}

// The status line's code of GET `path` on the metrics port ("HTTP/1.1 503 ..." -> 503), 0
// without an answer.
int HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return 0;
  }
  const std::string request =
      "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string out;
  char buf[512];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return NumberAfter(out, "HTTP/1.1 ");
}

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

TEST(LossdDrainTest, NotReadyFirstThenCallsStillServedThroughTheGraceThenThePortCloses) {
  constexpr double kGrace = 3;
  Lossd lossd;
  ASSERT_TRUE(lossd.Start({"--backend=cpu", "--threads=1", "--address=127.0.0.1", "--port=0",
                           "--metrics_address=127.0.0.1",
                           absl::StrCat("--metrics_port=", FreePort()),
                           absl::StrCat("--health_port=", FreePort()), "--shutdown_grace=3s",
                           "--drain_seconds=5"}));
  ASSERT_EQ(Health(lossd.port()), 1);
  ASSERT_EQ(Health(lossd.health_port()), 1);
  ASSERT_EQ(HttpGet(lossd.metrics_port(), "/readyz"), 200);

  lossd.Signal(SIGTERM);
  const auto signalled = Clock::now();
  // Not ready on every probe, promptly.
  int main_health = 1, health_port = 1, readyz = 200;
  while (SecondsSince(signalled) < 1 &&
         (main_health != 2 || health_port != 2 || readyz != 503)) {
    main_health = Health(lossd.port());
    health_port = Health(lossd.health_port());
    readyz = HttpGet(lossd.metrics_port(), "/readyz");
  }
  EXPECT_EQ(main_health, 2) << "the main port's health is not NOT_SERVING 1 s after SIGTERM";
  EXPECT_EQ(health_port, 2) << "--health_port is not NOT_SERVING 1 s after SIGTERM";
  EXPECT_EQ(readyz, 503) << "/readyz is not 503 1 s after SIGTERM";

  // Within the grace a new connection is still accepted and its call served.
  const grpc::Status during = ServerInfoCall(lossd.port());
  const double served_at = SecondsSince(signalled);
  EXPECT_TRUE(during.ok()) << during.error_code() << ": " << during.error_message();
  EXPECT_LT(served_at, kGrace) << "the call came too late to show the grace";

  // Then the listener closes: not before the grace, and well before the drain's end.
  while (SecondsSince(signalled) < kGrace + 5 && Accepts(lossd.port())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double closed_at = SecondsSince(signalled);
  EXPECT_FALSE(Accepts(lossd.port())) << "the port still accepts " << closed_at
                                      << " s after SIGTERM";
  EXPECT_GE(closed_at, kGrace - 0.1) << "the port closed before --shutdown_grace was over";
  EXPECT_EQ(lossd.WaitExit(20), 0);
}

// --shutdown_grace=0: no grace; the port closes at once.
TEST(LossdDrainTest, ZeroGraceClosesThePortAtOnce) {
  Lossd lossd;
  ASSERT_TRUE(lossd.Start({"--backend=cpu", "--threads=1", "--address=127.0.0.1", "--port=0",
                           "--metrics_address=127.0.0.1",
                           absl::StrCat("--metrics_port=", FreePort()),
                           absl::StrCat("--health_port=", FreePort()), "--shutdown_grace=0",
                           "--drain_seconds=5"}));
  lossd.Signal(SIGTERM);
  const auto signalled = Clock::now();
  while (SecondsSince(signalled) < 5 && Accepts(lossd.port())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_LT(SecondsSince(signalled), 1.5);
  EXPECT_EQ(lossd.WaitExit(20), 0);
}

}  // namespace
}  // namespace lossd
