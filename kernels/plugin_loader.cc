#include "kernels/plugin_loader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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
// closed: the backend's code and vtable live in the library, and a probe that is followed by
// a load gets the same handle back from dlopen.
struct OpenedPlugin {
  std::string path;
  void* handle = nullptr;
  uint32_t abi_version = 0;
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
  auto abi = reinterpret_cast<LossdCudaAbiVersionFn>(
      dlsym(p.handle, LOSSD_CUDA_ABI_VERSION_SYMBOL));
  if (abi == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        p.path, " exports no ", LOSSD_CUDA_ABI_VERSION_SYMBOL,
        ": it predates the versioned plugin ABI; this server needs ABI version ",
        LOSSD_CUDA_ABI_VERSION));
  }
  p.abi_version = abi();
  return p;
}

}  // namespace

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
  void* handle = opened->handle;
  if (opened->abi_version != LOSSD_CUDA_ABI_VERSION) {
    return absl::FailedPreconditionError(
        absl::StrCat(chosen, " was built for plugin ABI version ", opened->abi_version,
                     "; this server needs version ", LOSSD_CUDA_ABI_VERSION));
  }
  auto factory =
      reinterpret_cast<LossdCreateCudaBackendFn>(dlsym(handle, LOSSD_CUDA_FACTORY_SYMBOL));
  if (factory == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(chosen, " has no symbol ", LOSSD_CUDA_FACTORY_SYMBOL));
  }
  char err[1024] = {0};
  Backend* backend = factory(&options, err, sizeof(err));
  if (backend == nullptr) {
    const std::string msg = err[0] != '\0' ? std::string(err) : "unknown error";
    if (absl::StartsWith(msg, LOSSD_CUDA_NO_GPU_PREFIX)) {
      return absl::UnavailableError(absl::StrCat(chosen, ": ", msg));
    }
    return absl::InternalError(absl::StrCat(chosen, ": ", msg));
  }
  return std::unique_ptr<Backend>(backend);
}

}  // namespace lossd
