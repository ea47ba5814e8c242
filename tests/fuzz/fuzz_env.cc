// SPDX-License-Identifier: Apache-2.0
#include "tests/fuzz/fuzz_env.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kernels/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "service/wire_convert.h"

namespace lossd {
namespace fuzz {
namespace {

// A small deterministic generator: the preloaded weights must be the same in every run so a
// saved crash replays.
uint32_t NextRandom(uint64_t* state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<uint32_t>(*state >> 33);
}

// The clock of the two-phase tickets' TTLs: CheckIdle moves it past every TTL, so a ticket an
// input kept and never consumed is freed (and one that is not shows as left behind).
std::atomic<int64_t> ticket_clock_ns{1};

FuzzEnv* MakeEnv() {
  auto* env = new FuzzEnv();
  EngineOptions o;
  o.ticket_clock_ns = [] { return ticket_clock_ns.load(); };
  o.instance = kInstance;
  o.memory_budget_bytes = kMemoryBudget;
  o.max_queue = 4;
  o.executor_threads = 1;
  o.weight_cache_bytes = kWeightCacheBytes;
  o.accumulator_bytes = kAccumulatorBytes;
  o.max_accumulators = 4;
  o.max_bt = kMaxBT;
  o.max_h = kMaxH;
  o.max_v = kMaxV;
  o.max_request_bytes = kMaxRequestBytes;
  o.check_finite = true;
  env->engine = new Engine(NewCpuBackend(1), o);

  uint64_t state = 42;
  env->preload_w.resize(kPreloadV * kPreloadH * 2);
  env->preload_bias.resize(kPreloadV * 2);
  for (int64_t i = 0; i < kPreloadV * kPreloadH; ++i) {
    const float f = (static_cast<float>(NextRandom(&state) % 2001) - 1000.0f) / 1000.0f;
    StoreFromFloat(env->preload_w.data(), DType::kBF16, i, f);
  }
  for (int64_t i = 0; i < kPreloadV; ++i) {
    const float f = (static_cast<float>(NextRandom(&state) % 2001) - 1000.0f) / 2000.0f;
    StoreFromFloat(env->preload_bias.data(), DType::kBF16, i, f);
  }
  TensorDesc w{true, DType::kBF16, {kPreloadV, kPreloadH}};
  TensorDesc b{true, DType::kBF16, {kPreloadV}};
  auto pending = env->engine->BeginPutWeights(w, b);
  Check(pending.ok(), "preload: BeginPutWeights");
  Check(env->engine
            ->WriteWeights(**pending, false, 0, env->preload_w.data(), env->preload_w.size())
            .ok(),
        "preload: WriteWeights w");
  Check(env->engine
            ->WriteWeights(**pending, true, 0, env->preload_bias.data(),
                           env->preload_bias.size())
            .ok(),
        "preload: WriteWeights bias");
  auto handle = env->engine->CommitWeights(std::move(*pending));
  Check(handle.ok() && *handle == kPreloadHandle, "preload: CommitWeights gives w-fuzz-1");
  env->handle = *handle;
  return env;
}

}  // namespace

FuzzEnv& Env() {
  static FuzzEnv* env = MakeEnv();
  return *env;
}

std::vector<absl::string_view> SplitRecords(const uint8_t* data, size_t size,
                                            size_t max_records) {
  std::vector<absl::string_view> out;
  size_t pos = 0;
  while (pos + 2 <= size && out.size() < max_records) {
    const size_t n = static_cast<size_t>(data[pos]) | (static_cast<size_t>(data[pos + 1]) << 8);
    pos += 2;
    const size_t take = std::min(n, size - pos);
    out.emplace_back(reinterpret_cast<const char*>(data + pos), take);
    pos += take;
  }
  return out;
}

void AppendRecord(std::string* out, absl::string_view record) {
  const size_t n = std::min<size_t>(record.size(), 0xFFFF);
  out->push_back(static_cast<char>(n & 0xFF));
  out->push_back(static_cast<char>(n >> 8));
  out->append(record.data(), n);
}

void Check(bool ok, absl::string_view what) {
  if (ok) return;
  std::fprintf(stderr, "lossd fuzz finding: %.*s\n", static_cast<int>(what.size()),
               what.data());
  std::fflush(stderr);
  std::abort();
}

void CheckCleanError(const absl::Status& s, absl::string_view where) {
  const bool known = s.code() == absl::StatusCode::kInvalidArgument ||
                     s.code() == absl::StatusCode::kNotFound ||
                     s.code() == absl::StatusCode::kResourceExhausted ||
                     s.code() == absl::StatusCode::kFailedPrecondition;
  if (!known || s.message().empty()) {
    std::fprintf(stderr, "lossd fuzz finding: %.*s gave an unexpected status: %s\n",
                 static_cast<int>(where.size()), where.data(), s.ToString().c_str());
    std::fflush(stderr);
    std::abort();
  }
}

absl::StatusOr<ComputePlan> PlanFromWire(Engine& engine, const v1::ComputeHeader& header) {
  auto spec = ComputeSpecFromWire(header);
  if (!spec.ok()) {
    CheckCleanError(spec.status(), "ComputeSpecFromWire");
    return spec.status();
  }
  auto planned = engine.Plan(*spec);
  if (!planned.ok()) CheckCleanError(planned.status(), "Engine::Plan");
  return planned;
}

ComputeOutcome RunAndWait(std::shared_ptr<const ComputePlan> plan,
                          std::shared_ptr<Engine::InputBuffers> inputs,
                          bool inputs_checked_finite) {
  auto done = std::make_shared<absl::Notification>();
  auto outcome = std::make_shared<ComputeOutcome>();
  Env().engine->Run(std::move(plan), std::move(inputs), [done, outcome](ComputeOutcome o) {
    *outcome = std::move(o);
    done->Notify();
  }, absl::InfiniteFuture(), inputs_checked_finite);
  // Generous: the largest admissible request takes milliseconds even under sanitizers.
  Check(done->WaitForNotificationWithTimeout(absl::Seconds(30)),
        "Engine::Run did not finish within 30 s (hang)");
  return std::move(*outcome);
}

void CheckIdle(absl::string_view where) {
  Engine& e = *Env().engine;
  if (e.budget().in_use() != 0) {
    std::fprintf(stderr, "after %.*s: %llu bytes still admitted\n",
                 static_cast<int>(where.size()), where.data(),
                 static_cast<unsigned long long>(e.budget().in_use()));
    Check(false, "admitted memory left behind");
  }
  // A leaked weight reservation shows as room that cannot be reserved.
  const uint64_t room = e.weights().budget() - e.weights().bytes();
  absl::Status s = e.weights().Reserve(room);
  Check(s.ok(), "weight-cache reservation left behind (Reserve of the free room failed)");
  e.weights().Unreserve(room);
  Check(e.weights().Get(Env().handle).ok(), "the preloaded weight handle is no longer served");
  Check(e.accumulators().count() == 0, "an accumulator was left behind");
  ticket_clock_ns += (e.options().ticket_max_ms + 1) * 1000000;
  Check(e.tickets().count() == 0 && e.tickets().bytes() == 0,
        "a two-phase ticket outlived its TTL");
}

}  // namespace fuzz
}  // namespace lossd
