// SPDX-License-Identifier: Apache-2.0
// Fault injection over real gRPC on loopback (CPU backend): clients that vanish mid-upload
// and mid-download, a backend that fails half way through adding into an accumulator, LRU
// eviction of a weight handle, and a server restart between the micro-batches of one step.
// Each test asserts the exact status code and a message substring, that nothing is left
// behind (admitted memory, weight-cache reservations, handles, accumulators) and that the
// server keeps serving.
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/forwarding_backend.h"
#include "testing/test_util.h"
#include "service/loss_server.h"
#include "service/metrics.h"
#include "testing/server_harness.h"
#include "tests/health_status.h"

namespace lossd {
namespace {

using testing_harness::ComputeReply;
using testing_harness::Harness;
using testing_harness::HarnessOptions;
using testing_harness::HeaderFor;
using testing_harness::PartsFor;
using testing_harness::RunCompute;

RandomProblemSpec Spec(uint64_t seed, int64_t bt = 47, int64_t h = 31, int64_t v = 123) {
  RandomProblemSpec s = ShapeSpec(bt, h, v, DType::kBF16);
  s.seed = seed;
  s.ignore_fraction = 0.1;
  return s;
}

::testing::AssertionResult MatchesRef(const RandomProblem& rp, ComputeReply& reply) {
  return testing_harness::ReplyMatchesReference(rp, reply, rp.spec().dtype);
}

void ExpectServes(Harness& h) {
  RandomProblem rp = RandomProblem::Make(Spec(99));
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  EXPECT_TRUE(MatchesRef(rp, r));
}

// Room left in the weight cache that can be reserved: a reservation leaked by a cut-off
// upload shows as room that cannot be.
bool WeightCacheRoomIsFree(Engine& e) {
  const uint64_t room = e.weights().budget() - e.weights().bytes();
  if (!e.weights().Reserve(room).ok()) return false;
  e.weights().Unreserve(room);
  return true;
}

// Waits until `pred` holds or `seconds` pass.
template <typename Pred>
bool Eventually(Pred pred, double seconds = 5) {
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int>(seconds * 1000));
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

// ---------------------------------------------------------------------------------------
// A client killed mid-stream.

class ClientKilledTest : public testing_harness::SuiteHarness<ClientKilledTest> {};

TEST_F(ClientKilledTest, CancelMidUploadOfComputeFreesEverythingAndCreatesNothing) {
  RandomProblemSpec s = Spec(5, 64, 32, 2000);
  RandomProblem rp = RandomProblem::Make(s);
  v1::ComputeHeader header = HeaderFor(rp);
  header.set_accumulator("killed-mid-upload");
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 1024);
  ASSERT_GT(parts.size(), 10u);

  grpc::ClientContext ctx;
  auto stream = h_->stub().Compute(&ctx);
  v1::ComputeRequest first;
  *first.mutable_header() = header;
  ASSERT_TRUE(stream->Write(first));
  for (size_t i = 0; i < parts.size() / 2; ++i) ASSERT_TRUE(stream->Write(parts[i]));
  // The server has admitted the request and holds its buffers now.
  ASSERT_TRUE(Eventually([&] { return h_->engine().budget().in_use() > 0; }))
      << "the request was never admitted";
  ctx.TryCancel();  // the client dies half way through its upload
  grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();

