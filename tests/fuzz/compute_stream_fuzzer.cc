// SPDX-License-Identifier: Apache-2.0
// Fuzz target: one Compute stream as the server sees it. The input is a list of records (see
// fuzz_env.h), each one received message; the first must be the header. As in the raw
// Compute method, every record arrives as a gRPC byte buffer (split into slices at places
// the record's bytes choose, empty slices included) and is parsed in place by
// wire::StreamFrame; protobuf's own parse of the same bytes is the oracle for what it
// finds. Then ComputeSpecFromWire -> Engine::Plan -> admission -> ComputeAssembler::Accept
// (pieces, NaN/Inf checked part by part) for every part -> CheckComplete -> Engine::Run
// (skipping its own NaN/Inf scan, as the server does), as the reactor drives them. Promises
// checked: no crash or sanitizer report, no hang, the in-place parse agrees with protobuf,
// refusals are clean errors, a plan stays within the limits, a completed compute had finite
// inputs and returns exactly the planned outputs, accumulators count the micro-batch and
// serve any byte range of their dW | db, and nothing (memory, reservations, accumulators) is
// left behind. A header with `overlap` drives the overlapped path as the reactor does: the
// compute starts once every input but X is in and takes X's rows as the parts bring them
// (StreamedRows); a stream that fails or ends early fails the rows, and the compute with it
// unless every row was already in; dX rows are reported in increasing order and never ahead
// of the rows of X; a completed overlapped compute gives the same bits as the same inputs
// computed whole.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "wire/part_codec.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "core/dtype.h"
#include "lossd/v1/lossd.pb.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "service/compute_assembler.h"
#include "engine/streamed_rows.h"
#include "service/wire_convert.h"
#include "tests/fuzz/fuzz_env.h"

