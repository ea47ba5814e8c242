// SPDX-License-Identifier: Apache-2.0
// Fuzz target: option handling. The input is one serialized lossd.v1.ComputeHeader; it goes
// through ComputeSpecFromWire and Engine::Plan. A header the engine accepts is then run with
// valid inputs made up here (finite values, targets in range or ignore_index) drawn from a
// seed taken from the input, so that every accepted combination of shapes, dtypes and options
// is also computed: the compute must succeed, and for cross-entropy where the options are in
// the range the tolerance table models it must match the float64 reference (every loss kind is
// computed, its own inputs made up too).
#include <cmath>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "kernels/cpu/reference.h"
#include "testing/test_util.h"
#include "lossd/v1/lossd.pb.h"
#include "service/wire_convert.h"
#include "tests/fuzz/fuzz_env.h"

namespace lossd {
namespace fuzz {
namespace {

uint64_t Fnv1a(const uint8_t* data, size_t size) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 1099511628211ull;
  return h;
}

struct Rng {
  uint64_t s;
  uint32_t Next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(s >> 33);
  }
  float Uniform(float lo, float hi) { return lo + (hi - lo) * (Next() % 100001) / 100000.0f; }
};

// The loss kinds' own inputs a plan sends: upstream gradients and advantages in [-2, 2), old
// and reference log-probs in [-4, 0), the teacher as X and W below (its own hidden size).
void FillKindInputs(const ComputePlan& p, Rng* rng, Engine::InputBuffers* in) {
  auto rows = [&](InputSlot s, float lo, float hi) {
    if (p.input_bytes[static_cast<int>(s)] == 0) return;
    float* f = reinterpret_cast<float*>((*in)[static_cast<int>(s)].get());
    for (int64_t i = 0; i < p.bt; ++i) f[i] = rng->Uniform(lo, hi);
  };
  rows(InputSlot::kDlogp, -2, 2);
  rows(InputSlot::kDentropy, -2, 2);
  rows(InputSlot::kAdvantages, -2, 2);
  rows(InputSlot::kOldLogp, -4, 0);
  rows(InputSlot::kRefLogp, -4, 0);
  auto stored = [&](InputSlot s, int64_t n, float scale) {
    if (p.input_bytes[static_cast<int>(s)] == 0) return;
    uint8_t* b = (*in)[static_cast<int>(s)].get();
    for (int64_t i = 0; i < n; ++i) StoreFromFloat(b, p.dtype, i, scale * rng->Uniform(-1, 1));
  };
  const int64_t ht = p.teacher_h;
  stored(InputSlot::kTeacherX, p.bt * ht, 2.0f);
  stored(InputSlot::kTeacherW, p.v * ht, ht > 0 ? 2.0f / std::sqrt(static_cast<float>(ht)) : 0);
  stored(InputSlot::kTeacherBias, p.v, 0.5f);
}

// Valid inputs for a plan: X in [-2, 2), inline W scaled by 1/sqrt(H) so logits are O(1..4),
// targets mostly in range with some ignore_index, class weights in [0.25, 2), grad_output in
// [-2, 2).
std::shared_ptr<Engine::InputBuffers> MakeInputs(const ComputePlan& p, Rng* rng) {
  auto in = std::make_shared<Engine::InputBuffers>();
  auto slot = [&](InputSlot s) -> HostBuffer& { return (*in)[static_cast<int>(s)]; };
  auto bytes = [&](InputSlot s) { return p.input_bytes[static_cast<int>(s)]; };
  for (int i = 0; i < static_cast<int>(InputSlot::kCount); ++i) {
    if (p.input_bytes[i] > 0) (*in)[i] = NewHostBuffer(p.input_bytes[i]);
  }
  // A two-phase backward sends no X (its ticket holds it).
  for (int64_t i = 0; bytes(InputSlot::kX) > 0 && i < p.bt * p.h; ++i) {
    StoreFromFloat(slot(InputSlot::kX).get(), p.dtype, i, rng->Uniform(-2, 2));
  }
  if (bytes(InputSlot::kW) > 0) {
    const float scale = 2.0f / std::sqrt(static_cast<float>(p.h));
    for (int64_t i = 0; i < p.v * p.h; ++i) {
      StoreFromFloat(slot(InputSlot::kW).get(), p.dtype, i, scale * rng->Uniform(-1, 1));
    }
  }
  if (bytes(InputSlot::kBias) > 0) {
    for (int64_t i = 0; i < p.v; ++i) {
      StoreFromFloat(slot(InputSlot::kBias).get(), p.dtype, i, rng->Uniform(-0.5f, 0.5f));
    }
  }
  // Distill may come without targets (every row counts).
  for (int64_t i = 0; bytes(InputSlot::kTargets) > 0 && i < p.bt; ++i) {
    int64_t t = (rng->Next() % 8 == 0) ? p.options.ignore_index
                                       : static_cast<int64_t>(rng->Next() % p.v);
    if (p.target_dtype == DType::kI32) {
      // An ignore_index that int32 cannot hold cannot be sent as an int32 target.
      if (t != static_cast<int32_t>(t)) t = static_cast<int64_t>(rng->Next() % p.v);
      reinterpret_cast<int32_t*>(slot(InputSlot::kTargets).get())[i] = static_cast<int32_t>(t);
    } else {
      reinterpret_cast<int64_t*>(slot(InputSlot::kTargets).get())[i] = t;
    }
  }
  if (bytes(InputSlot::kClassWeights) > 0) {
    float* cw = reinterpret_cast<float*>(slot(InputSlot::kClassWeights).get());
    for (int64_t j = 0; j < p.v; ++j) cw[j] = rng->Uniform(0.25f, 2.0f);
  }
  if (bytes(InputSlot::kGradOutput) > 0) {
    float* go = reinterpret_cast<float*>(slot(InputSlot::kGradOutput).get());
    for (int64_t i = 0; i < p.bt; ++i) go[i] = rng->Uniform(-2.0f, 2.0f);
  }
  FillKindInputs(p, rng, in.get());
  return in;
}

// The range the tolerance table is derived for (first-order rounding bounds, no underflow or
// overflow of the gradient dtype); outside it a mismatch says more about the bound than about
// the backend. Gradients of a tiny grad_scale underflow to 0 (regressions/options/*_underflow_*)
// and fp16 ones of a large grad_scale overflow: that is the dtype's range, not an error.
bool InModeledRange(const ComputePlan& p) {
  const LossOptions& o = p.options;
  const float g = std::fabs(o.grad_scale);
  // G itself is stored in the input dtype, so fp16 inputs bound it even with fp32 gradients
  // (regressions/options/fp16_inputs_g_underflows_with_fp32_grads).
  const bool half = p.dtype == DType::kF16 || p.grad_dtype == DType::kF16;
  const bool grad_ok = g == 0.0f || (half ? (g >= 0.1f && g <= 10.0f) : (g >= 1e-30f && g <= 1e3f));
  // A denormal z-loss scale alone (V = 1: the cross-entropy gradient is 0) gives gradients
  // below fp32's normal range (regressions/options/fp32_grads_underflow_denormal_z_loss_v1).
  const bool z_ok =
      o.z_loss_scale == 0.0f || (o.z_loss_scale >= 1e-6f && o.z_loss_scale <= 1.0f);
  // One class and no z-loss: the softmax is exactly 1, so the gradient is exactly 0, and what
  // the fp32 arithmetic leaves of a p - hot - sm cw (about 1e-8 with label smoothing) has no
  // norm to be relative to (regressions/options/v1_smoothing_gradient_cancels_to_rounding).
  const bool cancels = p.v == 1 && o.z_loss_scale == 0.0f;
  return grad_ok && z_ok && !cancels &&
         (o.softcap == 0.0f || (o.softcap >= 1.0f && o.softcap <= 1e4f));
}

void CompareWithReference(const ComputePlan& plan, const Engine::InputBuffers& in,
                          ComputeOutcome& out) {
  auto buf = [&](InputSlot s) -> const void* { return in[static_cast<int>(s)].get(); };
  const FuzzEnv& env = Env();
  LossProblem p;
  p.bt = plan.bt;
  p.h = plan.h;
  p.v = plan.v;
  p.dtype = plan.dtype;
  p.x = buf(InputSlot::kX);
  if (plan.weights) {
    // Only the preloaded weights can be named by a handle here.
    p.w = env.preload_w.data();
    p.bias = env.preload_bias.data();
  } else {
    p.w = buf(InputSlot::kW);
    p.bias = plan.has_bias ? buf(InputSlot::kBias) : nullptr;
  }
  p.targets = buf(InputSlot::kTargets);
  p.target_dtype = plan.target_dtype;
  p.class_weights = static_cast<const float*>(buf(InputSlot::kClassWeights));
  p.grad_output = static_cast<const float*>(buf(InputSlot::kGradOutput));
  p.options = plan.options;
  ReferenceOutputs ref;
  absl::Status s = ReferenceCompute(p, &ref);
  Check(s.ok(), "the reference refused inputs the engine accepted");

  LossOutputs got;
  got.grad_dtype = plan.grad_dtype;
  float loss = out.loss, z_loss = out.z_loss, accuracy = out.accuracy;
  int64_t tokens = out.tokens;
  const bool none = plan.options.reduction == Reduction::kNone;
  if (!none) {
    got.loss = &loss;
    got.z_loss = plan.wanted.z_loss ? &z_loss : nullptr;
  }
  // A near-tie argmax may flip under the stored-logit rounding; the checker accepts such a
  // flip only by looking at the predictions, so accuracy is judged only when they were sent
  // (regressions/options/accuracy_near_tie_without_predictions).
  got.accuracy = plan.wanted.predictions ? &accuracy : nullptr;
  got.tokens = &tokens;
  for (size_t i = 0; i < plan.outputs.size(); ++i) {
    BindOutput(plan.outputs[i].slot, out.outputs[i].get(), &got);
  }
  LogitStats stats = ComputeLogitStats(p);
  ::testing::AssertionResult r = MatchesReference(p, stats, ref, got);
  if (!r) {
    std::fprintf(stderr, "%s\n", r.message());
    Check(false, "a compute with modeled options does not match the float64 reference");
  }
}

// The backward of a two-phase forward the fuzzer just kept, at once, with random upstream
// gradients: the backward's path runs for every kept forward, and no ticket piles up. The
// engine may refuse it as it refuses the one-phase call (the loss overflows fp32: logits over a
// tiny temperature); a refused backward keeps its ticket for a retry, so the harness consumes
// it itself.
void RunBackward(const ComputePlan& forward, const std::string& ticket, Rng* rng) {
  ComputeSpec spec;
  spec.kind = LossKind::kLogprob;
  spec.ticket = ticket;
  for (InputSlot s : {InputSlot::kDlogp, InputSlot::kDentropy}) {
    TensorDesc& t = spec.inputs[static_cast<int>(s)];
    t.present = true;
    t.dtype = DType::kF32;
    t.shape = {forward.bt};
  }
  spec.wanted.dx = spec.wanted.dw = true;
  auto planned = Env().engine->Plan(spec);
  if (!planned.ok()) std::fprintf(stderr, "status: %s\n", planned.status().ToString().c_str());
  Check(planned.ok(), "the backward of a ticket just kept was refused");
  auto plan = std::make_shared<const ComputePlan>(std::move(*planned));
  ComputeOutcome out = RunAndWait(plan, MakeInputs(*plan, rng));
  if (absl::IsInvalidArgument(out.status) &&
      absl::StrContains(out.status.message(), "the loss is not finite")) {
    TicketStore& store = Env().engine->tickets();
    auto kept = store.Get(ticket, "");
    Check(kept.ok(), "a ticket whose backward was refused is gone");
    Check(store.Claim(**kept).ok(), "a ticket whose backward was refused cannot be claimed");
    store.Consume(**kept);
    return;
  }
  if (!out.status.ok()) std::fprintf(stderr, "status: %s\n", out.status.ToString().c_str());
  Check(out.status.ok(), "the backward of a ticket just kept failed");
  Check(Env().engine->tickets().count() == 0, "a consumed ticket is still held");
}

}  // namespace

