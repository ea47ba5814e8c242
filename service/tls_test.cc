// The warning for a gRPC listener open to anyone: off loopback with neither TLS nor tokens.
#include "service/tls.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

TEST(TlsTest, OpenListenerWarningOnlyOffLoopbackWithNeitherTlsNorTokens) {
  const std::string w = OpenListenerWarning("0.0.0.0", 50051, false, false);
  EXPECT_THAT(w, StartsWith("gRPC listens on 0.0.0.0:50051 (every address of this host) in "
                            "plaintext and without bearer tokens"));
  EXPECT_THAT(w, HasSubstr("--tls_cert"));
  EXPECT_THAT(w, HasSubstr("--auth_tokens_file"));
  EXPECT_THAT(OpenListenerWarning("10.1.2.3", 7, false, false),
              StartsWith("gRPC listens on 10.1.2.3:7 in plaintext"));
  EXPECT_THAT(OpenListenerWarning("[::]", 7, false, false), HasSubstr("every address"));
  for (const char* loopback : {"127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"}) {
    EXPECT_THAT(OpenListenerWarning(loopback, 50051, false, false), IsEmpty()) << loopback;
  }
  EXPECT_THAT(OpenListenerWarning("0.0.0.0", 50051, true, false), IsEmpty());
  EXPECT_THAT(OpenListenerWarning("0.0.0.0", 50051, false, true), IsEmpty());
}

}  // namespace
}  // namespace lossd
