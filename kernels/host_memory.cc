// SPDX-License-Identifier: Apache-2.0
#include "kernels/host_memory.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace lossd {
namespace {

// cgroup v1 writes "no limit" as the largest page-aligned int64; anything at or above 2^62
// is no limit a machine could have.
constexpr uint64_t kNoLimitAbove = 1ull << 62;

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

uint64_t MemInfoField(const std::string& text, absl::string_view name) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, name) && absl::ConsumePrefix(&line, ":")) {
      line = absl::StripAsciiWhitespace(line);
      absl::ConsumeSuffix(&line, "kB");
      uint64_t kb = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kb)) return kb * 1024;
    }
  }
  return 0;
}

// A limit file's value: 0 for "max", a no-limit number, or anything unreadable.
uint64_t LimitIn(const std::string& path) {
  std::string text;
  if (!ReadFile(path, &text)) return 0;
  uint64_t v = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v) || v >= kNoLimitAbove) return 0;
  return v;
}

uint64_t NumberIn(const std::string& path) {
  std::string text;
  uint64_t v = 0;
  if (!ReadFile(path, &text) || !absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v)) return 0;
  return v;
}

// The folders from the cgroup's own up to the mount root: "/a/b" gives root/a/b, root/a, root.
// A path the mount does not show (a container that sees the host's path) falls back to root.
std::vector<std::string> FoldersUp(const std::string& root, absl::string_view cgroup_path) {
  std::vector<std::string> out;
  std::string path(absl::StripSuffix(cgroup_path, "/"));
  while (!path.empty() && path != "/") {
    out.push_back(root + path);
    path = path.substr(0, path.rfind('/'));
  }
  out.push_back(root);
  return out;
}

struct CgroupLimit {
  uint64_t bytes = 0;
  std::string file;
  std::string usage_file;  // the usage beside `file`
};

// The tightest limit along the path, with the usage of the folder that sets it.
CgroupLimit TightestLimit(const std::vector<std::string>& folders, const char* limit_name,
                          const char* usage_name) {
  CgroupLimit best;
  for (const std::string& dir : folders) {
    const std::string file = absl::StrCat(dir, "/", limit_name);
    const uint64_t v = LimitIn(file);
    if (v != 0 && (best.bytes == 0 || v < best.bytes)) {
      best.bytes = v;
      best.file = file;
      best.usage_file = absl::StrCat(dir, "/", usage_name);
    }
  }
  return best;
}

CgroupLimit ReadCgroupLimit(const HostMemoryLimitPaths& paths) {
  std::string self;
  if (!ReadFile(paths.self_cgroup, &self)) return {};
  CgroupLimit v1, v2;
  // Lines are "id:controllers:path"; v2's is "0::path", v1's memory line names "memory".
  for (absl::string_view line : absl::StrSplit(self, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) {
      v2 = TightestLimit(FoldersUp(paths.cgroup_root, f[2]), "memory.max", "memory.current");
      if (v2.bytes == 0) {  // v2 may also be mounted beside v1 ("hybrid")
        v2 = TightestLimit(FoldersUp(paths.cgroup_root + "/unified", f[2]), "memory.max",
                           "memory.current");
      }
    } else {
      for (absl::string_view c : absl::StrSplit(f[1], ',')) {
        if (c == "memory") {
          v1 = TightestLimit(FoldersUp(paths.cgroup_root + "/memory", f[2]),
                             "memory.limit_in_bytes", "memory.usage_in_bytes");
        }
      }
    }
  }
  if (v1.bytes != 0 && (v2.bytes == 0 || v1.bytes < v2.bytes)) return v1;
  return v2;
}

std::string GiB(uint64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1ull << 30));
}

}  // namespace

uint64_t HostMemoryLimit::limit_bytes() const {
  if (physical_bytes == 0) return cgroup_bytes;
  if (cgroup_bytes == 0) return physical_bytes;
  return std::min(physical_bytes, cgroup_bytes);
}

std::string HostMemoryLimit::Describe() const {
  if (cgroup_binds()) {
    return absl::StrCat(GiB(cgroup_bytes), " (cgroup limit, ", cgroup_file, "; physical ",
                        GiB(physical_bytes), ")");
  }
  if (physical_bytes == 0 && cgroup_bytes == 0) return "unknown (no /proc/meminfo, no cgroup)";
  return absl::StrCat(GiB(limit_bytes()), cgroup_bytes != 0 ? " (physical; cgroup limit " : "",
                      cgroup_bytes != 0 ? GiB(cgroup_bytes) + ")" : " (physical, no cgroup limit)");
}

uint64_t HostMemoryLimit::ReadUsedBytes() const {
  if (cgroup_binds() || physical_bytes == 0) return NumberIn(usage_file);
  std::string meminfo;
  if (!ReadFile(meminfo_file, &meminfo)) return 0;
  const uint64_t available = MemInfoField(meminfo, "MemAvailable");
  return physical_bytes > available ? physical_bytes - available : 0;
}

HostMemoryLimit ReadHostMemoryLimit(const HostMemoryLimitPaths& paths) {
  HostMemoryLimit m;
  m.meminfo_file = paths.meminfo;
  std::string meminfo;
  if (ReadFile(paths.meminfo, &meminfo)) m.physical_bytes = MemInfoField(meminfo, "MemTotal");
  const CgroupLimit c = ReadCgroupLimit(paths);
  m.cgroup_bytes = c.bytes;
  m.cgroup_file = c.file;
  m.usage_file = c.usage_file;
  m.used_bytes = m.ReadUsedBytes();
  return m;
}

}  // namespace lossd
