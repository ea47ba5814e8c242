// SPDX-License-Identifier: Apache-2.0
#include "client/lossctl_output.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

TEST(LossctlOutputTest, StringsAreEscaped) {
  EXPECT_EQ(JsonString("plain"), "\"plain\"");
  EXPECT_EQ(JsonString("a\"b\\c\nd\te\x01"), "\"a\\\"b\\\\c\\nd\\te\\u0001\"");
  EXPECT_EQ(JsonString("caf\xc3\xa9"), "\"caf\xc3\xa9\"");  // UTF-8 passes through
}

TEST(LossctlOutputTest, Values) {
  EXPECT_EQ(JsonText(int64_t{-3}), "-3");
  EXPECT_EQ(JsonText(uint64_t{18446744073709551615u}), "18446744073709551615");
  EXPECT_EQ(JsonText(0.1), "0.10000000000000001");
  EXPECT_EQ(JsonText(std::nan("")), "null");
  EXPECT_EQ(JsonText(-INFINITY), "null");
  EXPECT_EQ(JsonText(true), "true");
  EXPECT_EQ(JsonText(std::string("x")), "\"x\"");
  EXPECT_EQ(JsonText(std::vector<std::string>{"dx", "d\"w"}), "[\"dx\", \"d\\\"w\"]");
  EXPECT_EQ(JsonText(std::vector<std::string>{}), "[]");
}

// The whole object, through a pipe of our own: stdout is what lossctl prints.
std::string Captured(void (*body)()) {
  std::fflush(stdout);
  char* buf = nullptr;
  size_t len = 0;
  FILE* mem = open_memstream(&buf, &len);
  FILE* saved = stdout;
  stdout = mem;
  body();
  std::fflush(stdout);
  stdout = saved;
  std::fclose(mem);
  std::string out(buf, len);
  std::free(buf);
  return out;
}

TEST(LossctlOutputTest, JsonObjectOnFinish) {
  const std::string out = Captured([] {
    CommandOutput o("list", /*json=*/true);
    o.Field("a", int64_t{1}, "a 1");
    o.Row("state", {{"name", std::string("w-1")}}, "w-1");
    o.Row("state", {{"name", std::string("acc")}}, "acc");
    o.Progress({{"done", int64_t{1}}}, "progress");
    o.Finish(absl::NotFoundError("no \"x\""));
  });
  EXPECT_EQ(out,
            "{\"progress\": {\"done\": 1}}\n"
            "{\"command\": \"list\", \"ok\": false, \"a\": 1, \"state\": [{\"name\": \"w-1\"}, "
            "{\"name\": \"acc\"}], \"error\": {\"code\": \"NOT_FOUND\", \"message\": "
            "\"no \\\"x\\\"\"}}\n");
}

TEST(LossctlOutputTest, TextLinesAsTheyCome) {
  const std::string out = Captured([] {
    CommandOutput o("info", /*json=*/false);
    o.Field("a", int64_t{1}, "a           1");
    o.Field("b", int64_t{2}, "");  // shown on another field's line
    o.Row("rows", {}, "row");
    o.Finish(absl::OkStatus());
  });
  EXPECT_EQ(out, "a           1\nrow\n");
}

}  // namespace
}  // namespace client
}  // namespace lossd
