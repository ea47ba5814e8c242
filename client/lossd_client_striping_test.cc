// SPDX-License-Identifier: Apache-2.0
// Tests the client's striping against a real lossd server (engine, CPU backend, gRPC on
// loopback, in this process): a weight upload split over several connections, gradients
// fetched by byte range, the reset that drops the accumulator, failures half way, and the
// default rule for how many stripes a transfer gets.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/host_tensor.h"
#include "client/lossd_client.h"
#include "client/npy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference.h"
#include "testing/test_util.h"
#include "core/dtype.h"
#include "testing/server_harness.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;
using testing_harness::Harness;
using testing_harness::HarnessOptions;

RandomProblem Problem(DType dtype, bool bias, uint64_t seed) {
  RandomProblemSpec s;
  s.bt = 24;
  s.h = 40;
  s.v = 1003;  // odd: stripes and ranges fall mid-row
  s.dtype = dtype;
  s.bias = bias;
  s.seed = seed;
  return RandomProblem::Make(s);
}

HostTensor W(const RandomProblem& rp) {
  return HostTensor::View(rp.spec().dtype, {rp.spec().v, rp.spec().h}, rp.w.data());
}

HostTensor Bias(const RandomProblem& rp) {
  return HostTensor::View(rp.spec().dtype, {rp.spec().v}, rp.bias.data());
}

// A Compute of the problem with inline weights (and bias), or by `handle` when given.
ComputeRequest RequestFor(const RandomProblem& rp, const std::string& handle = "") {
  ComputeRequest r;
  r.x = HostTensor::View(rp.spec().dtype, {rp.spec().bt, rp.spec().h}, rp.x.data());
  r.targets = HostTensor::View(DType::kI64, {rp.spec().bt}, rp.targets.data());
  if (handle.empty()) {
    r.w = W(rp);
    if (!rp.bias.empty()) r.bias = Bias(rp);
  } else {
    r.weight_handle = handle;
  }
  r.want.dx = r.want.dw = true;
  r.want.db = !rp.bias.empty();
  r.want.lse = true;
  return r;
}

// Byte-for-byte comparison that names the first differing byte.
void ExpectSameBytes(const std::string& what, const HostTensor& got, const HostTensor& want) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < want.num_bytes(); ++i) {
    if (got.data()[i] != want.data()[i] && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << what << ": " << mismatches << " of " << want.num_bytes()
                            << " bytes differ, first at byte " << first;
}

class StripingTest : public ::testing::Test {
 protected:
  // A client of harness_, or of `other`.
  ClientOptions Options(int connections, int stripes, Harness* other = nullptr) {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", (other != nullptr ? other : &harness_)->port());
    o.deadline = absl::Seconds(30);
    o.connections = connections;
    o.stripes = stripes;
    // Small parts: every stripe and range travels as many parts.
    o.part_bytes = 3000;
    o.response_part_bytes = 2000;
    return o;
  }

  std::unique_ptr<LossClient> Client(const ClientOptions& o) {
    auto c = LossClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  Harness harness_;
};

TEST_F(StripingTest, StripedUploadComputesBitIdenticallyToInlineWeights) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    SCOPED_TRACE(DTypeName(dtype));
    RandomProblem rp = Problem(dtype, /*bias=*/true, 5);
    auto client = Client(Options(4, 4));
    ASSERT_NE(client, nullptr);
    const HostTensor w = W(rp), bias = Bias(rp);
    absl::StatusOr<PutWeightsResult> put = client->PutWeights(w, &bias);
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->stripes, 4);
    EXPECT_EQ(put->bytes, w.num_bytes() + bias.num_bytes());
    EXPECT_EQ(harness_.engine().weights().count(), 1u);

    absl::StatusOr<ComputeResult> by_handle = client->Compute(RequestFor(rp, put->handle));
    absl::StatusOr<ComputeResult> inline_w = client->Compute(RequestFor(rp));
    ASSERT_TRUE(by_handle.ok()) << by_handle.status();
    ASSERT_TRUE(inline_w.ok()) << inline_w.status();
    EXPECT_TRUE(std::isfinite(inline_w->loss));
    EXPECT_EQ(std::memcmp(&by_handle->loss, &inline_w->loss, sizeof(float)), 0)
        << by_handle->loss << " vs " << inline_w->loss;
    ASSERT_EQ(by_handle->outputs.size(), 4u);  // dx, dw, db, lse
    ASSERT_EQ(inline_w->outputs.size(), 4u);
    for (const auto& [id, t] : inline_w->outputs) {
      const HostTensor* got = by_handle->Find(id);
      ASSERT_NE(got, nullptr) << OutputTensorName(id);
      ExpectSameBytes(OutputTensorName(id), *got, t);
    }
    ASSERT_TRUE(client->DropWeights(put->handle).ok());
  }
}

