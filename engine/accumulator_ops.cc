// SPDX-License-Identifier: Apache-2.0
// Engine's accumulator operations: the instance check, fetches of the sum (whole or a byte
// range, with or without a reset), the undo of a reset whose data never reached the client,
// the partial-sum mark of a failed call, and drop. Every read and change of a sum holds the
// accumulator's lock; a sum that may be partial or overflowed is never served as whole.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/status_macros.h"
#include "engine/engine.h"
#include "engine/message_bounds.h"
#include "engine/request_checks.h"

namespace lossd {

std::string Engine::MarkPartial(Accumulator& acc, uint64_t resets_at_add) {
  absl::MutexLock lock(&acc.mu);
  if (acc.resets != resets_at_add) {
    // A reset fetch has taken the sum with the micro-batch in it since: the sum there is
    // now is a new one, which it is not part of.
    return absl::StrCat("; its micro-batch had been added into accumulator '", acc.name,
                        "', whose sum a reset fetch has taken since");
  }
  acc.poisoned = true;
  return absl::StrCat("; its micro-batch had already been added into accumulator '", acc.name,
                      "', which now refuses further use until it is dropped (the sum cannot "
                      "be trusted: redo the step)");
}

namespace {

// The fetch's range of `acc` with (0, 0) resolved to all of it, or why it is not one.
absl::StatusOr<std::pair<uint64_t, uint64_t>> FetchRangeOf(const Accumulator& acc,
                                                           const std::string& name, bool reset,
                                                           uint64_t begin, uint64_t end) {
  const uint64_t v = static_cast<uint64_t>(acc.v);  // dW | db in fp32
  const uint64_t total = v * static_cast<uint64_t>(acc.h) * 4 + (acc.has_bias ? v * 4 : 0);
  if (begin == 0 && end == 0) end = total;
  if (begin >= end || end > total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range [", begin, ", ", end, ") is not a non-empty byte range of accumulator '", name,
        "', whose dW | db holds ", total, " bytes"));
  }
  if (reset && (begin != 0 || end != total)) {
    return absl::InvalidArgumentError(
        "reset applies to whole fetches only; drop the accumulator after the last range");
  }
  return std::make_pair(begin, end);
}

}  // namespace

absl::Status Engine::CheckAccumulatorInstance(const std::string& expected,
                                              const std::string& name,
                                              absl::string_view field) const {
  if (expected.empty() || expected == options_.instance) return absl::OkStatus();
  LOSSD_RETURN_IF_ERROR(CheckIdLength(expected, field));
  return absl::FailedPreconditionError(absl::StrCat(
      field, " '", expected, "' is not this server (instance '", options_.instance,
      "'): accumulator '", ClippedText(name), "' began on another server instance (another "
      "replica, or "
      "this server before a restart, which lost its accumulators), and nothing of it is here. "
      "Keep a trainer's calls on one replica; after a restart drop the accumulator and start "
      "its sum again"));
}

absl::StatusOr<std::pair<uint64_t, uint64_t>> Engine::CheckFetch(const std::string& name,
                                                                 bool reset, uint64_t begin,
                                                                 uint64_t end,
                                                                 const std::string& caller) {
  LOSSD_RETURN_IF_ERROR(ValidateAccumulatorName(name, "accumulator"));
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<Accumulator> a, accumulators_.Get(name));
  LOSSD_RETURN_IF_ERROR(CheckOwner(a->owner, caller, absl::StrCat("accumulator '", name, "'")));
  return FetchRangeOf(*a, name, reset, begin, end);
}

