// SPDX-License-Identifier: Apache-2.0
#include "testing/gloo_backend_comm.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace lossd {
namespace {

// A BackendComm over one of gloo's HeadComms (the engine's own, in host memory: the CPU
// backend's buffers are host memory).
class GlooBackendComm : public BackendComm {
 public:
  explicit GlooBackendComm(std::shared_ptr<HeadComm> comm) : comm_(std::move(comm)) {}
  absl::Status ReduceScatter(float* buf, int64_t n) override {
    return comm_->ReduceScatter(buf, n);
  }
  absl::Status AllGather(void* buf, int64_t n, size_t elem_bytes) override {
    return comm_->AllGather(buf, n, elem_bytes);
  }
  void Abort() override { comm_->Abort("aborted by the engine"); }

 private:
  std::shared_ptr<HeadComm> comm_;
};

}  // namespace

absl::Status GlooBackedDevice::CommAvailable() {
  if (unavailable_) return absl::FailedPreconditionError("the test's collectives are off");
  return absl::OkStatus();
}

absl::StatusOr<std::string> GlooBackedDevice::NewCommId() {
  if (absl::Status s = CommAvailable(); !s.ok()) return s;
  std::random_device rd;
  std::string id(kBackendCommIdBytes, '\0');
  for (char& c : id) c = static_cast<char>('a' + rd() % 26);
  return id;
}

absl::StatusOr<std::unique_ptr<BackendComm>> GlooBackedDevice::ConnectComm(
    const std::string& id, uint32_t size, uint32_t rank, int64_t timeout_ms) {
  if (id.size() != kBackendCommIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a communicator id is ", kBackendCommIdBytes,
                                                   " bytes, got ", id.size()));
  }
  HeadGroup g;
  for (uint32_t m = 0; m < size; ++m) g.members.push_back(absl::StrCat("device-", m));
  g.member = rank;
  g.id = absl::StrCat("device-comm/", id);
  GlooOptions o;
  o.timeout = absl::Milliseconds(timeout_ms);
  absl::StatusOr<std::shared_ptr<HeadComm>> comm = ConnectGloo(comms_, g, o);
  if (!comm.ok()) return comm.status();
  connects_.fetch_add(1);
  return std::unique_ptr<BackendComm>(std::make_unique<GlooBackendComm>(*std::move(comm)));
}

}  // namespace lossd
