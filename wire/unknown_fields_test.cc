// SPDX-License-Identifier: Apache-2.0
// Tests RefuseUnknownFields on lossd.v1 messages: a field the schema lacks, at the top or in a
// nested message, is named with its path, type and number; a message without one passes.
#include "wire/unknown_fields.h"

#include <string>

#include "gtest/gtest.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace {

v1::ComputeHeader KnownHeader() {
  v1::ComputeHeader h;
  h.mutable_x()->set_dtype(v1::DTYPE_BF16);
  h.mutable_x()->add_shape(8);
  h.mutable_options()->set_softcap(30);
  h.mutable_outputs()->set_dx(true);
  h.set_accumulator("step");
  return h;
}

// Serialises and parses again, as the server receives it.
v1::ComputeHeader RoundTrip(const v1::ComputeHeader& h) {
  v1::ComputeHeader back;
  EXPECT_TRUE(back.ParseFromString(h.SerializeAsString()));
  return back;
}

TEST(UnknownFieldsTest, KnownFieldsPass) {
  EXPECT_TRUE(RefuseUnknownFields(RoundTrip(KnownHeader()), "header").ok());
}

TEST(UnknownFieldsTest, TopLevelFieldIsNamed) {
  v1::ComputeHeader h = KnownHeader();
  h.GetReflection()->MutableUnknownFields(&h)->AddVarint(99, 1);
  absl::Status s = RefuseUnknownFields(RoundTrip(h), "header");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("header (lossd.v1.ComputeHeader) carries field number 99, which "
                             "this server does not know"),
            std::string::npos)
      << s.message();
}

TEST(UnknownFieldsTest, NestedFieldsAreNamedWithTheirPath) {
  v1::ComputeHeader h = KnownHeader();
  v1::LossOptions* o = h.mutable_options();
  o->GetReflection()->MutableUnknownFields(o)->AddFixed32(12, 7);
  absl::Status s = RefuseUnknownFields(RoundTrip(h), "header");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("header.options (lossd.v1.LossOptions) carries field number 12"),
            std::string::npos)
      << s.message();

  h = KnownHeader();
  v1::TensorSpec* x = h.mutable_x();
  x->GetReflection()->MutableUnknownFields(x)->AddLengthDelimited(5, "abc");
  s = RefuseUnknownFields(RoundTrip(h), "header");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("header.x (lossd.v1.TensorSpec) carries field number 5"),
            std::string::npos)
      << s.message();
}

TEST(UnknownFieldsTest, MessagesInsideAOneofAreChecked) {
  v1::PutWeightsRequest r;
  v1::WeightsHeader* h = r.mutable_header();
  h->GetReflection()->MutableUnknownFields(h)->AddVarint(40, 3);
  v1::PutWeightsRequest back;
  ASSERT_TRUE(back.ParseFromString(r.SerializeAsString()));
  absl::Status s = RefuseUnknownFields(back, "PutWeightsRequest");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("PutWeightsRequest.header (lossd.v1.WeightsHeader) carries field "
                             "number 40"),
            std::string::npos)
      << s.message();
}

}  // namespace
}  // namespace lossd
