// SPDX-License-Identifier: Apache-2.0
// Engine-level test helpers (testonly): a Compute spec and its input buffers for a random
// problem or from any sources, a Compute planned and run to its outcome, a weight upload, a
// hosted head made, one random micro-batch added into a named accumulator, and a wait for jobs
// already on the executor. Nothing here checks results; the tests that use them do.
#ifndef LOSSD_TESTING_ENGINE_CALLS_H_
#define LOSSD_TESTING_ENGINE_CALLS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "testing/test_util.h"

namespace lossd {

// A present tensor of `dtype` and `shape`, as a spec describes an input.
TensorDesc InputDesc(DType dtype, std::vector<int64_t> shape);
// Puts `t` in `spec`'s input `slot` (TensorDesc{} leaves the input out).
void SetInput(ComputeSpec* spec, InputSlot slot, TensorDesc t);
// `n` floats uniform in [-2, 2) from `seed`: per-row inputs (upstream gradients, advantages).
std::vector<float> RandomRows(int64_t n, uint64_t seed);

// The spec of `rp`'s problem: X, W and targets inline, dX and dW wanted.
ComputeSpec ComputeSpecFor(const RandomProblem& rp);
// `rp`'s X, W and targets copied into buffers of `plan`'s input sizes.
std::shared_ptr<Engine::InputBuffers> InputBuffersFor(const RandomProblem& rp,
                                                      const ComputePlan& plan);
// Where each input's bytes come from, by InputSlot; null for an input the test never sends.
using InputSources = std::array<const void*, static_cast<int>(InputSlot::kCount)>;
// The sources of `p`'s X, W, bias (null without one) and targets; the rest null.
InputSources InputSourcesOf(const LossProblem& p);
// Every input `plan` sends, `plan.input_bytes` of it copied from `src`. An input the plan
// sends with no source is a broken test: a gtest failure naming the input (its buffer zeros).
std::shared_ptr<Engine::InputBuffers> InputBuffersFrom(const ComputePlan& plan,
                                                       const InputSources& src);
// Runs `plan` on `e`'s executor and waits for its outcome.
ComputeOutcome RunSync(Engine& e, const ComputePlan& plan,
                       std::shared_ptr<Engine::InputBuffers> in);
// Plans `spec` on `e` and runs it on the buffers `inputs` makes for the plan; a refused
// plan's error as the outcome's status.
using InputsForPlan = std::function<std::shared_ptr<Engine::InputBuffers>(const ComputePlan&)>;
ComputeOutcome PlanAndRun(Engine& e, const ComputeSpec& spec, const InputsForPlan& inputs);

// Uploads W (V, H) of `dtype` and, unless `bias` is empty, its bias (V) under `owner`;
// returns the handle, or the first step's error.
absl::StatusOr<std::string> UploadWeights(Engine& e, DType dtype, int64_t v, int64_t h,
                                          const std::vector<uint8_t>& w,
                                          const std::vector<uint8_t>& bias,
                                          const std::string& owner = "");
// Creates hosted head `spec` (no owner) from its master W alone; the first step's error.
absl::Status CreateHead(Engine& e, const HeadSpec& spec, const std::vector<uint8_t>& master_w);

// Runs a (BT=4, H=3, V=5) bf16 Compute whose dW goes into accumulator `name` (created if
// needed) and returns its outcome; the plan's error as the outcome's status if it is refused.
ComputeOutcome AddRandomMicroBatch(Engine& engine, const std::string& name);

// Returns once every job submitted to the engine's executor before it has run.
void DrainExecutor(Engine& engine);

}  // namespace lossd

#endif  // LOSSD_TESTING_ENGINE_CALLS_H_