  EXPECT_EQ(h_->WaitForIdleMemory(), 0u) << "a cancelled upload left admitted memory behind";
  EXPECT_EQ(h_->engine().accumulators().count(), 0u)
      << "a cancelled upload created its accumulator";
  ExpectServes(*h_);
}

TEST_F(ClientKilledTest, CancelMidUploadOfPutWeightsCreatesNoHandleAndFreesTheReservation) {
  RandomProblemSpec s = Spec(6, 4, 64, 4000);
  s.bias = true;
  RandomProblem rp = RandomProblem::Make(s);
  const size_t handles_before = h_->engine().weights().count();
  const uint64_t bytes_before = h_->engine().weights().bytes();

  grpc::ClientContext ctx;
  v1::PutWeightsResponse resp;
  auto writer = h_->stub().PutWeights(&ctx, &resp);
  v1::PutWeightsRequest hdr;
  *hdr.mutable_header()->mutable_w() = HeaderFor(rp).w();
  *hdr.mutable_header()->mutable_bias() = HeaderFor(rp).bias();
  ASSERT_TRUE(writer->Write(hdr));
  const size_t part = 4096;
  for (size_t off = 0; off < rp.w.size() / 2; off += part) {
    v1::PutWeightsRequest r;
    r.mutable_part()->set_tensor(v1::TENSOR_W);
    r.mutable_part()->set_offset(off);
    r.mutable_part()->set_data(rp.w.data() + off, part);
    ASSERT_TRUE(writer->Write(r));
  }
  // Wait until the server has begun the upload (it reserved the weights' bytes).
  ASSERT_TRUE(Eventually([&] { return !WeightCacheRoomIsFree(h_->engine()); }))
      << "the upload never reserved its bytes";
  ctx.TryCancel();
  grpc::Status st = writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  EXPECT_TRUE(resp.handle().empty()) << "a cancelled upload returned handle " << resp.handle();

  EXPECT_TRUE(Eventually([&] { return WeightCacheRoomIsFree(h_->engine()); }))
      << "a cancelled upload kept its weight-cache reservation";
  EXPECT_EQ(h_->engine().weights().count(), handles_before);
  EXPECT_EQ(h_->engine().weights().bytes(), bytes_before);
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
  ExpectServes(*h_);
}

TEST_F(ClientKilledTest, ClientGoneWhileResultsAreSentFreesEverything) {
  RandomProblemSpec s = Spec(7, 64, 64, 3000);
  RandomProblem rp = RandomProblem::Make(s);
  v1::ComputeHeader header = HeaderFor(rp);
  header.set_response_part_bytes(1024);  // dW alone is hundreds of parts
  grpc::ClientContext ctx;
  auto stream = h_->stub().Compute(&ctx);
  v1::ComputeRequest first;
  *first.mutable_header() = header;
  ASSERT_TRUE(stream->Write(first));
  for (const auto& p : PartsFor(rp, 1 << 20)) ASSERT_TRUE(stream->Write(p));
  ASSERT_TRUE(stream->WritesDone());
  v1::ComputeResponse r;
  ASSERT_TRUE(stream->Read(&r));
  ASSERT_TRUE(r.has_summary());
  ASSERT_TRUE(stream->Read(&r));  // one part, then the client dies
  ctx.TryCancel();
  grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u) << "a client gone mid-download left memory behind";
  ExpectServes(*h_);
}

// ---------------------------------------------------------------------------------------
// A failed micro-batch never leaves an accumulator half-updated without saying so.

// A backend that forwards to the CPU backend and, when armed, fails a Compute half way
// through: it has already added garbage into half of the dW accumulator, as a device fault
// or an out-of-memory in the middle of a chunk loop would.
class FailingBackend : public ForwardingBackend {
 public:
  explicit FailingBackend(std::unique_ptr<Backend> inner) : ForwardingBackend(std::move(inner)) {}
  void ArmFailure() { armed_.store(true); }

  // Reports the backend unhealthy, as a sticky device error would.
  void SetHealthy(bool healthy) { healthy_.store(healthy); }

  BackendInfo Info() override {
    BackendInfo info = ForwardingBackend::Info();
    info.healthy = info.healthy && healthy_.load();
    return info;
  }
  absl::Status Compute(const LossProblem& p, const LossOutputs& out,
                       LossStats* stats) override {
    if (armed_.exchange(false)) {
      if (out.dw_accum != nullptr) {
        for (int64_t i = 0; i < p.v * p.h / 2; ++i) out.dw_accum[i] += 1.0f;
      }
      return absl::InternalError("injected fault half way through the chunk loop");
    }
    return ForwardingBackend::Compute(p, out, stats);
  }

