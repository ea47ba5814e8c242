// SPDX-License-Identifier: Apache-2.0
// Tests of the CUDA plugin loader and the plugin ABI that need neither CUDA nor the plugin: the
// search order, the status codes for a missing, broken or mismatched plugin file, and every
// function of the C table (fake_plugin.cc's CPU backend behind it) against the CPU backend
// called directly.
#include "kernels/plugin_loader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optimizer.h"
#include "kernels/plugin_abi.h"
#include "testing/optimizer_cases.h"
#include "testing/plugin_cases.h"
#include "testing/test_util.h"

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

// The fake plugins' paths (fake_plugin.cc says what each is), from the test's arguments.
std::string g_no_entry, g_v1, g_v5, g_next_major, g_newer_minor, g_cpu, g_cpu_6_0;

std::string Absolute(const std::string& path) {
  char* real = realpath(path.c_str(), nullptr);
  std::string out = real != nullptr ? real : path;
  std::free(real);
  return out;
}

// This server's version and what it loads, as its refusals say them.
std::string Accepted() {
  return absl::StrCat("this server speaks ", LOSSD_PLUGIN_ABI_MAJOR, ".",
                      LOSSD_PLUGIN_ABI_CURRENT_MINOR, " and loads plugins of ABI ",
                      LOSSD_PLUGIN_ABI_MAJOR, ".0 to ", LOSSD_PLUGIN_ABI_MAJOR, ".",
                      LOSSD_PLUGIN_ABI_CURRENT_MINOR);
}

TEST(PluginLoaderTest, VersionsAreMajorDotMinor) {
  EXPECT_EQ(LOSSD_PLUGIN_ABI_VERSION,
            (LOSSD_PLUGIN_ABI_MAJOR << 16) | LOSSD_PLUGIN_ABI_CURRENT_MINOR);
  EXPECT_EQ(PluginAbiVersionText(LOSSD_PLUGIN_ABI_VERSION_OF(6, 0)), "6.0");
  EXPECT_EQ(PluginAbiVersionText(LOSSD_PLUGIN_ABI_VERSION_OF(7, 12)), "7.12");
  EXPECT_EQ(PluginAbiVersionText(5), "5");  // before major.minor
  EXPECT_EQ(LOSSD_PLUGIN_ABI_MAJOR_OF(5u), 5u);
  EXPECT_EQ(LOSSD_PLUGIN_ABI_MINOR_OF(5u), 0u);
  // Every minor of this major up to this server's own loads; nothing else does.
  for (uint32_t minor = 0; minor <= LOSSD_PLUGIN_ABI_CURRENT_MINOR; ++minor) {
    EXPECT_TRUE(PluginAbiLoadable(LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR, minor)));
  }
  EXPECT_FALSE(PluginAbiLoadable(
      LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR, LOSSD_PLUGIN_ABI_CURRENT_MINOR + 1)));
  EXPECT_FALSE(PluginAbiLoadable(LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR + 1, 0)));
  EXPECT_FALSE(PluginAbiLoadable(LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR - 1, 0)));
  EXPECT_FALSE(PluginAbiLoadable(5));
  EXPECT_FALSE(PluginAbiLoadable(LOSSD_PLUGIN_ABI_MAJOR));  // a bare number is never major.minor
}

TEST(PluginLoaderTest, PluginWithoutTheEntryPointIsRefused) {
  auto b = LoadCudaBackend(Absolute(g_no_entry), DefaultCudaOptions());
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(b.status())) << b.status();
  EXPECT_NE(b.status().message().find(absl::StrCat(
                "exports no LossdPluginGetApi: it is not a lossd plugin of a versioned ABI; ",
                Accepted())),
            std::string::npos)
      << b.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(ProbeCudaPlugin(Absolute(g_no_entry)).status()));
}

// The plugin at `path` was built for ABI `version` (`text` as the server writes it), one this
// server does not load: loading it is refused with FAILED_PRECONDITION naming both versions,
// while the probe reports the number rather than refusing (--version prints it), with the
// plugin's path.
void ExpectOtherAbiRefused(const std::string& path, uint32_t version, const std::string& text) {
  auto b = LoadCudaBackend(path, DefaultCudaOptions());
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(b.status())) << b.status();
  EXPECT_EQ(b.status().message(),
            absl::StrCat(path, " was built for plugin ABI version ", text, "; ", Accepted()));
  absl::StatusOr<CudaPluginProbe> p = ProbeCudaPlugin(path);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->abi_version, version);
  EXPECT_EQ(p->path, path);
}

