// SPDX-License-Identifier: Apache-2.0
#include "engine/instance_id.h"

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(InstanceIdTest, NewIdsHaveTheFormTheyAreCheckedFor) {
  for (int i = 0; i < 16; ++i) {
    const std::string id = NewInstanceId();
    EXPECT_TRUE(IsInstanceId(id)) << id;
  }
  EXPECT_FALSE(IsInstanceId("0123abc"));
  EXPECT_FALSE(IsInstanceId("0123abcde"));
  EXPECT_FALSE(IsInstanceId("0123ABCD"));
  EXPECT_FALSE(IsInstanceId("0123abcg"));
}

TEST(InstanceIdTest, HandleInstanceIsSetOnlyForHandlesAsLossdWritesThem) {
  EXPECT_EQ(HandleInstance("w-0123abcd-1"), "0123abcd");
  EXPECT_EQ(HandleInstance("w-deadbeef-18446744073709551615"), "deadbeef");
  for (const char* made_up :
       {"w-", "w-0123abcd", "w-0123abcd-", "w-0123abcd-0", "w-0123abcd-01", "w-0123abcd-+1",
        "w-0123abcd-1x", "w-0123abcd-18446744073709551616", "w-0123ABCD-1", "w-elsewhere-1",
        "w-0123abcd1-1", "x-0123abcd-1", "w-0123abc-1", "W-0123abcd-1"}) {
    EXPECT_EQ(HandleInstance(made_up), "") << made_up;
  }
}

}  // namespace
}  // namespace lossd
