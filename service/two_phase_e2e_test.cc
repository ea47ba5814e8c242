// SPDX-License-Identifier: Apache-2.0
// The two-phase log-prob over the wire, through a real server on the CPU backend: a forward
// with keep_ms returns logp, entropy and a ticket (listed as STATE_TICKET, counted in
// /metrics); its backward sends only dlogp and dentropy and gets the bits of a one-phase call;
// a second backward is NOT_FOUND; the refusals name the header field; the ticket limits are on
// /metrics.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"

namespace lossd {
namespace testing_harness {
namespace {

constexpr int64_t kBt = 24, kH = 16, kV = 40;
constexpr size_t kPartBytes = 200;  // several parts per tensor

std::vector<float> Uniform(uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> r(kBt);
  for (float& f : r) f = u(g);
  return r;
}

v1::TensorSpec F32Rows() {
  v1::TensorSpec s;
  s.set_dtype(v1::DTYPE_FP32);
  s.add_shape(kBt);
  return s;
}

void AddRows(std::vector<v1::ComputeRequest>* out, v1::TensorId id,
             const std::vector<float>& rows) {
  v1::ComputeRequest r;
  r.mutable_part()->set_tensor(id);
  r.mutable_part()->set_data(rows.data(), rows.size() * 4);
  out->push_back(std::move(r));
}

void ExpectStatus(const grpc::Status& s, grpc::StatusCode code, const std::string& part) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  EXPECT_NE(s.error_message().find(part), std::string::npos) << s.error_message();
}

class TwoPhaseE2eTest : public ::testing::Test {
 protected:
  TwoPhaseE2eTest()
      : rp_(RandomProblem::Make([] {
          RandomProblemSpec s = ShapeSpec(kBt, kH, kV);
          s.bias = true;
          s.ignore_fraction = 0.2;
          s.seed = 9;
          return s;
        }())),
        dlogp_(Uniform(31)),
        dentropy_(Uniform(32)) {}

  // A logprob header over rp_ at temperature 0.8 and softcap 4, with entropy.
  v1::ComputeHeader Logprob() const {
    v1::ComputeHeader h = HeaderFor(rp_);
    h.clear_outputs();
    h.set_kind(v1::LOSS_KIND_LOGPROB);
    h.mutable_options()->set_temperature(0.8f);
    h.mutable_options()->set_softcap(4.0f);
    h.mutable_outputs()->set_entropy(true);
    return h;
  }
  void WithGradients(v1::ComputeHeader* h, std::vector<v1::ComputeRequest>* parts) const {
    *h->mutable_dlogp() = F32Rows();
    *h->mutable_dentropy() = F32Rows();
    h->mutable_outputs()->set_dx(true);
    h->mutable_outputs()->set_dw(true);
    h->mutable_outputs()->set_db(true);
    h->mutable_options()->set_grad_scale(0.25f);
    AddRows(parts, v1::TENSOR_DLOGP, dlogp_);
    AddRows(parts, v1::TENSOR_DENTROPY, dentropy_);
  }
  ComputeReply Forward(uint32_t keep_ms = 60000) {
    v1::ComputeHeader h = Logprob();
    h.set_keep_ms(keep_ms);
    return RunCompute(h_.stub(), h, PartsFor(rp_, kPartBytes));
  }
  ComputeReply Backward(const std::string& ticket, v1::ComputeHeader h = {}) {
    h.set_kind(v1::LOSS_KIND_LOGPROB);
    h.set_ticket(ticket);
    h.mutable_outputs()->set_entropy(true);
    std::vector<v1::ComputeRequest> parts;
    WithGradients(&h, &parts);
    return RunCompute(h_.stub(), h, parts);
  }
  ComputeReply OnePhase() {
    v1::ComputeHeader h = Logprob();
    std::vector<v1::ComputeRequest> parts = PartsFor(rp_, kPartBytes);
    WithGradients(&h, &parts);
    return RunCompute(h_.stub(), h, parts);
  }