TEST_F(StripingTest, StripedUploadWithoutBiasAndWithUnevenStripes) {
  RandomProblem rp = Problem(DType::kBF16, /*bias=*/false, 6);
  auto client = Client(Options(3, 3));
  ASSERT_NE(client, nullptr);
  absl::StatusOr<PutWeightsResult> put = client->PutWeights(W(rp), nullptr);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stripes, 3);
  absl::StatusOr<ComputeResult> by_handle = client->Compute(RequestFor(rp, put->handle));
  absl::StatusOr<ComputeResult> inline_w = client->Compute(RequestFor(rp));
  ASSERT_TRUE(by_handle.ok()) << by_handle.status();
  ASSERT_TRUE(inline_w.ok()) << inline_w.status();
  for (OutputTensor t : {OutputTensor::kDx, OutputTensor::kDw, OutputTensor::kLse}) {
    ASSERT_NE(by_handle->Find(t), nullptr);
    ASSERT_NE(inline_w->Find(t), nullptr);
    ExpectSameBytes(OutputTensorName(t), *by_handle->Find(t), *inline_w->Find(t));
  }
}

// More stripes than W has elements: each stripe still gets at least one.
TEST_F(StripingTest, TinyWeightsUseAtMostOneStripePerElement) {
  auto client = Client(Options(4, 4));
  ASSERT_NE(client, nullptr);
  const std::vector<float> w = {0.5f, -1.25f, 2.0f};
  absl::StatusOr<PutWeightsResult> put =
      client->PutWeights(HostTensor::View(DType::kF32, {3, 1}, w.data()), nullptr);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stripes, 3);
  EXPECT_EQ(harness_.engine().weights().count(), 1u);
}

// A non-finite value in the last stripe's range: that stripe is refused half way, the server
// aborts the others, and the caller hears the refusal (not the siblings' ABORTED), soon.
TEST_F(StripingTest, AFailureHalfWaySurfacesItsErrorAndLeavesNoHandle) {
  RandomProblem rp = Problem(DType::kF32, /*bias=*/true, 7);
  const float nan = std::nanf("");
  std::memcpy(rp.w.data() + rp.w.size() - 8 * sizeof(float), &nan, sizeof(float));
  auto client = Client(Options(4, 4));
  ASSERT_NE(client, nullptr);
  const HostTensor w = W(rp), bias = Bias(rp);
  const absl::Time start = absl::Now();
  absl::StatusOr<PutWeightsResult> put = client->PutWeights(w, &bias);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not the 30 s deadline
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kInvalidArgument) << put.status();
  EXPECT_THAT(put.status().message(), HasSubstr("non-finite value (nan)")) << put.status();
  EXPECT_EQ(harness_.engine().weights().count(), 0u);
  EXPECT_EQ(harness_.engine().weights().bytes(), 0u);
  // The reservation was given back: the whole cache budget can be reserved again.
  EXPECT_TRUE(harness_.engine().weights().Reserve(harness_.engine().weights().budget()).ok());
  harness_.engine().weights().Unreserve(harness_.engine().weights().budget());

  // The client is not left in a bad state: the same upload without the NaN works.
  RandomProblem good = Problem(DType::kF32, /*bias=*/true, 7);
  const HostTensor gw = W(good), gb = Bias(good);
  absl::StatusOr<PutWeightsResult> again = client->PutWeights(gw, &gb);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->stripes, 4);
}

