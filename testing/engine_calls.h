// Engine-level test helpers (testonly): add one random micro-batch into a named accumulator
// through Engine::Plan and Engine::Run, and wait for jobs already on the executor. Nothing
// here checks results; the tests that use them do.
#ifndef LOSSD_TESTING_ENGINE_CALLS_H_
#define LOSSD_TESTING_ENGINE_CALLS_H_

#include <string>

#include "engine/engine.h"

namespace lossd {

// Runs a (BT=4, H=3, V=5) bf16 Compute whose dW goes into accumulator `name` (created if
// needed) and returns its outcome; the plan's error as the outcome's status if it is refused.
ComputeOutcome AddRandomMicroBatch(Engine& engine, const std::string& name);

// Returns once every job submitted to the engine's executor before it has run.
void DrainExecutor(Engine& engine);

}  // namespace lossd

#endif  // LOSSD_TESTING_ENGINE_CALLS_H_
