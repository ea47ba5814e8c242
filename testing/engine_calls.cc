#include "testing/engine_calls.h"

#include <cstring>
#include <future>
#include <utility>
#include <vector>

namespace lossd {

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

ComputeOutcome RunSync(Engine& e, const ComputePlan& plan,
                       std::shared_ptr<Engine::InputBuffers> in) {
  std::promise<ComputeOutcome> done;
  e.Run(std::make_shared<const ComputePlan>(plan), in,
        [&](ComputeOutcome o) { done.set_value(std::move(o)); });
  return done.get_future().get();
}

ComputeOutcome AddRandomMicroBatch(Engine& engine, const std::string& name) {
  RandomProblemSpec rs;
  rs.bt = 4;
  rs.h = 3;
  rs.v = 5;
  RandomProblem rp = RandomProblem::Make(rs);
  ComputeSpec spec = ComputeSpecFor(rp);
  spec.accumulator = name;
  auto plan = engine.Plan(spec);
  if (!plan.ok()) {
    ComputeOutcome refused;
    refused.status = plan.status();
    return refused;
  }
  return RunSync(engine, *plan, InputBuffersFor(rp, *plan));
}

void DrainExecutor(Engine& engine) {
  std::promise<void> ran;
  engine.Submit([&] { ran.set_value(); });
  ran.get_future().wait();
}

}  // namespace lossd