TEST(PluginLoaderTest, VersionOnePluginIsRefusedNamingBothVersions) {
  ExpectOtherAbiRefused(Absolute(g_v1), 1, "1");
}

TEST(PluginLoaderTest, VersionFivePluginIsRefusedNamingBothVersions) {
  ExpectOtherAbiRefused(Absolute(g_v5), 5, "5");
}

TEST(PluginLoaderTest, PluginOfAnotherMajorIsRefusedNamingBothVersions) {
  ExpectOtherAbiRefused(Absolute(g_next_major),
                        LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR + 1, 0),
                        absl::StrCat(LOSSD_PLUGIN_ABI_MAJOR + 1, ".0"));
}

// A newer minor's plugin would read the server's structs past their end: refused too.
TEST(PluginLoaderTest, PluginOfANewerMinorIsRefusedNamingBothVersions) {
  ExpectOtherAbiRefused(
      Absolute(g_newer_minor),
      LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR, LOSSD_PLUGIN_ABI_CURRENT_MINOR + 1),
      absl::StrCat(LOSSD_PLUGIN_ABI_MAJOR, ".", LOSSD_PLUGIN_ABI_CURRENT_MINOR + 1));
}

// The entry point itself: its table for any minor of its major, null for another major, and
// its own version either way.
TEST(PluginLoaderTest, EntryPointAnswersEveryMinorOfItsMajor) {
  void* handle = dlopen(Absolute(g_cpu).c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(handle, nullptr) << dlerror();
  auto get = reinterpret_cast<LossdPluginGetApiFn>(dlsym(handle, LOSSD_PLUGIN_ENTRY_SYMBOL));
  ASSERT_NE(get, nullptr);
  uint32_t version = 0;
  EXPECT_EQ(get(LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR + 1, 0), &version), nullptr);
  EXPECT_EQ(version, LOSSD_PLUGIN_ABI_VERSION);
  version = 0;
  EXPECT_EQ(get(5, &version), nullptr);
  EXPECT_EQ(version, LOSSD_PLUGIN_ABI_VERSION);
  for (uint32_t minor : {0u, LOSSD_PLUGIN_ABI_CURRENT_MINOR, 99u}) {
    version = 0;
    const LossdBackendApi* api =
        get(LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR, minor), &version);
    ASSERT_NE(api, nullptr) << minor;
    EXPECT_EQ(version, LOSSD_PLUGIN_ABI_VERSION);
    EXPECT_EQ(api->abi_version, LOSSD_PLUGIN_ABI_VERSION);
    EXPECT_EQ(api->struct_size, sizeof(LossdBackendApi));
  }
  absl::StatusOr<CudaPluginProbe> p = ProbeCudaPlugin(Absolute(g_cpu));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->abi_version, LOSSD_PLUGIN_ABI_VERSION);
}

