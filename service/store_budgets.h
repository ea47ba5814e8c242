// The start-up check of the budgets of what lossd keeps in backend memory between requests
// (the weight cache and the gradient accumulators) against the memory the backend has.
// Only compares numbers; never allocates or probes the device.
#ifndef LOSSD_SERVICE_STORE_BUDGETS_H_
#define LOSSD_SERVICE_STORE_BUDGETS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace lossd {

// INVALID_ARGUMENT, naming both flags and their values, when --weight_cache_bytes plus
// --accumulator_bytes exceed what the backend may hold: its own budget where it has one
// (CUDA: --device_memory_budget_bytes), else its memory (the GPU's, or the host's for the CPU
// backend, whose buffers are host memory). OK where the backend reports neither.
absl::Status CheckStoreBudgets(uint64_t weight_cache_bytes, uint64_t accumulator_bytes,
                               const BackendInfo& backend);

// For the defaults alone (neither flag given): where CheckStoreBudgets would refuse them,
// scales both down in their ratio to half of the backend's limit, so that lossd starts with
// its defaults on a small machine (a laptop, a small GPU) and requests keep the other half.
// Returns true when it lowered them. Values a user gave are never changed: those are checked.
bool FitDefaultStoreBudgets(uint64_t* weight_cache_bytes, uint64_t* accumulator_bytes,
                            const BackendInfo& backend);

// The host-memory budgets left at their defaults, derived from the host memory lossd may use
// (kernels/host_memory.h: the smaller of physical memory and the cgroup's limit): the
// admission budget (--memory_budget_bytes) at most a quarter of it, the pool of idle request
// buffers (--host_buffer_pool_bytes) at most an eighth, so that in a small container lossd
// refuses what cannot fit (RESOURCE_EXHAUSTED) instead of being OOM-killed. A value the user
// gave (`*_given`) is kept as it is; a host limit of 0 (unknown) changes nothing. Returns true
// when it lowered either.
bool FitDefaultHostBudgets(uint64_t host_limit_bytes, bool memory_budget_given,
                           bool pool_given, uint64_t* memory_budget_bytes,
                           uint64_t* host_buffer_pool_bytes);

}  // namespace lossd

#endif  // LOSSD_SERVICE_STORE_BUDGETS_H_
