// SPDX-License-Identifier: Apache-2.0
#include "service/loss_server.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <limits>
#include <utility>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "service/log.h"
#include "service/reflection_guard.h"
#include "service/tsan_annotations.h"

namespace lossd {
namespace {

constexpr int kMaxMetadataBytes = 8 << 10;

// Whether another socket holds `port` for TCP on this host: a probe bind on the wildcard
// address, which any listener on that port (on any local address) refuses. gRPC reports a
// failed bind only in its log, so the reason is found out again here.
bool PortTaken(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(address).substr(colon + 1), &port) || port <= 0 ||
      port > 65535) {
    return false;
  }
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  const int one = 1;
  // Like gRPC's own listener, so a socket in TIME_WAIT does not count as taken.
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  const bool taken = bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0 &&
                     errno == EADDRINUSE;
  close(fd);
  return taken;
}

// A plaintext server with the default health service alone (grpc::EnableDefaultHealthCheckService
// is on): no Loss service, and the reflection plugin Debian's library registers taken out.
// `unknown` answers every other method UNIMPLEMENTED; it also makes this a callback server,
// which gRPC needs before it will start one with no service of its own.
std::unique_ptr<grpc::Server> StartHealthOnly(const std::string& address,
                                              grpc::CallbackGenericService* unknown, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  builder.RegisterCallbackGenericService(unknown);
  ConfigureReflection(&builder, /*enabled=*/false, nullptr);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
  builder.SetMaxReceiveMessageSize(4 << 10);
  return builder.BuildAndStart();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LossServer>> LossServer::Start(Engine* engine,
                                                               ServerMetrics* metrics,
                                                               LossServerOptions options) {
  grpc::EnableDefaultHealthCheckService(true);
  std::unique_ptr<LossServer> s(new LossServer());
  s->engine_ = engine;
  s->service_ = std::make_unique<LossService>(engine, metrics, options.service);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(
      options.address,
      options.credentials ? options.credentials : grpc::InsecureServerCredentials(), &s->port_);
  builder.RegisterService(s->service_.get());
  if (options.head_group_service != nullptr) builder.RegisterService(options.head_group_service);
  ConfigureReflection(&builder, options.reflection, options.service.auth);
  // gRPC sets SO_REUSEPORT by default: a second lossd on the same port would start and
  // silently take a share of its connections. Off, the second one fails to bind.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Request metadata is bounded here, not left to the library's default: a call over it is
  // refused by gRPC (RESOURCE_EXHAUSTED, "received initial metadata size exceeds limit")
  // before lossd sees it. 8 KiB holds any bearer token and tracing headers.
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
  // A part plus its framing must fit in one message.
  const int limit = static_cast<int>(std::min<int64_t>(
      int64_t{options.service.max_part_bytes} + (1 << 20), std::numeric_limits<int>::max()));
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  if (options.grpc_threads > 0) {
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS,
                                options.grpc_threads);
  }
  // The health port first: a failure there leaves nothing of the main server to undo (a
  // LossServer without server_ never drains the caller's engine).
  if (!options.health_address.empty()) {
    s->health_unknown_ = std::make_unique<grpc::CallbackGenericService>();
    s->health_server_ =
        StartHealthOnly(options.health_address, s->health_unknown_.get(), &s->health_port_);
    if (s->health_server_ == nullptr || s->health_port_ == 0) {
      s->health_server_.reset();
      return absl::UnavailableError(absl::StrCat(
          "cannot listen for gRPC health on ", options.health_address,
          PortTaken(options.health_address)
              ? ": the port is taken (another process listens on it)"
              : ""));
    }
  }
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen for gRPC on ", options.address,
        PortTaken(options.address) ? ": the port is taken (another process listens on it)"
                                   : ""));
  }
  s->SetServing(true);
  if (options.health_poll > absl::ZeroDuration()) {
    s->health_ = std::thread([server = s.get(), poll = options.health_poll] {
      server->FollowBackendHealth(poll);
    });
  }
  return s;
}

LossServer::~LossServer() {
  // No server_ when Start could not listen: nothing to shut down, and the engine, which
  // Shutdown would drain, is the caller's to keep using.
  if (!shut_down_ && server_ != nullptr) Shutdown(absl::ZeroDuration());
}

void LossServer::FollowBackendHealth(absl::Duration poll) {
  bool serving = true;
  absl::MutexLock lock(&health_mu_);
  while (!health_stop_) {
    const bool healthy = engine_->backend_info().healthy;
    if (healthy != serving) {
      SetServing(healthy);
      serving = healthy;
      Log(healthy ? LogLevel::kInfo : LogLevel::kError,
          healthy ? "backend healthy again" : "backend unhealthy",
          {{"health", healthy ? "SERVING" : "NOT_SERVING"}});
    }
    health_cv_.WaitWithTimeout(&health_mu_, poll);
  }
}

void LossServer::SetServing(bool serving) {
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    grpc::HealthCheckServiceInterface* health =
        server != nullptr ? server->GetHealthCheckService() : nullptr;
    if (health == nullptr) continue;
    health->SetServingStatus(serving);
    health->SetServingStatus("lossd.v1.Loss", serving);
  }
}

void LossServer::StopServing() {
  if (health_.joinable()) {
    // First, so that the health thread cannot turn a draining server SERVING again.
    {
      absl::MutexLock lock(&health_mu_);
      health_stop_ = true;
      health_cv_.Signal();
    }
    health_.join();
  }
  SetServing(false);
}

void LossServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  StopServing();
  engine_->Drain();
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(grace)));
  server_->Wait();
  // The health port answers NOT_SERVING through the drain, and goes last.
  if (health_server_ != nullptr) {
    health_server_->Shutdown(std::chrono::system_clock::now());
    health_server_->Wait();
  }
  // gRPC returns from a shutdown only after every call's OnDone, ordered inside libgrpc++.
  LOSSD_TSAN_ACQUIRE(service_.get());
}

void LossServer::Wait() {
  server_->Wait();
  LOSSD_TSAN_ACQUIRE(service_.get());  // as in Shutdown
}

}  // namespace lossd
