#include "testing/engine_calls.h"

#include <cstring>
#include <future>
#include <memory>
#include <utility>

#include "testing/test_util.h"

namespace lossd {

ComputeOutcome AddRandomMicroBatch(Engine& engine, const std::string& name) {
  RandomProblemSpec rs;
  rs.bt = 4;
  rs.h = 3;
  rs.v = 5;
  RandomProblem rp = RandomProblem::Make(rs);
  ComputeSpec spec;
  auto set = [&](InputSlot slot, DType dt, std::vector<int64_t> shape) {
    TensorDesc& t = spec.inputs[static_cast<int>(slot)];
    t.present = true;
    t.dtype = dt;
    t.shape = std::move(shape);
  };
  set(InputSlot::kX, rs.dtype, {rs.bt, rs.h});
  set(InputSlot::kW, rs.dtype, {rs.v, rs.h});
  set(InputSlot::kTargets, rs.target_dtype, {rs.bt});
  spec.options = rs.options;
  spec.wanted.dw = true;
  spec.accumulator = name;
  auto plan = engine.Plan(spec);
  if (!plan.ok()) {
    ComputeOutcome refused;
    refused.status = plan.status();
    return refused;
  }
  auto in = std::make_shared<Engine::InputBuffers>();
  LossProblem p = rp.problem();
  for (auto [slot, src] : {std::pair<InputSlot, const void*>{InputSlot::kX, p.x},
                           {InputSlot::kW, p.w},
                           {InputSlot::kTargets, p.targets}}) {
    const uint64_t n = plan->input_bytes[static_cast<int>(slot)];
    (*in)[static_cast<int>(slot)] = NewHostBuffer(n);
    std::memcpy((*in)[static_cast<int>(slot)].get(), src, n);
  }
  std::promise<ComputeOutcome> done;
  engine.Run(std::make_shared<const ComputePlan>(std::move(*plan)), in,
             [&](ComputeOutcome o) { done.set_value(std::move(o)); });
  return done.get_future().get();
}

void DrainExecutor(Engine& engine) {
  std::promise<void> ran;
  engine.Submit([&] { ran.set_value(); });
  ran.get_future().wait();
}

}  // namespace lossd
