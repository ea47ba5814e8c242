// SPDX-License-Identifier: Apache-2.0
// End to end over real gRPC on loopback, the server's limits: accumulators, the memory budget
// (FetchGradients' host copies included, and a reset fetch undone), request bytes, parts per
// request, in-flight calls per client, and draining. Each test starts its own server with the
// limit it checks.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"
#include "tests/e2e_fixture.h"

namespace lossd {
namespace {

// An fp32 problem with W of (v, h), reduction sum: what the fetch tests accumulate.
RandomProblem SumProblem(uint64_t seed, int64_t h, int64_t v) {
  RandomProblemSpec s = WideSpec(DType::kF32, seed, h, v);
  s.options.reduction = Reduction::kSum;
  return RandomProblem::Make(s);
}

TEST(AccumulatorLimitTest, ANewAccumulatorOverTheLimitsIsRefusedAtTheHeader) {
  HarnessOptions o;
  o.engine.max_accumulators = 1;
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kBF16, 23));
  v1::ComputeHeader first = HeaderFor(rp);
  first.set_accumulator("only-one");
  ASSERT_TRUE(RunCompute(h.stub(), first, PartsFor(rp, 1 << 20)).status.ok());
  v1::ComputeHeader second = HeaderFor(rp);
  second.set_accumulator("one-too-many");
  ComputeReply r = RunCompute(h.stub(), second, {});  // no tensors sent
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(r.status.error_message().find("cannot create accumulator 'one-too-many': 1 "
                                          "accumulators exist (--max_accumulators=1)"),
            std::string::npos)
      << r.status.error_message();
  ExpectServes(h);
}

TEST(BudgetTest, ARequestOverTheMemoryBudgetIsRefusedAtOnce) {
  HarnessOptions o;
  o.engine.memory_budget_bytes = 200 << 10;  // the small problem fits, W of 512 KB not
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(WideSpec(DType::kF32, 2, 64, 2000));  // W alone: 512 KB
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), {});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(r.status.error_message().find("more than the whole memory budget of 204800 bytes"),
            std::string::npos)
      << r.status.error_message();
  ExpectServes(h);
}

// FetchGradients' host copy of its range comes out of the memory budget: a range larger than
// the whole budget is refused, ranges that fit are served, and two that do not fit together
// take turns instead of both taking memory.
TEST(BudgetTest, FetchGradientsCopiesComeOutOfTheMemoryBudget) {
  // dW in fp32: 1024000 bytes; a Compute into an accumulator needs about 300 KB.
  RandomProblem rp = SumProblem(5, 256, 1000);
  // The same gradient returned by a server with room for it.
  ComputeReply ref;
  {
    Harness roomy;
    v1::ComputeHeader whole = HeaderFor(rp);
    whole.mutable_options()->set_grad_dtype(v1::DTYPE_FP32);
    ref = RunCompute(roomy.stub(), whole, PartsFor(rp, 1 << 20));
    ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();
  }
  HarnessOptions o;
  o.engine.memory_budget_bytes = 700000;
  Harness h(o);
  std::string handle;
  ASSERT_TRUE(testing_harness::PutWeights(h.stub(), rp, 1 << 20, &handle).ok());
  v1::ComputeHeader acc = HeaderFor(rp, handle);
  acc.set_accumulator("fetch-budget");
  ComputeReply r = RunCompute(h.stub(), acc, PartsFor(rp, 1 << 20, false));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();

  auto fetch = [&](uint64_t begin, uint64_t end, std::vector<uint8_t>* bytes) {
    grpc::ClientContext ctx;
    v1::FetchGradientsRequest fr;
    fr.set_accumulator("fetch-budget");
    fr.set_range_begin(begin);
    fr.set_range_end(end);
    auto reader = h.stub().FetchGradients(&ctx, fr);
    v1::FetchGradientsResponse msg;
    while (reader->Read(&msg)) {
      if (msg.has_part()) {
        bytes->insert(bytes->end(), msg.part().data().begin(), msg.part().data().end());
      }
    }
    return reader->Finish();
  };
  std::vector<uint8_t> all;
  grpc::Status st = fetch(0, 0, &all);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("fetching bytes [0, 1024000) of accumulator 'fetch-budget' "
                                    "needs a host copy of 1024000 bytes, more than the whole "
                                    "memory budget of 700000 bytes"),
            std::string::npos)
      << st.error_message();
  // Two halves at once: 512000 bytes each, so one waits for the other to finish.
  std::vector<uint8_t> lo, hi;
  grpc::Status st_lo, st_hi;
  std::thread t([&] { st_lo = fetch(0, 512000, &lo); });
  st_hi = fetch(512000, 1024000, &hi);
  t.join();
  ASSERT_TRUE(st_lo.ok()) << st_lo.error_message();
  ASSERT_TRUE(st_hi.ok()) << st_hi.error_message();
  // One micro-batch added to zeros: the bits of the same gradient returned in fp32.
  lo.insert(lo.end(), hi.begin(), hi.end());
  EXPECT_EQ(lo, ref.tensors[v1::TENSOR_DW]);
  EXPECT_EQ(h.WaitForIdleMemory(), 0u) << "a fetch left memory reserved";
  ExpectServes(h);
}

