// Fuzz target: one Compute stream as the server sees it. The input is a list of records (see
// fuzz_env.h), each parsed as a lossd.v1.ComputeRequest; the first must be the header. It
// goes through ComputeSpecFromWire -> Engine::Plan -> admission -> ComputeAssembler::Accept
// for every part -> CheckComplete -> Engine::Run, as the reactor drives them. Promises
// checked: no crash or sanitizer report, no hang, refusals are clean errors, a plan stays
// within the limits, a completed compute returns exactly the planned outputs, accumulators
// count the micro-batch, and nothing (memory, reservations, accumulators) is left behind.
#include <cmath>
#include <memory>
#include <utility>

#include "lossd/v1/lossd.pb.h"
#include "server/compute_assembler.h"
#include "server/wire_convert.h"
#include "tests/fuzz/fuzz_env.h"

namespace lossd {
namespace fuzz {
namespace {

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

}  // namespace

void ComputeStreamOneInput(const uint8_t* data, size_t size) {
  FuzzEnv& env = Env();
  Engine& engine = *env.engine;
  const std::vector<absl::string_view> records = SplitRecords(data, size, 256);
  if (records.empty()) return;
  v1::ComputeRequest first;
  if (!first.ParseFromArray(records[0].data(), static_cast<int>(records[0].size()))) return;
  if (!first.has_header()) return;  // the reactor refuses this before any engine call

  auto spec = ComputeSpecFromWire(first.header());
  if (!spec.ok()) {
    CheckCleanError(spec.status(), "ComputeSpecFromWire");
    return;
  }
  auto planned = engine.Plan(*spec);
  if (!planned.ok()) {
    CheckCleanError(planned.status(), "Engine::Plan");
    return;
  }
  CheckPlan(*planned);
  auto plan = std::make_shared<const ComputePlan>(std::move(*planned));

  // Admission, as the reactor does it. Nothing else holds memory, so a request that fits the
  // budget is granted at once.
  bool granted = false;
  uint64_t ticket = 0;
  absl::Status admitted = engine.budget().Reserve(
      plan->admission_bytes(), "fuzz", [&granted](absl::Status s) { granted = s.ok(); },
      &ticket);
  if (!admitted.ok()) {
    CheckCleanError(admitted, "MemoryBudget::Reserve");
    CheckIdle("a refused admission");
    return;
  }
  Check(granted, "an idle budget did not grant a request that fits");

  auto assembler = std::make_unique<ComputeAssembler>(plan, kMaxPartBytes);
  bool stream_ok = true;
  for (size_t i = 1; i < records.size(); ++i) {
    v1::ComputeRequest m;
    if (!m.ParseFromArray(records[i].data(), static_cast<int>(records[i].size()))) {
      stream_ok = false;  // gRPC would fail the call before the reactor sees it
      break;
    }
    if (!m.has_part()) {
      stream_ok = false;  // a second header or an empty message: the reactor refuses it
      break;
    }
    absl::Status s = assembler->Accept(m.part());
    if (!s.ok()) {
      CheckCleanError(s, "ComputeAssembler::Accept");
      stream_ok = false;
      break;
    }
  }
  if (stream_ok) {
    absl::Status complete = assembler->CheckComplete();
    if (!complete.ok()) {
      CheckCleanError(complete, "ComputeAssembler::CheckComplete");
    } else {
      auto inputs = assembler->buffers();
      assembler.reset();
      ComputeOutcome out = RunAndWait(plan, std::move(inputs));
      CheckOutcome(*plan, out);
      if (!plan->accumulator.empty() && out.status.ok()) {
        auto g = engine.FetchGradients(plan->accumulator, /*reset=*/false);
        Check(g.ok(), "FetchGradients after a successful accumulation failed");
        Check(g->micro_batches == 1, "a fresh accumulator does not count one micro-batch");
        Check(g->tokens == out.tokens, "the accumulator's tokens differ from the compute's");
        Check(g->v == plan->v && g->h == plan->h, "the accumulator's shape is not the plan's");
      }
    }
  }
  assembler.reset();
  engine.budget().Release(plan->admission_bytes());
  if (!plan->accumulator.empty()) (void)engine.DropAccumulator(plan->accumulator);
  CheckIdle("a Compute stream");
}

}  // namespace fuzz
}  // namespace lossd
