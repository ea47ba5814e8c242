// SPDX-License-Identifier: Apache-2.0
// The metrics port as an HTTP server: /healthz and /readyz follow their functions, HEAD is
// answered as GET without a body, a 405 names the methods allowed, every other path or method
// and a malformed request get an answer (Debian's civetweb crashed the
// process writing its own error pages: a GET of an unknown path, or a POST of /metrics).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/metrics.h"

namespace lossd {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// Sends `request` as it is and returns what comes back until the server closes.
std::string Exchange(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return "connect failed";
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)!write(fd, request.data(), request.size());
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

std::string Get(int port, const std::string& path) {
  return Exchange(port, "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
}

TEST(MetricsHttpTest, ProbesAndEveryOtherRequestAreAnswered) {
  static std::atomic<bool> live{true}, ready{false};
  ServerMetrics metrics([] { return StateSample{}; });
  HttpProbes probes;
  probes.live = [] { return live.load(); };
  probes.ready = [] { return ready.load(); };
  auto exposer = StartMetricsExposer("127.0.0.1:0", metrics, probes);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  ASSERT_FALSE((*exposer)->GetListeningPorts().empty());
  const int port = (*exposer)->GetListeningPorts()[0];

  EXPECT_THAT(Get(port, "/healthz"), StartsWith("HTTP/1.1 200 OK\r\n"));
  std::string r = Get(port, "/readyz");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 503 Service Unavailable\r\n"));
  EXPECT_THAT(r, HasSubstr("\r\n\r\nnot ready\n"));
  ready = true;
  EXPECT_THAT(Get(port, "/readyz"), StartsWith("HTTP/1.1 200 OK\r\n"));
  live = false;
  r = Get(port, "/healthz");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 503 Service Unavailable\r\n"));
  EXPECT_THAT(r, HasSubstr("\r\n\r\nunhealthy\n"));
  live = true;

  r = Get(port, "/metrics");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("process_resident_memory_bytes"));
  EXPECT_THAT(Get(port, "/favicon.ico"), StartsWith("HTTP/1.1 404 Not Found\r\n"));
  EXPECT_THAT(Get(port, "/../../etc/passwd"), StartsWith("HTTP/1.1 404 Not Found\r\n"));
  r = Exchange(port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 405 Method Not Allowed\r\n"));
  EXPECT_THAT(r, HasSubstr("\r\nAllow: GET, HEAD\r\n"));
  r = Exchange(port, "DELETE /readyz HTTP/1.1\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 405 Method Not Allowed\r\n"));
  EXPECT_THAT(r, HasSubstr("\r\nAllow: GET, HEAD\r\n"));
  EXPECT_THAT(Get(port, "/readyz"), Not(HasSubstr("Allow:")));
  EXPECT_THAT(Exchange(port, "GARBAGE\r\n\r\n"), StartsWith("HTTP/1.1 400 "));
  EXPECT_THAT(Exchange(port, "GET /metrics HTTP/9.9\r\n\r\n"), StartsWith("HTTP/1.1 505 "));
  // Still serving after all of that.
  EXPECT_THAT(Get(port, "/metrics"), StartsWith("HTTP/1.1 200 OK\r\n"));
}

// HEAD is answered as GET would be, status and headers, with no body: probes and load
// balancers that check with HEAD see the same 200 or 503.
TEST(MetricsHttpTest, HeadAnswersLikeGetWithoutABody) {
  static std::atomic<bool> ready{true};
  ServerMetrics metrics([] { return StateSample{}; });
  HttpProbes probes;
  probes.live = [] { return true; };
  probes.ready = [] { return ready.load(); };
  auto exposer = StartMetricsExposer("127.0.0.1:0", metrics, probes);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  const int port = (*exposer)->GetListeningPorts()[0];
  auto head = [port](const std::string& path) {
    return Exchange(port, "HEAD " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  };

  std::string r = head("/healthz");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("\r\nContent-Length: 3\r\n"));  // GET's "ok\n"
  EXPECT_THAT(r, EndsWith("\r\n\r\n"));                     // and no body
  ready = false;
  r = head("/readyz");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 503 Service Unavailable\r\n"));
  EXPECT_THAT(r, EndsWith("\r\n\r\n"));
  ready = true;
  EXPECT_THAT(head("/readyz"), StartsWith("HTTP/1.1 200 OK\r\n"));
  r = head("/metrics");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(r, EndsWith("\r\n\r\n"));
  r = head("/favicon.ico");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 404 Not Found\r\n"));
  EXPECT_THAT(r, EndsWith("\r\n\r\n"));
  EXPECT_THAT(Get(port, "/metrics"), HasSubstr("process_resident_memory_bytes"));
}

}  // namespace
}  // namespace lossd