// A deadline that runs out mid-upload: DEADLINE_EXCEEDED, no handle, nothing left reserved.
TEST_F(StripingTest, ADeadlineMidUploadLeavesNoHandle) {
  RandomProblemSpec s;
  s.bt = 4;
  s.h = 512;
  s.v = 8192;  // 16 MiB of fp32 in 4 KiB parts: far more than 1 ms of work
  s.dtype = DType::kF32;
  s.seed = 8;
  RandomProblem rp = RandomProblem::Make(s);
  ClientOptions o = Options(4, 4);
  o.part_bytes = 4096;
  o.deadline = absl::Milliseconds(1);
  auto client = Client(o);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<PutWeightsResult> put = client->PutWeights(W(rp), nullptr);
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kDeadlineExceeded) << put.status();
  // The server notices the cut-off stripes and aborts the upload, giving its reservation
  // back.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  bool reservable = false;
  while (!reservable && absl::Now() < until) {
    reservable = harness_.engine().weights().Reserve(harness_.engine().weights().budget()).ok();
    if (reservable) {
      harness_.engine().weights().Unreserve(harness_.engine().weights().budget());
    } else {
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  EXPECT_TRUE(reservable) << "the aborted upload still holds its cache reservation";
  EXPECT_EQ(harness_.engine().weights().count(), 0u);
}

// Accumulates two micro-batches (with a bias) into `name`.
void Accumulate(LossClient& client, const std::string& name, const RandomProblem& a,
                const RandomProblem& b) {
  for (const RandomProblem* rp : {&a, &b}) {
    ComputeRequest r = RequestFor(*rp);
    r.accumulator = name;
    r.want.dx = false;
    absl::StatusOr<ComputeResult> res = client.Compute(r);
    ASSERT_TRUE(res.ok()) << res.status();
  }
}

TEST_F(StripingTest, StripedFetchEqualsAWholeFetchBitForBit) {
  RandomProblem a = Problem(DType::kBF16, true, 11), b = Problem(DType::kBF16, true, 12);
  auto whole_client = Client(Options(1, 1));
  ASSERT_NE(whole_client, nullptr);
  Accumulate(*whole_client, "acc", a, b);
  absl::StatusOr<FetchGradientsResult> whole = whole_client->FetchGradients("acc", false);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->stripes, 1);
  EXPECT_EQ(whole->micro_batches, 2u);
  ASSERT_TRUE(whole->db.has_value());
  // Not all zeros: the comparison below could not fail otherwise.
  bool any_nonzero = false;
  for (int64_t i = 0; i < whole->dw.num_elements(); ++i) {
    any_nonzero |= whole->dw.data_as<float>()[i] != 0.0f;
  }
  EXPECT_TRUE(any_nonzero);

  for (int stripes : {2, 3, 4}) {
    SCOPED_TRACE(absl::StrCat(stripes, " stripes"));
    auto client = Client(Options(4, stripes));
    ASSERT_NE(client, nullptr);
    absl::StatusOr<FetchGradientsResult> striped = client->FetchGradients("acc", false);
    ASSERT_TRUE(striped.ok()) << striped.status();
    EXPECT_EQ(striped->stripes, stripes);
    EXPECT_EQ(striped->micro_batches, whole->micro_batches);
    EXPECT_EQ(striped->tokens, whole->tokens);
    EXPECT_EQ(striped->instance, whole->instance);
    ExpectSameBytes("dw", striped->dw, whole->dw);
    ASSERT_TRUE(striped->db.has_value());
    ExpectSameBytes("db", *striped->db, *whole->db);
  }
}

