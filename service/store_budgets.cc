// SPDX-License-Identifier: Apache-2.0
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

bool FitDefaultStoreBudgets(StoreBudgets* b, const StoreBudgetsGiven& given,
                            const BackendInfo& backend) {
  if (CheckStoreBudgets(*b, backend).ok()) return false;
  struct Budget {
    bool given;
    uint64_t* bytes;
  };
  const Budget all[] = {{given.weight_cache, &b->weight_cache_bytes},
                        {given.accumulator, &b->accumulator_bytes},
                        {given.head, &b->head_bytes},
                        {given.ticket, &b->ticket_bytes}};
  // In long double: sums and products of byte counts do not fit in 64 bits.
  long double given_sum = 0, defaulted_sum = 0;
  for (const Budget& x : all) (x.given ? given_sum : defaulted_sum) += *x.bytes;
  if (defaulted_sum == 0) return false;
  const long double half = static_cast<long double>(StoreLimit(backend) / 2);
  const long double scale = half > given_sum ? (half - given_sum) / defaulted_sum : 0;
  for (const Budget& x : all) {
    if (!x.given) *x.bytes = static_cast<uint64_t>(*x.bytes * scale);
  }
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

absl::Status CheckStoreBudgets(const StoreBudgets& b, const BackendInfo& backend) {
  const uint64_t total = backend.memory_total_bytes;
  const uint64_t budget = backend.memory_budget_bytes;
  const uint64_t limit = StoreLimit(backend);
  // The backend's own budget where it is the limit (a budget above the device's memory cannot
  // be held either, and then the device's memory is).
  const bool by_budget = budget != 0 && limit == budget;
  if (limit == 0) return absl::OkStatus();  // the backend does not say: nothing to compare
  // Summed in long double, which four large flags cannot wrap.
  const long double sum = static_cast<long double>(b.weight_cache_bytes) +
                          static_cast<long double>(b.accumulator_bytes) +
                          static_cast<long double>(b.head_bytes) +
                          static_cast<long double>(b.ticket_bytes);
  if (sum <= static_cast<long double>(limit)) return absl::OkStatus();
  const std::string sum_text =
      sum >= 18446744073709551616.0L ? std::string("more than 2^64")
                                     : absl::StrCat(static_cast<uint64_t>(sum));
  std::string what;
  if (by_budget) {
    // The only budget a backend has is the CUDA one, set by this flag.
    what = absl::StrCat("the ", backend.name, " backend's memory budget (",
                        "--device_memory_budget_bytes=", budget, ")");
  } else {
    // The CPU backend keeps weights, accumulators and heads in host memory.
    what = absl::StrCat("the ", backend.name, " backend's ",
                        backend.name == "cpu" ? "host" : "device", " memory of ", total,
                        " bytes (", backend.device, ")");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--weight_cache_bytes=", b.weight_cache_bytes, " plus --accumulator_bytes=",
      b.accumulator_bytes, " plus --head_bytes=", b.head_bytes, " plus --ticket_bytes=",
      b.ticket_bytes, " (", sum_text, " bytes) exceed ", what,
      "; all four are held in backend memory between requests, so lower them"));
}

}  // namespace lossd
