// SPDX-License-Identifier: Apache-2.0
#include "service/process_metrics.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace lossd {
namespace {

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

// The fields of /proc/<pid>/stat after the command name, which may itself hold spaces and
// parentheses: field 3 (state) is fields[0].
std::vector<std::string> StatFields(const std::string& stat) {
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return {};
  return absl::StrSplit(absl::StripAsciiWhitespace(stat.substr(close + 1)), ' ',
                        absl::SkipEmpty());
}

}  // namespace

void AddUnlabelledFamily(std::vector<prometheus::MetricFamily>* out, const char* name,
                         const char* help, prometheus::MetricType type, double v) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = v;
  } else {
    m.gauge.value = v;
  }
  f.metric.push_back(m);
  out->push_back(std::move(f));
}

ProcessCollector::ProcessCollector(std::string proc)
    : proc_(std::move(proc)),
      ticks_per_second_(sysconf(_SC_CLK_TCK)),
      page_bytes_(sysconf(_SC_PAGESIZE)) {}

std::vector<prometheus::MetricFamily> ProcessCollector::Collect() const {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> out;
  std::string text;
  if (ReadFile(proc_ + "/self/stat", &text)) {
    const std::vector<std::string> f = StatFields(text);
    // stat(5): utime 14, stime 15, starttime 22, vsize 23, rss 24; fields[0] is field 3.
    double utime = 0, stime = 0, start = 0, vsize = 0, rss = 0;
    if (f.size() > 21 && absl::SimpleAtod(f[11], &utime) && absl::SimpleAtod(f[12], &stime) &&
        absl::SimpleAtod(f[19], &start) && absl::SimpleAtod(f[20], &vsize) &&
        absl::SimpleAtod(f[21], &rss) && ticks_per_second_ > 0) {
      const double hz = static_cast<double>(ticks_per_second_);
      AddUnlabelledFamily(&out, "process_cpu_seconds_total",
                          "User and system CPU time spent, in seconds.", MetricType::Counter,
                          (utime + stime) / hz);
      AddUnlabelledFamily(&out, "process_resident_memory_bytes", "Resident memory size in bytes.",
                          MetricType::Gauge, rss * static_cast<double>(page_bytes_));
      AddUnlabelledFamily(&out, "process_virtual_memory_bytes", "Virtual memory size in bytes.",
                          MetricType::Gauge, vsize);
      // starttime counts ticks since boot; /proc/stat's btime is the boot's Unix time.
      std::string system_stat;
      if (ReadFile(proc_ + "/stat", &system_stat)) {
        for (absl::string_view line : absl::StrSplit(system_stat, '\n')) {
          double btime = 0;
          if (absl::ConsumePrefix(&line, "btime ") &&
              absl::SimpleAtod(absl::StripAsciiWhitespace(line), &btime)) {
            AddUnlabelledFamily(&out, "process_start_time_seconds",
                                "Start time of the process since the Unix epoch, in seconds.",
                                MetricType::Gauge, btime + start / hz);
          }
        }
      }
    }
  }
  if (DIR* d = opendir((proc_ + "/self/fd").c_str()); d != nullptr) {
    // Not counted: the descriptor this listing itself holds open.
    const std::string own = std::to_string(dirfd(d));
    double n = 0;
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.' && own != e->d_name) ++n;
    }
    closedir(d);
    AddUnlabelledFamily(&out, "process_open_fds", "Open file descriptors.", MetricType::Gauge, n);
  }
  if (ReadFile(proc_ + "/self/limits", &text)) {
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (!absl::ConsumePrefix(&line, "Max open files")) continue;
      std::vector<absl::string_view> w =
          absl::StrSplit(absl::StripAsciiWhitespace(line), ' ', absl::SkipEmpty());
      double soft = 0;
      if (!w.empty() && absl::SimpleAtod(w[0], &soft)) {
        AddUnlabelledFamily(&out, "process_max_fds",
                            "Most open file descriptors allowed (the soft limit).",
                            MetricType::Gauge, soft);
      }
    }
  }
  return out;
}

}  // namespace lossd
