// SPDX-License-Identifier: Apache-2.0
// The overlapped Compute (ComputeHeader.overlap) end to end over real gRPC on loopback, CPU
// backend: the server computes chunks and sends dX while X is still arriving, the response
// order is preliminary summary, parts, final summary, and the results are bit-identical to
// the same request without overlap. A stream cut off, refused, stalled or cancelled while the
// compute waits for rows fails with its own code, frees its memory and poisons a named
// accumulator; the server keeps serving.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"
#include "testing/server_harness.h"

namespace lossd {
namespace {

using testing_harness::ComputeReply;
using testing_harness::Harness;
using testing_harness::HarnessOptions;
using testing_harness::HeaderFor;
using testing_harness::PartsFor;
using testing_harness::RunCompute;

// Every input but X first, then X: the order that lets the server start early.
std::vector<v1::ComputeRequest> OverlapOrder(std::vector<v1::ComputeRequest> parts) {
  return testing_harness::XLast(std::move(parts));
}

// One overlapped call, as it happened.
struct OverlapReply {
  grpc::Status status;
  std::vector<v1::ComputeSummary> summaries;  // in arrival order
  std::vector<std::string> order;             // "preliminary", "final" or a tensor name
  std::map<int, std::vector<uint8_t>> tensors;
  bool dx_before_x_done = false;  // a dX part arrived before the last X part was sent
  bool dx_during_hook = false;    // a dX part arrived before OverlapScript::before_last_x returned
};

struct OverlapScript {
  // X parts sent before the writer waits for the first dX part (-1: never waits).
  int x_parts_before_wait = -1;
  // X parts sent in all (-1: every one), then the stream closes (or is cancelled).
  int x_parts_total = -1;
  bool cancel_instead_of_close = false;
  bool hold_open_after = false;  // neither close nor cancel: let the server's limits act
  double deadline_seconds = 30;
  // Called on the writer's thread just before the last part of X goes (null: nothing).
  std::function<void()> before_last_x;
};

// Waits up to 10 s for the engine's executor to be idle (see RunOverlap).
void WaitForIdleExecutor(Engine* engine) {
  EXPECT_NE(engine, nullptr) << "a script that waits for dX needs the engine";
  if (engine != nullptr) {
    const absl::Time limit = absl::Now() + absl::Seconds(10);
    while (!engine->executor_idle() && absl::Now() < limit) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_TRUE(engine->executor_idle()) << "the executor stayed busy for 10 s";
  }
}

// A summary into the reply, in arrival order; the preliminary one announces the tensors,
// whose buffers are made here, poisoned, for the parts to fill.
void TakeSummary(const v1::ComputeSummary& summary, OverlapReply* reply) {
  reply->order.push_back(summary.preliminary() ? "preliminary" : "final");
  reply->summaries.push_back(summary);
  if (summary.preliminary()) {
    for (int i = 0; i < summary.tensors_size(); ++i) {
      uint64_t n = 1;
      for (int64_t d : summary.specs(i).shape()) n *= d;
      const v1::DType dt = summary.specs(i).dtype();
      const uint64_t es = dt == v1::DTYPE_INT64                               ? 8
                          : dt == v1::DTYPE_FP32 || dt == v1::DTYPE_INT32 ? 4
                                                                           : 2;
      reply->tensors[summary.tensors(i)].assign(n * es, 0xFF);
    }
  }
}

// `engine`: the server's engine, needed when the script waits for dX mid-stream. The server
// starts a call before all of its X is in only on an idle executor, and looks again only when
// another part comes, so a writer that stops to wait for dX while the previous test's job still
// holds an executor thread (a loaded machine) would wait in vain: the call is made only once
// the executor is idle.
OverlapReply RunOverlap(v1::Loss::Stub& stub, v1::ComputeHeader header,
                        const std::vector<v1::ComputeRequest>& parts, const OverlapScript& sc,
                        Engine* engine = nullptr) {
  header.set_overlap(true);
  if (sc.x_parts_before_wait >= 0) WaitForIdleExecutor(engine);
  OverlapReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(sc.deadline_seconds * 1000)));
  auto stream = stub.Compute(&ctx);
  std::mutex mu;
  std::condition_variable cv;
  bool saw_dx = false, read_over = false, x_done = false, hook_done = false;
  const int x_parts = static_cast<int>(
      std::count_if(parts.begin(), parts.end(),
                    [](const v1::ComputeRequest& r) { return r.part().tensor() == v1::TENSOR_X; }));
  std::thread writer([&] {
    v1::ComputeRequest h;
    *h.mutable_header() = header;
    if (!stream->Write(h)) return;
    int x_sent = 0;
    for (const v1::ComputeRequest& m : parts) {
      const bool is_x = m.part().tensor() == v1::TENSOR_X;
      if (is_x && x_sent == x_parts - 1 && sc.before_last_x) {
        sc.before_last_x();
        std::lock_guard<std::mutex> lock(mu);
        hook_done = true;
      }
      if (is_x && x_sent == sc.x_parts_before_wait) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait_for(lock, std::chrono::seconds(10), [&] { return saw_dx || read_over; });
        if (!saw_dx) {
          ADD_FAILURE() << "no dX part arrived while " << x_sent << " parts of X were in";
        }
      }
      if (is_x && sc.x_parts_total >= 0 && x_sent == sc.x_parts_total) break;
      if (!stream->Write(m)) break;
      if (is_x) ++x_sent;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      x_done = true;
    }
    if (sc.cancel_instead_of_close) {
      ctx.TryCancel();
    } else if (!sc.hold_open_after) {
      stream->WritesDone();
    }
  });
  v1::ComputeResponse r;
  while (stream->Read(&r)) {
    if (r.has_summary()) {
      TakeSummary(r.summary(), &reply);
      continue;
    }
    const v1::TensorPart& p = r.part();
    if (reply.order.empty() || reply.order.back() != v1::TensorId_Name(p.tensor())) {
      reply.order.push_back(v1::TensorId_Name(p.tensor()));
    }
    auto it = reply.tensors.find(p.tensor());
    if (it == reply.tensors.end() || p.offset() + p.data().size() > it->second.size()) {
      ADD_FAILURE() << "part of " << v1::TensorId_Name(p.tensor()) << " not announced or too long";
      continue;
    }
    std::memcpy(it->second.data() + p.offset(), p.data().data(), p.data().size());
    if (p.tensor() == v1::TENSOR_DX) {
      std::lock_guard<std::mutex> lock(mu);
      if (!x_done) reply.dx_before_x_done = true;
      if (sc.before_last_x && !hook_done) reply.dx_during_hook = true;
      saw_dx = true;
      cv.notify_all();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    read_over = true;
    cv.notify_all();
  }
  writer.join();
  reply.status = stream->Finish();
  return reply;
}