// A plugin built at an older minor than this server's (6.0) loads and computes: the functions
// and fields of 6.0 cross as they did, and a field its minor lacks (6.1's compute_path) reads
// as absent, not as whatever lies past the end of its struct.
TEST(PluginLoaderTest, PluginOfAnOlderMinorLoadsAndComputes) {
  ASSERT_GE(LOSSD_PLUGIN_ABI_CURRENT_MINOR, 1u);
  const std::string path = Absolute(g_cpu_6_0);
  absl::StatusOr<CudaPluginProbe> probe = ProbeCudaPlugin(path);
  ASSERT_TRUE(probe.ok()) << probe.status();
  EXPECT_EQ(probe->abi_version, LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR, 0));
  absl::StatusOr<std::unique_ptr<Backend>> b = LoadCudaBackend(path, DefaultCudaOptions());
  ASSERT_TRUE(b.ok()) << b.status();
  Backend& plugin = **b;
  CpuBackend direct(2);
  const BackendInfo got = plugin.Info(), want = direct.Info();
  EXPECT_EQ(got.name, "cpu");
  EXPECT_EQ(got.device, want.device);
  EXPECT_EQ(got.loss_kinds, want.loss_kinds);
  EXPECT_TRUE(got.healthy);
  EXPECT_EQ(want.compute_path, "cpu");
  EXPECT_EQ(got.compute_path, "");
  const RandomProblem rp = RandomProblem::Make(
      SpecOf(47, 31, 123, DType::kBF16, CombinedOptions(Reduction::kMean, 10), 1.0f, 61));
  const LossProblem p = rp.problem();
  HostOutputs want_out(p, DType::kBF16), got_out(p, DType::kBF16);
  LossStats want_stats, got_stats;
  ASSERT_TRUE(direct.Compute(p, want_out.outputs(), &want_stats).ok());
  const absl::Status st = plugin.Compute(p, got_out.outputs(), &got_stats);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(BitIdentical(want_out, got_out));
  ExpectSameStats(got_stats, want_stats, "6.0 plugin");
  EXPECT_EQ(plugin.WorkspaceBytes(ShapeOf(p, got_out.outputs())),
            direct.WorkspaceBytes(ShapeOf(p, want_out.outputs())));
  // 6.2's comm functions lie past the end of its table: never called, UNIMPLEMENTED naming
  // the plugin's version and the one head groups need.
  for (const absl::Status& comm :
       {plugin.CommAvailable(), plugin.NewCommId().status(),
        plugin.ConnectComm(std::string(kBackendCommIdBytes, 'x'), 2, 0, 1000).status()}) {
    EXPECT_TRUE(absl::IsUnimplemented(comm)) << comm;
    EXPECT_NE(comm.message().find("the plugin speaks ABI 6.0, which carries no head-group "
                                  "collectives; head groups on it need a plugin of ABI 6.2"),
              std::string::npos)
        << comm;
  }
}

// What loading the fake CPU plugin on `device` returns (its status).
absl::Status LoadStatusOnDevice(int32_t device) {
  LossdCudaOptions o = DefaultCudaOptions();
  o.device = device;
  return LoadCudaBackend(Absolute(g_cpu), o).status();
}

TEST(PluginLoaderTest, CreateFailuresKeepTheirCodeAndMessage) {
  const absl::Status none = LoadStatusOnDevice(-1);
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(absl::IsUnavailable(none)) << none;
  EXPECT_EQ(none.message(), Absolute(g_cpu) + ": no GPU: the fake plugin has no device -1");
  const absl::Status refused = LoadStatusOnDevice(-2);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsInternal(refused)) << refused;
  EXPECT_EQ(refused.message(), Absolute(g_cpu) + ": the fake plugin refused device -2");
}

// The CPU backend through the C boundary (the fake plugin) and called directly.
class FakePluginTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> b =
        LoadCudaBackend(Absolute(g_cpu), DefaultCudaOptions());
    ASSERT_TRUE(b.ok()) << b.status();
    plugin_ = std::move(*b);
  }
  std::unique_ptr<Backend> plugin_;
  CpuBackend direct_{2};
};

TEST_F(FakePluginTest, InfoCrosses) {
  const BackendInfo got = plugin_->Info();
  const BackendInfo want = direct_.Info();
  EXPECT_EQ(got.name, "cpu");
  EXPECT_EQ(want.compute_path, "cpu");
  EXPECT_EQ(got.compute_path, want.compute_path);  // ABI 6.1's field
  EXPECT_EQ(got.device, want.device);
  EXPECT_EQ(got.memory_total_bytes, want.memory_total_bytes);
  EXPECT_NE(got.loss_kinds, 0u);
  EXPECT_EQ(got.loss_kinds, want.loss_kinds);
  EXPECT_TRUE(got.healthy);
  EXPECT_EQ(got.memory_held_bytes, 0u);
  {
    absl::StatusOr<std::unique_ptr<BackendBuffer>> buf = plugin_->Allocate(1000);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_EQ(plugin_->Info().memory_held_bytes, 1000u);
    EXPECT_EQ(plugin_->Info().memory_peak_bytes, 1000u);
  }
  EXPECT_EQ(plugin_->Info().memory_held_bytes, 0u);
}

