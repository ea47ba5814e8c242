// SPDX-License-Identifier: Apache-2.0
// Replays every committed fuzz input (the seed corpus and the regressions, one file each)
// through its target with the ordinary toolchain, so CI re-checks them on every run without
// clang or libFuzzer (and under --config=asan with the sanitizers). Each input runs in a child
// process: a finding aborts, and the test names the file and shows the child's report.
#include <dirent.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/fuzz/fuzz_env.h"

namespace lossd {
namespace fuzz {
namespace {

std::string DataDir() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return std::string(srcdir ? srcdir : ".") + "/" + (workspace ? workspace : "lossd") +
         "/tests/fuzz";
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> files;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return files;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == ".." || name == "README.md") continue;
    files.push_back(dir + "/" + name);
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  return files;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

using OneInput = void (*)(const uint8_t*, size_t);

struct Target {
  const char* name;
  OneInput fn;
};

class ReplayTest : public ::testing::TestWithParam<Target> {};

void ReplayDir(const Target& t, const std::string& kind, size_t* count) {
  for (const std::string& path : FilesIn(DataDir() + "/" + kind + "/" + t.name)) {
    const std::string bytes = ReadFile(path);
    ++*count;
    EXPECT_EXIT(
        {
          t.fn(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
          std::_Exit(0);
        },
        ::testing::ExitedWithCode(0), "")
        << "input " << path;
  }
}

TEST_P(ReplayTest, EveryCommittedInputPasses) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  size_t count = 0;
  ReplayDir(GetParam(), "corpus", &count);
  ReplayDir(GetParam(), "regressions", &count);
  EXPECT_GT(count, 0u) << "no committed inputs found under " << DataDir();
}

INSTANTIATE_TEST_SUITE_P(
    Targets, ReplayTest,
    ::testing::Values(Target{"compute_stream", &ComputeStreamOneInput},
                      Target{"options", &OptionsOneInput},
                      Target{"put_weights", &PutWeightsOneInput}),
    [](const ::testing::TestParamInfo<Target>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace fuzz
}  // namespace lossd
