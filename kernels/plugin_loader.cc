// SPDX-License-Identifier: Apache-2.0
#include "kernels/plugin_loader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/plugin_abi.h"
#include "kernels/plugin_abi_convert.h"
#include "kernels/plugin_backend.h"

namespace lossd {
namespace {

constexpr char kPluginName[] = "liblossd_cuda.so";
constexpr char kRunfilesPath[] = "lossd/kernels/cuda/liblossd_cuda.so";

std::string SelfExe() {
  std::string buf(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return "";
  buf.resize(static_cast<size_t>(n));
  return buf;
}

bool Exists(const std::string& path) { return !path.empty() && access(path.c_str(), R_OK) == 0; }

// The first candidate that exists, dlopened, with its ABI version read. The handle is never
// closed: the backend's code lives in the library, and a probe that is followed by a load
// gets the same handle back from dlopen.
struct OpenedPlugin {
  std::string path;
  void* handle = nullptr;
  uint32_t abi_version = 0;
  // The plugin's table when it speaks this server's major (any minor); else null.
  const LossdBackendApi* api = nullptr;
};

absl::StatusOr<OpenedPlugin> OpenPlugin(const std::string& path_or_empty) {
  const std::vector<std::string> candidates = CudaPluginCandidates(path_or_empty);
  OpenedPlugin p;
  for (const std::string& c : candidates) {
    if (Exists(c)) {
      p.path = c;
      break;
    }
  }
  if (p.path.empty()) {
    return absl::NotFoundError(
        absl::StrCat("CUDA plugin not found; tried ", absl::StrJoin(candidates, ", ")));
  }
  // RTLD_LOCAL keeps cuBLAS's symbols out of the global namespace.
  p.handle = dlopen(p.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (p.handle == nullptr) {
    const char* e = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("dlopen(", p.path, "): ", e != nullptr ? e : "unknown error"));
  }
  auto get_api =
      reinterpret_cast<LossdPluginGetApiFn>(dlsym(p.handle, LOSSD_PLUGIN_ENTRY_SYMBOL));
  if (get_api != nullptr) {
    p.api = get_api(LOSSD_PLUGIN_ABI_VERSION, &p.abi_version);
    return p;
  }
  // A version 1 plugin (a C++ Backend* across dlopen) said its version this way; read it
  // only to name it. Nothing else of such a plugin is ever called.
  using V1VersionFn = uint32_t (*)();
  auto v1 = reinterpret_cast<V1VersionFn>(dlsym(p.handle, LOSSD_PLUGIN_V1_VERSION_SYMBOL));
  if (v1 != nullptr) {
    p.abi_version = v1();
    return p;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      p.path, " exports no ", LOSSD_PLUGIN_ENTRY_SYMBOL,
      ": it is not a lossd plugin of a versioned ABI; ", PluginAbiAccepted()));
}

// The table of a plugin this server loads (PluginAbiLoadable(version)): it says the version
// the entry point said, reaches at least to the last function of 6.0 and no further than this
// server's own table (an older minor's table is shorter; a function a later minor adds is
// called only where struct_size covers it), and has every function of 6.0.
absl::Status CheckTable(const std::string& path, uint32_t version, const LossdBackendApi& api) {
  constexpr size_t kMajorTableBytes =
      offsetof(LossdBackendApi, sum_of_squares) + sizeof(LossdBackendApi::sum_of_squares);
  if (api.abi_version != version || api.struct_size < kMajorTableBytes ||
      api.struct_size > sizeof(LossdBackendApi)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " returned a table of ", api.struct_size, " bytes for ABI version ",
        PluginAbiVersionText(api.abi_version), " (its entry point said ",
        PluginAbiVersionText(version), "); this server reads ", kMajorTableBytes, " to ",
        sizeof(LossdBackendApi), " bytes of a table of ABI ", LOSSD_PLUGIN_ABI_MAJOR, ".x"));
  }
  const bool complete = api.create != nullptr && api.destroy != nullptr && api.info != nullptr &&
                        api.allocate != nullptr && api.free_buffer != nullptr &&
                        api.copy_to_backend != nullptr && api.copy_from_backend != nullptr &&
                        api.zero != nullptr && api.workspace_bytes != nullptr &&
                        api.compute != nullptr && api.host_memory != nullptr &&
                        api.host_alloc != nullptr && api.host_free != nullptr &&
                        api.optimizer_step != nullptr && api.sum_of_squares != nullptr;
  if (!complete) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " returned a table with a function missing"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string PluginAbiVersionText(uint32_t abi_version) {
  if (abi_version >> 16 == 0) return absl::StrCat(abi_version);
  return absl::StrCat(LOSSD_PLUGIN_ABI_MAJOR_OF(abi_version), ".",
                      LOSSD_PLUGIN_ABI_MINOR_OF(abi_version));
}

bool PluginAbiLoadable(uint32_t abi_version) {
  return LOSSD_PLUGIN_ABI_MAJOR_OF(abi_version) == LOSSD_PLUGIN_ABI_MAJOR &&
         LOSSD_PLUGIN_ABI_MINOR_OF(abi_version) <= LOSSD_PLUGIN_ABI_MINOR &&
         abi_version >> 16 != 0;
}

std::string PluginAbiAccepted() {
  return absl::StrCat("this server speaks ", PluginAbiVersionText(LOSSD_PLUGIN_ABI_VERSION),
                      " and loads plugins of ABI ", LOSSD_PLUGIN_ABI_MAJOR, ".0 to ",
                      PluginAbiVersionText(LOSSD_PLUGIN_ABI_VERSION));
}

absl::StatusOr<CudaPluginProbe> ProbeCudaPlugin(const std::string& path_or_empty) {
  absl::StatusOr<OpenedPlugin> p = OpenPlugin(path_or_empty);
  if (!p.ok()) return p.status();
  return CudaPluginProbe{p->path, p->abi_version};
}

std::vector<std::string> CudaPluginCandidates(const std::string& path) {
  std::vector<std::string> out;
  if (!path.empty()) out.push_back(path);
  const std::string exe = SelfExe();
  if (!exe.empty()) {
    const std::string dir = exe.substr(0, exe.rfind('/'));
    out.push_back(absl::StrCat(dir, "/", kPluginName));
    out.push_back(absl::StrCat(dir, "/lib/", kPluginName));
  }
  if (const char* runfiles = std::getenv("RUNFILES_DIR"); runfiles != nullptr && *runfiles) {
    out.push_back(absl::StrCat(runfiles, "/", kRunfilesPath));
  }
  if (!exe.empty()) out.push_back(absl::StrCat(exe, ".runfiles/", kRunfilesPath));
  return out;
}

absl::StatusOr<std::unique_ptr<Backend>> LoadCudaBackend(const std::string& path_or_empty,
                                                         const LossdCudaOptions& options) {
  absl::StatusOr<OpenedPlugin> opened = OpenPlugin(path_or_empty);
  if (!opened.ok()) return opened.status();
  const std::string& chosen = opened->path;
  if (!PluginAbiLoadable(opened->abi_version) || opened->api == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(chosen, " was built for plugin ABI version ",
                     PluginAbiVersionText(opened->abi_version), "; ", PluginAbiAccepted()));
  }
  const LossdBackendApi* api = opened->api;
  if (absl::Status st = CheckTable(chosen, opened->abi_version, *api); !st.ok()) return st;
  StatusBuffer st;
  LossdBackend* backend = nullptr;
  const int32_t code = api->create(&options, &backend, st.get());
  if (code != 0 || backend == nullptr) {
    const absl::Status created = st.ToStatus(code);
    const std::string msg = !created.message().empty() ? std::string(created.message())
                                                       : "unknown error";
    if (absl::StartsWith(msg, LOSSD_CUDA_NO_GPU_PREFIX)) {
      return absl::UnavailableError(absl::StrCat(chosen, ": ", msg));
    }
    return absl::InternalError(absl::StrCat(chosen, ": ", msg));
  }
  return NewPluginBackend(api, backend);
}

}  // namespace lossd