 private:
  std::atomic<bool> armed_{false};
  std::atomic<bool> healthy_{true};
};

// A server around an engine on FailingBackend.
struct FaultyServer {
  FaultyServer() {
    auto backend = std::make_unique<FailingBackend>(NewCpuBackend(2));
    failing = backend.get();
    EngineOptions eo;
    eo.instance = "faulty";
    engine = std::make_unique<Engine>(std::move(backend), eo);
    metrics = std::make_unique<ServerMetrics>([] { return StateSample(); });
    LossServerOptions so;
    so.address = "127.0.0.1:0";
    so.service.instance = "faulty";
    so.service.version = "test";
    so.health_poll = absl::Milliseconds(20);
    auto s = LossServer::Start(engine.get(), metrics.get(), so);
    EXPECT_TRUE(s.ok()) << s.status();
    server = std::move(*s);
    channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()),
                                  grpc::InsecureChannelCredentials());
    stub = v1::Loss::NewStub(channel);
  }
  ~FaultyServer() { server->Shutdown(absl::Seconds(5)); }

  FailingBackend* failing = nullptr;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ServerMetrics> metrics;
  std::unique_ptr<LossServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Loss::Stub> stub;
};

struct Fetched {
  grpc::Status status;
  v1::GradientsHeader header;
  std::vector<uint8_t> dw;
};

Fetched Fetch(v1::Loss::Stub& stub, const std::string& name) {
  Fetched f;
  grpc::ClientContext ctx;
  v1::FetchGradientsRequest req;
  req.set_accumulator(name);
  auto reader = stub.FetchGradients(&ctx, req);
  v1::FetchGradientsResponse m;
  while (reader->Read(&m)) {
    if (m.has_header()) {
      f.header = m.header();
      f.dw.assign(f.header.dw().shape(0) * f.header.dw().shape(1) * 4, 0xFF);
    } else if (m.part().tensor() == v1::TENSOR_DW) {
      EXPECT_LE(m.part().offset() + m.part().data().size(), f.dw.size());
      std::memcpy(f.dw.data() + m.part().offset(), m.part().data().data(),
                  m.part().data().size());
    }
  }
  f.status = reader->Finish();
  return f;
}

ComputeReply Accumulate(v1::Loss::Stub& stub, const RandomProblem& rp, const std::string& acc) {
  v1::ComputeHeader h = HeaderFor(rp);
  h.set_accumulator(acc);
  return RunCompute(stub, h, PartsFor(rp, 1 << 20));
}

TEST(AccumulatorFaultTest, RefusedBeforeTheBackendLeavesTheSumUntouched) {
  FaultyServer s;
  RandomProblem a = RandomProblem::Make(Spec(31));
  ComputeReply r1 = Accumulate(*s.stub, a, "step");
  ASSERT_TRUE(r1.status.ok()) << r1.status.error_message();
  Fetched before = Fetch(*s.stub, "step");
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();

  // Bad data is refused before anything is added.
  RandomProblem bad = RandomProblem::Make(Spec(32));
  bad.targets[3] = 123;
  ComputeReply r2 = Accumulate(*s.stub, bad, "step");
  EXPECT_EQ(r2.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r2.status.error_message().find("targets[3] = 123"), std::string::npos)
      << r2.status.error_message();

  Fetched after = Fetch(*s.stub, "step");
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.header.micro_batches(), 1u);
  EXPECT_EQ(after.dw, before.dw) << "a refused micro-batch changed the accumulated dW";
}

