// SPDX-License-Identifier: Apache-2.0
#include "service/auth.h"

#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"

namespace lossd {
namespace {

using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;

TEST(AuthTest, ConstantTimeEqualsComparesExactly) {
  EXPECT_TRUE(ConstantTimeEquals("secret", 6, "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secreT", 6, "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret1", 7, "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secre", 5, "secret"));
  EXPECT_FALSE(ConstantTimeEquals("", 0, "secret"));
}

TEST(AuthTest, AcceptsAnyListedTokenAndRefusesOthersWithoutEchoingThem) {
  TokenAuthenticator auth({"alpha-token", "beta-token"});
  Metadata ok{{"authorization", "Bearer beta-token"}};
  EXPECT_TRUE(auth.Check(ok).ok());
  Metadata wrong{{"authorization", "Bearer gamma-token"}};
  absl::Status s = auth.Check(wrong);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(s.message().find("gamma"), std::string::npos) << s;
  Metadata missing;
  EXPECT_EQ(auth.Check(missing).code(), absl::StatusCode::kUnauthenticated);
  Metadata basic{{"authorization", "Basic alpha-token"}};
  EXPECT_EQ(auth.Check(basic).code(), absl::StatusCode::kUnauthenticated);
  Metadata bearer_no_space{{"authorization", "Beareralpha-token"}};
  EXPECT_EQ(auth.Check(bearer_no_space).code(), absl::StatusCode::kUnauthenticated);
}

TEST(AuthTest, TheSchemeIsCaseInsensitive) {
  // RFC 7235: the auth scheme is case-insensitive; the token is not.
  TokenAuthenticator auth({"alpha-token"});
  for (const char* value : {"bearer alpha-token", "BEARER alpha-token", "bEaReR alpha-token"}) {
    absl::Status s = auth.Check(Metadata{{"authorization", value}});
    EXPECT_TRUE(s.ok()) << value << ": " << s;
  }
  EXPECT_EQ(auth.Check(Metadata{{"authorization", "bearer ALPHA-token"}}).code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(AuthTest, TokensFileSkipsCommentsAndBlankLines) {
  const std::string path = ::testing::TempDir() + "/tokens.txt";
  {
    std::ofstream f(path);
    f << "# trainers\n\n  tok-1  \ntok-2\n";
  }
  auto auth = TokenAuthenticator::FromFile(path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE(auth->Check(Metadata{{"authorization", "Bearer tok-1"}}).ok());
  EXPECT_TRUE(auth->Check(Metadata{{"authorization", "Bearer tok-2"}}).ok());
  EXPECT_FALSE(auth->Check(Metadata{{"authorization", "Bearer # trainers"}}).ok());
  {
    std::ofstream f(path);
    f << "# nothing\n";
  }
  EXPECT_EQ(TokenAuthenticator::FromFile(path).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenAuthenticator::FromFile(path + ".missing").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace lossd
