// The entry points of liblossd_cuda.so, the only symbols the plugin exports: its ABI version
// and the backend factory. The server loads
// it with dlopen (kernels/plugin_loader.h) so cuBLAS never enters its static link.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/plugin_loader.h"

namespace {

void WriteError(const std::string& msg, char* err, size_t err_len) {
  if (err == nullptr || err_len == 0) return;
  std::snprintf(err, err_len, "%s", msg.c_str());
}

}  // namespace

// The ABI this library was built for; the loader checks it before it calls the factory.
extern "C" __attribute__((visibility("default"))) uint32_t LossdCudaAbiVersion() {
  return LOSSD_CUDA_ABI_VERSION;
}

extern "C" __attribute__((visibility("default"))) lossd::Backend* LossdCreateCudaBackend(
    const LossdCudaOptions* opts, char* err, size_t err_len) {
  lossd::cuda::CudaBackendOptions o;
  if (opts != nullptr) {
    o.device = opts->device;
    o.memory_budget_bytes = opts->memory_budget_bytes;
    o.chunk_budget_bytes = opts->chunk_budget_bytes;
    o.autotune_gemms = opts->fixed_gemm_algorithms == 0;
  }
  absl::StatusOr<std::unique_ptr<lossd::cuda::CudaBackend>> b =
      lossd::cuda::CudaBackend::Create(o);
  if (!b.ok()) {
    // The backend's "no GPU: " messages pass through unchanged; callers match the prefix.
    WriteError(std::string(b.status().message()), err, err_len);
    return nullptr;
  }
  return b->release();
}
