// SPDX-License-Identifier: Apache-2.0
// The plugin side of the plugin ABI (kernels/plugin_abi.h): a table of C functions over the
// lossd::Backend a plugin's factory makes, each turning its C arguments into the Backend's
// C++ ones and the resulting absl::Status into a code and a message. A plugin's
// LossdPluginGetApi is one call to ServePluginApi. Never lets a C++ type cross the boundary.
#ifndef LOSSD_KERNELS_PLUGIN_EXPORT_H_
#define LOSSD_KERNELS_PLUGIN_EXPORT_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/plugin_abi.h"

namespace lossd {

// Makes the plugin's backend; its error message is what create reports (the no-GPU prefix
// included).
using PluginBackendFactory =
    absl::StatusOr<std::unique_ptr<Backend>> (*)(const LossdCudaOptions& options);

// What LossdPluginGetApi returns: the table of LOSSD_PLUGIN_ABI_VERSION (the minor this file
// was built at), whose create calls `factory`, when `abi_version` has this major (any minor);
// null for another major; *plugin_abi_version (when not null) gets LOSSD_PLUGIN_ABI_VERSION
// either way. One factory per shared library: every call must pass
// the same one.
const LossdBackendApi* ServePluginApi(uint32_t abi_version, uint32_t* plugin_abi_version,
                                      PluginBackendFactory factory);

}  // namespace lossd

#endif  // LOSSD_KERNELS_PLUGIN_EXPORT_H_
