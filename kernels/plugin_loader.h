// Loads the CUDA backend from its plugin shared library (liblossd_cuda.so) with dlopen, so a
// binary that serves metrics never links cuBLAS statically (cuBLAS's static TLS leaves
// civetweb's small thread stacks too little room). Includes no CUDA header; never aborts.
#ifndef LOSSD_KERNELS_PLUGIN_LOADER_H_
#define LOSSD_KERNELS_PLUGIN_LOADER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

// Options the plugin's factory takes: plain data, the same layout on both sides of dlopen.
extern "C" {
struct LossdCudaOptions {
  int32_t device;                // CUDA device index
  uint64_t memory_budget_bytes;  // most device bytes the backend may hold; 0 = no own limit
  uint64_t chunk_budget_bytes;   // chunk buffer + GEMM workspaces per Compute; 0 = the default
                                 // (512 MiB, more for V > ~128K: DefaultChunkBudget)
  // 0: time cuBLASLt's candidates on the first Compute of each shape and keep the fastest
  // (CudaBackendOptions::autotune_gemms); 1: its first choice, the same in every process.
  int32_t fixed_gemm_algorithms;
};
}

// The plugin's one exported symbol, and its type. Returns null and writes a NUL-terminated
// message into err (at most err_len bytes) when there is no usable GPU or on any other error.
#define LOSSD_CUDA_FACTORY_SYMBOL "LossdCreateCudaBackend"
typedef lossd::Backend* (*LossdCreateCudaBackendFn)(const LossdCudaOptions* opts, char* err,
                                                    size_t err_len);

// The plugin's ABI version: what LossdCudaOptions and the Backend interface look like across
// dlopen. The plugin exports it (a function returning the number it was built with); the
// loader refuses a plugin whose number differs or that has none, instead of calling into a
// layout it does not know. Bump it whenever either side of that boundary changes.
#define LOSSD_CUDA_ABI_VERSION_SYMBOL "LossdCudaAbiVersion"
#define LOSSD_CUDA_ABI_VERSION 1u
typedef uint32_t (*LossdCudaAbiVersionFn)();

// Message prefix the plugin uses when the machine has no usable GPU (no device, or a driver
// too old for the runtime), so callers can fall back to the CPU backend quietly.
#define LOSSD_CUDA_NO_GPU_PREFIX "no GPU: "

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
  uint32_t abi_version;   // what it exports under LOSSD_CUDA_ABI_VERSION_SYMBOL
};

// dlopens the first candidate that exists and reads its ABI version. NOT_FOUND: no candidate
// exists. FAILED_PRECONDITION: it could not be loaded (e.g. cuBLAS missing) or exports no ABI
// version. A version that differs from LOSSD_CUDA_ABI_VERSION is returned, not refused, so a
// caller such as `lossd --version` can say which it is.
absl::StatusOr<CudaPluginProbe> ProbeCudaPlugin(const std::string& path_or_empty);

// dlopens the first candidate that exists and creates a backend through its factory.
// NOT_FOUND: no candidate file exists. UNAVAILABLE: the plugin loaded but there is no usable
// GPU (message starts with "no GPU: "). FAILED_PRECONDITION: the file could not be loaded,
// lacks the factory, or was built for another ABI version (the message names both numbers).
// INTERNAL: the factory failed otherwise. The library stays loaded
// for the life of the process (the backend's code lives in it).
absl::StatusOr<std::unique_ptr<Backend>> LoadCudaBackend(const std::string& path_or_empty,
                                                         const LossdCudaOptions& options);

}  // namespace lossd

#endif  // LOSSD_KERNELS_PLUGIN_LOADER_H_
