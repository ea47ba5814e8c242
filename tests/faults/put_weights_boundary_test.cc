// SPDX-License-Identifier: Apache-2.0
// Regression: PutWeights parts that split a tensor element. --check_finite once read each
// part as if it started an element, so a NaN whose bytes straddled two parts was stored and a
// finite upload split at an odd byte could be refused as "non-finite" (found by //tests/fuzz
// put_weights). Either a part that splits an element is refused for that reason, or the check
// works on the tensor's element grid; never a false "non-finite" and never a stored NaN.
#include <cstring>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "gtest/gtest.h"
#include "testing/server_harness.h"

namespace lossd {
namespace {

using testing_harness::Harness;

// Uploads bf16 W (V, H) from `w` in parts of the given sizes (in order, cycling).
grpc::Status Upload(v1::Loss::Stub& stub, const std::vector<uint16_t>& w, int64_t v, int64_t h,
                    const std::vector<size_t>& sizes, std::string* handle) {
  grpc::ClientContext ctx;
  v1::PutWeightsResponse resp;
  auto writer = stub.PutWeights(&ctx, &resp);
  v1::PutWeightsRequest hdr;
  hdr.mutable_header()->mutable_w()->set_dtype(v1::DTYPE_BF16);
  hdr.mutable_header()->mutable_w()->add_shape(v);
  hdr.mutable_header()->mutable_w()->add_shape(h);
  writer->Write(hdr);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w.data());
  const size_t total = w.size() * 2;
  size_t off = 0;
  for (size_t i = 0; off < total; ++i) {
    const size_t n = std::min(sizes[i % sizes.size()], total - off);
    v1::PutWeightsRequest r;
    r.mutable_part()->set_tensor(v1::TENSOR_W);
    r.mutable_part()->set_offset(off);
    r.mutable_part()->set_data(bytes + off, n);
    if (!writer->Write(r)) break;
    off += n;
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  *handle = resp.handle();
  return s;
}

class PutWeightsBoundaryTest : public testing_harness::SuiteHarness<PutWeightsBoundaryTest> {};

TEST_F(PutWeightsBoundaryTest, FiniteWeightsSplitAtAnOddByteAreAccepted) {
  // -1.0 (0xBF80) then 0.996 (0x3F7F): both finite, but bytes 1..2 read as one bf16 are
  // 0x7FBF, a NaN. A part starting at byte 1 must not be judged from there.
  std::vector<uint16_t> w(4 * 8);
  for (size_t i = 0; i < w.size(); i += 2) {
    w[i] = 0xBF80;
    w[i + 1] = 0x3F7F;
  }
  std::string handle;
  grpc::Status s = Upload(h_->stub(), w, 4, 8, {1, 7}, &handle);
  if (s.ok()) {
    EXPECT_FALSE(handle.empty());
  } else {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_EQ(s.error_message().find("non-finite"), std::string::npos)
        << "finite weights were refused as non-finite: " << s.error_message();
    EXPECT_NE(s.error_message().find("whole"), std::string::npos)
        << "the refusal does not say that parts must hold whole elements: "
        << s.error_message();
  }
}

TEST_F(PutWeightsBoundaryTest, ANaNWhoseBytesStraddleTwoPartsIsRefused) {
  std::vector<uint16_t> w(4 * 8, 0x3F80);  // 1.0
  w[5] = 0x7FC0;                           // NaN, bytes 10 and 11
  std::string handle;
  // Parts of 11 bytes then 3 bytes...: byte 10 ends the first part, byte 11 starts the next.
  grpc::Status s = Upload(h_->stub(), w, 4, 8, {11, 3}, &handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << "a NaN split across two parts was stored (handle '" << handle << "')";
  EXPECT_TRUE(s.error_message().find("non-finite value (nan)") != std::string::npos ||
              s.error_message().find("whole") != std::string::npos)
      << s.error_message();
  EXPECT_TRUE(handle.empty());
}

TEST_F(PutWeightsBoundaryTest, AlignedPartsStillWork) {
  std::vector<uint16_t> w(4 * 8, 0x3F80);
  std::string handle;
  EXPECT_TRUE(Upload(h_->stub(), w, 4, 8, {16}, &handle).ok());
  w[9] = 0x7F80;  // +Inf at an aligned place
  grpc::Status s = Upload(h_->stub(), w, 4, 8, {16}, &handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("non-finite value (inf)"), std::string::npos)
      << s.error_message();
}

}  // namespace
}  // namespace lossd
