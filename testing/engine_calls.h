// Engine-level test helpers (testonly): a Compute spec and its input buffers for a random
// problem, a Compute run to its outcome, one random micro-batch added into a named
// accumulator, and a wait for jobs already on the executor. Nothing here checks results; the
// tests that use them do.
#ifndef LOSSD_TESTING_ENGINE_CALLS_H_
#define LOSSD_TESTING_ENGINE_CALLS_H_

#include <memory>
#include <string>

#include "engine/engine.h"
#include "testing/test_util.h"

namespace lossd {

// The spec of `rp`'s problem: X, W and targets inline, dX and dW wanted.
ComputeSpec ComputeSpecFor(const RandomProblem& rp);
// `rp`'s X, W and targets copied into buffers of `plan`'s input sizes.
std::shared_ptr<Engine::InputBuffers> InputBuffersFor(const RandomProblem& rp,
                                                      const ComputePlan& plan);
// Runs `plan` on `e`'s executor and waits for its outcome.
ComputeOutcome RunSync(Engine& e, const ComputePlan& plan,
                       std::shared_ptr<Engine::InputBuffers> in);

// Runs a (BT=4, H=3, V=5) bf16 Compute whose dW goes into accumulator `name` (created if
// needed) and returns its outcome; the plan's error as the outcome's status if it is refused.
ComputeOutcome AddRandomMicroBatch(Engine& engine, const std::string& name);

// Returns once every job submitted to the engine's executor before it has run.
void DrainExecutor(Engine& engine);

}  // namespace lossd

#endif  // LOSSD_TESTING_ENGINE_CALLS_H_
