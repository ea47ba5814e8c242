// SPDX-License-Identifier: Apache-2.0
#include "kernels/plugin_backend.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"
#include "kernels/plugin_abi.h"
#include "kernels/plugin_abi_convert.h"

namespace lossd {
namespace {

static_assert(LOSSD_COMM_ID_BYTES == kBackendCommIdBytes, "the ABI carries NCCL's id size");

// A buffer the plugin allocated; freed through the plugin, which may outlive the backend.
class PluginBuffer final : public BackendBuffer {
 public:
  PluginBuffer(const LossdBackendApi* api, LossdBuffer* handle, void* data, size_t size)
      : api_(api), handle_(handle), data_(data), size_(size) {}
  ~PluginBuffer() override { api_->free_buffer(handle_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }
  LossdBuffer* handle() const { return handle_; }

 private:
  const LossdBackendApi* const api_;
  LossdBuffer* const handle_;
  void* const data_;
  const size_t size_;
};

class PluginHostMemory final : public HostMemory {
 public:
  PluginHostMemory(const LossdBackendApi* api, LossdHostMemory* handle)
      : api_(api), handle_(handle) {}
  void* Allocate(size_t bytes) override { return api_->host_alloc(handle_, bytes); }
  void Free(void* p) override { api_->host_free(handle_, p); }
  const LossdBackendApi* api() const { return api_; }
  LossdHostMemory* handle() const { return handle_; }

 private:
  const LossdBackendApi* const api_;
  LossdHostMemory* const handle_;
};

// The engine's RowStream behind the plugin's LossdRowStream callbacks.
int32_t WaitX(void* ctx, int64_t rows, LossdStatus* status) {
  return WriteStatus(static_cast<RowStream*>(ctx)->WaitX(rows), status);
}

void DxReady(void* ctx, int64_t rows) { static_cast<RowStream*>(ctx)->DxReady(rows); }

// A head group's communicator made by the plugin's comm_connect (ABI 6.2); destroyed
// through the plugin, which may outlive the backend.
class PluginComm final : public BackendComm {
 public:
  PluginComm(const LossdBackendApi* api, LossdComm* handle) : api_(api), handle_(handle) {}
  ~PluginComm() override { api_->comm_destroy(handle_); }

  absl::Status ReduceScatter(float* buf, int64_t n) override {
    StatusBuffer st;
    return st.ToStatus(api_->comm_reduce_scatter(handle_, buf, n, st.get()));
  }
  absl::Status AllGather(void* buf, int64_t n, size_t elem_bytes) override {
    StatusBuffer st;
    return st.ToStatus(api_->comm_all_gather(handle_, buf, n, elem_bytes, st.get()));
  }
  void Abort() override { api_->comm_abort(handle_); }

 private:
  const LossdBackendApi* const api_;
  LossdComm* const handle_;
};

// Whether the plugin's table reaches 6.2's comm_* functions (an older minor's table stops
// before them: plugin_abi.h) and has each of them.
bool HasComm(const LossdBackendApi* api) {
  constexpr size_t kCommTableBytes =
      offsetof(LossdBackendApi, comm_destroy) + sizeof(LossdBackendApi::comm_destroy);
  return api->struct_size >= kCommTableBytes && api->comm_available != nullptr &&
         api->comm_new_id != nullptr && api->comm_connect != nullptr &&
         api->comm_reduce_scatter != nullptr && api->comm_all_gather != nullptr &&
         api->comm_abort != nullptr && api->comm_destroy != nullptr;
}

// What every comm call answers on a plugin without them: the engine names it to the client.
absl::Status NoPluginComm(const LossdBackendApi* api, const char* call) {
  const uint32_t v = api->abi_version;
  return absl::UnimplementedError(absl::StrCat(
      "plugin backend: ", call, ": the plugin speaks ABI ", LOSSD_PLUGIN_ABI_MAJOR_OF(v), ".",
      LOSSD_PLUGIN_ABI_MINOR_OF(v), ", which carries no head-group collectives; head groups on "
      "it need a plugin of ABI 6.2 or newer (rebuild liblossd_cuda.so from this server's "
      "source)"));
}

absl::Status NotOurs(const char* call) {
  return absl::InvalidArgumentError(
      absl::StrCat("plugin backend: ", call, " was given a buffer this backend did not allocate"));
}

// The one PluginHostMemory for each plugin host memory handle. Like the plugin's own, they
// live as long as the process: host memory taken from one may be given back after the backend
// that offered it is gone.
HostMemory* HostMemoryFor(const LossdBackendApi* api, LossdHostMemory* handle) {
  if (handle == nullptr) return nullptr;
  static absl::Mutex mu(absl::kConstInit);
  static auto* memories = new std::vector<std::unique_ptr<PluginHostMemory>>;
  absl::MutexLock lock(&mu);
  for (const std::unique_ptr<PluginHostMemory>& m : *memories) {
    if (m->api() == api && m->handle() == handle) return m.get();
  }
  memories->push_back(std::make_unique<PluginHostMemory>(api, handle));
  return memories->back().get();
}

class PluginBackend final : public Backend {
 public:
  PluginBackend(const LossdBackendApi* api, LossdBackend* handle)
      : api_(api), handle_(handle), host_memory_(HostMemoryFor(api, api->host_memory(handle))) {}
  ~PluginBackend() override { api_->destroy(handle_); }

