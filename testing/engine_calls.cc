// SPDX-License-Identifier: Apache-2.0
#include "testing/engine_calls.h"

#include <cstring>
#include <future>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {

TensorDesc InputDesc(DType dtype, std::vector<int64_t> shape) {
  TensorDesc t;
  t.present = true;
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

void SetInput(ComputeSpec* spec, InputSlot slot, TensorDesc t) {
  spec->inputs[static_cast<int>(slot)] = std::move(t);
}

std::vector<float> RandomRows(int64_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> r(n);
  for (float& f : r) f = u(g);
  return r;
}

ComputeSpec ComputeSpecFor(const RandomProblem& rp) {
  const RandomProblemSpec& s = rp.spec();
  ComputeSpec c;
  auto set = [&](InputSlot slot, DType dt, std::vector<int64_t> shape) {
    TensorDesc& t = c.inputs[static_cast<int>(slot)];
    t.present = true;
    t.dtype = dt;
    t.shape = std::move(shape);
  };
  set(InputSlot::kX, s.dtype, {s.bt, s.h});
  set(InputSlot::kW, s.dtype, {s.v, s.h});
  set(InputSlot::kTargets, s.target_dtype, {s.bt});
  c.options = s.options;
  c.wanted.dx = c.wanted.dw = true;
  return c;
}

std::shared_ptr<Engine::InputBuffers> InputBuffersFor(const RandomProblem& rp,
                                                      const ComputePlan& plan) {
  auto in = std::make_shared<Engine::InputBuffers>();
  LossProblem p = rp.problem();
  auto copy = [&](InputSlot s, const void* src) {
    const uint64_t n = plan.input_bytes[static_cast<int>(s)];
    (*in)[static_cast<int>(s)] = NewHostBuffer(n);
    std::memcpy((*in)[static_cast<int>(s)].get(), src, n);
  };
  copy(InputSlot::kX, p.x);
  copy(InputSlot::kW, p.w);
  copy(InputSlot::kTargets, p.targets);
  return in;
}

InputSources InputSourcesOf(const LossProblem& p) {
  InputSources src{};
  src[static_cast<int>(InputSlot::kX)] = p.x;
  src[static_cast<int>(InputSlot::kW)] = p.w;
  src[static_cast<int>(InputSlot::kBias)] = p.bias;
  src[static_cast<int>(InputSlot::kTargets)] = p.targets;
  return src;
}

std::shared_ptr<Engine::InputBuffers> InputBuffersFrom(const ComputePlan& plan,
                                                       const InputSources& src) {
  auto in = std::make_shared<Engine::InputBuffers>();
  for (int i = 0; i < static_cast<int>(InputSlot::kCount); ++i) {
    const uint64_t n = plan.input_bytes[i];
    if (n == 0) continue;
    (*in)[i] = NewHostBuffer(n);
    if (src[i] == nullptr) {
      ADD_FAILURE() << "the plan sends input " << InputSlotName(static_cast<InputSlot>(i))
                    << " and the test gave no source for it";
      std::memset((*in)[i].get(), 0, n);
      continue;
    }
    std::memcpy((*in)[i].get(), src[i], n);
  }
  return in;
}

ComputeOutcome RunSync(Engine& e, const ComputePlan& plan,
                       std::shared_ptr<Engine::InputBuffers> in) {
  std::promise<ComputeOutcome> done;
  e.Run(std::make_shared<const ComputePlan>(plan), in,
        [&](ComputeOutcome o) { done.set_value(std::move(o)); });
  return done.get_future().get();
}

ComputeOutcome PlanAndRun(Engine& e, const ComputeSpec& spec, const InputsForPlan& inputs) {
  auto plan = e.Plan(spec);
  if (!plan.ok()) {
    ComputeOutcome refused;
    refused.status = plan.status();
    return refused;
  }
  return RunSync(e, *plan, inputs(*plan));
}

absl::StatusOr<std::string> UploadWeights(Engine& e, DType dtype, int64_t v, int64_t h,
                                          const std::vector<uint8_t>& w,
                                          const std::vector<uint8_t>& bias,
                                          const std::string& owner) {
  const TensorDesc b = bias.empty() ? TensorDesc{} : InputDesc(dtype, {v});
  auto p = e.BeginPutWeights(InputDesc(dtype, {v, h}), b, owner);
  if (!p.ok()) return p.status();
  absl::Status s = e.WriteWeights(**p, false, 0, w.data(), w.size());
  if (!s.ok()) return s;
  if (!bias.empty()) {
    s = e.WriteWeights(**p, true, 0, bias.data(), bias.size());
    if (!s.ok()) return s;
  }
  return e.CommitWeights(std::move(*p));
}

absl::Status CreateHead(Engine& e, const HeadSpec& spec, const std::vector<uint8_t>& master_w) {
  auto c = e.heads().BeginCreate(spec, "");
  if (!c.ok()) return c.status();
  if (c->pending == nullptr) {
    return absl::AlreadyExistsError("head '" + spec.name + "' is already here at its version");
  }
  absl::Status s =
      e.heads().WriteCreate(*c->pending, HeadTensor::kMasterW, 0, master_w.data(), master_w.size());
  if (!s.ok()) return s;
  return e.heads().CommitCreate(std::move(c->pending)).status();
}

ComputeOutcome AddRandomMicroBatch(Engine& engine, const std::string& name) {
  RandomProblemSpec rs;
  rs.bt = 4;
  rs.h = 3;
  rs.v = 5;
  RandomProblem rp = RandomProblem::Make(rs);
  ComputeSpec spec = ComputeSpecFor(rp);
  spec.accumulator = name;
  return PlanAndRun(engine, spec,
                    [&](const ComputePlan& plan) { return InputBuffersFor(rp, plan); });
}

void DrainExecutor(Engine& engine) {
  std::promise<void> ran;
  engine.Submit([&] { ran.set_value(); });
  ran.get_future().wait();
}

}  // namespace lossd
