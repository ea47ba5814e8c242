// SPDX-License-Identifier: Apache-2.0
#include "service/process_metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "gtest/gtest.h"

namespace lossd {
namespace {

std::map<std::string, double> Values(const ProcessCollector& c) {
  std::map<std::string, double> out;
  for (const prometheus::MetricFamily& f : c.Collect()) {
    EXPECT_EQ(f.metric.size(), 1u) << f.name;
    out[f.name] = f.type == prometheus::MetricType::Counter ? f.metric[0].counter.value
                                                            : f.metric[0].gauge.value;
  }
  return out;
}

TEST(ProcessMetricsTest, InjectedProcGivesExactValues) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string proc = std::string(tmp != nullptr ? tmp : "/tmp") + "/fake_proc";
  std::filesystem::remove_all(proc);
  std::filesystem::create_directories(proc + "/self/fd");
  for (const char* fd : {"0", "1", "2", "7", "19"}) std::ofstream(proc + "/self/fd/" + fd);
  const long hz = sysconf(_SC_CLK_TCK);      // NOLINT(runtime/int)
  const long page = sysconf(_SC_PAGESIZE);  // NOLINT(runtime/int)
  // A command name with a space and a parenthesis, as stat(5) allows; utime 3 s and stime
  // 1.5 s of ticks, started 250 s of ticks after boot, 2 GiB virtual, 1000 pages resident.
  std::ofstream(proc + "/self/stat")
      << "4242 (los d) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 " << 3 * hz << " " << hz * 3 / 2
      << " 0 0 20 0 12 0 " << 250 * hz << " 2147483648 1000 18446744073709551615\n";
  std::ofstream(proc + "/stat") << "cpu  1 2 3\nbtime 1764000000\nprocesses 9\n";
  std::ofstream(proc + "/self/limits")
      << "Limit                     Soft Limit           Hard Limit           Units\n"
      << "Max open files            65536                1048576              files\n";
  std::map<std::string, double> v = Values(ProcessCollector(proc));
  EXPECT_DOUBLE_EQ(v["process_cpu_seconds_total"], 4.5);
  EXPECT_DOUBLE_EQ(v["process_start_time_seconds"], 1764000250.0);
  EXPECT_DOUBLE_EQ(v["process_virtual_memory_bytes"], 2147483648.0);
  EXPECT_DOUBLE_EQ(v["process_resident_memory_bytes"], 1000.0 * page);
  EXPECT_DOUBLE_EQ(v["process_open_fds"], 5);
  EXPECT_DOUBLE_EQ(v["process_max_fds"], 65536);
  EXPECT_EQ(v.size(), 6u);
}

TEST(ProcessMetricsTest, MissingFilesLeaveMetricsOut) {
  EXPECT_TRUE(ProcessCollector("/nonexistent_proc").Collect().empty());
}

TEST(ProcessMetricsTest, ThisProcess) {
  ProcessCollector c;
  std::map<std::string, double> v = Values(c);
  ASSERT_EQ(v.size(), 6u);
  EXPECT_GT(v["process_resident_memory_bytes"], 1 << 20);
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(v["process_start_time_seconds"], now + 1);
  EXPECT_GT(v["process_start_time_seconds"], now - 3600);
  // Opening a file shows as one more descriptor.
  const int fd = open("/proc/self/stat", O_RDONLY);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(Values(c)["process_open_fds"], v["process_open_fds"] + 1);
  close(fd);
  // CPU time only grows.
  volatile double x = 0;
  for (int i = 0; i < 50000000; ++i) x = x + i * 1e-9;
  EXPECT_GT(Values(c)["process_cpu_seconds_total"], v["process_cpu_seconds_total"]);
}

}  // namespace
}  // namespace lossd
