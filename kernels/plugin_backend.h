// SPDX-License-Identifier: Apache-2.0
// The server side of the plugin ABI (kernels/plugin_abi.h): a lossd::Backend over a plugin's
// table of C functions, so the engine keeps using Backend whatever library serves it. Turns
// each C++ call into its C structs and each returned code and message back into an
// absl::Status; never dlopens (kernels/plugin_loader.h does) and never checks versions.
#ifndef LOSSD_KERNELS_PLUGIN_BACKEND_H_
#define LOSSD_KERNELS_PLUGIN_BACKEND_H_

#include <memory>

#include "kernels/backend.h"
#include "kernels/plugin_abi.h"

namespace lossd {

// A Backend over `backend`, made by `api`'s create; destroys it when destroyed. `api` (a
// table of this server's major and a minor no newer than its own, every function of 6.0
// present) must outlive it and every buffer and communicator it hands out; the plugin's
// library stays loaded for the life of the process. A function a later minor added is called
// only where the table's struct_size covers it: on a table older than 6.2, CommAvailable,
// NewCommId and ConnectComm are UNIMPLEMENTED, naming the plugin's ABI version.
std::unique_ptr<Backend> NewPluginBackend(const LossdBackendApi* api, LossdBackend* backend);

}  // namespace lossd

#endif  // LOSSD_KERNELS_PLUGIN_BACKEND_H_