// A reset fetch whose client goes away after the first part: the sum it reset is put back
// (the step's gradient is not lost), bit for bit, with its counts.
TEST(FetchResetTest, AResetFetchThatDoesNotArriveIsUndone) {
  // 16 MiB of fp32 dW: far more than the stream's flow-control window.
  RandomProblem rp = SumProblem(8, 1024, 4096);
  Harness h;
  std::string handle;
  ASSERT_TRUE(testing_harness::PutWeights(h.stub(), rp, 1 << 20, &handle).ok());
  v1::ComputeHeader acc = HeaderFor(rp, handle);
  acc.set_accumulator("undo");
  ASSERT_TRUE(RunCompute(h.stub(), acc, PartsFor(rp, 1 << 20, false)).status.ok());
  ASSERT_TRUE(RunCompute(h.stub(), acc, PartsFor(rp, 1 << 20, false)).status.ok());
  auto before = h.engine().FetchGradients("undo", false);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(before->micro_batches, 2u);

  grpc::ClientContext ctx;
  v1::FetchGradientsRequest fr;
  fr.set_accumulator("undo");
  fr.set_reset(true);
  fr.set_response_part_bytes(1 << 16);
  auto reader = h.stub().FetchGradients(&ctx, fr);
  v1::FetchGradientsResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  ASSERT_TRUE(msg.has_header());
  EXPECT_EQ(msg.header().micro_batches(), 2u);
  ctx.TryCancel();  // gone before the parts
  while (reader->Read(&msg)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
  // The server finishes the call (and the undo) on its own time: wait for the counts.
  absl::StatusOr<GradientsSnapshot> after;
  for (int i = 0; i < 500; ++i) {
    after = h.engine().FetchGradients("undo", false);
    if (!after.ok() || after->micro_batches != 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->micro_batches, 2u);
  EXPECT_EQ(after->tokens, before->tokens);
  ASSERT_EQ(after->end - after->begin, before->end - before->begin);
  EXPECT_EQ(std::memcmp(after->data.get(), before->data.get(), before->end - before->begin), 0);
  ExpectServes(h);
}

TEST(BudgetTest, ARequestOverMaxRequestBytesIsRefused) {
  HarnessOptions o;
  o.engine.max_request_bytes = 10000;
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kF32, 2));
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), {});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("more than --max_request_bytes=10000"),
            std::string::npos)
      << r.status.error_message();
}

TEST(DrainTest, ADrainingServerRefusesNewWorkWithUnavailable) {
  Harness h;
  h.engine().Drain();
  RandomProblem rp = RandomProblem::Make(SmallSpec());
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(r.status.error_message().find("draining"), std::string::npos);
}

TEST(LimitsTest, PartsPerRequestIsLimited) {
  HarnessOptions o;
  o.service.max_parts_per_request = 10;
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kF32, 3));
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 64));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("more than --max_parts_per_request=10"),
            std::string::npos)
      << r.status.error_message();
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
  ExpectServes(h);
}

// Without --auth_tokens_file a client is its host: an authorization header nobody checks (here
// on the held stream only) does not make it another client.
class InFlightPerClientTest : public ::testing::TestWithParam<bool> {};

TEST_P(InFlightPerClientTest, InFlightPerClientIsLimited) {
  HarnessOptions o;
  o.service.max_in_flight_per_client = 1;
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kF32, 3));
  // One stream held open (header sent, nothing more) takes this client's only slot.
  grpc::ClientContext ctx;
  if (GetParam()) ctx.AddMetadata("authorization", "Bearer one-of-many");
  auto held = h.stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(held->Write(header));
  for (int i = 0; i < 200 && h.engine().budget().in_use() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ComputeReply second = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(second.status.error_message().find("--max_in_flight_per_client"), std::string::npos)
      << second.status.error_message();
  ctx.TryCancel();
  held->Finish();
  // The slot is given back when the held call ends.
  grpc::Status last;
  for (int i = 0; i < 100; ++i) {
    last = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20)).status;
    if (last.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(last.ok()) << last.error_message();
}

INSTANTIATE_TEST_SUITE_P(UncheckedHeader, InFlightPerClientTest, ::testing::Bool());

}  // namespace
}  // namespace lossd
