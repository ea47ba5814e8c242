// SPDX-License-Identifier: Apache-2.0
// How much host memory this process may use: the smaller of the machine's physical memory
// (/proc/meminfo) and the limit of the memory cgroup it runs in (cgroup v2 memory.max, v1
// memory.limit_in_bytes, the tightest along the path to the root), so that budgets derived
// from it hold inside a container instead of the process being OOM-killed. Reads files only;
// never fails (what it cannot read it treats as "no limit there").
#ifndef LOSSD_KERNELS_HOST_MEMORY_H_
#define LOSSD_KERNELS_HOST_MEMORY_H_

#include <cstdint>
#include <string>

namespace lossd {

// Where the files are; tests point these at a folder of their own.
struct HostMemoryLimitPaths {
  std::string meminfo = "/proc/meminfo";
  std::string self_cgroup = "/proc/self/cgroup";
  std::string cgroup_root = "/sys/fs/cgroup";  // v2 mounted here, or v1's "memory" below it
};

struct HostMemoryLimit {
  uint64_t physical_bytes = 0;  // MemTotal; 0 if unreadable
  uint64_t cgroup_bytes = 0;    // the tightest cgroup limit; 0 = none found
  std::string cgroup_file;      // the file that set cgroup_bytes
  // Bytes in use against the binding limit when read: the cgroup's usage where the cgroup
  // binds (memory.current, v1 memory.usage_in_bytes), else MemTotal - MemAvailable.
  uint64_t used_bytes = 0;
  std::string usage_file;    // the cgroup's usage file beside cgroup_file
  std::string meminfo_file;  // where MemAvailable is read

  // used_bytes now: one file read, for callers that ask often (the limit does not change
  // while the process runs, so they keep this object and ask again).
  uint64_t ReadUsedBytes() const;

  // What budgets derive from: the smaller of the two that are known (0 if neither is).
  uint64_t limit_bytes() const;
  bool cgroup_binds() const { return cgroup_bytes != 0 && cgroup_bytes < physical_bytes; }
  // One line for the start-up log, e.g. "1.00 GiB (cgroup limit, /sys/fs/cgroup/memory.max;
  // physical 23.43 GiB)".
  std::string Describe() const;
};

HostMemoryLimit ReadHostMemoryLimit(const HostMemoryLimitPaths& paths = HostMemoryLimitPaths());

}  // namespace lossd

#endif  // LOSSD_KERNELS_HOST_MEMORY_H_
