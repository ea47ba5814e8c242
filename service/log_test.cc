// SPDX-License-Identifier: Apache-2.0
#include "service/log.h"

#include <grpc/grpc.h>
#include <grpc/support/log.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Captures the logger's lines for one test.
class LogTest : public ::testing::Test {
 protected:
  void Init(LogOptions o) {
    InitLogging(o, std::make_shared<spdlog::sinks::ostream_sink_mt>(out_));
  }
  std::vector<std::string> Lines() {
    return absl::StrSplit(out_.str(), '\n', absl::SkipEmpty());
  }
  std::ostringstream out_;
};

CallRecord Refused(absl::string_view method, absl::string_view message) {
  CallRecord c;
  c.method = method;
  c.peer = "ipv4:127.0.0.1:40000";
  c.caller = "ipv4:127.0.0.1";
  c.code = "INVALID_ARGUMENT";
  c.message = message;
  c.latency = absl::Milliseconds(3);
  return c;
}

TEST(ParseLogFormatTest, NamesTheFlagAndValue) {
  EXPECT_EQ(*ParseLogFormat("text"), LogFormat::kText);
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  absl::StatusOr<LogFormat> bad = ParseLogFormat("xml");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--log_format must be text or json, got 'xml'"));
}

TEST(JsonEscapeTest, EscapesQuotesControlAndHighBytes) {
  EXPECT_EQ(JsonEscape("a\"b\\c\nd\te\x01\xff"), "a\\\"b\\\\c\\nd\\u0009e\\u0001\\u00ff");
}

TEST(LogClippedTest, BoundsAndSaysTheLength) {
  EXPECT_EQ(LogClipped("abc", 3), "abc");
  EXPECT_EQ(LogClipped(std::string(100, 'x'), 4), "xxxx... (100 bytes)");
}

TEST_F(LogTest, TextWarningNamesMethodPeerCodeAndMessage) {
  Init({});
  LogCall(Refused("Compute", "H must be positive, got -1"));
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 1u) << out_.str();
  EXPECT_THAT(lines[0], HasSubstr(" WARNING lossd: call failed method=Compute "
                                  "peer=ipv4:127.0.0.1:40000 code=INVALID_ARGUMENT "
                                  "message=\"H must be positive, got -1\""));
}

TEST_F(LogTest, OkCallsLogNothingWithoutTheAccessLog) {
  Init({});
  CallRecord c = Refused("Health", "");
  c.code = "OK";
  LogCall(c);
  EXPECT_EQ(out_.str(), "");
}

TEST_F(LogTest, JsonLinesEscapeClientStrings) {
  Init({.format = LogFormat::kJson});
  // A weight handle a client chose, echoed in the refusal.
  LogCall(Refused("Compute", "unknown weight handle 'a\"b\nc\\' "));
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 1u) << out_.str();  // the newline did not split the line
  EXPECT_EQ(lines[0].front(), '{');
  EXPECT_EQ(lines[0].back(), '}');
  EXPECT_THAT(lines[0], HasSubstr("\"level\":\"WARNING\",\"method\":\"Compute\","
                                  "\"peer\":\"ipv4:127.0.0.1:40000\","
                                  "\"code\":\"INVALID_ARGUMENT\","
                                  "\"message\":\"unknown weight handle 'a\\\"b\\nc\\\\' \","
                                  "\"msg\":\"call failed\"}"));
}

TEST_F(LogTest, MessagesAreBounded) {
  Init({});
  LogCall(Refused("Compute", std::string(100000, 'm')));
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_LT(lines[0].size(), 1400u);
  EXPECT_THAT(lines[0], HasSubstr("... (100000 bytes)"));
}

TEST_F(LogTest, BurstIsRateLimitedAndSummarised) {
  Init({.warnings_per_second = 3});
  for (int i = 0; i < 50; ++i) LogCall(Refused("Compute", "bad"));
  LogCall(Refused("PutWeights", "bad"));  // another method is not held back by Compute's
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 4u) << out_.str();
  EXPECT_THAT(lines[3], HasSubstr("method=PutWeights"));
  absl::SleepFor(absl::Milliseconds(1100));  // the next window
  LogCall(Refused("Compute", "bad"));
  lines = Lines();
  ASSERT_EQ(lines.size(), 5u) << out_.str();
  EXPECT_THAT(lines[4], HasSubstr("method=Compute"));
  EXPECT_THAT(lines[4], HasSubstr("suppressed=47"));
  EXPECT_THAT(lines[0], Not(HasSubstr("suppressed")));

  // A burst at the end is summarised at stop.
  for (int i = 0; i < 10; ++i) LogCall(Refused("Compute", "bad"));
  LogSuppressedCalls();
  lines = Lines();
  ASSERT_EQ(lines.size(), 8u) << out_.str();  // 2 more admitted, then the summary
  EXPECT_THAT(lines[7], HasSubstr(" WARNING lossd: calls failed, lines suppressed "
                                  "method=Compute code=INVALID_ARGUMENT caller=ipv4:127.0.0.1 "
                                  "suppressed=8"));
  LogSuppressedCalls();  // reported once
  EXPECT_EQ(Lines().size(), 8u);
}

TEST(LogRateLimiterTest, CountsRefusalsPerKeyAndWindow) {
  LogRateLimiter limiter(2);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(limiter.Admit("a", t0), 0);
  EXPECT_EQ(limiter.Admit("a", t0), 0);
  EXPECT_EQ(limiter.Admit("a", t0 + absl::Milliseconds(500)), -1);
  EXPECT_EQ(limiter.Admit("a", t0 + absl::Milliseconds(999)), -1);
  EXPECT_EQ(limiter.Admit("b", t0), 0);
  EXPECT_EQ(limiter.Admit("a", t0 + absl::Seconds(1)), 2);
  EXPECT_EQ(limiter.Admit("a", t0 + absl::Seconds(1)), 0);
}

