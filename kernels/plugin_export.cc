// SPDX-License-Identifier: Apache-2.0
#include "kernels/plugin_export.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"
#include "kernels/plugin_abi.h"
#include "kernels/plugin_abi_convert.h"

// The opaque handles of plugin_abi.h, as this side defines them.
struct LossdBackend {
  std::unique_ptr<lossd::Backend> impl;
};
struct LossdBuffer {
  std::unique_ptr<lossd::BackendBuffer> impl;
};
#if LOSSD_PLUGIN_ABI_MINOR >= 2
struct LossdComm {
  std::unique_ptr<lossd::BackendComm> impl;
};
#endif

namespace lossd {
namespace {

std::atomic<PluginBackendFactory> g_factory{nullptr};

// The caller's row stream (a LossdRowStream) as the backend sees it.
class CallerRows final : public RowStream {
 public:
  explicit CallerRows(const LossdRowStream& rows) : rows_(rows) {}
  absl::Status WaitX(int64_t rows) override {
    StatusBuffer st;
    return st.ToStatus(rows_.wait_x(rows_.ctx, rows, st.get()));
  }
  void DxReady(int64_t rows) override { rows_.dx_ready(rows_.ctx, rows); }

 private:
  const LossdRowStream rows_;
};

int32_t Create(const LossdCudaOptions* options, LossdBackend** backend, LossdStatus* status) {
  *backend = nullptr;
  const PluginBackendFactory factory = g_factory.load();
  if (factory == nullptr) {
    return WriteStatus(absl::InternalError("the plugin has no backend factory"), status);
  }
  LossdCudaOptions o{0, 0, 0, 0};
  if (options != nullptr) o = *options;
  absl::StatusOr<std::unique_ptr<Backend>> b = factory(o);
  if (!b.ok()) return WriteStatus(b.status(), status);
  *backend = new LossdBackend{std::move(*b)};
  return WriteStatus(absl::OkStatus(), status);
}

void Destroy(LossdBackend* backend) { delete backend; }

void Info(LossdBackend* backend, LossdBackendInfo* info) {
  *info = ToC(backend->impl->Info());
}

int32_t Allocate(LossdBackend* backend, size_t bytes, LossdBuffer** buffer, void** data,
                 size_t* size, LossdStatus* status) {
  *buffer = nullptr;
  *data = nullptr;
  *size = 0;
  absl::StatusOr<std::unique_ptr<BackendBuffer>> b = backend->impl->Allocate(bytes);
  if (!b.ok()) return WriteStatus(b.status(), status);
  *data = (*b)->data();
  *size = (*b)->size();
  *buffer = new LossdBuffer{std::move(*b)};
  return WriteStatus(absl::OkStatus(), status);
}

void FreeBuffer(LossdBuffer* buffer) { delete buffer; }

int32_t CopyToBackend(LossdBackend* backend, LossdBuffer* dst, size_t offset, const void* src,
                      size_t bytes, LossdStatus* status) {
  return WriteStatus(backend->impl->CopyToBackend(*dst->impl, offset, src, bytes), status);
}

int32_t CopyFromBackend(LossdBackend* backend, const LossdBuffer* src, size_t offset, void* dst,
                        size_t bytes, LossdStatus* status) {
  return WriteStatus(backend->impl->CopyFromBackend(*src->impl, offset, dst, bytes), status);
}

int32_t Zero(LossdBackend* backend, LossdBuffer* buffer, LossdStatus* status) {
  return WriteStatus(backend->impl->Zero(*buffer->impl), status);
}

uint64_t WorkspaceBytes(LossdBackend* backend, const LossdWorkspaceShape* shape) {
  return backend->impl->WorkspaceBytes(FromC(*shape));
}

int32_t Compute(LossdBackend* backend, const LossdProblem* problem, const LossdOutputs* outputs,
                LossdStats* stats, LossdStatus* status) {
  std::optional<CallerRows> rows;
  if (problem->rows != nullptr) rows.emplace(*problem->rows);
  const LossProblem p = FromC(*problem, rows.has_value() ? &*rows : nullptr);
  if (stats == nullptr) {
    return WriteStatus(backend->impl->Compute(p, FromC(*outputs), nullptr), status);
  }
  // The caller's values go in, so what the backend leaves alone comes back unchanged.
  LossStats s = FromC(*stats);
  const absl::Status st = backend->impl->Compute(p, FromC(*outputs), &s);
  *stats = ToC(s);
  return WriteStatus(st, status);
}

// A host memory's handle is the HostMemory itself: both live as long as the process.
LossdHostMemory* GetHostMemory(LossdBackend* backend) {
  return reinterpret_cast<LossdHostMemory*>(backend->impl->host_memory());
}

void* HostAlloc(LossdHostMemory* memory, size_t bytes) {
  return reinterpret_cast<HostMemory*>(memory)->Allocate(bytes);
}

void HostFree(LossdHostMemory* memory, void* ptr) {
  reinterpret_cast<HostMemory*>(memory)->Free(ptr);
}

int32_t OptimizerStep(LossdBackend* backend, const LossdOptimizerParams* params,
                      const LossdOptimizerTensors* tensors, LossdStatus* status) {
  return WriteStatus(backend->impl->OptimizerStep(FromC(*params), FromC(*tensors)), status);
}

int32_t SumOfSquares(LossdBackend* backend, const float* data, int64_t n, double* sum,
                     LossdStatus* status) {
  *sum = 0;
  absl::StatusOr<double> s = backend->impl->SumOfSquares(data, n);
  if (!s.ok()) return WriteStatus(s.status(), status);
  *sum = *s;
  return WriteStatus(absl::OkStatus(), status);
}

#if LOSSD_PLUGIN_ABI_MINOR >= 2
int32_t CommAvailable(LossdBackend* backend, LossdStatus* status) {
  return WriteStatus(backend->impl->CommAvailable(), status);
}

int32_t CommNewId(LossdBackend* backend, uint8_t* id, LossdStatus* status) {
  absl::StatusOr<std::string> made = backend->impl->NewCommId();
  if (!made.ok()) return WriteStatus(made.status(), status);
  // The C side reads exactly LOSSD_COMM_ID_BYTES: an id of another size cannot cross.
  if (made->size() != LOSSD_COMM_ID_BYTES) {
    return WriteStatus(absl::InternalError(absl::StrCat(
                           "plugin: the backend's NewCommId made an id of ", made->size(),
                           " bytes; the plugin ABI carries ", LOSSD_COMM_ID_BYTES)),
                       status);
  }
  std::copy(made->begin(), made->end(), id);
  return WriteStatus(absl::OkStatus(), status);
}

int32_t CommConnect(LossdBackend* backend, const uint8_t* id, uint32_t size, uint32_t rank,
                    int64_t timeout_ms, LossdComm** comm, LossdStatus* status) {
  *comm = nullptr;
  const std::string id_bytes(reinterpret_cast<const char*>(id), LOSSD_COMM_ID_BYTES);
  absl::StatusOr<std::unique_ptr<BackendComm>> c =
      backend->impl->ConnectComm(id_bytes, size, rank, timeout_ms);
  if (!c.ok()) return WriteStatus(c.status(), status);
  *comm = new LossdComm{std::move(*c)};
  return WriteStatus(absl::OkStatus(), status);
}

int32_t CommReduceScatter(LossdComm* comm, float* buf, int64_t n, LossdStatus* status) {
  return WriteStatus(comm->impl->ReduceScatter(buf, n), status);
}

int32_t CommAllGather(LossdComm* comm, void* buf, int64_t n, size_t elem_bytes,
                      LossdStatus* status) {
  return WriteStatus(comm->impl->AllGather(buf, n, elem_bytes), status);
}

void CommAbort(LossdComm* comm) { comm->impl->Abort(); }

void CommDestroy(LossdComm* comm) { delete comm; }
#endif

constexpr LossdBackendApi kApi = {
    sizeof(LossdBackendApi),
    LOSSD_PLUGIN_ABI_VERSION,
    &Create,
    &Destroy,
    &Info,
    &Allocate,
    &FreeBuffer,
    &CopyToBackend,
    &CopyFromBackend,
    &Zero,
    &WorkspaceBytes,
    &Compute,
    &GetHostMemory,
    &HostAlloc,
    &HostFree,
    &OptimizerStep,
    &SumOfSquares,
#if LOSSD_PLUGIN_ABI_MINOR >= 2
    &CommAvailable,
    &CommNewId,
    &CommConnect,
    &CommReduceScatter,
    &CommAllGather,
    &CommAbort,
    &CommDestroy,
#endif
};

}  // namespace

const LossdBackendApi* ServePluginApi(uint32_t abi_version, uint32_t* plugin_abi_version,
                                      PluginBackendFactory factory) {
  if (plugin_abi_version != nullptr) *plugin_abi_version = LOSSD_PLUGIN_ABI_VERSION;
  // Any minor of this major: the server decides whether ours is old enough for it
  // (plugin_abi.h), and it can name both versions only if it gets the table's.
  if (LOSSD_PLUGIN_ABI_MAJOR_OF(abi_version) != LOSSD_PLUGIN_ABI_MAJOR) return nullptr;
  g_factory.store(factory);
  return &kApi;
}

}  // namespace lossd