void OptionsOneInput(const uint8_t* data, size_t size) {
  v1::ComputeHeader header;
  if (!header.ParseFromArray(data, static_cast<int>(size))) return;
  Engine& engine = *Env().engine;
  auto planned = PlanFromWire(engine, header);
  if (!planned.ok()) return;
  auto plan = std::make_shared<const ComputePlan>(std::move(*planned));
  Check(plan->admission_bytes() <= kMemoryBudget,
        "a plan within the shape and request limits exceeds the memory budget");
  Rng rng{Fnv1a(data, size)};
  std::shared_ptr<Engine::InputBuffers> inputs = MakeInputs(*plan, &rng);
  ComputeOutcome out = RunAndWait(plan, inputs);
  if (!plan->accumulator.empty()) (void)engine.DropAccumulator(plan->accumulator);
  if (absl::IsInvalidArgument(out.status) &&
      absl::StrContains(out.status.message(), "the loss is not finite")) {
    CheckIdle("an options input whose loss overflows fp32");  // a clean, documented refusal
    return;
  }
  if (!out.status.ok()) {
    std::fprintf(stderr, "status: %s\n", out.status.ToString().c_str());
    Check(false, "a compute of valid inputs under accepted options failed");
  }
  if (!out.ticket.empty()) RunBackward(*plan, out.ticket, &rng);
  // The other loss kinds' references are their backends' and the end-to-end tests' oracle;
  // here they must compute (and stay finite) under every option the engine accepts.
  if (plan->kind == LossKind::kCrossEntropy && InModeledRange(*plan)) {
    CompareWithReference(*plan, *inputs, out);
  }
  CheckIdle("an options input");
}

}  // namespace fuzz
}  // namespace lossd
