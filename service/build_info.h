// SPDX-License-Identifier: Apache-2.0
// What `lossd --version` prints: the release, the commit the build came from (Bazel stamping,
// tools/workspace_status.sh), the build mode, and what the CUDA plugin beside the binary says
// of itself. Starts no GPU and no server.
#ifndef LOSSD_SERVICE_BUILD_INFO_H_
#define LOSSD_SERVICE_BUILD_INFO_H_

#include <string>

#include "absl/status/statusor.h"
#include "kernels/plugin_loader.h"

namespace lossd {

// The release of lossd.v1's server.
inline constexpr char kLossdVersion[] = "0.1.0";

struct BuildInfo {
  std::string version;  // kLossdVersion
  std::string commit;   // short hash, "-dirty" when built from a modified tree, or a sentence
                        // saying the build had no git checkout
  std::string mode;     // Bazel's compilation mode (opt, fastbuild, dbg), and whether NDEBUG is
                        // defined (assertions off)
};

BuildInfo GetBuildInfo();

// The --version text: one "key: value" line each for the release, commit, build mode and the
// CUDA plugin (its path and ABI version, whether this server can load it, or why none).
std::string VersionText(const BuildInfo& build, const absl::StatusOr<CudaPluginProbe>& plugin);

}  // namespace lossd

#endif  // LOSSD_SERVICE_BUILD_INFO_H_
