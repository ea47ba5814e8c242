// SPDX-License-Identifier: Apache-2.0
#include "core/status_macros.h"
#include "engine/fetch_lease.h"

#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {
namespace {

std::string Describe(const FetchRequest& r) {
  return absl::StrCat("fetching bytes [", r.begin, ", ", r.end, ") of accumulator '",
                      r.accumulator, "'");
}

}  // namespace

FetchLease::FetchLease(Engine* engine, FetchRequest request)
    : engine_(engine), request_(std::move(request)), admission_(&engine->budget()) {}

absl::StatusOr<std::unique_ptr<FetchLease>> FetchLease::Check(Engine* engine,
                                                              FetchRequest request) {
  LOSSD_RETURN_IF_ERROR(engine->CheckAccumulatorInstance(
      request.accumulator_instance, request.accumulator, "accumulator_instance"));
  auto range = engine->CheckFetch(request.accumulator, request.reset, request.begin,
                                  request.end, request.principal);
  if (!range.ok()) return range.status();
  std::tie(request.begin, request.end) = *range;
  const uint64_t bytes = request.end - request.begin;
  if (bytes > engine->budget().budget()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        Describe(request), " needs a host copy of ", bytes,
        " bytes, more than the whole memory budget of ", engine->budget().budget(),
        " bytes (--memory_budget_bytes); fetch it in smaller ranges (range_begin, range_end)"));
  }
  return std::unique_ptr<FetchLease>(new FetchLease(engine, std::move(request)));
}

FetchLease::~FetchLease() { Delivered(false); }

absl::Status FetchLease::Admit(MemoryBudget::Callback admitted) {
  return admission_.Request(request_.end - request_.begin, Describe(request_),
                            std::move(admitted));
}

absl::Status FetchLease::TakeSnapshot() {
  auto g = engine_->FetchGradients(request_.accumulator, request_.reset, request_.begin,
                                   request_.end, request_.principal);
  if (!g.ok()) return g.status();
  snapshot_ = std::move(*g);
  data_ = std::make_shared<std::vector<HostBuffer>>();
  data_->push_back(std::move(snapshot_.data));
  return absl::OkStatus();
}

void FetchLease::Settle(absl::Status s, bool client_gone,
                        std::function<void(absl::Status)> finish) {
  if (s.ok() && snapshot_.reset_of != nullptr && client_gone) {
    // Every part was written, but the client gave up before the status: it can only see a
    // failure, so this is one.
    s = absl::CancelledError("the call was cancelled before its OK status went out");
  }
  // The buffer goes back once the sender has released every slice of it; a reset fetch that
  // went well keeps it until Delivered says whether the OK reached the client.
  auto done = [this, finish = std::move(finish)](absl::Status st) {
    if (!(st.ok() && holds_reset())) data_.reset();
    admission_.Release();
    finish(std::move(st));
  };
  if (!s.ok() && holds_reset()) {
    // The accumulator was reset for data that did not arrive: put the sum back.
    engine_->Submit([this, s, done = std::move(done)] {
      const std::string said = engine_->UndoReset(snapshot_, (*data_)[0].get());
      done(absl::Status(s.code(), absl::StrCat(s.message(), said)));
    });
    return;
  }
  done(std::move(s));
}

void FetchLease::Delivered(bool delivered) {
  if (delivered || !holds_reset()) {
    if (delivered) data_.reset();
    return;
  }
  // Finished OK, but the status never reached the client (it gave up at the last moment):
  // it sees a failure, so the reset is undone as for one. The job owns what it needs.
  Engine* engine = engine_;
  auto snapshot = std::make_shared<GradientsSnapshot>(std::move(snapshot_));
  engine->Submit([engine, snapshot, data = std::move(data_)] {
    engine->UndoReset(*snapshot, (*data)[0].get());
  });
  snapshot_ = GradientsSnapshot();
}

}  // namespace lossd