namespace lossd {
namespace fuzz {
namespace {

// Parts one fuzzed stream may send (the server's --max_parts_per_request): small, so that the
// refusal is reachable within the 256 records of an input.
constexpr uint64_t kMaxParts = 64;

uint64_t Fnv1a(absl::string_view bytes) {
  uint64_t h = 1469598103934665603ull;
  for (char c : bytes) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

// The record as gRPC may hand it to a raw method: one slice, or slices of 1..48 bytes with
// or without empty slices between them. Each slice is its own copy, so a read past one is
// a sanitizer report.
grpc::ByteBuffer AsReceived(absl::string_view record) {
  const uint64_t h = Fnv1a(record);
  std::vector<grpc::Slice> slices;
  if (h % 4 == 0 || record.empty()) {
    if (!record.empty()) slices.emplace_back(record.data(), record.size());
  } else {
    const size_t step = 1 + (h >> 2) % 48;
    const bool empties = ((h >> 10) & 1) != 0;
    for (size_t pos = 0; pos < record.size(); pos += step) {
      if (empties) slices.emplace_back();
      slices.emplace_back(record.data() + pos, std::min(step, record.size() - pos));
    }
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Parses `record` in place into `frame` as the raw Compute method does; when protobuf parses
// the same bytes too, both must have found the same message.
absl::Status ParseFrame(absl::string_view record, wire::StreamFrame* frame) {
  const grpc::ByteBuffer buffer = AsReceived(record);
  absl::Status parsed = frame->Parse(buffer);
  if (!parsed.ok()) {
    CheckCleanError(parsed, "wire::StreamFrame::Parse");
    return parsed;
  }
  v1::ComputeRequest m;
  if (!m.ParseFromArray(record.data(), static_cast<int>(record.size()))) return parsed;
  using Kind = wire::StreamFrame::Kind;
  switch (m.kind_case()) {
    case v1::ComputeRequest::kHeader: {
      Check(frame->kind() == Kind::kHeader, "protobuf parses a header, wire::StreamFrame does not");
      v1::ComputeHeader header;
      Check(header.ParseFromString(frame->header_bytes()),
            "the header bytes wire::StreamFrame found do not parse");
      Check(header.SerializeAsString() == m.header().SerializeAsString(),
            "wire::StreamFrame's header differs from protobuf's");
      break;
    }
    case v1::ComputeRequest::kPart: {
      Check(frame->kind() == Kind::kPart, "protobuf parses a part, wire::StreamFrame does not");
      const v1::TensorPart& p = m.part();
      Check(frame->tensor() == static_cast<int32_t>(p.tensor()),
            "wire::StreamFrame's part tensor differs from protobuf's");
      Check(frame->offset() == p.offset(), "StreamFrame's part offset differs from protobuf's");
      Check(frame->data_size() == p.data().size(),
            "wire::StreamFrame's part size differs from protobuf's");
      std::string data;
      for (const auto& piece : frame->data_pieces()) {
        data.append(reinterpret_cast<const char*>(piece.first), piece.second);
      }
      Check(data == p.data(), "wire::StreamFrame's part data pieces differ from protobuf's data");
      break;
    }
    default:
      Check(frame->kind() == Kind::kNone, "wire::StreamFrame finds a member protobuf does not");
  }
  return parsed;
}

// The oracle of --check_finite, element by element (a compute may succeed only when this
// holds): every float input is finite.
bool InputsFinite(const ComputePlan& plan, const Engine::InputBuffers& inputs) {
  for (int i = 0; i < static_cast<int>(InputSlot::kCount); ++i) {
    const InputSlot slot = static_cast<InputSlot>(i);
    if (plan.input_bytes[i] == 0 || slot == InputSlot::kTargets) continue;
    const DType dtype = slot == InputSlot::kClassWeights || slot == InputSlot::kGradOutput
                            ? DType::kF32
                            : plan.dtype;
    const uint64_t n = plan.input_bytes[i] / DTypeSize(dtype);
    for (uint64_t e = 0; e < n; ++e) {
      if (!std::isfinite(LoadAsFloat(inputs[i].get(), dtype, e))) return false;
    }
  }
  return true;
}

// A ranged fetch (FetchGradients' range_begin/range_end) with a range the input's bytes
// choose, empty or past the end at times: a valid range gives exactly those bytes of the whole
// snapshot `whole`, an invalid one a clean refusal; a ranged reset is refused and resets
// nothing.
void CheckRangeFetch(const std::string& name, const GradientsSnapshot& whole, uint64_t pick) {
  Engine& engine = *Env().engine;
  const uint64_t total = whole.dw_bytes() + whole.db_bytes();
  Check(whole.begin == 0 && whole.end == total, "a whole fetch does not cover dW | db");
  const uint64_t begin = pick % (total + 2), end = (pick >> 32) % (total + 2);
  auto r = engine.FetchGradients(name, /*reset=*/false, begin, end);
  if (begin == 0 && end == 0) {
    Check(r.ok() && r->begin == 0 && r->end == total, "the range (0, 0) is not the whole");
  } else if (begin < end && end <= total) {
    Check(r.ok(), "a valid range fetch failed");
    Check(r->begin == begin && r->end == end, "a range fetch covers other bytes");
    Check(std::memcmp(r->data.get(), whole.data.get() + begin, end - begin) == 0,
          "a range fetch differs from those bytes of the whole");
    auto reset = engine.FetchGradients(name, /*reset=*/true, begin, end);
    if (begin != 0 || end != total) {
      Check(!reset.ok(), "a ranged reset was accepted");
      CheckCleanError(reset.status(), "FetchGradients (ranged reset)");
      auto again = engine.FetchGradients(name, /*reset=*/false);
      Check(again.ok() && again->micro_batches == whole.micro_batches &&
                std::memcmp(again->data.get(), whole.data.get(), total) == 0,
            "a refused ranged reset changed the accumulator");
    }
  } else {
    Check(!r.ok(), "an empty or out-of-bounds range fetch was accepted");
    CheckCleanError(r.status(), "FetchGradients (range)");
  }
}

void CheckPlan(const ComputePlan& p) {
  Check(p.bt >= 1 && p.bt <= kMaxBT && p.h >= 1 && p.h <= kMaxH && p.v >= 1 && p.v <= kMaxV,
        "a plan outside the shape limits was accepted");
  Check(p.host_bytes <= kMaxRequestBytes, "a plan over max_request_bytes was accepted");
  uint64_t host = 0;
  for (uint64_t b : p.input_bytes) host += b;
  for (const OutputDesc& d : p.outputs) {
    uint64_t n = 1;
    for (int64_t s : d.shape) n *= static_cast<uint64_t>(s);
    Check(d.bytes == n * DTypeSize(d.dtype), "an output's bytes disagree with its shape");
    host += d.bytes;
  }
  Check(host == p.host_bytes, "plan.host_bytes is not the sum of its inputs and outputs");
  Check(p.input_bytes[static_cast<int>(InputSlot::kX)] ==
            static_cast<uint64_t>(p.bt * p.h) * DTypeSize(p.dtype),
        "x bytes disagree with (BT, H)");
  Check((p.weights != nullptr) == (p.input_bytes[static_cast<int>(InputSlot::kW)] == 0),
        "w is expected inline and by handle at once (or neither)");
}

void CheckOutcome(const ComputePlan& plan, const ComputeOutcome& out) {
  if (!out.status.ok()) {
    CheckCleanError(out.status, "Engine::Run");
    return;
  }
  Check(out.outputs.size() == plan.outputs.size(), "outputs differ in count from the plan");
  for (const auto& b : out.outputs) Check(b != nullptr, "a planned output is missing");
  Check(out.tokens >= 0 && out.tokens <= plan.bt, "tokens outside [0, BT]");
  Check(!(out.accuracy < 0.0f) && !(out.accuracy > 1.0f), "accuracy outside [0, 1]");
  if (out.tokens == 0 && plan.options.reduction != Reduction::kNone) {
    // Every target ignored: loss 0, never NaN (DESIGN.md).
    Check(out.loss == 0.0f, "an all-ignored batch gave a loss other than 0");
  }
}

// One overlapped compute, driven as the reactor drives it.
struct Overlapped {
  std::shared_ptr<StreamedRows> rows;
  std::shared_ptr<std::vector<HostBuffer>> outputs;
  std::shared_ptr<absl::Notification> done = std::make_shared<absl::Notification>();
  std::shared_ptr<ComputeOutcome> outcome = std::make_shared<ComputeOutcome>();
  // What DxReady reported: increasing, never ahead of the rows of X that had arrived.
  struct DxSeen {
    StreamedRows* rows = nullptr;
    int64_t last = 0;
    bool ahead = false, backwards = false;
  };
  std::shared_ptr<DxSeen> seen = std::make_shared<DxSeen>();

  // Every input but X is in: the compute starts on the executor, as MaybeStartCompute does.
  void Start(const std::shared_ptr<const ComputePlan>& plan, ComputeAssembler& assembler) {
    std::shared_ptr<DxSeen> s = seen;
    rows = std::make_shared<StreamedRows>(plan->bt, absl::Seconds(30), absl::InfiniteFuture(),
                                          [s](int64_t r) {
                                            if (r <= s->last) s->backwards = true;
                                            if (r > s->rows->arrived()) s->ahead = true;
                                            s->last = r;
                                          });
    seen->rows = rows.get();
    outputs = std::make_shared<std::vector<HostBuffer>>(Engine::NewOutputs(*plan));
    auto d = done;
    auto o = outcome;
    Env().engine->Run(plan, assembler.buffers(),
                      [d, o](ComputeOutcome r) {
                        *o = std::move(r);
                        d->Notify();
                      },
                      absl::InfiniteFuture(), assembler.finite_checked(),
                      OverlapIo{rows, outputs});
  }

  // The stream has ended (stream_ok: without a refused message).
  void Finish(const std::shared_ptr<const ComputePlan>& plan, ComputeAssembler& assembler,
              bool stream_ok) {
    absl::Status complete = stream_ok ? assembler.CheckComplete()
                                      : absl::InvalidArgumentError("the stream failed");
    if (stream_ok && !complete.ok()) CheckCleanError(complete, "ComputeAssembler::CheckComplete");
    if (complete.ok() && rows == nullptr) {
      Start(plan, assembler);  // X came before the other inputs: everything is in now
      rows->Arrived(plan->bt);
    }
    if (rows == nullptr) return;  // never started
    if (!complete.ok()) rows->Fail(complete);
    Check(done->WaitForNotificationWithTimeout(absl::Seconds(30)),
          "an overlapped Engine::Run did not finish within 30 s (hang)");
    ComputeOutcome& out = *outcome;
    Check(!seen->ahead, "dX rows were reported ahead of the rows of X that had arrived");
    Check(!seen->backwards, "dX rows were reported out of order");
    Check(out.outputs.empty(), "an overlapped compute returned outputs of its own");
    if (!out.status.ok()) {
      CheckCleanError(out.status, "Engine::Run (overlapped)");
      return;
    }
    Check(rows->arrived() == plan->bt, "an overlapped compute succeeded without all of X");
    if (!complete.ok()) return;  // the call fails anyway; the rows it needed were all in
    const bool finite = InputsFinite(*plan, *assembler.buffers());
    Check(finite, "an overlapped compute with a NaN/Inf input succeeded");
    out.outputs = std::move(*outputs);
    CheckOutcome(*plan, out);
    if (!plan->accumulator.empty()) return;  // a second run would add to it again
    ComputeOutcome whole = RunAndWait(plan, assembler.buffers(), assembler.finite_checked());
    Check(whole.status.ok(), "the same inputs computed whole failed");
    Check(std::memcmp(&whole.loss, &out.loss, sizeof(float)) == 0 &&
              std::memcmp(&whole.z_loss, &out.z_loss, sizeof(float)) == 0 &&
              whole.tokens == out.tokens,
          "the overlapped loss differs from the whole compute's");
    for (size_t i = 0; i < plan->outputs.size(); ++i) {
      Check(std::memcmp(whole.outputs[i].get(), out.outputs[i].get(), plan->outputs[i].bytes) == 0,
            "an overlapped output differs from the whole compute's");
    }
  }
};

// Admission, as the reactor does it. Nothing else holds memory, so a request that fits the
// budget is granted at once. False when the budget refuses it (cleanly, leaving nothing).
bool Admit(Engine& engine, const ComputePlan& plan) {
  bool granted = false;
  uint64_t ticket = 0;
  absl::Status admitted = engine.budget().Reserve(
      plan.admission_bytes(), "fuzz", [&granted](absl::Status s) { granted = s.ok(); },
      &ticket);
  if (!admitted.ok()) {
    CheckCleanError(admitted, "MemoryBudget::Reserve");
    CheckIdle("a refused admission");
    return false;
  }
  Check(granted, "an idle budget did not grant a request that fits");
  return true;
}

// The records after the header, each a part into the assembler (and, with `overlap`, X's rows
// to the started compute). False when a record fails the stream.
bool FeedParts(const std::vector<absl::string_view>& records, bool overlap,
               const std::shared_ptr<const ComputePlan>& plan, ComputeAssembler& assembler,
               wire::StreamFrame* frame, Overlapped* ov) {
  for (size_t i = 1; i < records.size(); ++i) {
    absl::Status s = ParseFrame(records[i], frame);  // an error fails the call
    if (s.ok() && frame->kind() != wire::StreamFrame::Kind::kPart) {
      // A second header or an empty message: the reactor refuses it.
      s = absl::InvalidArgumentError("not a part");
    }
    if (s.ok()) {
      s = assembler.Accept(frame->tensor(), frame->offset(), frame->data_pieces(),
                           frame->data_size());
      if (!s.ok()) CheckCleanError(s, "ComputeAssembler::Accept");
    }
    if (!s.ok()) {
      if (ov->rows != nullptr) ov->rows->Fail(s);
      return false;
    }
    if (overlap) {
      if (ov->rows == nullptr && assembler.AllButXComplete()) ov->Start(plan, assembler);
      if (ov->rows != nullptr) ov->rows->Arrived(assembler.XRowsReady());
    }
  }
  return true;
}

// After a successful compute into an accumulator: an overflowed sum is refused, naming the
// micro-batch; otherwise it counts the one micro-batch and serves any byte range (chosen by
// `seed`).
void CheckAccumulated(Engine& engine, const ComputePlan& plan, const ComputeOutcome& out,
                      uint64_t seed) {
  const bool sum_nonfinite = (out.stats.nonfinite & (kNonFiniteDw | kNonFiniteDb)) != 0;
  if (sum_nonfinite) {
    // Finite inputs can still overflow (a grad_scale near fp32's largest): the summary
    // says so and the accumulator refuses to be read until a reset or a drop.
    auto g = engine.FetchGradients(plan.accumulator, /*reset=*/false);
    Check(g.status().code() == absl::StatusCode::kFailedPrecondition &&
              absl::StrContains(g.status().message(), "holds a non-finite sum: micro-batch 1"),
          "an overflowed accumulator was not refused, naming the micro-batch");
    return;
  }
  auto g = engine.FetchGradients(plan.accumulator, /*reset=*/false);
  Check(g.ok(), "FetchGradients after a successful accumulation failed");
  Check(g->micro_batches == 1, "a fresh accumulator does not count one micro-batch");
  Check(g->tokens == out.tokens, "the accumulator's tokens differ from the compute's");
  Check(g->v == plan.v && g->h == plan.h, "the accumulator's shape is not the plan's");
  CheckRangeFetch(plan.accumulator, *g, seed);
}

// The stream ended without a refused message and without overlap: every input complete,
// then one Engine::Run (the assembler released before it, as the reactor does).
void RunWholeAndCheck(Engine& engine, const std::shared_ptr<const ComputePlan>& plan,
                      std::unique_ptr<ComputeAssembler>* assembler, uint64_t seed) {
  absl::Status complete = (*assembler)->CheckComplete();
  if (!complete.ok()) {
    CheckCleanError(complete, "ComputeAssembler::CheckComplete");
    return;
  }
  auto inputs = (*assembler)->buffers();
  const bool checked = (*assembler)->finite_checked();
  const bool finite = InputsFinite(*plan, *inputs);
  assembler->reset();
  ComputeOutcome out = RunAndWait(plan, std::move(inputs), checked);
  CheckOutcome(*plan, out);
  Check(finite || !out.status.ok(),
        "a compute with a NaN/Inf input succeeded (--check_finite is on)");
  if (!plan->accumulator.empty() && out.status.ok()) CheckAccumulated(engine, *plan, out, seed);
}

}  // namespace

void ComputeStreamOneInput(const uint8_t* data, size_t size) {
  FuzzEnv& env = Env();
  Engine& engine = *env.engine;
  const std::vector<absl::string_view> records = SplitRecords(data, size, 256);
  if (records.empty()) return;
  wire::StreamFrame frame;
  if (!ParseFrame(records[0], &frame).ok()) return;  // the reactor refuses the call
  if (frame.kind() != wire::StreamFrame::Kind::kHeader) return;  // refused as well
  v1::ComputeHeader header;
  if (!header.ParseFromString(frame.header_bytes())) return;

  auto planned = PlanFromWire(engine, header);
  if (!planned.ok()) return;
  CheckPlan(*planned);
  auto plan = std::make_shared<const ComputePlan>(std::move(*planned));
  if (!Admit(engine, *plan)) return;

  auto assembler = std::make_unique<ComputeAssembler>(plan, kMaxPartBytes, kMaxParts,
                                                      /*check_finite=*/true);
  Overlapped ov;
  const bool stream_ok = FeedParts(records, header.overlap(), plan, *assembler, &frame, &ov);
  if (header.overlap()) {
    ov.Finish(plan, *assembler, stream_ok);
    assembler.reset();
  } else if (stream_ok) {
    RunWholeAndCheck(engine, plan, &assembler,
                     Fnv1a(absl::string_view(reinterpret_cast<const char*>(data), size)));
  }
  assembler.reset();
  engine.budget().Release(plan->admission_bytes());
  if (!plan->accumulator.empty()) (void)engine.DropAccumulator(plan->accumulator);
  CheckIdle("a Compute stream");
}

}  // namespace fuzz
}  // namespace lossd