TEST_F(FakePluginTest, BuffersAllocateCopyAndZero) {
  absl::StatusOr<std::unique_ptr<BackendBuffer>> buf = plugin_->Allocate(100);
  ASSERT_TRUE(buf.ok()) << buf.status();
  BackendBuffer& b = **buf;
  EXPECT_EQ(b.size(), 100u);
  ASSERT_NE(b.data(), nullptr);
  std::vector<uint8_t> in(100), out(100, 0xAB);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_TRUE(plugin_->CopyToBackend(b, 0, in.data(), in.size()).ok());
  ASSERT_TRUE(plugin_->CopyFromBackend(b, 0, out.data(), out.size()).ok());
  EXPECT_EQ(in, out);
  // The CPU backend's memory is host memory: data() is where the bytes went.
  EXPECT_EQ(std::memcmp(b.data(), in.data(), in.size()), 0);
  ASSERT_TRUE(plugin_->CopyFromBackend(b, 10, out.data(), 5).ok());
  EXPECT_EQ(out[0], in[10]);
  ASSERT_TRUE(plugin_->Zero(b).ok());
  ASSERT_TRUE(plugin_->CopyFromBackend(b, 0, out.data(), out.size()).ok());
  EXPECT_EQ(out, std::vector<uint8_t>(100, 0));
}

// An error crosses as its code and its message, word for word what the backend said.
TEST_F(FakePluginTest, ErrorsKeepTheirCodeAndMessage) {
  absl::StatusOr<std::unique_ptr<BackendBuffer>> mine = plugin_->Allocate(16);
  absl::StatusOr<std::unique_ptr<BackendBuffer>> theirs = direct_.Allocate(16);
  ASSERT_TRUE(mine.ok() && theirs.ok());
  char bytes[32] = {0};
  const absl::Status want = direct_.CopyToBackend(**theirs, 8, bytes, 32);
  ASSERT_TRUE(absl::IsInvalidArgument(want)) << want;
  EXPECT_EQ(plugin_->CopyToBackend(**mine, 8, bytes, 32), want);
  EXPECT_EQ(plugin_->CopyFromBackend(**mine, 8, bytes, 32),
            direct_.CopyFromBackend(**theirs, 8, bytes, 32));
  // A buffer of another backend is refused before it reaches the plugin.
  EXPECT_TRUE(absl::IsInvalidArgument(plugin_->Zero(**theirs)));
  // Too much memory: RESOURCE_EXHAUSTED, as the backend says it.
  absl::StatusOr<std::unique_ptr<BackendBuffer>> huge = plugin_->Allocate(~size_t{0} - 8);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status(), direct_.Allocate(~size_t{0} - 8).status());
}

// The CPU backend has no collectives of its own (its groups run on gloo in the engine): a
// plugin of 6.2 carries its UNIMPLEMENTED across, word for word.
TEST_F(FakePluginTest, CommOfABackendWithoutOneCrossesAsUnimplemented) {
  EXPECT_EQ(plugin_->CommAvailable(), direct_.CommAvailable());
  EXPECT_EQ(plugin_->NewCommId().status(), direct_.NewCommId().status());
  const std::string id(kBackendCommIdBytes, 'x');
  EXPECT_EQ(plugin_->ConnectComm(id, 2, 1, 1000).status(),
            direct_.ConnectComm(id, 2, 1, 1000).status());
  EXPECT_TRUE(absl::IsUnimplemented(plugin_->CommAvailable()));
}

TEST_F(FakePluginTest, HostMemoryCrosses) {
  HostMemory* m = plugin_->host_memory();
  ASSERT_NE(m, nullptr);
  void* p = m->Allocate(256);
  ASSERT_NE(p, nullptr);
  std::memset(p, 0x5A, 256);
  m->Free(p);
  // It outlives the backend that offered it.
  plugin_.reset();
  void* q = m->Allocate(64);
  ASSERT_NE(q, nullptr);
  m->Free(q);
}

TEST_F(FakePluginTest, WorkspaceBytesAreTheBackendsOwn) {
  for (bool accumulate : {false, true}) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      const WorkspaceShape s =
          BiasedShape(47, 31, 123, dtype, accumulate ? GradOut::kAccumulated : GradOut::kWritten,
                      accumulate ? 10 : 0);
      EXPECT_EQ(plugin_->WorkspaceBytes(s), direct_.WorkspaceBytes(s));
      EXPECT_GT(plugin_->WorkspaceBytes(s), 0u);
    }
  }
}

