// SPDX-License-Identifier: Apache-2.0
// The start-up check of the budgets of what lossd keeps in backend memory between requests
// (the weight cache, the gradient accumulators and the hosted heads) against the memory the
// backend has.
// Only compares numbers; never allocates or probes the device.
#ifndef LOSSD_SERVICE_STORE_BUDGETS_H_
#define LOSSD_SERVICE_STORE_BUDGETS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace lossd {

// What lossd keeps in backend memory between requests, each with its own budget.
struct StoreBudgets {
  uint64_t weight_cache_bytes = 0;  // --weight_cache_bytes
  uint64_t accumulator_bytes = 0;   // --accumulator_bytes
  uint64_t head_bytes = 0;          // --head_bytes (hosted heads)
  // --ticket_bytes (two-phase log-prob tickets): counted whole, though only their copies of
  // inline weights are backend memory (X and the targets stay in host memory).
  uint64_t ticket_bytes = 0;
};

// Which of them the user set on the command line.
struct StoreBudgetsGiven {
  bool weight_cache = false, accumulator = false, head = false, ticket = false;
};

// INVALID_ARGUMENT, naming the four flags and their values, when --weight_cache_bytes plus
// --accumulator_bytes plus --head_bytes plus --ticket_bytes exceed what the backend may hold:
// its own budget where it has one (CUDA: --device_memory_budget_bytes), else its memory (the GPU's, or the
// host's for the CPU backend, whose buffers are host memory). OK where the backend reports
// neither.
absl::Status CheckStoreBudgets(const StoreBudgets& b, const BackendInfo& backend);

// For the budgets left at their defaults (not in `given`): where
// CheckStoreBudgets would refuse them, scales the defaulted ones down in their ratio so that
// all four take at most half of the backend's limit (what the given ones leave of that
// half, and nothing where they take it all), so that lossd starts with its defaults on a
// small machine (a laptop, a small GPU) and requests keep the other half. Returns true when
// it lowered any. Values a user gave are never changed: those are checked.
bool FitDefaultStoreBudgets(StoreBudgets* b, const StoreBudgetsGiven& given,
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