// A fetch of more than 64 MiB: the client faults the result's pages in on a helper thread
// while the bytes arrive (PagePopulator); whole and striped results must still be exactly
// what the server holds (bit for bit against each other, and the reference's dW).
TEST_F(StripingTest, LargeFetchesWhoseBufferIsPopulatedWhileReceivingAreExact) {
  RandomProblemSpec s;
  s.bt = 4;
  s.h = 1024;
  s.v = 18500;  // 75.8 MB of fp32 dW
  s.dtype = DType::kF32;
  s.seed = 31;
  RandomProblem rp = RandomProblem::Make(s);
  ClientOptions o = Options(1, 1);
  o.part_bytes = 4 << 20;
  o.response_part_bytes = 4 << 20;
  auto whole_client = Client(o);
  ASSERT_NE(whole_client, nullptr);
  ComputeRequest r = RequestFor(rp);
  r.accumulator = "big";
  r.want.dx = false;
  ASSERT_TRUE(whole_client->Compute(r).ok());
  absl::StatusOr<FetchGradientsResult> whole = whole_client->FetchGradients("big", false);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(rp.problem(), &ref).ok());
  ASSERT_EQ(static_cast<size_t>(whole->dw.num_elements()), ref.dw.size());
  std::vector<double> got(whole->dw.data_as<float>(),
                          whole->dw.data_as<float>() + whole->dw.num_elements());
  const CompareResult c = CompareRelNorm("dw", ref.dw, got, 1e-5);
  EXPECT_TRUE(c.ok()) << c.ToString();
  o.connections = 4;
  o.stripes = 4;
  auto client = Client(o);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<FetchGradientsResult> striped = client->FetchGradients("big", false);
  ASSERT_TRUE(striped.ok()) << striped.status();
  EXPECT_EQ(striped->stripes, 4);
  ExpectSameBytes("dw", striped->dw, whole->dw);
}

TEST_F(StripingTest, StripedFetchWithoutBias) {
  RandomProblem a = Problem(DType::kF32, false, 13), b = Problem(DType::kF32, false, 14);
  auto client = Client(Options(4, 4));
  ASSERT_NE(client, nullptr);
  Accumulate(*client, "nb", a, b);
  absl::StatusOr<FetchGradientsResult> whole = Client(Options(1, 1))->FetchGradients("nb", false);
  absl::StatusOr<FetchGradientsResult> striped = client->FetchGradients("nb", false);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(striped.ok()) << striped.status();
  EXPECT_EQ(striped->stripes, 4);
  EXPECT_FALSE(striped->db.has_value());
  ExpectSameBytes("dw", striped->dw, whole->dw);
}

// reset with stripes: every range is read, then the accumulator is dropped; the next Compute
// naming it starts from zero.
TEST_F(StripingTest, StripedResetDropsTheAccumulatorAfterTheLastRange) {
  RandomProblem a = Problem(DType::kBF16, true, 21), b = Problem(DType::kBF16, true, 22);
  auto client = Client(Options(4, 4));
  ASSERT_NE(client, nullptr);
  auto whole_client = Client(Options(1, 1));
  ASSERT_NE(whole_client, nullptr);

  // The gradients of micro-batch `a` alone, from a fresh accumulator.
  ComputeRequest ra = RequestFor(a);
  ra.accumulator = "ref";
  ASSERT_TRUE(client->Compute(ra).ok());
  absl::StatusOr<FetchGradientsResult> only_a = whole_client->FetchGradients("ref", true);
  ASSERT_TRUE(only_a.ok()) << only_a.status();
  EXPECT_EQ(only_a->micro_batches, 1u);

  Accumulate(*client, "acc", a, b);
  absl::StatusOr<FetchGradientsResult> whole = whole_client->FetchGradients("acc", false);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const size_t accumulators = harness_.engine().accumulators().count();
  absl::StatusOr<FetchGradientsResult> striped = client->FetchGradients("acc", /*reset=*/true);
  ASSERT_TRUE(striped.ok()) << striped.status();
  EXPECT_EQ(striped->stripes, 4);
  EXPECT_EQ(striped->micro_batches, 2u);
  ExpectSameBytes("dw", striped->dw, whole->dw);
  ExpectSameBytes("db", *striped->db, *whole->db);
  EXPECT_EQ(harness_.engine().accumulators().count(), accumulators - 1);

  // Gone until a Compute names it again ...
  absl::StatusOr<FetchGradientsResult> gone = client->FetchGradients("acc", false);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  // ... which starts it from zero: it then holds micro-batch a alone.
  ra.accumulator = "acc";
  ASSERT_TRUE(client->Compute(ra).ok());
  absl::StatusOr<FetchGradientsResult> after = client->FetchGradients("acc", false);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->micro_batches, 1u);
  EXPECT_EQ(after->tokens, only_a->tokens);
  ExpectSameBytes("dw after reset", after->dw, only_a->dw);
  ExpectSameBytes("db after reset", *after->db, *only_a->db);
}

