// SPDX-License-Identifier: Apache-2.0
// Regression test for the cuBLAS / civetweb trap: with the CUDA plugin (and so cuBLAS)
// loaded into the process, a prometheus-cpp Exposer must still start and serve /metrics.
// Linked statically, cuBLAS's TLS leaves civetweb's 100 KiB thread stacks too small and the
// Exposer fails with "null context when constructing CivetServer". Runs with or without a GPU.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/plugin_loader.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace lossd {
namespace {

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req =
        "GET " + path + " HTTP/1.0\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, n);
    }
  }
  close(fd);
  return response;
}

TEST(PluginExposerTest, MetricsServeWithTheCudaPluginLoaded) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = LoadCudaBackend("", DefaultCudaOptions());
  // No GPU on this machine is fine; the library itself must have loaded.
  ASSERT_TRUE(backend.ok() || absl::IsUnavailable(backend.status())) << backend.status();
  if (!backend.ok()) {
    EXPECT_NE(backend.status().message().find(LOSSD_CUDA_NO_GPU_PREFIX), std::string::npos)
        << backend.status();
  }
  bool loaded = false;
  for (const std::string& c : CudaPluginCandidates("")) {
    if (dlopen(c.c_str(), RTLD_NOW | RTLD_NOLOAD) != nullptr) loaded = true;
  }
  ASSERT_TRUE(loaded) << "liblossd_cuda.so is not loaded in this process";

  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>("127.0.0.1:0");
  } catch (const std::exception& e) {
    FAIL() << "prometheus::Exposer failed to start with the CUDA plugin loaded: " << e.what();
  }
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("lossd_plugin_test_total")
      .Help("Counts nothing; proves the exposer serves.")
      .Register(*registry)
      .Add({})
      .Increment(3);
  exposer->RegisterCollectable(registry);
  const std::vector<int> ports = exposer->GetListeningPorts();
  ASSERT_EQ(ports.size(), 1u);
  const std::string body = HttpGet(ports[0], "/metrics");
  EXPECT_NE(body.find("200 OK"), std::string::npos) << body;
  EXPECT_NE(body.find("lossd_plugin_test_total 3"), std::string::npos) << body;
  if (backend.ok()) {
    EXPECT_EQ((*backend)->Info().name, "cuda");
  }
}

}  // namespace
}  // namespace lossd