  BackendInfo Info() override {
    LossdBackendInfo info{};
    api_->info(handle_, &info);
    return FromC(info);
  }

  absl::StatusOr<std::unique_ptr<BackendBuffer>> Allocate(size_t bytes) override {
    StatusBuffer st;
    LossdBuffer* buffer = nullptr;
    void* data = nullptr;
    size_t size = 0;
    const int32_t code = api_->allocate(handle_, bytes, &buffer, &data, &size, st.get());
    if (code != 0) return st.ToStatus(code);
    return std::unique_ptr<BackendBuffer>(new PluginBuffer(api_, buffer, data, size));
  }

  absl::Status CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                             size_t bytes) override {
    auto* b = dynamic_cast<PluginBuffer*>(&dst);
    if (b == nullptr) return NotOurs("CopyToBackend");
    StatusBuffer st;
    return st.ToStatus(api_->copy_to_backend(handle_, b->handle(), offset, src, bytes, st.get()));
  }

  absl::Status CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                               size_t bytes) override {
    const auto* b = dynamic_cast<const PluginBuffer*>(&src);
    if (b == nullptr) return NotOurs("CopyFromBackend");
    StatusBuffer st;
    return st.ToStatus(
        api_->copy_from_backend(handle_, b->handle(), offset, dst, bytes, st.get()));
  }

  absl::Status Zero(BackendBuffer& buf) override {
    auto* b = dynamic_cast<PluginBuffer*>(&buf);
    if (b == nullptr) return NotOurs("Zero");
    StatusBuffer st;
    return st.ToStatus(api_->zero(handle_, b->handle(), st.get()));
  }

  uint64_t WorkspaceBytes(const WorkspaceShape& shape) override {
    const LossdWorkspaceShape s = ToC(shape);
    return api_->workspace_bytes(handle_, &s);
  }

  absl::Status Compute(const LossProblem& p, const LossOutputs& out, LossStats* stats) override {
    const LossdRowStream rows{p.rows, &WaitX, &DxReady};
    const LossdProblem problem = ToC(p, p.rows != nullptr ? &rows : nullptr);
    const LossdOutputs outputs = ToC(out);
    StatusBuffer st;
    if (stats == nullptr) {
      return st.ToStatus(api_->compute(handle_, &problem, &outputs, nullptr, st.get()));
    }
    LossdStats s = ToC(*stats);
    const int32_t code = api_->compute(handle_, &problem, &outputs, &s, st.get());
    *stats = FromC(s);
    return st.ToStatus(code);
  }

  absl::Status OptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) override {
    const LossdOptimizerParams params = ToC(p);
    const LossdOptimizerTensors tensors = ToC(t);
    StatusBuffer st;
    return st.ToStatus(api_->optimizer_step(handle_, &params, &tensors, st.get()));
  }

  absl::StatusOr<double> SumOfSquares(const float* data, int64_t n) override {
    double sum = 0;
    StatusBuffer st;
    const int32_t code = api_->sum_of_squares(handle_, data, n, &sum, st.get());
    if (code != 0) return st.ToStatus(code);
    return sum;
  }

  HostMemory* host_memory() override { return host_memory_; }

  absl::Status CommAvailable() override {
    if (!HasComm(api_)) return NoPluginComm(api_, "CommAvailable");
    StatusBuffer st;
    return st.ToStatus(api_->comm_available(handle_, st.get()));
  }

  absl::StatusOr<std::string> NewCommId() override {
    if (!HasComm(api_)) return NoPluginComm(api_, "NewCommId");
    uint8_t id[LOSSD_COMM_ID_BYTES] = {0};
    StatusBuffer st;
    const int32_t code = api_->comm_new_id(handle_, id, st.get());
    if (code != 0) return st.ToStatus(code);
    return std::string(reinterpret_cast<const char*>(id), sizeof(id));
  }

  absl::StatusOr<std::unique_ptr<BackendComm>> ConnectComm(const std::string& id, uint32_t size,
                                                           uint32_t rank,
                                                           int64_t timeout_ms) override {
    if (!HasComm(api_)) return NoPluginComm(api_, "ConnectComm");
    // The C side reads exactly LOSSD_COMM_ID_BYTES from id.
    if (id.size() != LOSSD_COMM_ID_BYTES) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plugin backend: ConnectComm: a communicator id is ", LOSSD_COMM_ID_BYTES,
          " bytes (NewCommId's); got ", id.size()));
    }
    LossdComm* comm = nullptr;
    StatusBuffer st;
    const int32_t code =
        api_->comm_connect(handle_, reinterpret_cast<const uint8_t*>(id.data()), size, rank,
                           timeout_ms, &comm, st.get());
    if (code != 0) return st.ToStatus(code);
    if (comm == nullptr) {
      return absl::InternalError("plugin backend: ConnectComm: the plugin returned no comm");
    }
    return std::unique_ptr<BackendComm>(new PluginComm(api_, comm));
  }

 private:
  const LossdBackendApi* const api_;
  LossdBackend* const handle_;
  HostMemory* const host_memory_;  // null when the plugin has none
};

}  // namespace

std::unique_ptr<Backend> NewPluginBackend(const LossdBackendApi* api, LossdBackend* backend) {
  return std::make_unique<PluginBackend>(api, backend);
}

}  // namespace lossd
