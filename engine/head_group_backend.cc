// SPDX-License-Identifier: Apache-2.0
// A head group's communicator on a backend's own collectives (NCCL on the CUDA backend):
// the gradient's reduce-scatter and the copy's all-gather run in the backend's memory, where
// the head's buffers live, with no copy through the host. The step's small values (its
// arguments, counts and norms) go through a staging buffer of the backend's. Arrival marks,
// abort reasons and the refusal of later calls are MarkedComm's, as for gloo.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "engine/head_group.h"
#include "engine/head_group_marked.h"
#include "kernels/backend.h"

namespace lossd {
namespace {

class BackendHeadComm : public MarkedComm {
 public:
  BackendHeadComm(Backend& backend, std::unique_ptr<BackendComm> comm,
                  std::shared_ptr<HeadGroupStore> store, HeadGroup group)
      : MarkedComm(std::move(store), std::move(group)),
        backend_(backend),
        comm_(std::move(comm)) {}

  absl::Status ReduceScatter(float* buf, int64_t n) override {
    return Run("reduce-scatter of the summed gradient",
               [&] { return comm_->ReduceScatter(buf, n); });
  }

  absl::Status AllGather(void* buf, int64_t n, size_t elem_bytes) override {
    return Run("all-gather of the new compute copy",
               [&] { return comm_->AllGather(buf, n, elem_bytes); });
  }

  // k values per member: member m's are elements [k m, k (m + 1)) of a staging buffer of
  // k S doubles, exactly its slice, so one all-gather carries them.
  absl::StatusOr<std::vector<double>> AllGatherValues(
      const std::vector<double>& values) override {
    const size_t k = values.size(), S = size(), bytes = k * S * sizeof(double);
    std::vector<double> out(k * S);
    absl::Status s = Run("all-gather of the step's arguments and norms", [&]() -> absl::Status {
      absl::MutexLock lock(&staging_mu_);
      if (staging_ == nullptr || staging_->size() < bytes) {
        staging_.reset();
        LOSSD_ASSIGN_OR_RETURN(staging_, backend_.Allocate(std::max<size_t>(bytes, 4096)));
      }
      if (k > 0) {
        LOSSD_RETURN_IF_ERROR(backend_.CopyToBackend(*staging_, k * member() * sizeof(double),
                                                     values.data(), k * sizeof(double)));
      }
      LOSSD_RETURN_IF_ERROR(comm_->AllGather(staging_->data(), static_cast<int64_t>(k * S),
                                             sizeof(double)));
      return bytes == 0 ? absl::OkStatus()
                        : backend_.CopyFromBackend(*staging_, 0, out.data(), bytes);
    });
    if (!s.ok()) return s;
    return out;
  }

  absl::Status Barrier() override { return AllGatherValues({0.0}).status(); }

 private:
  // The backend's abort ends a collective in flight on another thread too.
  void CloseTransport() override { comm_->Abort(); }

  Backend& backend_;
  const std::unique_ptr<BackendComm> comm_;
  absl::Mutex staging_mu_;
  std::unique_ptr<BackendBuffer> staging_ ABSL_GUARDED_BY(staging_mu_);
};

}  // namespace

absl::StatusOr<std::shared_ptr<HeadComm>> ConnectBackendComm(Backend& backend,
                                                             std::shared_ptr<HeadGroupStore> store,
                                                             const HeadGroup& group,
                                                             absl::Duration timeout) {
  const uint32_t size = group.size();
  if (group.members.empty() || group.member >= size || group.id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a head group needs its members, this server's index among them and an id; got ",
        group.members.size(), " members, member ", group.member, ", id '", group.id, "'"));
  }
  const absl::Time end = absl::Now() + timeout;
  JoinMarks joins(*store, group);
  const std::string id_key = absl::StrCat(group.id, "/comm_id");
  joins.Mark();
  absl::StatusOr<std::string> id;
  if (group.member == 0) {
    id = backend.NewCommId();
    if (id.ok()) {
      absl::Status s = store->Set(id_key, *id);
      if (!s.ok()) id = s;
    }
  } else {
    id = store->Get(id_key, timeout);
  }
  absl::StatusOr<std::unique_ptr<BackendComm>> comm = absl::UnknownError("no id");
  if (id.ok()) {
    const int64_t left_ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(end - absl::Now()));
    comm = backend.ConnectComm(*id, size, group.member, left_ms);
  } else {
    comm = id.status();
  }
  if (!comm.ok()) {
    if (group.member == 0) store->Delete(id_key).IgnoreError();  // a retry makes a new one
    return absl::Status(
        absl::IsDeadlineExceeded(comm.status()) ? absl::StatusCode::kDeadlineExceeded
                                                : comm.status().code(),
        absl::StrCat("member ", NamedMember(group, group.member), " could not form head group '",
                     group.id, "' on the backend's collectives", joins.NeverJoined(timeout), ": ",
                     comm.status().message()));
  }
  // Joining returns on every member only once all have joined, so every member has read the
  // id: it can go, with this member's mark.
  if (group.member == 0) store->Delete(id_key).IgnoreError();
  joins.Clear();
  return std::shared_ptr<HeadComm>(
      std::make_shared<BackendHeadComm>(backend, *std::move(comm), std::move(store), group));
}

absl::StatusOr<std::shared_ptr<HeadComm>> ConnectHeadGroup(Backend* memory_of,
                                                           std::shared_ptr<HeadGroupStore> store,
                                                           const HeadGroup& group,
                                                           const GlooOptions& options) {
  if (memory_of == nullptr || memory_of->Info().name == "cpu") {
    return ConnectGloo(std::move(store), group, options);
  }
  return ConnectBackendComm(*memory_of, std::move(store), group, options.timeout);
}

}  // namespace lossd
