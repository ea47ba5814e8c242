// SPDX-License-Identifier: Apache-2.0
// End to end over real gRPC on loopback: cancellation, idle streams, stalled readers and
// deadlines free everything a request holds, and the server keeps serving.
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"
#include "tests/e2e_fixture.h"

namespace lossd {
namespace {

// ---------------------------------------------------------------------------------------
// Cancellation and deadlines free everything a request holds.

TEST_F(E2eTest, ACancelledStreamLeavesNoMemoryBehind) {
  RandomProblem rp = RandomProblem::Make(WideSpec(DType::kF32, 4, 64, 3000));
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 4096);
  grpc::ClientContext ctx;
  auto stream = h_->stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(stream->Write(header));
  for (size_t i = 0; i < parts.size() / 2; ++i) ASSERT_TRUE(stream->Write(parts[i]));
  // The server holds the admitted request now.
  for (int i = 0; i < 200 && h_->engine().budget().in_use() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GT(h_->engine().budget().in_use(), 0u);
  ctx.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
  EXPECT_EQ(MetricValue(h_->ScrapeMetrics(), "lossd_memory_in_use_bytes"), 0);
  ExpectServes(*h_);
}

// --stream_idle_timeout: a client that stops sending, with no deadline of its own, loses its
// stream and what it held (its memory reservation here), and the server keeps serving.
TEST(IdleStreamTest, AComputeThatStopsSendingIsCancelledAndFreesItsMemory) {
  HarnessOptions o;
  o.service.stream_idle_timeout = absl::Milliseconds(300);
  Harness h(o);
  const std::string labels = R"(code="DEADLINE_EXCEEDED",method="Compute")";
  const double before =
      std::max(0.0, MetricValue(h.ScrapeMetrics(), "lossd_requests_total", labels));
  RandomProblem rp = RandomProblem::Make(WideSpec(DType::kF32, 4, 64, 3000));
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 4096);
  grpc::ClientContext ctx;  // no deadline
  auto stream = h.stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(stream->Write(header));
  // Parts at a pace well inside the timeout keep the stream alive past it.
  const size_t half = parts.size() / 2;
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < half; ++i) {
    ASSERT_TRUE(stream->Write(parts[i]));
    if (i < 8) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_GT(absl::Now() - start, absl::Milliseconds(700));
  EXPECT_GT(h.engine().budget().in_use(), 0u) << "the compute was admitted and is receiving";
  // Then silence, with the stream left open: cancelled by the server.
  v1::ComputeResponse r;
  EXPECT_FALSE(stream->Read(&r));
  const grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
  EXPECT_EQ(MetricValue(h.ScrapeMetrics(), "lossd_requests_total", labels), before + 1)
      << "the server's own status for the call";
  ExpectServes(h);
}

// A header and nothing else: the same.
TEST(IdleStreamTest, AComputeWithAHeaderAloneIsCancelled) {
  HarnessOptions o;
  o.service.stream_idle_timeout = absl::Milliseconds(300);
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kBF16, 6));
  grpc::ClientContext ctx;
  auto stream = h.stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(stream->Write(header));
  v1::ComputeResponse r;
  EXPECT_FALSE(stream->Read(&r));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
  ExpectServes(h);
}

// A client that stops reading its results: the server's writes wait on flow control, and
// after --stream_idle_timeout without a write taken the call is cancelled and its admitted
// memory given back, while the client still holds the stream (it held 9.6 MB of a 15 MB
// budget past the timeout, so that a second identical call waited and failed).
class StalledReaderTest : public ::testing::TestWithParam<bool> {};

RandomProblem LargeOutputProblem() {
  // dW is 32 MiB: far more than flow control lets through unread.
  RandomProblemSpec s = WideSpec(DType::kF32, 12, 512, 16384);
  s.bt = 16;
  return RandomProblem::Make(s);
}

double DeadlineExceeded(Harness& h, const char* method) {
  return std::max(0.0, MetricValue(h.ScrapeMetrics(), "lossd_requests_total",
                                   absl::StrCat(R"(code="DEADLINE_EXCEEDED",method=")", method,
                                                "\"")));
}