RandomProblemSpec Spec(DType dtype, uint64_t seed) {
  RandomProblemSpec s;
  s.bt = 61;  // 8 chunks of 8 rows, the last one short
  s.h = 24;
  s.v = 200;
  s.dtype = dtype;
  s.seed = seed;
  s.ignore_fraction = 0.1;
  s.options.chunk_rows = 8;
  return s;
}

// Parts of one row of X each, so rows arrive one part at a time.
size_t RowBytes(const RandomProblemSpec& s) { return s.h * DTypeSize(s.dtype); }

class OverlapTest : public testing_harness::SuiteHarness<OverlapTest> {
 protected:
  void ExpectServes() {
    RandomProblem rp = RandomProblem::Make(Spec(DType::kBF16, 99));
    OverlapReply r = RunOverlap(h_->stub(), HeaderFor(rp),
                                OverlapOrder(PartsFor(rp, RowBytes(rp.spec()))), {});
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(h_->WaitForIdleMemory(), 0u) << "a call left memory behind";
  }
  // *hd: rp's header on its W uploaded with PutWeights, into accumulator `acc`. Call under
  // ASSERT_NO_FATAL_FAILURE: a refused upload ends the test.
  void AccumulateByHandle(const RandomProblem& rp, const std::string& acc, v1::ComputeHeader* hd) {
    std::string handle;
    ASSERT_TRUE(testing_harness::PutWeights(h_->stub(), rp, 1 << 20, &handle).ok());
    *hd = HeaderFor(rp, handle);
    hd->set_accumulator(acc);
  }
  // hd's accumulator may hold a partial sum: the next Compute into it (rp by hd's handle) is
  // refused with FAILED_PRECONDITION saying so; then it is dropped and the server serves.
  void ExpectAccumulatorRefusesFurtherUse(const v1::ComputeHeader& hd, const RandomProblem& rp) {
    ComputeReply next = RunCompute(h_->stub(), hd, PartsFor(rp, 1 << 20, false));
    EXPECT_EQ(next.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(next.status.error_message().find("accumulator '" + hd.accumulator() +
                                               "' may hold a partial sum"),
              std::string::npos)
        << next.status.error_message();
    ASSERT_TRUE(h_->engine().DropAccumulator(hd.accumulator()).ok());
    ExpectServes();
  }
};

struct OverlapCase {
  const char* name;
  DType dtype;
  Reduction reduction;
  bool bias, class_weights;
  float smoothing, z_loss;
};

class OverlapOptionsTest : public OverlapTest, public ::testing::WithParamInterface<OverlapCase> {};

// The dX of the first rows comes back while the last rows of X have not been sent, every output
// is bit-identical to the same request without overlap, and both match the reference.
TEST_P(OverlapOptionsTest, ComputesWhileXArrivesAndGivesTheSameBits) {
  const OverlapCase& c = GetParam();
  RandomProblemSpec s = Spec(c.dtype, 7);
  s.bias = c.bias;
  s.class_weights = c.class_weights;
  s.options.reduction = c.reduction;
  s.options.label_smoothing = c.smoothing;
  s.options.z_loss_scale = c.z_loss;
  s.grad_output = c.reduction == Reduction::kNone;
  RandomProblem rp = RandomProblem::Make(s);
  const std::vector<v1::ComputeRequest> parts = OverlapOrder(PartsFor(rp, RowBytes(s)));

  OverlapScript sc;
  sc.x_parts_before_wait = 30;  // rows [0, 30) in: chunks 0-2 can finish
  OverlapReply o = RunOverlap(h_->stub(), HeaderFor(rp), parts, sc, &h_->engine());
  ASSERT_TRUE(o.status.ok()) << o.status.error_message();
  EXPECT_TRUE(o.dx_before_x_done);
  ASSERT_EQ(o.summaries.size(), 2u);
  EXPECT_EQ(o.order.front(), "preliminary");
  EXPECT_EQ(o.order.back(), "final");
  EXPECT_EQ(o.summaries[0].tensors_size(), o.summaries[1].tensors_size());
  EXPECT_EQ(o.summaries[0].loss(), 0.0f) << "the preliminary summary carries no results";

  ComputeReply plain = RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  const float lo = o.summaries[1].loss(), lp = plain.summary.loss();
  EXPECT_EQ(std::memcmp(&lo, &lp, 4), 0) << lo << " vs " << lp;
  EXPECT_EQ(o.summaries[1].tokens(), plain.summary.tokens());
  EXPECT_EQ(o.summaries[1].accuracy(), plain.summary.accuracy());
  ASSERT_EQ(o.tensors.size(), plain.tensors.size());
  for (const auto& [id, bytes] : plain.tensors) {
    EXPECT_TRUE(o.tensors[id] == bytes) << v1::TensorId_Name(static_cast<v1::TensorId>(id));
  }

  ComputeReply as_reply;
  as_reply.status = o.status;
  as_reply.summary = o.summaries[1];
  as_reply.tensors = o.tensors;
  EXPECT_TRUE(testing_harness::ReplyMatchesReference(rp, as_reply, s.dtype));
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, OverlapOptionsTest,
    ::testing::Values(OverlapCase{"bf16_mean", DType::kBF16, Reduction::kMean, false, false, 0, 0},
                      OverlapCase{"fp32_none", DType::kF32, Reduction::kNone, false, false, 0, 0},
                      OverlapCase{"bf16_all_options", DType::kBF16, Reduction::kMean, true, true,
                                  0.1f, 1e-3f},
                      OverlapCase{"fp16_sum_bias", DType::kF16, Reduction::kSum, true, false, 0,
                                  0}),
    [](const ::testing::TestParamInfo<OverlapCase>& i) { return std::string(i.param.name); });

TEST_F(OverlapTest, XSentBeforeTheOtherInputsStillWorks) {
  RandomProblem rp = RandomProblem::Make(Spec(DType::kBF16, 12));
  // PartsFor sends X first: the compute can start only at the end, and must still be right.
  OverlapReply o = RunOverlap(h_->stub(), HeaderFor(rp), PartsFor(rp, 100), {});
  ASSERT_TRUE(o.status.ok()) << o.status.error_message();
  ComputeReply plain = RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  ASSERT_TRUE(plain.status.ok());
  for (const auto& [id, bytes] : plain.tensors) EXPECT_TRUE(o.tensors[id] == bytes);
}

TEST_F(OverlapTest, AccumulatedMicroBatchesMatchThePlainPath) {
  RandomProblemSpec s = Spec(DType::kBF16, 13);
  s.bias = true;
  RandomProblem rp = RandomProblem::Make(s);
  std::string handle;
  ASSERT_TRUE(testing_harness::PutWeights(h_->stub(), rp, 1 << 20, &handle).ok());
  for (const char* acc : {"ov-acc", "plain-acc"}) {
    for (int k = 0; k < 3; ++k) {
      v1::ComputeHeader hd = HeaderFor(rp, handle);
      hd.set_accumulator(acc);
      if (std::string(acc) == "ov-acc") {
        OverlapReply o = RunOverlap(h_->stub(), hd, OverlapOrder(PartsFor(rp, RowBytes(s), false)),
                                    {});
        ASSERT_TRUE(o.status.ok()) << o.status.error_message();
        EXPECT_EQ(o.summaries.back().accumulated_micro_batches(), static_cast<uint64_t>(k + 1));
      } else {
        ComputeReply r = RunCompute(h_->stub(), hd, PartsFor(rp, 1 << 20, false));
        ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      }
    }
  }
  auto snap_ov = h_->engine().FetchGradients("ov-acc", false);
  auto snap_plain = h_->engine().FetchGradients("plain-acc", false);
  ASSERT_TRUE(snap_ov.ok() && snap_plain.ok());
  ASSERT_EQ(snap_ov->end - snap_ov->begin, snap_plain->end - snap_plain->begin);
  EXPECT_EQ(std::memcmp(snap_ov->data.get(), snap_plain->data.get(), snap_ov->end - snap_ov->begin),
            0);
  ASSERT_TRUE(h_->engine().DropAccumulator("ov-acc").ok());
  ASSERT_TRUE(h_->engine().DropAccumulator("plain-acc").ok());
}

TEST_F(OverlapTest, XCutOffWhileComputingFailsAndPoisonsTheAccumulator) {
  RandomProblemSpec s = Spec(DType::kBF16, 14);
  RandomProblem rp = RandomProblem::Make(s);
  v1::ComputeHeader hd;
  ASSERT_NO_FATAL_FAILURE(AccumulateByHandle(rp, "cut-acc", &hd));
  OverlapScript sc;
  sc.x_parts_before_wait = 20;
  sc.x_parts_total = 40;  // then the stream closes
  OverlapReply o = RunOverlap(h_->stub(), hd, OverlapOrder(PartsFor(rp, RowBytes(s), false)), sc,
                              &h_->engine());
  EXPECT_EQ(o.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << o.status.error_message();
  const std::string want = "the Compute stream closed early: x has " +
                           std::to_string(40 * RowBytes(s)) + " of its " +
                           std::to_string(s.bt * RowBytes(s)) + " bytes";
  EXPECT_NE(o.status.error_message().find(want), std::string::npos) << o.status.error_message();
  EXPECT_TRUE(o.dx_before_x_done);
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
  // Chunks [0, 40) were added: the accumulator says so instead of serving a partial sum.
  ExpectAccumulatorRefusesFurtherUse(hd, rp);
}

// Every row of X is in and the compute adds the micro-batch, but then the client sends a
// part the server refuses: the call fails with that error, which says the micro-batch was
// added, and the accumulator refuses further use (a retry would add it twice).
TEST_F(OverlapTest, ABadPartAfterTheLastRowOfXPoisonsTheAccumulatorItWasAddedTo) {
  RandomProblemSpec s = Spec(DType::kBF16, 17);
  RandomProblem rp = RandomProblem::Make(s);
  v1::ComputeHeader hd;
  ASSERT_NO_FATAL_FAILURE(AccumulateByHandle(rp, "late-bad-acc", &hd));
  std::vector<v1::ComputeRequest> parts = OverlapOrder(PartsFor(rp, RowBytes(s), false));
  v1::ComputeRequest stray;
  stray.mutable_part()->set_tensor(v1::TENSOR_TARGETS);
  stray.mutable_part()->set_offset(rp.targets.size() * sizeof(int64_t));  // past its end
  stray.mutable_part()->set_data(std::string(8, '\0'));
  parts.push_back(stray);
  OverlapScript sc;
  sc.x_parts_before_wait = 20;  // the compute has started before the rest of X goes
  OverlapReply o = RunOverlap(h_->stub(), hd, parts, sc, &h_->engine());
  EXPECT_EQ(o.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << o.status.error_message();
  EXPECT_NE(o.status.error_message().find("targets"), std::string::npos)
      << o.status.error_message();
  EXPECT_NE(o.status.error_message().find(
                "its micro-batch had already been added into accumulator 'late-bad-acc', which "
                "now refuses further use until it is dropped"),
            std::string::npos)
      << o.status.error_message();
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
  ExpectAccumulatorRefusesFurtherUse(hd, rp);
}

TEST_F(OverlapTest, NaNInALatePartOfXIsRefusedWithItsPlace) {
  RandomProblemSpec s = Spec(DType::kBF16, 15);
  RandomProblem rp = RandomProblem::Make(s);
  reinterpret_cast<uint16_t*>(rp.x.data())[50 * s.h + 7] = 0x7fc0;  // bf16 NaN at [50, 7]
  OverlapReply o = RunOverlap(h_->stub(), HeaderFor(rp), OverlapOrder(PartsFor(rp, RowBytes(s))),
                              {});
  EXPECT_EQ(o.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << o.status.error_message();
  EXPECT_NE(o.status.error_message().find("x contains a non-finite value (nan) at [50, 7]"),
            std::string::npos)
      << o.status.error_message();
  EXPECT_EQ(o.order.front(), "preliminary");
  EXPECT_EQ(std::count(o.order.begin(), o.order.end(), "final"), 0);
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
  ExpectServes();
}

TEST_F(OverlapTest, ACancelWhileTheComputeWaitsForRowsFreesEverything) {
  RandomProblemSpec s = Spec(DType::kF32, 16);
  RandomProblem rp = RandomProblem::Make(s);
  OverlapScript sc;
  sc.x_parts_before_wait = 10;
  sc.x_parts_total = 20;
  sc.cancel_instead_of_close = true;
  OverlapReply o = RunOverlap(h_->stub(), HeaderFor(rp), OverlapOrder(PartsFor(rp, RowBytes(s))),
                              sc, &h_->engine());
  EXPECT_EQ(o.status.error_code(), grpc::StatusCode::CANCELLED) << o.status.error_message();
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
  ExpectServes();
}

// Overlap hides the wire from an idle device only: a call whose other inputs are in while
// another compute holds the executor is submitted once all of its X is in, so it never
// holds the executor on rows still on the wire while others' are ready.
TEST_F(OverlapTest, ABusyExecutorWaitsForAllOfXBeforeStarting) {
  RandomProblem rp = RandomProblem::Make(Spec(DType::kBF16, 18));
  absl::Notification blocked, release;
  h_->engine().Submit([&] {
    blocked.Notify();
    release.WaitForNotification();
  });
  blocked.WaitForNotification();
  OverlapScript sc;
  sc.before_last_x = [&] {
    // Let the server take in every part sent so far (each refused an early start: the
    // executor is busy), then free the executor: with no new part to look again, the compute
    // must not start until the last part comes, so no dX may arrive meanwhile.
    absl::SleepFor(absl::Milliseconds(300));
    release.Notify();
    absl::SleepFor(absl::Milliseconds(300));
  };
  OverlapReply o = RunOverlap(h_->stub(), HeaderFor(rp),
                              OverlapOrder(PartsFor(rp, RowBytes(rp.spec()))), sc);
  ASSERT_TRUE(o.status.ok()) << o.status.error_message();
  EXPECT_FALSE(o.dx_during_hook) << "the compute started on a busy executor before X was in";
  ComputeReply plain = RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  ASSERT_TRUE(plain.status.ok());
  for (const auto& [id, bytes] : plain.tensors) EXPECT_TRUE(o.tensors[id] == bytes);
}

TEST(OverlapLimitsTest, RowsThatStopComingEndTheCallAtTheStallLimit) {
  HarnessOptions ho;
  ho.engine.overlap_stall = absl::Milliseconds(300);
  Harness h(ho);
  RandomProblemSpec s = Spec(DType::kBF16, 17);
  RandomProblem rp = RandomProblem::Make(s);
  OverlapScript sc;
  sc.x_parts_before_wait = 12;
  sc.x_parts_total = 24;
  sc.hold_open_after = true;  // the sender neither closes nor cancels
  const auto t0 = std::chrono::steady_clock::now();
  OverlapReply o =
      RunOverlap(h.stub(), HeaderFor(rp), OverlapOrder(PartsFor(rp, RowBytes(s))), sc, &h.engine());
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(o.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << o.status.error_message();
  EXPECT_NE(o.status.error_message().find("x stalled: no rows arrived for 300ms"),
            std::string::npos)
      << o.status.error_message();
  EXPECT_NE(o.status.error_message().find("(24 of 61 rows received)"), std::string::npos)
      << o.status.error_message();
  EXPECT_LT(took, 10.0) << "the stall limit, not the call's deadline, ended it";
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
}

}  // namespace
}  // namespace lossd
