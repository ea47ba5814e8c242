// SPDX-License-Identifier: Apache-2.0
// The soak, short: 20 s of the full mix (valid, invalid, cancelled, deadlines, uploads) from
// 4 clients against an in-process server. Every outcome must be the expected one and nothing
// may be left behind. The 10-minute run is //tests/soak:soak (not run by CI).
#include <cstdio>

#include "gtest/gtest.h"
#include "tests/soak/soak_lib.h"

namespace lossd {
namespace soak {
namespace {

TEST(SoakTest, TwentySecondsOfMixedLoadGiveOnlyExpectedOutcomes) {
  SoakOptions o;
  o.duration_seconds = 20;
  o.clients = 4;
  o.warmup_seconds = 5;
  o.rss_growth_bound_bytes = 64ull << 20;
  SoakReport r = RunSoak(o);
  std::fputs(r.ToString().c_str(), stdout);
  EXPECT_TRUE(r.ok()) << r.ToString();
  EXPECT_GT(r.served_ok, 20u);
  EXPECT_EQ(r.admitted_end, r.admitted_start);
  // Every kind of call was made at least once.
  for (const char* kind : {"valid_inline:OK", "valid_handle:OK", "accumulate:OK",
                           "cancel_upload:CANCELLED", "put_weights:OK"}) {
    EXPECT_GT(r.by_kind_and_code.count(kind), 0u) << kind << " never happened";
  }
}

}  // namespace
}  // namespace soak
}  // namespace lossd