TEST_F(StripingTest, StripedFetchOfAMissingAccumulatorIsNotFound) {
  auto client = Client(Options(4, 4));
  ASSERT_NE(client, nullptr);
  absl::StatusOr<FetchGradientsResult> g = client->FetchGradients("nobody", true);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kNotFound) << g.status();
}

// A server refuses a fetch whose host copy is larger than its whole memory budget; the client
// then fetches ranges of at most half the budget, whole or striped, and they add up to the
// same bytes as a whole fetch from a server with room. With reset the accumulator is dropped
// after the last range, as with striping.
TEST_F(StripingTest, AFetchLargerThanTheServersMemoryBudgetComesInRangesThatFit) {
  RandomProblemSpec spec;
  spec.bt = 24;
  spec.h = 256;
  spec.v = 1003;
  spec.dtype = DType::kF32;  // a bf16 Compute into an accumulator would need more than dW here
  spec.bias = true;
  spec.seed = 41;
  RandomProblem a = RandomProblem::Make(spec);
  spec.seed = 42;
  RandomProblem b = RandomProblem::Make(spec);
  const uint64_t grads = (spec.v * spec.h + spec.v) * sizeof(float);  // 1031084
  HarnessOptions small_options;
  // A Compute by weight handle fits (the weight cache has a budget of its own), the whole
  // dW | db does not, nor two halves of it (515542 bytes each), but four quarters do.
  small_options.engine.memory_budget_bytes = 500000;
  Harness small(small_options);
  // a's weights (by handle) with a's and then b's rows, into "acc"; returns the handle.
  const HostTensor bias = Bias(a);
  auto accumulate = [&](LossClient& client) -> std::string {
    absl::StatusOr<PutWeightsResult> put = client.PutWeights(W(a), &bias);
    EXPECT_TRUE(put.ok()) << put.status();
    if (!put.ok()) return "";
    for (const RandomProblem* rp : {&a, &b}) {
      ComputeRequest r = RequestFor(*rp, put->handle);
      r.accumulator = "acc";
      r.want.dx = false;
      absl::StatusOr<ComputeResult> res = client.Compute(r);
      EXPECT_TRUE(res.ok()) << res.status();
    }
    return put->handle;
  };
  auto roomy_client = Client(Options(1, 1));
  ASSERT_NE(roomy_client, nullptr);
  ASSERT_FALSE(accumulate(*roomy_client).empty());
  absl::StatusOr<FetchGradientsResult> whole = roomy_client->FetchGradients("acc", false);
  ASSERT_TRUE(whole.ok()) << whole.status();

  struct Case {
    int connections, stripes;
    bool reset;
    int ranges;  // ranges of at most 250000 bytes where the stripes' own do not fit
  };
  for (const Case& c : {Case{1, 1, false, 5}, Case{1, 1, true, 5}, Case{4, 2, false, 5},
                        Case{4, 2, true, 5}, Case{4, 4, false, 4}}) {
    SCOPED_TRACE(absl::StrCat(c.connections, " connections, ", c.stripes, " stripes, reset ",
                              c.reset));
    auto client = Client(Options(c.connections, c.stripes, &small));
    ASSERT_NE(client, nullptr);
    const std::string handle = accumulate(*client);
    ASSERT_FALSE(handle.empty());
    const size_t accumulators = small.engine().accumulators().count();
    absl::StatusOr<FetchGradientsResult> got = client->FetchGradients("acc", c.reset);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->stripes, c.stripes);
    EXPECT_EQ(got->ranges, c.ranges);
    if (c.stripes < 4) {
      EXPECT_EQ(static_cast<uint64_t>(got->ranges),
                FetchRangesWithin(grads, 500000, static_cast<uint64_t>(c.stripes)));
    }
    EXPECT_EQ(got->micro_batches, 2u);
    EXPECT_EQ(got->tokens, whole->tokens);
    ExpectSameBytes("dw", got->dw, whole->dw);
    ASSERT_TRUE(got->db.has_value());
    ExpectSameBytes("db", *got->db, *whole->db);
    EXPECT_EQ(small.engine().accumulators().count(), accumulators - (c.reset ? 1 : 0));
    if (!c.reset) {
      ASSERT_TRUE(client->DropAccumulator("acc").ok());
    }
    ASSERT_TRUE(client->DropWeights(handle).ok());
    EXPECT_EQ(small.WaitForIdleMemory(), 0u) << "a fetch left memory reserved";
  }
  // A fetch that fits is whole, as ever.
  absl::StatusOr<FetchGradientsResult> fits = roomy_client->FetchGradients("acc", true);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->ranges, 1);
}

