// SPDX-License-Identifier: Apache-2.0
#include "service/build_info.h"

#include "absl/strings/str_cat.h"
#include "service/build_stamp.h"

namespace lossd {

BuildInfo GetBuildInfo() {
  BuildInfo b;
  b.version = kLossdVersion;
  b.commit = LOSSD_BUILD_COMMIT;
#ifdef NDEBUG
  b.mode = absl::StrCat(LOSSD_BUILD_MODE, " (NDEBUG: assertions off)");
#else
  b.mode = absl::StrCat(LOSSD_BUILD_MODE, " (assertions on)");
#endif
  return b;
}

std::string VersionText(const BuildInfo& build, const absl::StatusOr<CudaPluginProbe>& plugin) {
  std::string cuda;
  if (!plugin.ok()) {
    cuda = absl::StrCat("none usable (", plugin.status().message(), ")");
  } else if (!PluginAbiLoadable(plugin->abi_version)) {
    cuda = absl::StrCat(plugin->path, ", ABI version ", PluginAbiVersionText(plugin->abi_version),
                        ": NOT loadable, ", PluginAbiAccepted());
  } else {
    cuda = absl::StrCat(plugin->path, ", ABI version ", PluginAbiVersionText(plugin->abi_version));
  }
  return absl::StrCat("lossd ", build.version, "\ncommit: ", build.commit,
                      "\nbuild: ", build.mode, "\ncuda plugin: ", cuda, "\n");
}

}  // namespace lossd
