// SPDX-License-Identifier: Apache-2.0
// Tests the token side of a call's principal: TokenAuthenticator::TokenIndex names the
// token's place among the file's tokens, never the token, and -1 for anything else.
#include <map>

#include "gtest/gtest.h"
#include "service/auth.h"

namespace lossd {
namespace {

using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;

TEST(PrincipalTest, TokenIndexNamesWhichTokenAndNothingElse) {
  TokenAuthenticator auth({"alpha-token", "beta-token", "gamma-token"});
  EXPECT_EQ(auth.TokenIndex(Metadata{{"authorization", "Bearer alpha-token"}}), 0);
  EXPECT_EQ(auth.TokenIndex(Metadata{{"authorization", "Bearer gamma-token"}}), 2);
  EXPECT_EQ(auth.TokenIndex(Metadata{{"authorization", "Bearer beta-token"}}), 1);
  EXPECT_EQ(auth.TokenIndex(Metadata{{"authorization", "Bearer beta-toke"}}), -1);
  EXPECT_EQ(auth.TokenIndex(Metadata{{"authorization", "beta-token"}}), -1);
  EXPECT_EQ(auth.TokenIndex(Metadata{}), -1);
}

}  // namespace
}  // namespace lossd
