// SPDX-License-Identifier: Apache-2.0
// Fuzz target: the PutWeights path. The input is a list of records (see fuzz_env.h), each
// parsed as a lossd.v1.PutWeightsRequest, fed through what the PutWeights reactor does with
// them (TensorDescFromWire -> Engine::BeginPutWeights -> WriteWeights per part ->
// CommitWeights at the end of the stream). Promises checked: no crash or sanitizer report,
// refusals are clean errors, a committed handle serves exactly the bytes that were sent,
// --check_finite holds for what was committed (no NaN or Inf is ever stored), and an upload
// cut off or refused leaves no reservation behind. Part data is handed over at odd addresses
// too.
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "lossd/v1/lossd.pb.h"
#include "service/wire_convert.h"
#include "tests/fuzz/fuzz_env.h"

namespace lossd {
namespace fuzz {

namespace {

// One upload as the reactor holds it: the pending entry once a header came, and the bytes the
// stream wrote, in order.
struct Upload {
  std::unique_ptr<PendingWeights> pending;
  std::vector<uint8_t> sent_w, sent_bias;
};

// The header record: its descriptors read from the wire, then the engine's reservation.
// False when the stream ends here (a second header, or a clean refusal).
bool BeginUpload(Engine& engine, const v1::PutWeightsRequest& m, Upload* up) {
  if (up->pending) return false;  // the reactor refuses a second header
  auto w = TensorDescFromWire(m.header().has_w(), m.header().w(), "header.w");
  auto b = TensorDescFromWire(m.header().has_bias(), m.header().bias(), "header.bias");
  if (!w.ok() || !b.ok()) {
    CheckCleanError(w.ok() ? b.status() : w.status(), "TensorDescFromWire");
    return false;
  }
  auto p = engine.BeginPutWeights(*w, *b);
  if (!p.ok()) {
    CheckCleanError(p.status(), "Engine::BeginPutWeights");
    return false;
  }
  up->pending = std::move(*p);
  return true;
}

// A part record, written into the pending entry. False when the stream ends here (no header
// yet, a part the reactor refuses, or a clean refusal by the engine).
bool WritePart(Engine& engine, absl::string_view rec, const v1::PutWeightsRequest& m,
               Upload* up) {
  if (!up->pending) return false;  // the reactor wants a header first
  const v1::TensorPart& part = m.part();
  if ((part.tensor() != v1::TENSOR_W && part.tensor() != v1::TENSOR_BIAS) ||
      part.data().size() > kMaxPartBytes) {
    return false;  // refused by the reactor before the engine
  }
  const bool bias = part.tensor() == v1::TENSOR_BIAS;
  // The data at an odd address for records of odd size: a part's bytes may lie anywhere
  // in a received buffer, and every read of them must allow for that.
  const size_t shift = rec.size() % 2;
  std::vector<uint8_t> moved(part.data().size() + 1);  // never empty: data() not null
  std::memcpy(moved.data() + shift, part.data().data(), part.data().size());
  const absl::Status s = engine.WriteWeights(*up->pending, bias, part.offset(),
                                             moved.data() + shift, part.data().size());
  if (!s.ok()) {
    CheckCleanError(s, "Engine::WriteWeights");
    return false;
  }
  std::vector<uint8_t>& sent = bias ? up->sent_bias : up->sent_w;
  sent.insert(sent.end(), part.data().begin(), part.data().end());
  return true;
}

// --check_finite holds for what was committed: no NaN or Inf in `sent` (its bytes in dtype).
void CheckSentFinite(const std::vector<uint8_t>& sent, DType dtype, const char* what) {
  for (size_t i = 0; i < sent.size() / DTypeSize(dtype); ++i) {
    Check(std::isfinite(LoadAsFloat(sent.data(), dtype, i)), what);
  }
}

// Commits a whole upload; a committed handle serves exactly the bytes sent, and is gone once
// dropped.
void CommitAndCheck(Engine& engine, Upload* up) {
  const DType dtype = up->pending->entry->dtype;
  auto handle = engine.CommitWeights(std::move(up->pending));
  if (!handle.ok()) {
    CheckCleanError(handle.status(), "Engine::CommitWeights");
    return;
  }
  const std::vector<uint8_t>& sent_w = up->sent_w;
  const std::vector<uint8_t>& sent_bias = up->sent_bias;
  auto entry = engine.weights().Get(*handle);
  Check(entry.ok(), "a committed handle is not served");
  const WeightEntry& e = **entry;
  Check(e.w->size() == sent_w.size(), "committed w differs in size from what was sent");
  Check(std::memcmp(e.w->data(), sent_w.data(), sent_w.size()) == 0,
        "committed w differs from the bytes sent");
  Check(e.bias != nullptr || sent_bias.empty(), "bias bytes were taken without a bias");
  if (e.bias) {
    Check(e.bias->size() == sent_bias.size() &&
              std::memcmp(e.bias->data(), sent_bias.data(), sent_bias.size()) == 0,
          "committed bias differs from the bytes sent");
  }
  if (engine.options().check_finite) {
    CheckSentFinite(sent_w, dtype, "--check_finite: a non-finite value in w was committed");
    CheckSentFinite(sent_bias, dtype, "--check_finite: a non-finite value in bias was committed");
  }
  Check(engine.DropWeights(*handle).ok(), "DropWeights of a fresh handle failed");
  auto gone = engine.weights().Get(*handle);
  Check(!gone.ok() && gone.status().code() == absl::StatusCode::kNotFound,
        "a dropped handle is still served");
}

}  // namespace

void PutWeightsOneInput(const uint8_t* data, size_t size) {
  Engine& engine = *Env().engine;
  const std::vector<absl::string_view> records = SplitRecords(data, size, 256);
  Upload up;
  bool failed = false;
  for (absl::string_view rec : records) {
    v1::PutWeightsRequest m;
    if (!m.ParseFromArray(rec.data(), static_cast<int>(rec.size()))) {
      failed = true;
      break;
    }
    const bool ok = m.has_header() ? BeginUpload(engine, m, &up) : WritePart(engine, rec, m, &up);
    if (!ok) {
      failed = true;
      break;
    }
  }
  if (!failed && up.pending) CommitAndCheck(engine, &up);
  up.pending.reset();  // a stream cut off here: the reservation must go back
  CheckIdle("a PutWeights stream");
}

}  // namespace fuzz
}  // namespace lossd
