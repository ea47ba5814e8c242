// SPDX-License-Identifier: Apache-2.0
// Loads the CUDA backend from its plugin shared library (liblossd_cuda.so) with dlopen, so a
// binary that serves metrics never links cuBLAS statically (cuBLAS's static TLS leaves
// civetweb's small thread stacks too little room), and checks that the plugin speaks this
// server's plugin ABI version before it calls anything else in it. Includes no CUDA header;
// never aborts.
#ifndef LOSSD_KERNELS_PLUGIN_LOADER_H_
#define LOSSD_KERNELS_PLUGIN_LOADER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/plugin_abi.h"

// The ABI itself (options, version, entry point, the no-GPU prefix) is plain C:
// kernels/plugin_abi.h.

namespace lossd {

inline LossdCudaOptions DefaultCudaOptions() { return LossdCudaOptions{0, 0, 0, 0}; }

// The file names LoadCudaBackend tries, in order: `path` if non-empty; then
// <dir of /proc/self/exe>/liblossd_cuda.so; <dir>/lib/liblossd_cuda.so; and the Bazel
// runfiles copies ($RUNFILES_DIR/lossd/kernels/cuda/liblossd_cuda.so, then
// <exe>.runfiles/lossd/kernels/cuda/liblossd_cuda.so).
std::vector<std::string> CudaPluginCandidates(const std::string& path);

// What a plugin found on disk says of itself, without starting a GPU.
struct CudaPluginProbe {
  std::string path;       // the candidate that exists
  uint32_t abi_version;   // the plugin ABI version it speaks (LOSSD_PLUGIN_ABI_VERSION_OF)
};

// "6.1" for a major.minor version; "5" for a version from before major.minor.
std::string PluginAbiVersionText(uint32_t abi_version);

// Whether this server loads a plugin of `abi_version`: the same major, a minor no newer than
// its own (plugin_abi.h says why).
bool PluginAbiLoadable(uint32_t abi_version);

// What this server's refusal says of itself: "this server speaks 6.2 and loads plugins of ABI
// 6.0 to 6.2".
std::string PluginAbiAccepted();

// dlopens the first candidate that exists and reads its ABI version: what its
// LossdPluginGetApi says, or for a version 1 plugin what its LossdCudaAbiVersion says.
// NOT_FOUND: no candidate exists. FAILED_PRECONDITION: it could not be loaded (e.g. cuBLAS
// missing) or exports neither symbol. A version this server does not load is returned, not
// refused, so a caller such as `lossd --version` can say which it is.
absl::StatusOr<CudaPluginProbe> ProbeCudaPlugin(const std::string& path_or_empty);

// dlopens the first candidate that exists and creates a backend through its table of
// functions (a lossd::Backend over the C ABI: kernels/plugin_backend.h). NOT_FOUND: no
// candidate file exists. UNAVAILABLE: the plugin loaded but there is no usable GPU (message
// starts with "no GPU: "). FAILED_PRECONDITION: the file could not be loaded, lacks the entry
// point, was built for an ABI version this server does not load (another major, or a newer
// minor; the message names both versions) or returned a table short of a function of 6.0. INTERNAL: create failed otherwise. The library stays loaded for
// the life of the process (the backend's code lives in it).
absl::StatusOr<std::unique_ptr<Backend>> LoadCudaBackend(const std::string& path_or_empty,
                                                         const LossdCudaOptions& options);

}  // namespace lossd

#endif  // LOSSD_KERNELS_PLUGIN_LOADER_H_
