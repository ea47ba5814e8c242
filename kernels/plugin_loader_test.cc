// Tests of the CUDA plugin loader that need neither CUDA nor the plugin: the search order and
// the status codes for a missing or broken plugin file.
#include "kernels/plugin_loader.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(PluginLoaderTest, SearchOrder) {
  setenv("RUNFILES_DIR", "/some/runfiles", 1);
  const std::vector<std::string> c = CudaPluginCandidates("/given/liblossd_cuda.so");
  ASSERT_EQ(c.size(), 5u);
  EXPECT_EQ(c[0], "/given/liblossd_cuda.so");
  EXPECT_NE(c[1].find("/liblossd_cuda.so"), std::string::npos);
  EXPECT_EQ(c[1].find("/lib/liblossd_cuda.so"), std::string::npos);
  EXPECT_NE(c[2].find("/lib/liblossd_cuda.so"), std::string::npos);
  EXPECT_EQ(c[3], "/some/runfiles/lossd/kernels/cuda/liblossd_cuda.so");
  EXPECT_NE(c[4].find(".runfiles/lossd/kernels/cuda/liblossd_cuda.so"), std::string::npos);
  // Without a path and without RUNFILES_DIR, three candidates remain.
  unsetenv("RUNFILES_DIR");
  EXPECT_EQ(CudaPluginCandidates("").size(), 3u);
}

TEST(PluginLoaderTest, MissingPluginIsNotFound) {
  unsetenv("RUNFILES_DIR");
  auto b = LoadCudaBackend("/nonexistent/liblossd_cuda.so", DefaultCudaOptions());
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::IsNotFound(b.status())) << b.status();
  EXPECT_NE(b.status().message().find("/nonexistent/liblossd_cuda.so"), std::string::npos);
}

TEST(PluginLoaderTest, BrokenPluginIsFailedPrecondition) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/broken_plugin.so";
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("not an ELF file", f);
  std::fclose(f);
  auto b = LoadCudaBackend(path, DefaultCudaOptions());
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(b.status())) << b.status();
  EXPECT_NE(b.status().message().find("dlopen"), std::string::npos) << b.status();
  unlink(path.c_str());
}

}  // namespace
}  // namespace lossd