TEST_F(LogTest, AccessLineHasLatencyAndBytes) {
  Init({.access_log = true});
  CallRecord c = Refused("PutWeights", "");
  c.code = "OK";
  c.latency = absl::Microseconds(2500);
  c.bytes_in = 4096;
  c.bytes_out = 7;
  LogCall(c);
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 1u) << out_.str();
  EXPECT_THAT(lines[0], HasSubstr(" INFO lossd: call method=PutWeights peer=ipv4:127.0.0.1:40000 "
                                  "code=OK latency_ms=2.500 bytes_in=4096 bytes_out=7"));
}

TEST_F(LogTest, JsonNumbersAreJsonNumbersAndTextStaysText) {
  Init({.format = LogFormat::kJson, .access_log = true});
  CallRecord c = Refused("PutWeights", "");
  c.code = "OK";
  c.latency = absl::Microseconds(2500);
  c.bytes_in = 4096;
  c.bytes_out = 7;
  LogCall(c);
  // A name a client chose that looks like a number stays a string.
  Log(LogLevel::kInfo, "exported head", {{"head", "123"}, {"count", int64_t{-5}}});
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 2u) << out_.str();
  EXPECT_THAT(lines[0], HasSubstr("\"code\":\"OK\",\"latency_ms\":2.500,\"bytes_in\":4096,"
                                  "\"bytes_out\":7,\"msg\":\"call\"}"));
  EXPECT_THAT(lines[1], HasSubstr("\"head\":\"123\",\"count\":-5,"));
}

TEST(LogValueTest, FixedIsANumberUnlessNotFinite) {
  EXPECT_TRUE(LogValue::Fixed(1.25, 1).number());
  EXPECT_EQ(LogValue::Fixed(1.25, 1).text(), "1.2");
  EXPECT_FALSE(LogValue::Fixed(std::nan(""), 3).number());
  EXPECT_FALSE(LogValue::Fixed(INFINITY, 3).number());
  EXPECT_FALSE(LogValue("42").number());
  EXPECT_TRUE(LogValue(uint64_t{42}).number());
}

TEST_F(LogTest, JsonSuppressedCountIsANumber) {
  Init({.format = LogFormat::kJson, .warnings_per_second = 1});
  for (int i = 0; i < 3; ++i) LogCall(Refused("Compute", "bad"));
  LogSuppressedCalls();
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 2u) << out_.str();
  EXPECT_THAT(lines[1], HasSubstr("\"caller\":\"ipv4:127.0.0.1\",\"suppressed\":2,"));
}

// One client's flood of refusals must not hide another's: the limit is per caller too.
TEST_F(LogTest, OneCallersFloodDoesNotHideAnothersRefusal) {
  Init({.warnings_per_second = 3});
  for (int i = 0; i < 50; ++i) {
    CallRecord c = Refused("Compute", "flood");
    c.caller = "token:1";
    LogCall(c);
  }
  CallRecord other = Refused("Compute", "the other client's");
  other.peer = "ipv4:10.0.0.9:5000";
  other.caller = "ipv4:10.0.0.9";
  LogCall(other);
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 4u) << out_.str();
  EXPECT_THAT(lines[3], HasSubstr("peer=ipv4:10.0.0.9:5000 code=INVALID_ARGUMENT "
                                  "message=\"the other client's\""));
  LogSuppressedCalls();
  lines = Lines();
  ASSERT_EQ(lines.size(), 5u) << out_.str();
  EXPECT_THAT(lines[4], HasSubstr("method=Compute code=INVALID_ARGUMENT caller=token:1 "
                                  "suppressed=47"));
}

// However many callers come, the table stays bounded: past it, they share one window.
TEST(LogRateLimiterTest, TheTableIsBoundedAndOverflowSharesAWindow) {
  LogRateLimiter limiter(1, /*max_keys=*/4);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(limiter.Admit(absl::StrCat("c", i), t0, "*"), 0);
  EXPECT_EQ(limiter.Admit("c4", t0, "*"), 0);   // the overflow window's one line
  EXPECT_EQ(limiter.Admit("c5", t0, "*"), -1);  // shares it
  for (int i = 6; i < 1000; ++i) limiter.Admit(absl::StrCat("c", i), t0, "*");
  EXPECT_EQ(limiter.keys(), 5u);
  EXPECT_EQ(limiter.Admit("c0", t0, "*"), -1);  // a caller in the table keeps its window
  // A second later the windows that owe nothing make room; c0 (one refusal owed) stays.
  const absl::Time t1 = t0 + absl::Seconds(1);
  EXPECT_EQ(limiter.Admit("new", t1, "*"), 0);
  EXPECT_EQ(limiter.keys(), 3u);  // c0, new and the overflow key
  EXPECT_EQ(limiter.Admit("c0", t1, "*"), 1);
  auto refused = limiter.TakeRefused();
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0], std::make_pair(std::string("*"), int64_t{995}));
}

TEST_F(LogTest, GrpcLinesAreRouted) {
  Init({});
  grpc_init();  // gRPC drops its lines until it is initialised (lossd's server does this)
  gpr_log(__FILE__, __LINE__, GPR_LOG_SEVERITY_ERROR, "grpc says %s", "hello");
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 1u) << out_.str();
  EXPECT_THAT(lines[0], HasSubstr(" ERROR lossd: grpc says hello source=grpc file="));
  grpc_shutdown();
}

}  // namespace
}  // namespace lossd
