// The start-up check of the budgets of what lossd keeps in backend memory between requests
// (the weight cache and the gradient accumulators) against the memory the backend has.
// Only compares numbers; never allocates or probes the device.
#ifndef LOSSD_SERVER_STORE_BUDGETS_H_
#define LOSSD_SERVER_STORE_BUDGETS_H_

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

}  // namespace lossd

#endif  // LOSSD_SERVER_STORE_BUDGETS_H_