  Harness h_;
  RandomProblem rp_;
  std::vector<float> dlogp_, dentropy_;
};

TEST_F(TwoPhaseE2eTest, TheBackwardOfATicketIsTheOnePhaseCallBitForBit) {
  grpc::ClientContext info_ctx;
  v1::ServerInfoResponse info;
  ASSERT_TRUE(h_.stub().ServerInfo(&info_ctx, v1::ServerInfoRequest(), &info).ok());
  EXPECT_NE(std::find(info.features().begin(), info.features().end(), "logprob_two_phase"),
            info.features().end());

  const int64_t before_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
  ComputeReply f = Forward();
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  const std::string ticket = f.summary.ticket();
  EXPECT_EQ(ticket.rfind("t-", 0), 0u) << ticket;
  EXPECT_GE(f.summary.ticket_expires_unix_ms(), before_ms + 60000);
  EXPECT_LE(f.summary.ticket_expires_unix_ms(), before_ms + 60000 + 600000);
  EXPECT_EQ(f.tensors[v1::TENSOR_LOGP].size(), kBt * 4u);
  EXPECT_EQ(f.tensors[v1::TENSOR_ENTROPY].size(), kBt * 4u);
  EXPECT_EQ(f.tensors.count(v1::TENSOR_DX), 0u);

  // Listed, and counted in /metrics.
  grpc::ClientContext list_ctx;
  v1::ListResponse listed;
  ASSERT_TRUE(h_.stub().List(&list_ctx, v1::ListRequest(), &listed).ok());
  ASSERT_EQ(listed.entries_size(), 1);
  EXPECT_EQ(listed.entries(0).kind(), v1::STATE_TICKET);
  EXPECT_EQ(listed.entries(0).name(), ticket);
  const uint64_t bytes = kBt * kH * 2 + kBt * 8 + kV * kH * 2 + kV * 2;  // X, targets, W, b
  EXPECT_EQ(listed.entries(0).bytes(), bytes);
  const std::string page = h_.ScrapeMetrics();
  EXPECT_EQ(MetricValue(page, "lossd_tickets"), 1);
  EXPECT_EQ(MetricValue(page, "lossd_ticket_bytes"), static_cast<double>(bytes));

  ComputeReply b = Backward(ticket);
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  ComputeReply one = OnePhase();
  ASSERT_TRUE(one.status.ok()) << one.status.error_message();
  EXPECT_EQ(b.summary.loss(), one.summary.loss());
  EXPECT_NE(b.summary.loss(), 0.0f);
  EXPECT_EQ(b.summary.tokens(), one.summary.tokens());
  EXPECT_TRUE(b.summary.ticket().empty());
  for (v1::TensorId id : {v1::TENSOR_LOGP, v1::TENSOR_ENTROPY, v1::TENSOR_DX, v1::TENSOR_DW,
                          v1::TENSOR_DB}) {
    ASSERT_FALSE(one.tensors[id].empty()) << v1::TensorId_Name(id);
    EXPECT_EQ(b.tensors[id], one.tensors[id]) << v1::TensorId_Name(id);
  }
  // The forward's logp and entropy were those of the one-phase call too.
  EXPECT_EQ(f.tensors[v1::TENSOR_LOGP], one.tensors[v1::TENSOR_LOGP]);
  EXPECT_EQ(f.tensors[v1::TENSOR_ENTROPY], one.tensors[v1::TENSOR_ENTROPY]);

  // Consumed: a second backward is told to resend X.
  ExpectStatus(Backward(ticket).status, grpc::StatusCode::NOT_FOUND,
               "was consumed by its backward; resend X as a one-phase logprob call");
  EXPECT_EQ(MetricValue(h_.ScrapeMetrics(), "lossd_tickets"), 0);
}

TEST_F(TwoPhaseE2eTest, TheRefusalsNameTheHeaderField) {
  ComputeReply f = Forward();
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  v1::ComputeHeader with_x;
  *with_x.mutable_x() = HeaderFor(rp_).x();
  ExpectStatus(Backward(f.summary.ticket(), with_x).status, grpc::StatusCode::INVALID_ARGUMENT,
               "header.x is sent with header.ticket");
  v1::ComputeHeader hotter;
  hotter.mutable_options()->set_temperature(1.0f);
  ExpectStatus(Backward(f.summary.ticket(), hotter).status, grpc::StatusCode::INVALID_ARGUMENT,
               "header.options.temperature 1 differs from the forward's 0.8");
  ExpectStatus(Backward("t-deadbeef-1").status, grpc::StatusCode::FAILED_PRECONDITION,
               "was issued by server instance 'deadbeef'");
  ExpectStatus(Backward(absl::StrCat(f.summary.ticket(), "0")).status,
               grpc::StatusCode::NOT_FOUND, "is not held here");
  v1::ComputeHeader overlapped = Logprob();
  overlapped.set_keep_ms(100);
  overlapped.set_overlap(true);
  ExpectStatus(RunCompute(h_.stub(), overlapped, XLast(PartsFor(rp_, kPartBytes))).status,
               grpc::StatusCode::INVALID_ARGUMENT, "header.overlap with header.keep_ms");
  v1::ComputeHeader overlapped_back;
  overlapped_back.set_overlap(true);
  ExpectStatus(Backward(f.summary.ticket(), overlapped_back).status,
               grpc::StatusCode::INVALID_ARGUMENT, "header.overlap with header.ticket");
  v1::ComputeHeader asks_dx = Logprob();
  asks_dx.set_keep_ms(100);
  asks_dx.mutable_outputs()->set_dx(true);
  ExpectStatus(RunCompute(h_.stub(), asks_dx, PartsFor(rp_, kPartBytes)).status,
               grpc::StatusCode::INVALID_ARGUMENT, "header.outputs.dx is asked with");
  // Every refusal left the ticket: its backward still works.
  EXPECT_TRUE(Backward(f.summary.ticket()).status.ok());
}

// The limits a forward is refused beyond are on /metrics beside what the tickets hold, so an
// alert can compare the two (LossdTicketBudgetNearlyFull).
TEST(TwoPhaseMetricsTest, TheTicketLimitsAreExported) {
  std::mt19937_64 g(77);
  HarnessOptions o;
  o.engine.ticket_bytes = std::uniform_int_distribution<uint64_t>(1 << 20, 1 << 30)(g);
  o.engine.max_tickets = std::uniform_int_distribution<size_t>(1, 1000)(g);
  Harness h(o);
  ASSERT_TRUE(h.started());
  const std::string page = h.ScrapeMetrics();
  EXPECT_EQ(MetricValue(page, "lossd_ticket_budget_bytes"),
            static_cast<double>(o.engine.ticket_bytes));
  EXPECT_EQ(MetricValue(page, "lossd_max_tickets"), static_cast<double>(o.engine.max_tickets));
  EXPECT_EQ(MetricValue(page, "lossd_ticket_bytes"), 0);
}

}  // namespace
}  // namespace testing_harness
}  // namespace lossd