TEST(AccumulatorFaultTest, FailureHalfWayPoisonsTheAccumulatorUntilDropped) {
  FaultyServer s;
  RandomProblem a = RandomProblem::Make(Spec(41));
  ASSERT_TRUE(Accumulate(*s.stub, a, "step").status.ok());

  s.failing->ArmFailure();
  RandomProblem b = RandomProblem::Make(Spec(42));
  ComputeReply failed = Accumulate(*s.stub, b, "step");
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_NE(failed.status.error_message().find("injected fault"), std::string::npos)
      << failed.status.error_message();

  // The half-updated sum is never served nor added to.
  Fetched f = Fetch(*s.stub, "step");
  EXPECT_EQ(f.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(f.status.error_message().find("may hold a partial sum"), std::string::npos)
      << f.status.error_message();
  EXPECT_TRUE(f.dw.empty()) << "gradients of a poisoned accumulator were sent";
  ComputeReply next = Accumulate(*s.stub, b, "step");
  EXPECT_EQ(next.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(next.status.error_message().find("drop it and redo the step"), std::string::npos)
      << next.status.error_message();

  // Dropped and redone, the step starts from zero.
  grpc::ClientContext ctx;
  v1::DropAccumulatorRequest drop;
  drop.set_accumulator("step");
  v1::DropAccumulatorResponse dropped;
  ASSERT_TRUE(s.stub->DropAccumulator(&ctx, drop, &dropped).ok());
  ComputeReply redo = Accumulate(*s.stub, b, "step");
  ASSERT_TRUE(redo.status.ok()) << redo.status.error_message();
  EXPECT_EQ(redo.summary.accumulated_micro_batches(), 1u);

  // And it holds exactly b's dW: the same as b's own fp32 dW computed without accumulator.
  Fetched g = Fetch(*s.stub, "step");
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  v1::ComputeHeader hb = HeaderFor(b);
  hb.mutable_options()->set_grad_dtype(v1::DTYPE_FP32);
  ComputeReply own = RunCompute(*s.stub, hb, PartsFor(b, 1 << 20));
  ASSERT_TRUE(own.status.ok());
  EXPECT_EQ(g.dw, own.tensors[v1::TENSOR_DW]);
  EXPECT_EQ(s.engine->budget().in_use(), 0u);
}

// ---------------------------------------------------------------------------------------
// An evicted handle is never served.

// ---------------------------------------------------------------------------------------
// Health follows the backend: NOT_SERVING once it reports a sticky error, so load balancers
// and the readiness probe take the replica out.

// Polls the health service until it answers `want` or 5 s have passed.
int WaitForHealth(const std::shared_ptr<grpc::Channel>& channel, int want) {
  int got = HealthStatus(channel);
  for (int i = 0; i < 250 && got != want; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    got = HealthStatus(channel);
  }
  return got;
}

TEST(HealthTest, AnUnhealthyBackendTurnsHealthNotServingAndARecoveredOneServingAgain) {
  FaultyServer s;
  ASSERT_EQ(HealthStatus(s.channel), 1);
  s.failing->SetHealthy(false);
  EXPECT_EQ(WaitForHealth(s.channel, 2), 2) << "health stayed SERVING after a sticky error";
  s.failing->SetHealthy(true);
  EXPECT_EQ(WaitForHealth(s.channel, 1), 1);
}

// The plan of a Compute of 16 bf16 rows of H = 64 on the weights of `handle`, dX wanted: it
// holds those weights (shared ownership) for as long as it lives.
absl::StatusOr<ComputePlan> PlanOnHandle(Engine& engine, const std::string& handle) {
  ComputeSpec spec;
  spec.inputs[static_cast<int>(InputSlot::kX)] = {true, DType::kBF16, {16, 64}};
  spec.inputs[static_cast<int>(InputSlot::kTargets)] = {true, DType::kI64, {16}};
  spec.weight_handle = handle;
  spec.wanted.dx = true;
  return engine.Plan(spec);
}

TEST(EvictionTest, AnEvictedHandleIsRefusedAndAComputeHoldingItFinishes) {
  // Room in bytes for two W of (V=500, H=64) bf16 = 64000 bytes, but one handle: B evicts A
  // by the handle count, even while a compute holds A (evicting by bytes passes over weights
  // in use, see WeightsInUseAreNotEvictedToMakeRoom).
  HarnessOptions o;
  o.engine.weight_cache_bytes = 150000;
  o.engine.max_weight_handles = 1;
  Harness h(o);
  RandomProblem a = RandomProblem::Make(Spec(51, 16, 64, 500));
  RandomProblem b = RandomProblem::Make(Spec(52, 16, 64, 500));
  std::string ha, hb;
  ASSERT_TRUE(testing_harness::PutWeights(h.stub(), a, 1 << 16, &ha).ok());

  // A compute planned on A holds A's weights (shared ownership), whatever happens next.
  auto plan = PlanOnHandle(h.engine(), ha);
  ASSERT_TRUE(plan.ok()) << plan.status();

  ASSERT_TRUE(testing_harness::PutWeights(h.stub(), b, 1 << 16, &hb).ok());  // evicts A
  EXPECT_EQ(h.engine().weights().bytes(), 2u * 64000) << "A's memory is held until the plan ends";
  ComputeReply by_a = RunCompute(h.stub(), HeaderFor(a, ha), PartsFor(a, 1 << 20, false));
  EXPECT_EQ(by_a.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(by_a.status.error_message().find("was evicted"), std::string::npos)
      << by_a.status.error_message();
  EXPECT_TRUE(by_a.tensors.empty());
  ComputeReply by_b = RunCompute(h.stub(), HeaderFor(b, hb), PartsFor(b, 1 << 20, false));
  EXPECT_TRUE(MatchesRef(b, by_b));

  // The compute planned before the eviction still runs on A's weights, unchanged.
  auto inputs = std::make_shared<Engine::InputBuffers>();
  (*inputs)[static_cast<int>(InputSlot::kX)] = NewHostBuffer(a.x.size());
  std::memcpy((*inputs)[static_cast<int>(InputSlot::kX)].get(), a.x.data(), a.x.size());
  (*inputs)[static_cast<int>(InputSlot::kTargets)] = NewHostBuffer(16 * 8);
  std::memcpy((*inputs)[static_cast<int>(InputSlot::kTargets)].get(), a.targets.data(), 16 * 8);
  std::promise<ComputeOutcome> done;
  h.engine().Run(std::make_shared<const ComputePlan>(std::move(*plan)), inputs,
                 [&done](ComputeOutcome o) { done.set_value(std::move(o)); });
  ComputeOutcome out = done.get_future().get();
  ASSERT_TRUE(out.status.ok()) << out.status;
  ComputeReply inline_a = RunCompute(h.stub(), HeaderFor(a), PartsFor(a, 1 << 20));
  ASSERT_TRUE(inline_a.status.ok());
  EXPECT_EQ(out.loss, inline_a.summary.loss());
  const std::vector<uint8_t>& dx = inline_a.tensors[v1::TENSOR_DX];
  ASSERT_EQ(dx.size(), 16u * 64 * 2);
  EXPECT_EQ(std::memcmp(out.outputs[0].get(), dx.data(), dx.size()), 0)
      << "a compute holding evicted weights saw them change";
}

// Evicting weights that a compute holds frees nothing until it ends: an upload that fits only
// in their place is refused, evicts nothing, and fits once the compute lets go.
TEST(EvictionTest, WeightsInUseAreNotEvictedToMakeRoom) {
  // Room for one W of (V=500, H=64) bf16 = 64000 bytes, not two.
  HarnessOptions o;
  o.engine.weight_cache_bytes = 100000;
  Harness h(o);
  RandomProblem a = RandomProblem::Make(Spec(53, 16, 64, 500));
  RandomProblem b = RandomProblem::Make(Spec(54, 16, 64, 500));
  std::string ha, hb;
  ASSERT_TRUE(testing_harness::PutWeights(h.stub(), a, 1 << 16, &ha).ok());
  {
    auto plan = PlanOnHandle(h.engine(), ha);  // holds A's weights
    ASSERT_TRUE(plan.ok()) << plan.status();
    const grpc::Status refused = testing_harness::PutWeights(h.stub(), b, 1 << 16, &hb);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(refused.error_message().find("64000 by weights that running requests use"),
              std::string::npos)
        << refused.error_message();
    EXPECT_EQ(h.engine().weights().bytes(), 64000u);
    EXPECT_EQ(h.engine().weights().evictions(), 0u);
  }
  // Looked up in the cache, not by a Compute, whose plan may outlive the reply a moment.
  EXPECT_TRUE(h.engine().weights().Get(ha).ok()) << "the refused upload evicted A";
  ASSERT_TRUE(testing_harness::PutWeights(h.stub(), b, 1 << 16, &hb).ok());  // evicts A
  EXPECT_EQ(h.engine().weights().evictions(), 1u);
  EXPECT_EQ(h.engine().weights().bytes(), 64000u);
  ComputeReply by_b = RunCompute(h.stub(), HeaderFor(b, hb), PartsFor(b, 1 << 20, false));
  EXPECT_TRUE(MatchesRef(b, by_b));
}

// ---------------------------------------------------------------------------------------
// A server restart between micro-batches is detected.

TEST(RestartTest, HandlesAndAccumulatorsOfTheOldInstanceAreRefused) {
  RandomProblemSpec s = Spec(61);
  s.bias = true;
  RandomProblem rp = RandomProblem::Make(s);
  std::string handle;
  std::string old_instance;
  {
    HarnessOptions o;
    o.engine.instance = "0be4e5ea";  // as lossd draws them (8 hex digits)
    Harness before(o);
    ASSERT_TRUE(testing_harness::PutWeights(before.stub(), rp, 1 << 16, &handle).ok());
    v1::ComputeHeader h = HeaderFor(rp, handle);
    h.set_accumulator("step-7");
    ComputeReply r = RunCompute(before.stub(), h, PartsFor(rp, 1 << 20, false));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.summary.accumulated_micro_batches(), 1u);
    old_instance = o.engine.instance;
  }  // the server goes away between micro-batches
  HarnessOptions o;
  o.engine.instance = "0af7e5ea";
  Harness after(o);

  v1::ComputeHeader h = HeaderFor(rp, handle);
  h.set_accumulator("step-7");
  ComputeReply r = RunCompute(after.stub(), h, PartsFor(rp, 1 << 20, false));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(r.status.error_message().find("another server instance"), std::string::npos)
      << r.status.error_message();
  EXPECT_EQ(after.engine().accumulators().count(), 0u)
      << "a refused micro-batch created the accumulator on the new instance";

  Fetched f = Fetch(after.stub(), "step-7");
  EXPECT_EQ(f.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(f.status.error_message().find("accumulator 'step-7' not found"), std::string::npos)
      << f.status.error_message();

  // A client that resends W inline sees the count restart at 1, not 2: the lost micro-batch
  // is visible, and FetchGradients names the new instance.
  v1::ComputeHeader inline_h = HeaderFor(rp);
  inline_h.set_accumulator("step-7");
  ComputeReply again = RunCompute(after.stub(), inline_h, PartsFor(rp, 1 << 20));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.summary.accumulated_micro_batches(), 1u);
  Fetched g = Fetch(after.stub(), "step-7");
  ASSERT_TRUE(g.status.ok());
  EXPECT_EQ(g.header.instance(), "0af7e5ea");
  EXPECT_NE(g.header.instance(), old_instance);
  EXPECT_EQ(after.WaitForIdleMemory(), 0u);
}

}  // namespace
}  // namespace lossd
