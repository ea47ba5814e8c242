#include "service/store_budgets.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace lossd {

namespace {

// The most bytes the backend may hold (its own budget, capped at its memory), 0 if unknown.
uint64_t StoreLimit(const BackendInfo& backend) {
  const uint64_t total = backend.memory_total_bytes;
  const uint64_t budget = backend.memory_budget_bytes;
  return budget != 0 && (total == 0 || budget <= total) ? budget : total;
}

}  // namespace

bool FitDefaultStoreBudgets(uint64_t* weight_cache_bytes, uint64_t* accumulator_bytes,
                            const BackendInfo& backend) {
  if (CheckStoreBudgets(*weight_cache_bytes, *accumulator_bytes, backend).ok()) return false;
  const uint64_t half = StoreLimit(backend) / 2;
  // In long double: the product of two byte counts does not fit in 64 bits.
  const long double sum =
      static_cast<long double>(*weight_cache_bytes) + static_cast<long double>(*accumulator_bytes);
  const long double scale = static_cast<long double>(half) / sum;
  *weight_cache_bytes = static_cast<uint64_t>(*weight_cache_bytes * scale);
  *accumulator_bytes = static_cast<uint64_t>(*accumulator_bytes * scale);
  return true;
}

bool FitDefaultHostBudgets(uint64_t host_limit_bytes, bool memory_budget_given,
                           bool pool_given, uint64_t* memory_budget_bytes,
                           uint64_t* host_buffer_pool_bytes) {
  if (host_limit_bytes == 0) return false;
  bool lowered = false;
  auto fit = [&](bool given, uint64_t share, uint64_t* value) {
    if (!given && *value > share) {
      *value = share;
      lowered = true;
    }
  };
  fit(memory_budget_given, host_limit_bytes / 4, memory_budget_bytes);
  fit(pool_given, host_limit_bytes / 8, host_buffer_pool_bytes);
  return lowered;
}

absl::Status CheckStoreBudgets(uint64_t weight_cache_bytes, uint64_t accumulator_bytes,
                               const BackendInfo& backend) {
  const uint64_t total = backend.memory_total_bytes;
  const uint64_t budget = backend.memory_budget_bytes;
  const uint64_t limit = StoreLimit(backend);
  // The backend's own budget where it is the limit (a budget above the device's memory cannot
  // be held either, and then the device's memory is).
  const bool by_budget = budget != 0 && limit == budget;
  if (limit == 0) return absl::OkStatus();  // the backend does not say: nothing to compare
  // Compared without forming the sum, which two large flags would wrap.
  if (weight_cache_bytes <= limit && accumulator_bytes <= limit - weight_cache_bytes) {
    return absl::OkStatus();
  }
  const std::string sum =
      accumulator_bytes > UINT64_MAX - weight_cache_bytes
          ? std::string("more than 2^64")
          : absl::StrCat(weight_cache_bytes + accumulator_bytes);
  std::string what;
  if (by_budget) {
    // The only budget a backend has is the CUDA one, set by this flag.
    what = absl::StrCat("the ", backend.name, " backend's memory budget (",
                        "--device_memory_budget_bytes=", budget, ")");
  } else {
    // The CPU backend keeps weights and accumulators in host memory.
    what = absl::StrCat("the ", backend.name, " backend's ",
                        backend.name == "cpu" ? "host" : "device", " memory of ", total,
                        " bytes (", backend.device, ")");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--weight_cache_bytes=", weight_cache_bytes, " plus --accumulator_bytes=",
      accumulator_bytes, " (", sum, " bytes) exceed ", what,
      "; both are held in backend memory between requests, so lower them"));
}

}  // namespace lossd