TEST(FetchRangesWithinTest, RangesOfAtMostHalfTheBudgetOrNoneWhereTheyCannotHelp) {
  EXPECT_EQ(FetchRangesWithin(1000, 1000, 1), 0u);   // fits whole: refused for another reason
  EXPECT_EQ(FetchRangesWithin(1000, 999, 1), 3u);    // 496 bytes (124 values) a range at most
  EXPECT_EQ(FetchRangesWithin(1000, 999, 2), 0u);    // two ranges of 500 already fit
  EXPECT_EQ(FetchRangesWithin(1000, 400, 2), 5u);    // 200 bytes a range
  EXPECT_EQ(FetchRangesWithin(1000, 100, 8), 21u);   // 48 bytes a range
  EXPECT_EQ(FetchRangesWithin(1000, 7, 1), 0u);      // not two values
  EXPECT_EQ(FetchRangesWithin(1000, 8, 1), 250u);    // one value a range
  EXPECT_EQ(FetchRangesWithin(uint64_t{8} << 30, 256 << 10, 1), kMaxFetchRanges);
  EXPECT_EQ(FetchRangesWithin(uint64_t{8} << 30, (256 << 10) - 8, 1), 0u);  // too many
}

// stripes = 0: min(connections, 4) stripes for transfers of at least auto_stripe_bytes, else
// one; one connection never stripes.
TEST_F(StripingTest, DefaultRule) {
  RandomProblem a = Problem(DType::kBF16, true, 31);
  const HostTensor w = W(a), bias = Bias(a);
  const uint64_t upload = w.num_bytes() + bias.num_bytes();
  const uint64_t grads = (a.spec().v * a.spec().h + a.spec().v) * sizeof(float);
  struct Case {
    int connections;
    uint64_t threshold;
    int put_stripes, fetch_stripes;
  };
  const Case cases[] = {
      {1, 1, 1, 1},                  // one connection: off
      {6, 1, 4, 4},                  // at most 4
      {3, 1, 3, 3},                  // at most connections
      {4, upload + 1, 1, 4},         // upload below the threshold, gradients (fp32) above
      {4, grads + 1, 1, 1},          // both below
      {4, ClientOptions().auto_stripe_bytes, 1, 1},  // the default 64 MiB: small stays whole
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.connections, " connections, threshold ", c.threshold));
    ClientOptions o = Options(c.connections, 0);
    o.auto_stripe_bytes = c.threshold;
    auto client = Client(o);
    ASSERT_NE(client, nullptr);
    absl::StatusOr<PutWeightsResult> put = client->PutWeights(w, &bias);
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->stripes, c.put_stripes);
    ComputeRequest r = RequestFor(a, put->handle);
    r.accumulator = "rule";
    ASSERT_TRUE(client->Compute(r).ok());
    absl::StatusOr<FetchGradientsResult> g = client->FetchGradients("rule", true);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->stripes, c.fetch_stripes);
    EXPECT_EQ(g->micro_batches, 1u);
    ASSERT_TRUE(client->DropWeights(put->handle).ok());
  }
}

