// SPDX-License-Identifier: Apache-2.0
// A stand-in for a device backend with collectives of its own (the CUDA backend's NCCL), for
// tests that run without a GPU: it forwards every call to a CPU backend, reports another
// name (so the engine takes the backend-collectives path, not its own gloo), and forms its
// BackendComm over gloo on 127.0.0.1 through a store its members share. The engine's side
// (ConnectBackendComm: the id handed through the group's store, the staging of the step's
// values, arrival marks, aborts) is then the same as on a GPU.
#ifndef LOSSD_TESTING_GLOO_BACKEND_COMM_H_
#define LOSSD_TESTING_GLOO_BACKEND_COMM_H_

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "engine/head_group.h"
#include "kernels/backend.h"
#include "testing/forwarding_backend.h"

namespace lossd {

class GlooBackedDevice : public ForwardingBackend {
 public:
  // `comms`: where the members' gloo rendezvous (one store for every member of a test).
  GlooBackedDevice(std::unique_ptr<Backend> inner, std::shared_ptr<HeadGroupStore> comms)
      : ForwardingBackend(std::move(inner)), comms_(std::move(comms)) {}

  BackendInfo Info() override {
    BackendInfo i = ForwardingBackend::Info();
    i.name = "gloo-backed-device";
    return i;
  }

  absl::Status CommAvailable() override;
  absl::StatusOr<std::string> NewCommId() override;
  absl::StatusOr<std::unique_ptr<BackendComm>> ConnectComm(const std::string& id, uint32_t size,
                                                           uint32_t rank,
                                                           int64_t timeout_ms) override;
  // How many communicators this backend formed.
  int connects() const { return connects_.load(); }
  // Makes CommAvailable fail (as a GPU host without NCCL's library would).
  void set_unavailable(bool v) { unavailable_ = v; }

 private:
  std::shared_ptr<HeadGroupStore> comms_;
  std::atomic<int> connects_{0};
  bool unavailable_ = false;
};

}  // namespace lossd

#endif  // LOSSD_TESTING_GLOO_BACKEND_COMM_H_
