// SPDX-License-Identifier: Apache-2.0
#include "service/build_info.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(BuildInfoTest, StampedFromTheBuild) {
  const BuildInfo b = GetBuildInfo();
  EXPECT_EQ(b.version, kLossdVersion);
  // A hash (12 hex digits, maybe "-dirty") from a checkout, else a sentence saying why not;
  // never empty and never the placeholder of a build that skipped the status command.
  ASSERT_FALSE(b.commit.empty());
  EXPECT_THAT(b.commit, ::testing::Not(HasSubstr("without tools/workspace_status.sh")));
  EXPECT_THAT(b.mode, ::testing::AnyOf(StartsWith("opt ("), StartsWith("fastbuild ("),
                                        StartsWith("dbg (")));
}

TEST(BuildInfoTest, VersionTextSaysWhatThePluginIs) {
  const BuildInfo b{"9.9.9", "0123456789ab", "opt (NDEBUG: assertions off)"};
  const std::string ok = VersionText(b, CudaPluginProbe{"/x/liblossd_cuda.so", LOSSD_PLUGIN_ABI_VERSION});
  EXPECT_EQ(ok, absl::StrCat("lossd 9.9.9\ncommit: 0123456789ab\nbuild: opt (NDEBUG: assertions "
                             "off)\ncuda plugin: /x/liblossd_cuda.so, ABI version ",
                             LOSSD_PLUGIN_ABI_MAJOR, ".", LOSSD_PLUGIN_ABI_CURRENT_MINOR, "\n"));
  const std::string server =
      absl::StrCat(LOSSD_PLUGIN_ABI_MAJOR, ".", LOSSD_PLUGIN_ABI_CURRENT_MINOR);
  const uint32_t next_major = LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR + 1, 0);
  EXPECT_THAT(
      VersionText(b, CudaPluginProbe{"/y.so", next_major}),
      HasSubstr(absl::StrCat("cuda plugin: /y.so, ABI version ", LOSSD_PLUGIN_ABI_MAJOR + 1,
                             ".0: NOT loadable, this server speaks ", server,
                             " and loads plugins of ABI ", LOSSD_PLUGIN_ABI_MAJOR, ".0 to ",
                             server)));
  EXPECT_THAT(VersionText(b, CudaPluginProbe{"/z.so", 5}),
              HasSubstr("cuda plugin: /z.so, ABI version 5: NOT loadable, this server speaks "));
  EXPECT_THAT(VersionText(b, absl::NotFoundError("CUDA plugin not found; tried /a")),
              HasSubstr("cuda plugin: none usable (CUDA plugin not found; tried /a)"));
}

}  // namespace
}  // namespace lossd
