// SPDX-License-Identifier: Apache-2.0
// The entry point of liblossd_cuda.so, the only symbol the plugin exports: the plugin ABI's
// table (kernels/plugin_abi.h) over a CudaBackend. The server loads it with dlopen
// (kernels/plugin_loader.h) so cuBLAS never enters its static link.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/plugin_abi.h"
#include "kernels/plugin_export.h"

namespace {

absl::StatusOr<std::unique_ptr<lossd::Backend>> CreateCudaBackend(
    const LossdCudaOptions& opts) {
  lossd::cuda::CudaBackendOptions o;
  o.device = opts.device;
  o.memory_budget_bytes = opts.memory_budget_bytes;
  o.chunk_budget_bytes = opts.chunk_budget_bytes;
  o.autotune_gemms = opts.fixed_gemm_algorithms == 0;
  // Before 6.3 the ABI carried neither is_ratio, the importance-sampling level nor verl's
  // options, before 6.4 not geo_mean and kl_cov, before 6.5 not vespo, before 6.6 not
  // cispo_clamp (cuda_backend.h); a plugin built at an older minor does not announce them.
  o.plugin_abi_minor = static_cast<int32_t>(LOSSD_PLUGIN_ABI_MINOR);
  // An operator's override of the device's default path, without a new ABI field:
  // LOSSD_CUDA_REF_EXP=0 (the logits GEMM + cross-entropy kernel path for every problem) or =1
  // (the reference-exp path wherever it covers the problem) (kernels/cuda/README.md).
  o.ref_exp = lossd::cuda::RefExpChoiceFromEnv(std::getenv("LOSSD_CUDA_REF_EXP"));
  // The backend's "no GPU: " messages pass through unchanged; the loader matches the prefix.
  absl::StatusOr<std::unique_ptr<lossd::cuda::CudaBackend>> b =
      lossd::cuda::CudaBackend::Create(o);
  if (!b.ok()) return b.status();
  return std::unique_ptr<lossd::Backend>(std::move(*b));
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const LossdBackendApi* LossdPluginGetApi(
    uint32_t abi_version, uint32_t* plugin_abi_version) {
  return lossd::ServePluginApi(abi_version, plugin_abi_version, &CreateCudaBackend);
}