// A Compute through the C boundary equals the CPU backend called directly, bit for bit, and
// so do its statistics (the time aside); with W in host memory or in backend memory, with
// plain gradient outputs or accumulators.
TEST_F(FakePluginTest, ComputeIsTheCpuBackendsBitForBit) {
  uint64_t seed = 40;
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (Reduction reduction : {Reduction::kMean, Reduction::kNone}) {
      for (bool resident : {false, true}) {
        const RandomProblem rp = RandomProblem::Make(
            SpecOf(47, 31, 123, dtype, CombinedOptions(reduction, 10), 1.0f, ++seed));
        LossProblem p = rp.problem();
        HostOutputs want(p, dtype, true, resident), got(p, dtype, true, resident);
        ProblemForBoth both;  // W (then the bias) in each backend's own memory when resident
        ASSERT_TRUE(PlaceForBoth(direct_, *plugin_, p, resident, &both).ok());
        LossStats want_stats, got_stats;
        want_stats.gemm_tunings = got_stats.gemm_tunings = 17;  // left alone by the backend
        ASSERT_TRUE(direct_.Compute(both.direct, want.outputs(), &want_stats).ok());
        const absl::Status st = plugin_->Compute(both.plugin, got.outputs(), &got_stats);
        const std::string where = absl::StrCat(DTypeName(dtype), " reduction ",
                                               static_cast<int>(reduction), " resident ", resident);
        ASSERT_TRUE(st.ok()) << where << ": " << st;
        EXPECT_TRUE(BitIdentical(want, got)) << where;
        ExpectSameStats(got_stats, want_stats, where);
        EXPECT_EQ(got_stats.gemm_tunings, want_stats.gemm_tunings) << where;
        EXPECT_GT(got_stats.compute_seconds, 0.0) << where;
      }
    }
  }
}

