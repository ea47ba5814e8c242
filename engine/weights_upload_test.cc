// SPDX-License-Identifier: Apache-2.0
#include "engine/weights_upload.h"

#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace lossd {
namespace {

constexpr uint64_t kWBytes = 4 * 2 * 4, kBiasBytes = 4 * 4;  // W (4, 2) fp32, bias (4) fp32

UploadHeader Header(const std::string& upload_id = "", uint32_t stripes = 0,
                    uint64_t w_begin = 0, uint64_t w_end = 0) {
  UploadHeader h;
  h.w = TensorDesc{true, DType::kF32, {4, 2}};
  h.bias = TensorDesc{true, DType::kF32, {4}};
  h.upload_id = upload_id;
  h.stripes = stripes;
  h.w_begin = w_begin;
  h.w_end = w_end;
  return h;
}

class WeightsUploadTest : public ::testing::Test {
 protected:
  std::unique_ptr<WeightsUpload> Begin(const UploadHeader& h) {
    auto u = WeightsUpload::Begin(&engine_, h, "client", "");
    EXPECT_TRUE(u.ok()) << u.status();
    return u.ok() ? std::move(*u) : nullptr;
  }
  absl::Status Write(WeightsUpload& u, bool bias, uint64_t offset, uint64_t size) {
    return u.Write(bias, offset, ones_.data(), size);
  }

  Engine engine_{NewCpuBackend(1), EngineOptions{}};
  std::vector<float> ones_ = std::vector<float>(16, 1.0f);
};

TEST_F(WeightsUploadTest, APlainUploadCommitsWhatItReceived) {
  auto u = Begin(Header());
  ASSERT_NE(u, nullptr);
  EXPECT_FALSE(u->striped());
  EXPECT_EQ(u->activity(), nullptr);
  EXPECT_EQ(u->bytes(), kWBytes + kBiasBytes);
  ASSERT_TRUE(Write(*u, false, 0, 16).ok());
  ASSERT_TRUE(Write(*u, false, 16, 16).ok());
  ASSERT_TRUE(Write(*u, true, 0, kBiasBytes).ok());
  EXPECT_TRUE(u->CheckComplete().ok());
  auto handle = u->Commit();
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_FALSE(handle->empty());
}

TEST_F(WeightsUploadTest, StripeFieldsWithoutAnUploadIdAreRefused) {
  auto u = WeightsUpload::Begin(&engine_, Header("", 2, 0, 16), "client", "");
  EXPECT_EQ(u.status(), absl::InvalidArgumentError(
                            "header.stripes (2), header.w_begin (0) and header.w_end (16) "
                            "describe one stripe of a striped upload and need "
                            "header.upload_id, which is empty"));
}

TEST_F(WeightsUploadTest, AStripeTakesItsPartsInOrderInsideItsRange) {
  auto first = Begin(Header("u", 2, 0, 16));
  auto second = Begin(Header("u", 2, 16, kWBytes));
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  EXPECT_TRUE(first->striped());
  EXPECT_EQ(first->activity(), second->activity());  // one upload
  EXPECT_EQ(second->bytes(), kWBytes + kBiasBytes);

  absl::Status s = Write(*second, false, 20, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("a part of w starts at byte offset 20 but this stripe expects "
                             "offset 16: parts must arrive in order"),
            std::string::npos)
      << s;
  s = Write(*second, false, 16, 20);
  EXPECT_NE(s.message().find("a part of w at offset 16 with 20 bytes runs past the stripe's "
                             "end at 32"),
            std::string::npos)
      << s;
  s = Write(*second, true, 0, 4);
  EXPECT_NE(s.message().find("a bias part arrived on a stripe that does not carry the bias"),
            std::string::npos)
      << s;
  ASSERT_TRUE(Write(*second, false, 16, 16).ok());
  EXPECT_TRUE(second->CheckComplete().ok());

  ASSERT_TRUE(Write(*first, false, 0, 8).ok());
  s = first->CheckComplete();
  EXPECT_EQ(s, absl::InvalidArgumentError(
                   "the stripe closed early: w has 8 of the bytes up to 16, bias 0 of 16"));
  ASSERT_TRUE(Write(*first, false, 8, 8).ok());
  ASSERT_TRUE(Write(*first, true, 0, kBiasBytes).ok());
  EXPECT_TRUE(first->CheckComplete().ok());

  std::optional<absl::StatusOr<std::string>> a, b;
  first->FinishStripe([&](absl::StatusOr<std::string> h) { a = h; });
  EXPECT_FALSE(a.has_value());  // waits for its sibling
  second->FinishStripe([&](absl::StatusOr<std::string> h) { b = h; });
  ASSERT_TRUE(a.has_value() && b.has_value());
  ASSERT_TRUE(a->ok()) << a->status();
  EXPECT_EQ(**a, **b);
}

TEST_F(WeightsUploadTest, AFailedStripeAbortsItsSiblings) {
  auto first = Begin(Header("u", 2, 0, 16));
  auto second = Begin(Header("u", 2, 16, kWBytes));
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  ASSERT_TRUE(Write(*second, false, 16, 16).ok());
  std::optional<absl::StatusOr<std::string>> waited;
  second->FinishStripe([&](absl::StatusOr<std::string> h) { waited = h; });
  first->Fail(absl::CancelledError("a stripe was cancelled"));
  ASSERT_TRUE(waited.has_value());
  EXPECT_EQ(waited->status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(waited->status().message().find("because a stripe failed: a stripe was cancelled"),
            std::string::npos)
      << waited->status();
}

// A stripe whose header does not fit the upload is refused, and the upload it named is
// aborted for the stripes already in it.
TEST_F(WeightsUploadTest, AStripeRefusedAtJoinAbortsItsUpload) {
  auto first = Begin(Header("u", 2, 0, 16));
  ASSERT_NE(first, nullptr);
  std::optional<absl::StatusOr<std::string>> waited;
  ASSERT_TRUE(Write(*first, false, 0, 16).ok());
  ASSERT_TRUE(Write(*first, true, 0, kBiasBytes).ok());
  first->FinishStripe([&](absl::StatusOr<std::string> h) { waited = h; });
  auto refused = WeightsUpload::Begin(&engine_, Header("u", 3, 16, kWBytes), "client", "");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  ASSERT_TRUE(waited.has_value());
  EXPECT_EQ(waited->status().code(), absl::StatusCode::kAborted);
}

// The cache holds room for one upload: the second fits only once the first gave its back.
TEST(WeightsUploadAbandonTest, AnAbandonedPlainUploadGivesItsReservationBack) {
  EngineOptions o;
  o.weight_cache_bytes = kWBytes + kBiasBytes;
  Engine engine(NewCpuBackend(1), o);
  auto first = WeightsUpload::Begin(&engine, Header(), "client", "");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(WeightsUpload::Begin(&engine, Header(), "client", "").status().code(),
            absl::StatusCode::kResourceExhausted);
  (*first)->Abandon();
  EXPECT_TRUE(WeightsUpload::Begin(&engine, Header(), "client", "").ok());
}

}  // namespace
}  // namespace lossd
