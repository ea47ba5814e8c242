// SPDX-License-Identifier: Apache-2.0
// The TLS set-up at start (a key that is not the certificate's is named as such, not as a port
// that cannot listen), the warning for a listener open to anyone, and gRPC's per-connection
// TLS failures logged as one rate-limited WARNING instead of an ERROR per connection.
#include "service/tls.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/log.h"
#include "spdlog/sinks/ostream_sink.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

// A self-signed certificate and its key, and a second key, made by openssl in a temporary
// folder.
class Keys {
 public:
  Keys() {
    dir_ = ::testing::TempDir() + "/tls_keys";
    const std::string script = "set -e; mkdir -p '" + dir_ + "'; cd '" + dir_ + "'; " +
                               "openssl req -x509 -newkey rsa:2048 -nodes -keyout server.key "
                               "-out server.pem -days 2 -subj /CN=localhost >/dev/null 2>&1; "
                               "openssl genrsa -out other.key 2048 >/dev/null 2>&1; "
                               "echo 'not a key' > garbage.key";
    ok_ = std::system(script.c_str()) == 0;
  }
  bool ok() const { return ok_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  std::string dir_;
  bool ok_ = false;
};

TEST(TlsTest, AKeyThatIsNotTheCertificatesIsNamedAtStart) {
  Keys k;
  ASSERT_TRUE(k.ok()) << "openssl could not make the test keys";
  EXPECT_TRUE(MakeServerCredentials(k.Path("server.pem"), k.Path("server.key"), "").ok());

  auto other = MakeServerCredentials(k.Path("server.pem"), k.Path("other.key"), "");
  ASSERT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument) << other.status();
  EXPECT_THAT(std::string(other.status().message()),
              HasSubstr("--tls_key " + k.Path("other.key") +
                        " is not the private key of the certificate in --tls_cert " +
                        k.Path("server.pem")));

  auto garbage = MakeServerCredentials(k.Path("server.pem"), k.Path("garbage.key"), "");
  ASSERT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(garbage.status().message()),
              HasSubstr("--tls_key " + k.Path("garbage.key") + " holds no PEM private key"));

  // The key given as the certificate.
  auto swapped = MakeServerCredentials(k.Path("server.key"), k.Path("server.pem"), "");
  ASSERT_EQ(swapped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(swapped.status().message()),
              HasSubstr("--tls_cert " + k.Path("server.key") + " holds no PEM certificate"));
}

TEST(TlsTest, OpenListenerWarningOnlyOffLoopbackWithNeitherTlsNorTokens) {
  const std::string w = OpenListenerWarning("0.0.0.0", 50051, false, false);
  EXPECT_THAT(w, StartsWith("gRPC listens on 0.0.0.0:50051 (every address of this host) in "
                            "plaintext and without bearer tokens"));
  EXPECT_THAT(w, HasSubstr("--tls_cert"));
  EXPECT_THAT(w, HasSubstr("--auth_tokens_file"));
  EXPECT_THAT(OpenListenerWarning("10.1.2.3", 7, false, false),
              StartsWith("gRPC listens on 10.1.2.3:7 in plaintext"));
  EXPECT_THAT(OpenListenerWarning("[::]", 7, false, false), HasSubstr("every address"));
  for (const char* loopback : {"127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"}) {
    EXPECT_THAT(OpenListenerWarning(loopback, 50051, false, false), IsEmpty()) << loopback;
  }
  EXPECT_THAT(OpenListenerWarning("0.0.0.0", 50051, true, false), IsEmpty());
  EXPECT_THAT(OpenListenerWarning("0.0.0.0", 50051, false, true), IsEmpty());
}

TEST(TlsTest, IntervalLimiterAdmitsOncePerIntervalAndCountsTheRest) {
  IntervalLimiter l(absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(l.Admit(t0), 0);
  EXPECT_EQ(l.Admit(t0 + absl::Seconds(1)), -1);
  EXPECT_EQ(l.Admit(t0 + absl::Seconds(9)), -1);
  EXPECT_EQ(l.Admit(t0 + absl::Seconds(10)), 2);
  EXPECT_EQ(l.Admit(t0 + absl::Seconds(30)), 0);
}

TEST(TlsTest, OnlyTheTlsLayersConnectionFailuresAreLimited) {
  EXPECT_TRUE(IsTlsConnectionFailure(
      "src/core/tsi/ssl_transport_security.cc",
      "Handshake failed with fatal error SSL_ERROR_SSL: error:0A00010B:SSL routines::wrong "
      "version number."));
  EXPECT_FALSE(IsTlsConnectionFailure("src/core/lib/iomgr/tcp_server_posix.cc",
                                      "Failed to add port to server"));
}

// Sends `bytes` to the port on loopback and reads until the server closes.
void SendAndDrain(int port, const std::string& bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    (void)!write(fd, bytes.data(), bytes.size());
    char buf[1024];
    while (read(fd, buf, sizeof(buf)) > 0) {
    }
  }
  close(fd);
}

// Plaintext HTTP and plaintext gRPC's preface at a TLS port, five times: one WARNING naming
// what happened, no ERROR from gRPC.
TEST(TlsTest, PlaintextClientsAtTheTlsPortLogOneWarningPerInterval) {
  Keys k;
  ASSERT_TRUE(k.ok()) << "openssl could not make the test keys";
  auto out = std::make_shared<std::ostringstream>();
  LogOptions lo;
  InitLogging(lo, std::make_shared<spdlog::sinks::ostream_sink_mt>(*out));
  RouteGrpcLogLimitingTlsFailures(absl::Hours(1));
  auto creds = MakeServerCredentials(k.Path("server.pem"), k.Path("server.key"), "");
  ASSERT_TRUE(creds.ok()) << creds.status();
  grpc::CallbackGenericService unknown;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", *creds, &port);
  builder.RegisterCallbackGenericService(&unknown);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  for (int i = 0; i < 5; ++i) {
    SendAndDrain(port, i % 2 == 0 ? "GET / HTTP/1.1\r\nHost: x\r\n\r\n"
                                  : "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
  }
  server->Shutdown(std::chrono::system_clock::now());
  server->Wait();
  const std::string log = out->str();
  int warnings = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (line.find("TLS handshake failed") != absl::string_view::npos) {
      ++warnings;
      EXPECT_THAT(std::string(line), HasSubstr("WARNING"));
      EXPECT_THAT(std::string(line), HasSubstr("not_logged_since_last=0"));
    }
    EXPECT_THAT(std::string(line), Not(HasSubstr("Z ERROR "))) << log;  // the line's level
  }
  EXPECT_EQ(warnings, 1) << log;
}

}  // namespace
}  // namespace lossd