// An optimizer step through the table is the CPU backend's, bit for bit, over buffers in each
// backend's own memory (both host memory here); so is the sum of squares; errors keep their
// code and message.
TEST_F(FakePluginTest, OptimizerStepAndSumOfSquaresCross) {
  const int64_t n = 1031;
  for (const OptimizerCase& c : AllOptimizerCases()) {
    SCOPED_TRACE(c.name);
    OptimizerBuffers want = RandomOptimizerBuffers(c, n, 8), got = want;
    const std::vector<float> grad = RandomGradient(n, 9);
    // got's buffers copied into the plugin's memory, stepped there and copied back.
    std::vector<std::unique_ptr<BackendBuffer>> bufs;
    for (std::vector<float>* v : {&got.param, const_cast<std::vector<float>*>(&grad),
                                  &got.state1, &got.state2, &got.state3}) {
      absl::StatusOr<std::unique_ptr<BackendBuffer>> b = plugin_->Allocate(n * 4);
      ASSERT_TRUE(b.ok()) << b.status();
      ASSERT_TRUE(plugin_->CopyToBackend(**b, 0, v->data(), n * 4).ok());
      bufs.push_back(std::move(*b));
    }
    absl::StatusOr<std::unique_ptr<BackendBuffer>> copy = plugin_->Allocate(n * 4);
    ASSERT_TRUE(copy.ok());
    ASSERT_TRUE(plugin_->CopyToBackend(**copy, 0, got.copy.data(), n * 4).ok());
    OptimizerTensors t;
    t.n = n;
    t.param = static_cast<float*>(bufs[0]->data());
    t.grad = static_cast<const float*>(bufs[1]->data());
    t.state1 = static_cast<float*>(bufs[2]->data());
    t.state2 = static_cast<float*>(bufs[3]->data());
    t.state3 = static_cast<float*>(bufs[4]->data());
    t.copy = c.copy ? (*copy)->data() : nullptr;
    t.copy_dtype = c.copy_dtype;
    const OptimizerParams p = ParamsAtStep(c.params, 0);
    ASSERT_TRUE(plugin_->OptimizerStep(p, t).ok());
    ASSERT_TRUE(direct_.OptimizerStep(p, HostTensors(c, want, grad.data())).ok());
    for (auto [buf, v] : {std::pair{0, &got.param}, {2, &got.state1}, {3, &got.state2},
                          {4, &got.state3}}) {
      ASSERT_TRUE(plugin_->CopyFromBackend(*bufs[buf], 0, v->data(), n * 4).ok());
    }
    ASSERT_TRUE(plugin_->CopyFromBackend(**copy, 0, got.copy.data(), n * 4).ok());
    EXPECT_EQ(CountNan(want.param), 0);
    EXPECT_EQ(std::memcmp(want.param.data(), got.param.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(want.state1.data(), got.state1.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(want.state2.data(), got.state2.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(want.state3.data(), got.state3.data(), n * 4), 0);
    EXPECT_EQ(want.copy, got.copy);
    const absl::StatusOr<double> sum = plugin_->SumOfSquares(t.param, n);
    ASSERT_TRUE(sum.ok()) << sum.status();
    EXPECT_EQ(*sum, *direct_.SumOfSquares(want.param.data(), n));
  }
  OptimizerTensors missing;  // AdamW without its buffers
  missing.n = 3;
  EXPECT_EQ(plugin_->OptimizerStep(OptimizerParams(), missing),
            direct_.OptimizerStep(OptimizerParams(), missing));
  EXPECT_EQ(plugin_->SumOfSquares(nullptr, 2).status(), direct_.SumOfSquares(nullptr, 2).status());
}

TEST_F(FakePluginTest, ComputeWithoutStatsOrGradients) {
  const RandomProblem rp = RandomProblem::Make(
      SpecOf(9, 8, 20, DType::kBF16, CombinedOptions(Reduction::kSum, 10), 1.0f, 3));
  const LossProblem p = rp.problem();
  HostOutputs want(p, DType::kBF16, false), got(p, DType::kBF16, false);
  ASSERT_TRUE(direct_.Compute(p, want.outputs(), nullptr).ok());
  ASSERT_TRUE(plugin_->Compute(p, got.outputs(), nullptr).ok());
  EXPECT_TRUE(BitIdentical(want, got));
}

// A backend assumes a validated problem (core/loss_problem_check.h), so a Compute's own
// refusal is one that arises while it runs: here its rows of X refused with INVALID_ARGUMENT,
// which must come back from the plugin as it does from the backend itself, code and message.
TEST_F(FakePluginTest, ComputeErrorsKeepTheirCodeAndMessage) {
  RandomProblem rp = RandomProblem::Make(
      SpecOf(9, 8, 20, DType::kBF16, CombinedOptions(Reduction::kMean, 10), 1.0f, 4));
  ExpectRowsRefusalCrossesBack(direct_, *plugin_, rp.problem());
}

// The overlapped Compute: X arrives through the row stream's callbacks, dX leaves through
// them, and the results are the whole problem's, bit for bit.
TEST_F(FakePluginTest, OverlappedComputeCrossesTheRowStream) {
  const RandomProblem rp = RandomProblem::Make(
      SpecOf(47, 31, 123, DType::kBF16, CombinedOptions(Reduction::kMean, 10), 1.0f, 5));
  const LossProblem whole = rp.problem();  // chunk_rows 10: 5 chunks, the last of 7 rows
  HostOutputs want(whole, DType::kBF16), got(whole, DType::kBF16);
  ASSERT_TRUE(direct_.Compute(whole, want.outputs(), nullptr).ok());
  TrickleRows::Spec ts;
  ts.steps = 6;
  TrickleRows rows(whole, ts);
  const LossProblem streamed = rows.Streamed(whole);
  const absl::Status st = plugin_->Compute(streamed, got.outputs(), nullptr);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(BitIdentical(want, got));
  EXPECT_TRUE(rows.CallsAreValid(whole.bt, 5));
}

// A wait that fails crosses back as its status and ends the Compute with it.
TEST_F(FakePluginTest, FailedRowWaitCrossesBack) {
  const RandomProblem rp = RandomProblem::Make(
      SpecOf(47, 31, 123, DType::kBF16, CombinedOptions(Reduction::kMean, 10), 1.0f, 6));
  for (int64_t fail_after : {0, 20}) {
    ExpectComputeEndsWithTheFailedWait(
        [&](const LossProblem& p, const LossOutputs& out) {
          return plugin_->Compute(p, out, nullptr);
        },
        rp.problem(), absl::CancelledError("test: the sender went away"), fail_after);
  }
}

}  // namespace
}  // namespace lossd

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc != 8) {
    std::fprintf(stderr,
                 "usage: %s NO_ENTRY.so V1.so V5.so NEXT_MAJOR.so NEWER_MINOR.so CPU.so "
                 "CPU_6_0.so\n",
                 argv[0]);
    return 2;
  }
  lossd::g_no_entry = argv[1];
  lossd::g_v1 = argv[2];
  lossd::g_v5 = argv[3];
  lossd::g_next_major = argv[4];
  lossd::g_newer_minor = argv[5];
  lossd::g_cpu = argv[6];
  lossd::g_cpu_6_0 = argv[7];
  return RUN_ALL_TESTS();
}