// lossctl's --stripes reaches put-weights, fetch-gradients and bench --put_weights.
TEST_F(StripingTest, LossctlStripes) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/lossctl_stripes");
  auto run = [&](const std::string& args, std::string* output) {
    const std::string cmd = absl::StrCat("client/lossctl --target=127.0.0.1:", harness_.port(),
                                         " --deadline_seconds=30 --part_bytes=4096 ", args,
                                         " 2>&1");
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) return -1;
    char buf[4096];
    size_t n;
    output->clear();
    while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
    const int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  std::string out;
  ASSERT_EQ(run("put-weights --v=1001 --h=40 --with_bias --connections=4 --stripes=4", &out), 0)
      << out;
  EXPECT_THAT(out, HasSubstr("stripes     4\n"));
  EXPECT_EQ(harness_.engine().weights().count(), 1u);
  // The default rule: 160 KB is below 64 MiB, so one stripe.
  ASSERT_EQ(run("put-weights --v=1001 --h=40 --connections=4", &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("stripes     1\n"));
  EXPECT_EQ(run("put-weights --v=1001 --h=40 --connections=2 --stripes=3", &out), 1);
  EXPECT_THAT(out, HasSubstr("INVALID_ARGUMENT"));

  ASSERT_EQ(run("compute --bt=16 --h=40 --v=1001 --with_bias --accumulator=cli --want=dx", &out),
            0)
      << out;
  auto client = Client(Options(1, 1));
  ASSERT_NE(client, nullptr);
  absl::StatusOr<FetchGradientsResult> whole = client->FetchGradients("cli", false);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_EQ(run("fetch-gradients --accumulator=cli --reset --connections=4 --stripes=3 --out_dir=" +
                    dir,
                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("stripes       3\n"));
  EXPECT_THAT(out, HasSubstr("ranges        3\n"));
  EXPECT_THAT(out, HasSubstr("micro_batches 1\n"));
  absl::StatusOr<HostTensor> dw = ReadNpy(dir + "/dw.npy");
  absl::StatusOr<HostTensor> db = ReadNpy(dir + "/db.npy");
  ASSERT_TRUE(dw.ok()) << dw.status();
  ASSERT_TRUE(db.ok()) << db.status();
  ExpectSameBytes("dw", *dw, whole->dw);
  ExpectSameBytes("db", *db, *whole->db);
  EXPECT_EQ(client->FetchGradients("cli", false).status().code(), absl::StatusCode::kNotFound);

  ASSERT_EQ(run("bench --bt=8 --h=40 --v=1001 --calls=2 --warmup=0 --connections=4 --stripes=2 "
                "--put_weights",
                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("over 2 stripe(s), handle "));
}

TEST(StripingOptionsTest, StripesNeedAsManyConnections) {
  ClientOptions o;
  o.connections = 2;
  o.stripes = 3;
  absl::StatusOr<std::unique_ptr<LossClient>> c = LossClient::Create(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("connections"));
  o.stripes = -1;
  EXPECT_EQ(LossClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.connections = 100;
  o.stripes = 65;
  EXPECT_EQ(LossClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.stripes = 64;
  EXPECT_TRUE(LossClient::Create(o).ok());
  o.connections = 1;
  o.stripes = 1;
  EXPECT_TRUE(LossClient::Create(o).ok());
}

}  // namespace
}  // namespace client
}  // namespace lossd
