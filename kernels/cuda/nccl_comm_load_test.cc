// SPDX-License-Identifier: Apache-2.0
// What a head group on the CUDA backend is told where NCCL does not load, without a GPU: the
// library path tried, the loader's error and the variable to set, the same answer every time
// (NCCL is looked for once per process); ConnectComm's argument checks come first.
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/nccl_comm.h"

namespace lossd {
namespace cuda {
namespace {

constexpr char kMissing[] = "/nonexistent/lossd-test/libnccl.so.2";

TEST(NcclCommLoadTest, TheLibraryPathComesFromTheEnvironment) {
  unsetenv(kNcclLibraryEnv);
  EXPECT_EQ(NcclLibraryPath(), "libnccl.so.2");
  setenv(kNcclLibraryEnv, "", 1);
  EXPECT_EQ(NcclLibraryPath(), "libnccl.so.2");
  setenv(kNcclLibraryEnv, kMissing, 1);
  EXPECT_EQ(NcclLibraryPath(), kMissing);
}

TEST(NcclCommLoadTest, AMissingLibraryIsNamedWithWhatToSet) {
  setenv(kNcclLibraryEnv, kMissing, 1);
  const absl::Status st = NcclAvailable();
  ASSERT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_NE(st.message().find(std::string("dlopen(") + kMissing + "): "), std::string::npos)
      << st;
  EXPECT_NE(st.message().find("No such file"), std::string::npos) << st;  // dlerror's words
  EXPECT_NE(st.message().find("set LOSSD_NCCL_LIBRARY to the path of libnccl.so.2"),
            std::string::npos)
      << st;
  // Looked for once: a variable set afterwards changes nothing, and the id and connect
  // calls give the same answer.
  setenv(kNcclLibraryEnv, "libc.so.6", 1);
  EXPECT_EQ(NcclAvailable(), st);
  EXPECT_EQ(NcclNewCommId().status(), st);
  EXPECT_EQ(NcclConnect(0, std::string(kBackendCommIdBytes, 'x'), 2, 1, 1000).status(), st);
}

// The arguments are checked before NCCL is looked for, so a bad call is named as such.
TEST(NcclCommLoadTest, BadConnectArgumentsAreRefusedFirst) {
  const std::string id(kBackendCommIdBytes, 'x');
  struct Case {
    std::string id;
    uint32_t size, rank;
    int64_t timeout_ms;
    const char* got;
  };
  for (const Case& c : {Case{"short", 2, 0, 1000, "got an id of 5 bytes, size 2, rank 0"},
                        Case{id, 0, 0, 1000, "size 0, rank 0"},
                        Case{id, 2, 2, 1000, "size 2, rank 2"},
                        Case{id, 0x80000000u, 0, 1000, "size 2147483648"},
                        Case{id, 2, 1, 0, "timeout_ms 0"},
                        Case{id, 2, 1, -5, "timeout_ms -5"}}) {
    const absl::Status st = NcclConnect(0, c.id, c.size, c.rank, c.timeout_ms).status();
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_NE(st.message().find("ConnectComm needs an id of 128 bytes"), std::string::npos)
        << st;
    EXPECT_NE(st.message().find(c.got), std::string::npos) << st;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