// Waits up to `seconds` for `done`; true when it came.
template <typename F>
bool WaitUntil(F done, double seconds = 10) {
  const absl::Time until = absl::Now() + absl::Seconds(seconds);
  while (!done() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(2));
  return done();
}

// A call (`what`, of `method`) whose client stopped reading: admitted (memory in use), then let
// go by the server itself: its memory back to 0 and one more DEADLINE_EXCEEDED than `before`
// counted for `method`. Call under ASSERT_NO_FATAL_FAILURE: a call never admitted ends the test.
void ExpectTheServerLetsGo(Harness& h, const char* method, double before, const char* what) {
  ASSERT_TRUE(WaitUntil([&] { return h.engine().budget().in_use() > 0; }))
      << "the " << what << " was never admitted";
  EXPECT_EQ(h.WaitForIdleMemory(10), 0u) << "a client that stopped reading kept its memory";
  EXPECT_TRUE(WaitUntil([&] { return DeadlineExceeded(h, method) == before + 1; }))
      << "the server's own status";
}

TEST_P(StalledReaderTest, AComputeWhoseClientStopsReadingIsCancelledAndFreesItsMemory) {
  HarnessOptions o;
  o.service.stream_idle_timeout = absl::Milliseconds(300);
  Harness h(o);
  const double before = DeadlineExceeded(h, "Compute");
  RandomProblem rp = LargeOutputProblem();
  // Made before the stream opens: the server waits for them no longer than the timeout.
  const std::vector<v1::ComputeRequest> parts = testing_harness::XLast(PartsFor(rp, 1 << 20));
  grpc::ClientContext ctx;  // no deadline
  auto stream = h.stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  header.mutable_header()->set_overlap(GetParam());
  ASSERT_TRUE(stream->Write(header));
  for (const v1::ComputeRequest& part : parts) {
    ASSERT_TRUE(stream->Write(part));
  }
  ASSERT_TRUE(stream->WritesDone());
  // Nothing is read: the server must let go of the call by itself.
  ASSERT_NO_FATAL_FAILURE(ExpectTheServerLetsGo(h, "Compute", before, "compute"));
  v1::ComputeResponse r;
  while (stream->Read(&r)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ExpectServes(h);
}

INSTANTIATE_TEST_SUITE_P(Overlap, StalledReaderTest, ::testing::Bool());

TEST(StalledReaderFetchTest, AFetchWhoseClientStopsReadingIsCancelledAndFreesItsMemory) {
  HarnessOptions o;
  o.service.stream_idle_timeout = absl::Milliseconds(300);
  Harness h(o);
  RandomProblem rp = LargeOutputProblem();
  v1::ComputeHeader hc = HeaderFor(rp);
  hc.set_accumulator("stalled-fetch");
  ASSERT_TRUE(RunCompute(h.stub(), hc, PartsFor(rp, 1 << 20)).status.ok());
  const double before = DeadlineExceeded(h, "FetchGradients");
  grpc::ClientContext ctx;
  v1::FetchGradientsRequest fr;
  fr.set_accumulator("stalled-fetch");
  auto reader = h.stub().FetchGradients(&ctx, fr);
  // The host copy of dW comes out of the memory budget while it is sent.
  ASSERT_NO_FATAL_FAILURE(ExpectTheServerLetsGo(h, "FetchGradients", before, "fetch"));
  v1::FetchGradientsResponse m;
  while (reader->Read(&m)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // Nothing was reset: the whole sum is still there for a client that reads.
  auto g = h.engine().FetchGradients("stalled-fetch", false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 1u);
  ExpectServes(h);
}

TEST_F(E2eTest, ADeadlineThatPassesMidStreamFreesTheRequest) {
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kF32, 6));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  auto stream = h_->stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(stream->Write(header));  // then nothing: the deadline passes
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
  ExpectServes(*h_);
}

}  // namespace
}  // namespace lossd
