// SPDX-License-Identifier: Apache-2.0
// Builds and runs the gRPC server: the Loss service, grpc.health.v1 and (when asked for)
// server reflection, with message limits raised for tensor parts. Used by main and by the end-to-end tests.
#ifndef LOSSD_SERVICE_LOSS_SERVER_H_
#define LOSSD_SERVICE_LOSS_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "service/loss_service.h"
#include "service/metrics.h"

namespace lossd {

struct LossServerOptions {
  std::string address = "0.0.0.0:50051";  // port 0 picks a free port
  int grpc_threads = 0;                   // 0 = gRPC's default
  std::shared_ptr<grpc::ServerCredentials> credentials;  // null = plaintext
  ServiceOptions service;
  // Serve grpc.reflection (off by default: it describes the whole API to anyone who asks).
  // With service.auth set it needs a token like the Loss service.
  bool reflection = false;
  // How often health looks at the backend: a sticky device error turns it NOT_SERVING (and a
  // backend healthy again, SERVING). Zero: health is left as SetServing puts it.
  absl::Duration health_poll = absl::Seconds(1);
  // Where a plaintext server that answers grpc.health.v1 alone listens ("" = none; port 0
  // picks one). For probes that cannot speak TLS (Kubernetes' native gRPC probes) when
  // `credentials` is TLS: it mirrors the main server's health, drain included, and serves
  // nothing else (no Loss service, no reflection).
  std::string health_address;
  // Served beside the Loss service on the same port and credentials (the head group
  // rendezvous, service/head_group_store.h); null: none. Outlives the server.
  grpc::Service* head_group_service = nullptr;
};

class LossServer {
 public:
  static absl::StatusOr<std::unique_ptr<LossServer>> Start(Engine* engine,
                                                           ServerMetrics* metrics,
                                                           LossServerOptions options);
  ~LossServer();

  int port() const { return port_; }
  // The health-only port (LossServerOptions::health_address), 0 without one.
  int health_port() const { return health_port_; }
  // Marks health SERVING or NOT_SERVING for "" and "lossd.v1.Loss".
  void SetServing(bool serving);
  // The first step of a drain: health NOT_SERVING on both ports for good (it no longer
  // follows the backend), while the listener still accepts and every call is still served,
  // so that load balancers take this server out before it refuses anything.
  void StopServing();
  // Graceful drain: StopServing, refuse new work, stop accepting, let in-flight calls finish
  // until `grace` has passed, then cancel what is left.
  void Shutdown(absl::Duration grace);
  void Wait();

 private:
  LossServer() = default;
  std::unique_ptr<LossService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::CallbackGenericService> health_unknown_;  // outlives health_server_
  std::unique_ptr<grpc::Server> health_server_;  // plaintext, grpc.health.v1 only; or null
  int health_port_ = 0;
  // Health follows the backend (LossServerOptions::health_poll) until Shutdown.
  void FollowBackendHealth(absl::Duration poll);

  Engine* engine_ = nullptr;
  int port_ = 0;
  bool shut_down_ = false;
  absl::Mutex health_mu_;
  absl::CondVar health_cv_;
  bool health_stop_ ABSL_GUARDED_BY(health_mu_) = false;
  std::thread health_;
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_LOSS_SERVER_H_
