// SPDX-License-Identifier: Apache-2.0
// Stand-ins for liblossd_cuda.so in kernels/plugin_loader_test, one per build flag, so the
// whole C boundary is tested without a GPU:
//   FAKE_PLUGIN_NO_ENTRY  exports no entry point at all;
//   FAKE_PLUGIN_V1        exports what a version 1 plugin did (LossdCudaAbiVersion, 1);
//   FAKE_PLUGIN_V5        what a version 5 plugin (before major.minor) answers: 5, no table;
//   FAKE_PLUGIN_NEXT_MAJOR an entry point that speaks the next ABI major only;
//   FAKE_PLUGIN_NEWER_MINOR a plugin of this major and the next minor, table and all;
//   FAKE_PLUGIN_CPU       the real table (kernels/plugin_export.h) over the CPU backend, with
//                         "pinned" host memory from malloc. Device -1 has "no GPU"; device
//                         -2 fails otherwise.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "kernels/plugin_abi.h"

#if defined(FAKE_PLUGIN_CPU)
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/plugin_export.h"

namespace {

class MallocHostMemory final : public lossd::HostMemory {
 public:
  void* Allocate(size_t bytes) override { return std::malloc(bytes); }
  void Free(void* p) override { std::free(p); }
};

// The CPU backend plus what it lacks and a GPU plugin has: host memory of its own. Its Compute
// is the CPU backend's, overlapped path (LossProblem::rows) included, so the row stream's
// callbacks cross the boundary as a GPU's would and the results are the CPU backend's.
class FakeGpuBackend final : public lossd::CpuBackend {
 public:
  FakeGpuBackend() : CpuBackend(2) {}

  lossd::HostMemory* host_memory() override {
    static MallocHostMemory* memory = new MallocHostMemory;
    return memory;
  }
};

absl::StatusOr<std::unique_ptr<lossd::Backend>> CreateFake(const LossdCudaOptions& o) {
  if (o.device == -1) {
    return absl::UnavailableError(LOSSD_CUDA_NO_GPU_PREFIX "the fake plugin has no device -1");
  }
  if (o.device == -2) return absl::InternalError("the fake plugin refused device -2");
  return std::unique_ptr<lossd::Backend>(new FakeGpuBackend);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const LossdBackendApi* LossdPluginGetApi(
    uint32_t abi_version, uint32_t* plugin_abi_version) {
  return lossd::ServePluginApi(abi_version, plugin_abi_version, &CreateFake);
}

#elif defined(FAKE_PLUGIN_V5) || defined(FAKE_PLUGIN_NEXT_MAJOR)

extern "C" __attribute__((visibility("default"))) const LossdBackendApi* LossdPluginGetApi(
    uint32_t, uint32_t* plugin_abi_version) {
#if defined(FAKE_PLUGIN_V5)
  if (plugin_abi_version != nullptr) *plugin_abi_version = 5;
#else
  if (plugin_abi_version != nullptr) {
    *plugin_abi_version = LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR + 1, 0);
  }
#endif
  return nullptr;
}

#elif defined(FAKE_PLUGIN_NEWER_MINOR)

// A newer minor's table is longer than this server's; nothing in it is ever called.
struct NewerTable {
  LossdBackendApi api;
  void* added_by_the_next_minor;
};

extern "C" __attribute__((visibility("default"))) const LossdBackendApi* LossdPluginGetApi(
    uint32_t, uint32_t* plugin_abi_version) {
  constexpr uint32_t kNewer =
      LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR, LOSSD_PLUGIN_ABI_CURRENT_MINOR + 1);
  static const NewerTable table = {{sizeof(NewerTable), kNewer}, nullptr};
  if (plugin_abi_version != nullptr) *plugin_abi_version = kNewer;
  return &table.api;
}

#elif defined(FAKE_PLUGIN_V1)

extern "C" __attribute__((visibility("default"))) uint32_t LossdCudaAbiVersion() { return 1; }

#elif defined(FAKE_PLUGIN_NO_ENTRY)

extern "C" __attribute__((visibility("default"))) int LossdNotAPlugin() { return 0; }

#else
#error "build fake_plugin.cc with one of the FAKE_PLUGIN_* flags"
#endif
