// SPDX-License-Identifier: Apache-2.0
// Striping over several connections: a weight upload split into stripes (each its own
// stream on its own channel) and gradients fetched by byte range; a stripe cut off half way
// aborts the upload and leaves no handle.
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"
#include "testing/server_harness.h"

namespace lossd {
namespace {

using testing_harness::ComputeReply;
using testing_harness::Harness;
using testing_harness::HeaderFor;
using testing_harness::PartsFor;
using testing_harness::RunCompute;

v1::TensorSpec Spec(v1::DType dt, std::vector<int64_t> shape) {
  v1::TensorSpec s;
  s.set_dtype(dt);
  for (int64_t d : shape) s.add_shape(d);
  return s;
}

struct StripeResult {
  grpc::Status status;
  std::string handle;
};

// Sends W bytes [begin, end) (and the bias when begin == 0) as one stripe. With
// `cancel_after_parts` >= 0 the stream is cancelled after that many parts.
StripeResult SendStripe(v1::Loss::Stub& stub, const RandomProblem& rp, const std::string& id,
                        uint32_t stripes, uint64_t begin, uint64_t end, size_t part_bytes,
                        int cancel_after_parts = -1,
                        const std::vector<int64_t>* bias_shape = nullptr,
                        std::chrono::milliseconds pause = std::chrono::milliseconds(0)) {
  StripeResult out;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::PutWeightsResponse resp;
  auto writer = stub.PutWeights(&ctx, &resp);
  v1::PutWeightsRequest h;
  v1::WeightsHeader* wh = h.mutable_header();
  *wh->mutable_w() = Spec(v1::DTYPE_BF16, {rp.spec().v, rp.spec().h});
  if (!rp.bias.empty()) *wh->mutable_bias() = Spec(v1::DTYPE_BF16, {rp.spec().v});
  if (bias_shape != nullptr) {
    wh->mutable_bias()->clear_shape();
    for (int64_t d : *bias_shape) wh->mutable_bias()->add_shape(d);
  }
  wh->set_upload_id(id);
  wh->set_stripes(stripes);
  wh->set_w_begin(begin);
  wh->set_w_end(end);
  writer->Write(h);
  int sent = 0;
  for (uint64_t off = begin; off < end; off += part_bytes) {
    if (sent++ == cancel_after_parts) {
      // Let the server read the header and join the stripe first: a stripe cancelled before
      // its header arrives is unknown to the upload, which then ends at its siblings'
      // deadline instead (still without a handle).
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      ctx.TryCancel();
      out.status = writer->Finish();
      return out;
    }
    v1::PutWeightsRequest r;
    r.mutable_part()->set_tensor(v1::TENSOR_W);
    r.mutable_part()->set_offset(off);
    r.mutable_part()->set_data(rp.w.data() + off, std::min<uint64_t>(part_bytes, end - off));
    if (!writer->Write(r)) break;
    if (pause.count() > 0) std::this_thread::sleep_for(pause);
  }
  if (begin == 0 && !rp.bias.empty()) {
    v1::PutWeightsRequest r;
    r.mutable_part()->set_tensor(v1::TENSOR_BIAS);
    r.mutable_part()->set_offset(0);
    r.mutable_part()->set_data(rp.bias.data(), rp.bias.size());
    writer->Write(r);
  }
  writer->WritesDone();
  out.status = writer->Finish();
  out.handle = resp.handle();
  return out;
}

RandomProblem Problem() {
  RandomProblemSpec s;
  s.bt = 32;
  s.h = 48;
  s.v = 1000;
  s.bias = true;
  s.seed = 17;
  return RandomProblem::Make(s);
}

TEST(StripingTest, FourStripesOnFourConnectionsMakeOneHandle) {
  Harness h;
  RandomProblem rp = Problem();
  const uint64_t w_bytes = rp.w.size();
  const uint64_t cuts[] = {0, 10000, 40000, 41000, w_bytes};
  std::vector<StripeResult> results(4);
  std::vector<std::unique_ptr<v1::Loss::Stub>> stubs;
  for (int i = 0; i < 4; ++i) stubs.push_back(h.NewStub(grpc::InsecureChannelCredentials()));
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      results[i] = SendStripe(*stubs[i], rp, "up-1", 4, cuts[i], cuts[i + 1], 3000);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    EXPECT_EQ(results[i].handle, results[0].handle);
  }
  ComputeReply by_handle =
      RunCompute(h.stub(), HeaderFor(rp, results[0].handle), PartsFor(rp, 1 << 20, false));
  ComputeReply inline_w = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  ASSERT_TRUE(by_handle.status.ok()) << by_handle.status.error_message();
  ASSERT_TRUE(inline_w.status.ok());
  EXPECT_EQ(by_handle.tensors, inline_w.tensors);
  EXPECT_EQ(h.engine().weights().count(), 1u);
}

TEST(StripingTest, AStripeCutOffHalfWayAbortsTheUploadAndLeavesNoHandle) {
  Harness h;
  RandomProblem rp = Problem();
  const uint64_t w_bytes = rp.w.size();
  auto a = h.NewStub(grpc::InsecureChannelCredentials());
  auto b = h.NewStub(grpc::InsecureChannelCredentials());
  StripeResult first, second;
  std::thread t1([&] { first = SendStripe(*a, rp, "up-2", 2, 0, w_bytes / 2, 2000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // first stripe sent, waiting
  second = SendStripe(*b, rp, "up-2", 2, w_bytes / 2, w_bytes, 2000, /*cancel_after_parts=*/3);
  t1.join();
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(first.status.error_code(), grpc::StatusCode::ABORTED) << first.status.error_message();
  EXPECT_NE(first.status.error_message().find("was aborted"), std::string::npos);
  EXPECT_TRUE(first.handle.empty());
  EXPECT_EQ(h.engine().weights().count(), 0u);
  EXPECT_EQ(h.engine().weights().bytes(), 0u);
  // The cache reservation was given back: the whole budget can be reserved again.
  EXPECT_TRUE(h.engine().weights().Reserve(h.engine().weights().budget()).ok());
  h.engine().weights().Unreserve(h.engine().weights().budget());
}

TEST(StripingTest, OverlappingStripesAreRefused) {
  Harness h;
  RandomProblem rp = Problem();
  auto a = h.NewStub(grpc::InsecureChannelCredentials());
  auto b = h.NewStub(grpc::InsecureChannelCredentials());
  StripeResult first;
  std::thread t([&] { first = SendStripe(*a, rp, "up-3", 2, 0, 50000, 4000); });
  // Let the first stripe register its range before the overlapping one joins.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  StripeResult second = SendStripe(*b, rp, "up-3", 2, 40000, rp.w.size(), 4000);
  t.join();
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(second.status.error_message().find("overlaps the range [0, 50000)"), std::string::npos)
      << second.status.error_message();
  EXPECT_EQ(first.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(h.engine().weights().count(), 0u);
}

// Ranges that leave a gap in W are refused when the last stripe joins, naming them; ranges
// that leave no room for the stripes still to come are refused at once (those stripes could
// never join, and the ones that did would wait for them until the idle timeout).
TEST(StripingTest, StripesWhoseRangesCannotCoverWAreRefusedWhenTheyJoin) {
  Harness h;
  RandomProblem rp = Problem();
  const uint64_t w_bytes = rp.w.size();  // 96000
  auto a = h.NewStub(grpc::InsecureChannelCredentials());
  auto b = h.NewStub(grpc::InsecureChannelCredentials());
  StripeResult first;
  std::thread t([&] { first = SendStripe(*a, rp, "gap", 2, 0, 4000, 4000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the first joins first
  StripeResult second = SendStripe(*b, rp, "gap", 2, 8000, w_bytes, 4000);
  t.join();
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(second.status.error_message().find(
                "the ranges of upload 'gap' cannot cover w's 96000 bytes with its 2 stripes: "
                "[0, 4000), [8000, 96000) cover 92000 bytes, 0 stripe(s) still to join"),
            std::string::npos)
      << second.status.error_message();
  EXPECT_EQ(first.status.error_code(), grpc::StatusCode::ABORTED) << first.status.error_message();

  StripeResult all = SendStripe(*a, rp, "no-room", 3, 0, w_bytes, 4000);
  EXPECT_EQ(all.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(all.status.error_message().find("[0, 96000) cover 96000 bytes, 2 stripe(s) still to "
                                            "join"),
            std::string::npos)
      << all.status.error_message();
  EXPECT_EQ(h.engine().weights().count(), 0u);
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
  // Ranges that do cover W still make one handle.
  StripeResult lo, hi;
  std::thread u([&] { lo = SendStripe(*a, rp, "whole", 2, 0, 50000, 4000); });
  hi = SendStripe(*b, rp, "whole", 2, 50000, w_bytes, 4000);
  u.join();
  ASSERT_TRUE(lo.status.ok()) << lo.status.error_message();
  ASSERT_TRUE(hi.status.ok()) << hi.status.error_message();
  EXPECT_EQ(lo.handle, hi.handle);
}

// --stream_idle_timeout and striped uploads: a stripe done with its range waits for its
// siblings without a message of its own, which is not idle while a sibling still sends; when
// no stripe sends (a sibling never comes), the upload is aborted and leaves nothing held.
TEST(StripingTest, AWaitingStripeFollowsItsSiblingsAndAnAbandonedUploadIsAborted) {
  testing_harness::HarnessOptions o;
  o.service.stream_idle_timeout = absl::Milliseconds(300);
  Harness h(o);
  RandomProblem rp = Problem();
  const uint64_t w_bytes = rp.w.size();
  {
    auto a = h.NewStub(grpc::InsecureChannelCredentials());
    auto b = h.NewStub(grpc::InsecureChannelCredentials());
    StripeResult first, second;
    std::thread t([&] { first = SendStripe(*a, rp, "idle-ok", 2, 0, 4000, 4000); });
    // The sibling takes about 1.2 s in parts 100 ms apart, four times the timeout.
    second = SendStripe(*b, rp, "idle-ok", 2, 4000, w_bytes, (w_bytes - 4000) / 12 + 8, -1,
                        nullptr, std::chrono::milliseconds(100));
    t.join();
    ASSERT_TRUE(first.status.ok()) << first.status.error_message();
    ASSERT_TRUE(second.status.ok()) << second.status.error_message();
    EXPECT_EQ(first.handle, second.handle);
  }
  // Two stripes announced, one sent: the one waits, then the upload is aborted.
  auto a = h.NewStub(grpc::InsecureChannelCredentials());
  StripeResult lone = SendStripe(*a, rp, "idle-abandoned", 2, 0, 4000, 4000);
  EXPECT_FALSE(lone.status.ok());
  EXPECT_TRUE(lone.handle.empty());
  EXPECT_EQ(h.engine().weights().count(), 1u) << "only the first upload's handle";
  // Its cache reservation is back: all but the first upload's bytes can be reserved.
  const uint64_t free_bytes = h.engine().weights().budget() - h.engine().weights().bytes();
  EXPECT_TRUE(h.engine().weights().Reserve(free_bytes).ok());
  h.engine().weights().Unreserve(free_bytes);
}

// A stripe's fields without an upload_id would be ignored: refused, naming them.
TEST(StripingTest, StripeFieldsWithoutAnUploadIdAreRefused) {
  Harness h;
  RandomProblem rp = Problem();
  StripeResult r = SendStripe(h.stub(), rp, "", 2, 0, 20000, 4000);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("header.stripes (2), header.w_begin (0) and "
                                          "header.w_end (20000) describe one stripe of a "
                                          "striped upload and need header.upload_id"),
            std::string::npos)
      << r.status.error_message();
  EXPECT_EQ(h.engine().weights().count(), 0u);
}

// A later stripe's header must say what the first one said; the upload's byte counts come
// from the first. A bias spec of no dimensions once crashed the server (it read shape[0]).
TEST(StripingTest, AStripeThatDisagreesAboutTheBiasIsRefusedAndTheServerKeepsServing) {
  Harness h;
  RandomProblem rp = Problem();
  const std::vector<std::vector<int64_t>> bad_shapes = {{}, {999}, {1000, 1}};
  const std::vector<std::string> said = {"bf16[]", "bf16[999]", "bf16[1000, 1]"};
  for (size_t i = 0; i < bad_shapes.size(); ++i) {
    SCOPED_TRACE(said[i]);
    const std::string id = "up-bias-" + std::to_string(i);
    auto a = h.NewStub(grpc::InsecureChannelCredentials());
    auto b = h.NewStub(grpc::InsecureChannelCredentials());
    StripeResult first;
    std::thread t([&] { first = SendStripe(*a, rp, id, 2, 0, 20000, 4000); });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the first stripe joined
    StripeResult second =
        SendStripe(*b, rp, id, 2, 20000, rp.w.size(), 4000, -1, &bad_shapes[i]);
    t.join();
    EXPECT_EQ(second.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(second.status.error_message().find("header.bias is " + said[i] +
                                                  ", the first stripe's is bf16[1000]"),
              std::string::npos)
        << second.status.error_message();
    EXPECT_EQ(first.status.error_code(), grpc::StatusCode::ABORTED);
    EXPECT_TRUE(first.handle.empty());
  }
  EXPECT_EQ(h.engine().weights().count(), 0u);
  // Still serving: a whole upload in two stripes, then a Compute with the handle.
  auto a = h.NewStub(grpc::InsecureChannelCredentials());
  auto b = h.NewStub(grpc::InsecureChannelCredentials());
  StripeResult first, second;
  std::thread t([&] { first = SendStripe(*a, rp, "up-bias-ok", 2, 0, 20000, 4000); });
  second = SendStripe(*b, rp, "up-bias-ok", 2, 20000, rp.w.size(), 4000);
  t.join();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  ComputeReply by_handle =
      RunCompute(h.stub(), HeaderFor(rp, first.handle), PartsFor(rp, 1 << 20, false));
  EXPECT_TRUE(by_handle.status.ok()) << by_handle.status.error_message();
}

// The fetched bytes of dW | db in a buffer of `total` bytes that starts as `fill`.
std::vector<uint8_t> Fetch(v1::Loss::Stub& stub, const std::string& name, uint64_t begin,
                           uint64_t end, grpc::Status* status, uint64_t dw_bytes,
                           uint64_t total, uint8_t fill = 0xEE) {
  grpc::ClientContext ctx;
  v1::FetchGradientsRequest r;
  r.set_accumulator(name);
  r.set_range_begin(begin);
  r.set_range_end(end);
  r.set_response_part_bytes(1777);  // divides no element size or range
  auto reader = stub.FetchGradients(&ctx, r);
  std::vector<uint8_t> all(total, fill);
  v1::FetchGradientsResponse m;
  while (reader->Read(&m)) {
    if (!m.has_part()) continue;
    const uint64_t base = m.part().tensor() == v1::TENSOR_DW ? 0 : dw_bytes;
    std::memcpy(all.data() + base + m.part().offset(), m.part().data().data(),
                m.part().data().size());
  }
  *status = reader->Finish();
  return all;
}

TEST(StripingTest, GradientsFetchedByRangeEqualOneWholeFetch) {
  Harness h;
  RandomProblem rp = Problem();
  v1::ComputeHeader header = HeaderFor(rp);
  header.set_accumulator("acc");
  ASSERT_TRUE(RunCompute(h.stub(), header, PartsFor(rp, 1 << 20)).status.ok());
  const uint64_t dw_bytes = rp.spec().v * rp.spec().h * 4, total = dw_bytes + rp.spec().v * 4;
  grpc::Status s;
  std::vector<uint8_t> whole = Fetch(h.stub(), "acc", 0, 0, &s, dw_bytes, total);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // The ranges land on another filler than the whole fetch: a byte that neither wrote would
  // differ between the two.
  std::vector<uint8_t> striped(total, 0xDD);
  const uint64_t cuts[] = {0, 5000, dw_bytes - 3, dw_bytes + 10, total};
  for (int i = 0; i < 4; ++i) {
    auto stub = h.NewStub(grpc::InsecureChannelCredentials());
    std::vector<uint8_t> part =
        Fetch(*stub, "acc", cuts[i], cuts[i + 1], &s, dw_bytes, total, 0xDD);
    ASSERT_TRUE(s.ok()) << s.error_message();
    std::memcpy(striped.data() + cuts[i], part.data() + cuts[i], cuts[i + 1] - cuts[i]);
  }
  EXPECT_EQ(striped, whole);

  grpc::ClientContext ctx;
  v1::FetchGradientsRequest bad;
  bad.set_accumulator("acc");
  bad.set_range_begin(0);
  bad.set_range_end(100);
  bad.set_reset(true);
  auto reader = h.stub().FetchGradients(&ctx, bad);
  v1::FetchGradientsResponse m;
  while (reader->Read(&m)) {
  }
  grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("reset applies to whole fetches only"), std::string::npos);
}

}  // namespace
}  // namespace lossd
