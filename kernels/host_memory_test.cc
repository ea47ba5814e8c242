// SPDX-License-Identifier: Apache-2.0
// ReadHostMemoryLimit against injected /proc and cgroup files: v2, v1, hybrid, nested limits, "no
// limit" spellings, a container that sees the host's cgroup path, and missing files.
#include "kernels/host_memory.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kGiB = 1ull << 30;

class HostMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = std::string(tmp != nullptr ? tmp : "/tmp") + "/host_memory_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ + "/cg");
    paths_.meminfo = dir_ + "/meminfo";
    paths_.self_cgroup = dir_ + "/self_cgroup";
    paths_.cgroup_root = dir_ + "/cg";
    // 16 GiB of RAM, 10 GiB of it available.
    Write("meminfo", "MemTotal:       16777216 kB\nMemFree:  1 kB\nMemAvailable:   10485760 kB\n");
  }

  void Write(const std::string& rel, const std::string& text) {
    const std::filesystem::path p = std::filesystem::path(dir_) / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }

  std::string dir_;
  HostMemoryLimitPaths paths_;
};

TEST_F(HostMemoryTest, NoCgroupIsPhysicalMemory) {
  const HostMemoryLimit m = ReadHostMemoryLimit(paths_);
  EXPECT_EQ(m.physical_bytes, 16 * kGiB);
  EXPECT_EQ(m.cgroup_bytes, 0u);
  EXPECT_EQ(m.limit_bytes(), 16 * kGiB);
  EXPECT_EQ(m.used_bytes, 6 * kGiB);
  EXPECT_EQ(m.Describe(), "16.00 GiB (physical, no cgroup limit)");
  // Asked again, MemAvailable is read anew (12 GiB available now).
  Write("meminfo", "MemTotal:       16777216 kB\nMemAvailable:   12582912 kB\n");
  EXPECT_EQ(m.ReadUsedBytes(), 4 * kGiB);
}

TEST_F(HostMemoryTest, CgroupV2LimitBindsWithItsUsage) {
  Write("self_cgroup", "0::/kubepods/pod1/ctr\n");
  Write("cg/kubepods/memory.max", "8589934592\n");
  Write("cg/kubepods/pod1/memory.max", "max\n");
  Write("cg/kubepods/pod1/ctr/memory.max", "1073741824\n");
  Write("cg/kubepods/pod1/ctr/memory.current", "52428800\n");
  const HostMemoryLimit m = ReadHostMemoryLimit(paths_);
  EXPECT_EQ(m.cgroup_bytes, kGiB);
  EXPECT_EQ(m.limit_bytes(), kGiB);
  EXPECT_EQ(m.used_bytes, 50u << 20);
  EXPECT_EQ(m.cgroup_file, paths_.cgroup_root + "/kubepods/pod1/ctr/memory.max");
  EXPECT_THAT(m.Describe(), HasSubstr("1.00 GiB (cgroup limit, "));
  EXPECT_THAT(m.Describe(), HasSubstr("physical 16.00 GiB"));
  // Asked again, the usage is read anew from the cgroup that binds.
  Write("cg/kubepods/pod1/ctr/memory.current", "104857600\n");
  EXPECT_EQ(m.ReadUsedBytes(), 100u << 20);
}

TEST_F(HostMemoryTest, TightestAncestorWins) {
  Write("self_cgroup", "0::/a/b\n");
  Write("cg/a/memory.max", "2147483648\n");
  Write("cg/a/memory.current", "1048576\n");
  Write("cg/a/b/memory.max", "max\n");
  const HostMemoryLimit m = ReadHostMemoryLimit(paths_);
  EXPECT_EQ(m.limit_bytes(), 2 * kGiB);
  EXPECT_EQ(m.used_bytes, 1u << 20);
}

TEST_F(HostMemoryTest, CgroupV1LimitAndItsNoLimitValue) {
  Write("self_cgroup", "5:cpu,cpuacct:/x\n4:memory:/job\n0::/\n");
  Write("cg/memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  Write("cg/memory/job/memory.limit_in_bytes", "536870912\n");
  Write("cg/memory/job/memory.usage_in_bytes", "1000\n");
  const HostMemoryLimit m = ReadHostMemoryLimit(paths_);
  EXPECT_EQ(m.limit_bytes(), kGiB / 2);
  EXPECT_EQ(m.used_bytes, 1000u);
  EXPECT_EQ(m.cgroup_file, paths_.cgroup_root + "/memory/job/memory.limit_in_bytes");
}

TEST_F(HostMemoryTest, ContainerSeeingTheHostsPathReadsItsMountRoot) {
  // Without a cgroup namespace a container's /proc/self/cgroup names the host's path while
  // its mount shows only its own cgroup at the root.
  Write("self_cgroup", "0::/kubepods/burstable/pod9/abc\n");
  Write("cg/memory.max", "3221225472\n");
  EXPECT_EQ(ReadHostMemoryLimit(paths_).limit_bytes(), 3 * kGiB);
}

TEST_F(HostMemoryTest, HybridV2UnderUnified) {
  Write("self_cgroup", "4:memory:/\n0::/svc\n");
  Write("cg/unified/svc/memory.max", "1610612736\n");
  EXPECT_EQ(ReadHostMemoryLimit(paths_).limit_bytes(), 3 * kGiB / 2);
}

TEST_F(HostMemoryTest, LimitAbovePhysicalDoesNotBind) {
  Write("self_cgroup", "0::/\n");
  Write("cg/memory.max", "68719476736\n");  // 64 GiB on a 16 GiB machine
  const HostMemoryLimit m = ReadHostMemoryLimit(paths_);
  EXPECT_FALSE(m.cgroup_binds());
  EXPECT_EQ(m.limit_bytes(), 16 * kGiB);
  EXPECT_EQ(m.used_bytes, 6 * kGiB);
}

TEST_F(HostMemoryTest, UnreadableFilesMeanNoLimit) {
  Write("self_cgroup", "0::/\n");
  Write("cg/memory.max", "garbage\n");
  paths_.meminfo = dir_ + "/no_such_file";
  const HostMemoryLimit m = ReadHostMemoryLimit(paths_);
  EXPECT_EQ(m.limit_bytes(), 0u);
  EXPECT_THAT(m.Describe(), HasSubstr("unknown"));
}

// The real files of this machine: whatever they say, the limit is never above MemTotal.
TEST(HostMemoryRealTest, NeverAbovePhysical) {
  const HostMemoryLimit m = ReadHostMemoryLimit();
  ASSERT_GT(m.physical_bytes, 0u);
  EXPECT_LE(m.limit_bytes(), m.physical_bytes);
}

}  // namespace
}  // namespace lossd
