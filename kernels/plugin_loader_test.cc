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

// The fake plugins' paths, from the test's arguments (see BUILD).
std::string g_no_abi, g_next_abi, g_this_abi;

std::string Absolute(const std::string& path) {
  char* real = realpath(path.c_str(), nullptr);
  std::string out = real != nullptr ? real : path;
  std::free(real);
  return out;
}

TEST(PluginLoaderTest, PluginWithoutAbiVersionIsRefusedBeforeItsFactory) {
  auto b = LoadCudaBackend(Absolute(g_no_abi), DefaultCudaOptions());
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(b.status())) << b.status();
  EXPECT_NE(b.status().message().find("exports no LossdCudaAbiVersion: it predates the "
                                      "versioned plugin ABI; this server needs ABI version 1"),
            std::string::npos)
      << b.status();
  EXPECT_FALSE(ProbeCudaPlugin(Absolute(g_no_abi)).ok());
}

TEST(PluginLoaderTest, PluginOfAnotherAbiIsRefusedBeforeItsFactory) {
  auto b = LoadCudaBackend(Absolute(g_next_abi), DefaultCudaOptions());
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(b.status())) << b.status();
  EXPECT_NE(b.status().message().find("was built for plugin ABI version 2; this server needs "
                                      "version 1"),
            std::string::npos)
      << b.status();
  // The probe reports the number rather than refusing: --version prints it.
  absl::StatusOr<CudaPluginProbe> p = ProbeCudaPlugin(Absolute(g_next_abi));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->abi_version, LOSSD_CUDA_ABI_VERSION + 1);
  EXPECT_EQ(p->path, Absolute(g_next_abi));
}

TEST(PluginLoaderTest, PluginOfThisAbiReachesItsFactory) {
  auto b = LoadCudaBackend(Absolute(g_this_abi), DefaultCudaOptions());
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::IsInternal(b.status())) << b.status();
  EXPECT_NE(b.status().message().find("the fake plugin's factory was called"), std::string::npos)
      << b.status();
  absl::StatusOr<CudaPluginProbe> p = ProbeCudaPlugin(Absolute(g_this_abi));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->abi_version, LOSSD_CUDA_ABI_VERSION);
}

}  // namespace
}  // namespace lossd

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s NO_ABI.so NEXT_ABI.so THIS_ABI.so\n", argv[0]);
    return 2;
  }
  lossd::g_no_abi = argv[1];
  lossd::g_next_abi = argv[2];
  lossd::g_this_abi = argv[3];
  return RUN_ALL_TESTS();
}
