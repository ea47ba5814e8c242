// SPDX-License-Identifier: Apache-2.0
// What every lossd fuzz target shares: one engine on the CPU backend with small limits (so no
// input can ask for a large allocation), weights preloaded under a known handle, the record
// framing of fuzz inputs, and the checks that turn a broken promise into a crash the fuzzer
// sees. Test-only; it makes no RPC (gRPC byte buffers at most; the reactors are covered by
// tests/e2e and faults).
#ifndef LOSSD_TESTS_FUZZ_FUZZ_ENV_H_
#define LOSSD_TESTS_FUZZ_FUZZ_ENV_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/engine.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace fuzz {

// Limits of the fuzz engine. Small enough that the largest admissible request costs
// milliseconds under ASan, large enough that every code path (chunking, bias, class weights,
// accumulators, handles) is reachable.
inline constexpr int64_t kMaxBT = 64;
inline constexpr int64_t kMaxH = 64;
inline constexpr int64_t kMaxV = 256;
inline constexpr uint64_t kMaxRequestBytes = 1ull << 20;
inline constexpr uint64_t kMemoryBudget = 64ull << 20;
inline constexpr uint64_t kWeightCacheBytes = 1ull << 20;
inline constexpr uint64_t kAccumulatorBytes = 1ull << 20;
inline constexpr uint64_t kMaxPartBytes = 64ull << 10;
inline constexpr char kInstance[] = "fuzz";

// Weights preloaded at start-up: bf16 (V=kPreloadV, H=kPreloadH) with a bias. Their handle is
// "w-fuzz-1", written into seeds by seed_writer.
inline constexpr int64_t kPreloadV = 40;
inline constexpr int64_t kPreloadH = 16;
inline constexpr char kPreloadHandle[] = "w-fuzz-1";

struct FuzzEnv {
  Engine* engine = nullptr;
  std::string handle;             // of the preloaded weights
  std::vector<uint8_t> preload_w;     // (kPreloadV, kPreloadH) bf16, host copy
  std::vector<uint8_t> preload_bias;  // (kPreloadV) bf16, host copy
};

// The process-wide environment, built on first use and never destroyed (the executor thread
// would otherwise race static destructors at exit).
FuzzEnv& Env();

// Fuzz inputs are records: a 2-byte little-endian length, then that many bytes (a truncated
// last record keeps what is there). At most `max_records`.
std::vector<absl::string_view> SplitRecords(const uint8_t* data, size_t size,
                                            size_t max_records);
// The inverse, for seed writers.
void AppendRecord(std::string* out, absl::string_view record);

// Aborts (a finding) with `what` when `ok` is false.
void Check(bool ok, absl::string_view what);
// A refusal must be a clean error: one of the codes a request may earn and a message.
void CheckCleanError(const absl::Status& s, absl::string_view where);
// A header's plan as the reactor makes it: ComputeSpecFromWire, then Engine::Plan. A refusal
// from either must be clean (CheckCleanError, named by the step that refused) and comes back.
absl::StatusOr<ComputePlan> PlanFromWire(Engine& engine, const v1::ComputeHeader& header);
// Runs a plan on the engine's executor and waits; aborts when it does not finish in time.
// `inputs_checked_finite` as in Engine::Run.
ComputeOutcome RunAndWait(std::shared_ptr<const ComputePlan> plan,
                          std::shared_ptr<Engine::InputBuffers> inputs,
                          bool inputs_checked_finite = false);
// Checks what must hold once an input is done: no admitted memory and no weight-cache
// reservation left behind, and the preloaded handle still served.
void CheckIdle(absl::string_view where);

// The entry points, one per target (each target's main calls one; the replay test all).
void ComputeStreamOneInput(const uint8_t* data, size_t size);
void OptionsOneInput(const uint8_t* data, size_t size);
void PutWeightsOneInput(const uint8_t* data, size_t size);

}  // namespace fuzz
}  // namespace lossd

#endif  // LOSSD_TESTS_FUZZ_FUZZ_ENV_H_