namespace {

// A reset fetch's zeroing of the sum and its counts. A failed zero leaves a sum nobody can
// trust: the accumulator is marked poisoned.
absl::Status ZeroSum(Backend& backend, Accumulator& acc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(acc.mu) {
  absl::Status s = backend.Zero(*acc.dw);
  if (s.ok() && acc.db) s = backend.Zero(*acc.db);
  if (!s.ok()) {
    acc.poisoned = true;
    return s;
  }
  SetMicroBatches(acc, 0);
  acc.tokens = 0;
  ++acc.resets;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GradientsSnapshot> Engine::FetchGradients(const std::string& name, bool reset,
                                                         uint64_t begin, uint64_t end,
                                                         const std::string& caller) {
  LOSSD_RETURN_IF_ERROR(ValidateAccumulatorName(name, "accumulator"));
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<Accumulator> a, accumulators_.Get(name));
  Accumulator& acc = *a;
  LOSSD_RETURN_IF_ERROR(CheckOwner(acc.owner, caller, absl::StrCat("accumulator '", name, "'")));
  acc.last_used_ns.store(NowNs());
  LOSSD_ASSIGN_OR_RETURN(std::tie(begin, end), FetchRangeOf(acc, name, reset, begin, end));
  GradientsSnapshot g;
  g.v = acc.v;
  g.h = acc.h;
  g.has_bias = acc.has_bias;
  absl::MutexLock lock(&acc.mu);
  if (acc.poisoned) {
    return PartialSumError(name);
  }
  if (absl::Status nf = NonFiniteSumStatus(acc); !nf.ok()) {
    if (!reset) return nf;
    // A reset fetch of an overflowed sum is how a trainer skips the step: nothing to return,
    // but the accumulator starts over.
    LOSSD_RETURN_IF_ERROR(ZeroSum(*backend_, acc));
    ++acc.generation;
    acc.nonfinite_by.clear();
    return absl::FailedPreconditionError(absl::StrCat(
        nf.message(), "; this reset fetch returned nothing and zeroed it: the next Compute "
        "into it begins a new sum"));
  }
  g.micro_batches = acc.micro_batches;
  g.tokens = acc.tokens;
  ++acc.generation;  // a reset being undone must not hide that this fetch saw the sum
  g.begin = begin;
  g.end = end;
  g.data = NewHostBuffer(end - begin);
  const uint64_t dw_bytes = g.dw_bytes();
  if (begin < dw_bytes) {
    const uint64_t n = std::min(end, dw_bytes) - begin;
    LOSSD_RETURN_IF_ERROR(backend_->CopyFromBackend(*acc.dw, begin, g.data.get(), n));
  }
  if (end > dw_bytes) {
    const uint64_t from = std::max(begin, dw_bytes);
    LOSSD_RETURN_IF_ERROR(backend_->CopyFromBackend(*acc.db, from - dw_bytes,
                                                    g.data.get() + (from - begin), end - from));
  }
  if (reset) {
    LOSSD_RETURN_IF_ERROR(ZeroSum(*backend_, acc));
    g.reset_of = a;
    g.generation_after_reset = acc.generation;
  }
  return g;
}

std::string Engine::UndoReset(const GradientsSnapshot& g, const uint8_t* data) {
  if (g.reset_of == nullptr) return "";
  Accumulator& acc = *g.reset_of;
  auto now = accumulators_.Get(acc.name);
  if (!now.ok() || now->get() != &acc) {
    return absl::StrCat("; accumulator '", acc.name, "', which it reset, has been dropped since");
  }
  absl::MutexLock lock(&acc.mu);
  if (acc.poisoned) return "";
  if (acc.generation != g.generation_after_reset) {
    acc.poisoned = true;
    return absl::StrCat("; its reset could not be undone (a Compute has added to accumulator '",
                        acc.name, "' or a fetch has read it since), so the accumulator now "
                        "refuses further use until it is dropped");
  }
  absl::Status s = backend_->CopyToBackend(*acc.dw, 0, data, g.dw_bytes());
  if (s.ok() && acc.db) s = backend_->CopyToBackend(*acc.db, 0, data + g.dw_bytes(), g.db_bytes());
  if (!s.ok()) {
    acc.poisoned = true;
    return absl::StrCat("; undoing its reset failed (", s.message(), "), so accumulator '",
                        acc.name, "' now refuses further use until it is dropped");
  }
  SetMicroBatches(acc, g.micro_batches);
  acc.tokens = g.tokens;
  return absl::StrCat("; its reset was undone: accumulator '", acc.name, "' holds its ",
                      g.micro_batches, " micro-batches again");
}

absl::Status Engine::DropAccumulator(const std::string& name, const std::string& caller) {
  LOSSD_RETURN_IF_ERROR(ValidateAccumulatorName(name, "accumulator"));
  return accumulators_.Drop(name, caller);
}

}  // namespace lossd
