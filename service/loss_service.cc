// SPDX-License-Identifier: Apache-2.0
#include "core/status_macros.h"
#include "service/loss_service.h"

#include <functional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/features.h"
#include "service/compute_reactor.h"
#include "service/create_head_reactor.h"
#include "service/export_head_reactor.h"
#include "service/fetch_gradients_reactor.h"
#include "service/head_wire.h"
#include "service/principal.h"
#include "service/put_weights_reactor.h"
#include "service/reactor_common.h"
#include "service/request_id.h"
#include "service/step_reactor.h"
#include "service/tsan_annotations.h"
#include "wire/unknown_fields.h"

namespace lossd {
namespace {

// A unary call: refuse unknown fields in `request`, run `body`, record metrics, finish.
template <typename Body>
grpc::ServerUnaryReactor* Unary(LossService* service, grpc::CallbackServerContext* ctx,
                                const char* method, const google::protobuf::Message& request,
                                Body body) {
  const absl::Time started = absl::Now();
  const std::string request_id = BeginRequestId(ctx);
  std::string client;
  absl::Status s = service->Enter(ctx, method, &client);
  if (s.ok()) {
    s = RefuseUnknownFields(request, request.GetDescriptor()->name());
    if (s.ok()) s = body();
    service->Leave(client);
  }
  grpc::Status g = RecordCall(service, *ctx, method, request_id, started, s, 0, 0);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(g);
  LOSSD_TSAN_RELEASE(service);  // the call (and the server's shutdown) ends after we return
  return reactor;
}

}  // namespace

LossService::LossService(Engine* engine, ServerMetrics* metrics, ServiceOptions options)
    : engine_(engine),
      metrics_(metrics),
      options_(std::move(options)),
      idle_watch_(options_.stream_idle_timeout) {}

// The client's identity for fairness: its bearer token when there is one (hashed, never
// kept in clear), else its address without the port.
// A client is its token where tokens are checked; else its host. (An unchecked header would
// let one client be as many as it sends different values.)
static std::string ClientKey(grpc::CallbackServerContext* ctx, bool tokens_checked) {
  auto it = ctx->client_metadata().find("authorization");
  if (tokens_checked && it != ctx->client_metadata().end()) {
    return absl::StrCat("token:",
                        std::hash<std::string>()(std::string(it->second.data(), it->second.size())));
  }
  std::string peer = ctx->peer();
  const size_t colon = peer.rfind(':');
  if (colon != std::string::npos && colon > peer.find(':')) peer.resize(colon);
  return peer;
}

absl::Status LossService::Enter(grpc::CallbackServerContext* ctx, const char* method,
                                std::string* client) {
  LOSSD_RETURN_IF_ERROR(CheckRequestId(ctx->client_metadata()));
  if (options_.auth) {
    LOSSD_RETURN_IF_ERROR(options_.auth->Check(ctx->client_metadata()));
  }
  if (engine_->draining()) {
    return absl::UnavailableError(
        absl::StrCat(method, " refused: the server is draining; retry on another replica"));
  }
  *client = ClientKey(ctx, options_.auth != nullptr);
  {
    absl::MutexLock lock(&clients_mu_);
    uint32_t& mine = client_in_flight_[*client];
    if (mine >= options_.max_in_flight_per_client) {
      return absl::UnavailableError(absl::StrCat(
          method, " refused: this client has ", mine,
          " RPCs in flight (--max_in_flight_per_client); retry later"));
    }
    ++mine;
  }
  uint32_t now = in_flight_.fetch_add(1) + 1;
  if (now > options_.max_in_flight) {
    in_flight_.fetch_sub(1);
    LeaveClient(*client);
    return absl::UnavailableError(absl::StrCat(
        method, " refused: ", options_.max_in_flight,
        " RPCs are in flight (--max_in_flight); retry later"));
  }
  metrics_->InFlight(+1);
  return absl::OkStatus();
}

absl::Status LossService::EnterWaiting(grpc::CallbackServerContext* ctx, const char* method) {
  LOSSD_RETURN_IF_ERROR(CheckRequestId(ctx->client_metadata()));
  if (options_.auth) {
    LOSSD_RETURN_IF_ERROR(options_.auth->Check(ctx->client_metadata()));
  }
  if (engine_->draining()) {
    return absl::UnavailableError(
        absl::StrCat(method, " refused: the server is draining; retry on another replica"));
  }
  metrics_->InFlight(+1);
  return absl::OkStatus();
}

void LossService::LeaveWaiting() { metrics_->InFlight(-1); }

std::string LossService::Principal(const grpc::CallbackServerContext* ctx) const {
  return CallPrincipal(*ctx, options_.auth.get());
}

void LossService::LeaveClient(const std::string& client) {
  absl::MutexLock lock(&clients_mu_);
  auto it = client_in_flight_.find(client);
  if (it != client_in_flight_.end() && --it->second == 0) client_in_flight_.erase(it);
}

void LossService::Leave(const std::string& client) {
  in_flight_.fetch_sub(1);
  LeaveClient(client);
  metrics_->InFlight(-1);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* LossService::Compute(
    grpc::CallbackServerContext* ctx) {
  return new ComputeReactor(this, ctx);
}

grpc::ServerReadReactor<v1::PutWeightsRequest>* LossService::PutWeights(
    grpc::CallbackServerContext* ctx, v1::PutWeightsResponse* response) {
  return new PutWeightsReactor(this, ctx, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossService::FetchGradients(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
  return new FetchGradientsReactor(this, ctx, request);
}

grpc::ServerUnaryReactor* LossService::DropWeights(grpc::CallbackServerContext* ctx,
                                                   const v1::DropWeightsRequest* request,
                                                   v1::DropWeightsResponse*) {
  return Unary(this, ctx, "DropWeights", *request,
               [&] { return engine_->DropWeights(request->handle(), Principal(ctx)); });
}

grpc::ServerUnaryReactor* LossService::DropAccumulator(
    grpc::CallbackServerContext* ctx, const v1::DropAccumulatorRequest* request,
    v1::DropAccumulatorResponse*) {
  return Unary(this, ctx, "DropAccumulator", *request,
               [&] { return engine_->DropAccumulator(request->accumulator(), Principal(ctx)); });
}

grpc::ServerUnaryReactor* LossService::ServerInfo(grpc::CallbackServerContext* ctx,
                                                  const v1::ServerInfoRequest* request,
                                                  v1::ServerInfoResponse* r) {
  return Unary(this, ctx, "ServerInfo", *request, [&] {
    const BackendInfo b = engine_->backend_info();
    const EngineOptions& o = engine_->options();
    r->set_version(options_.version);
    r->set_instance(options_.instance);
    r->set_backend(b.name);
    r->set_device(b.device);
    r->set_compute_path(b.compute_path);
    r->set_memory_total_bytes(b.memory_total_bytes);
    r->set_memory_budget_bytes(o.memory_budget_bytes);
    r->set_memory_in_use_bytes(engine_->budget().in_use());
    r->set_weight_cache_budget_bytes(o.weight_cache_bytes);
    r->set_weight_cache_bytes(engine_->weights().bytes());
    r->set_max_part_bytes(options_.max_part_bytes);
    r->set_max_bt(o.max_bt);
    r->set_max_h(o.max_h);
    r->set_max_v(o.max_v);
    r->set_max_in_flight(options_.max_in_flight);
    r->set_accumulators(static_cast<uint32_t>(engine_->accumulators().count()));
    for (const std::string& f : ServerFeatures(engine_->loss_kinds())) r->add_features(f);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* LossService::List(grpc::CallbackServerContext* ctx,
                                            const v1::ListRequest* request,
                                            v1::ListResponse* r) {
  return Unary(this, ctx, "List", *request, [&] {
    // Weight handles, accumulators and hosted heads.
    for (const StateInfo& s : engine_->ListState(Principal(ctx))) {
      StateEntryToWire(s, r->add_entries());
    }
    return absl::OkStatus();
  });
}

grpc::ServerReadReactor<v1::CreateHeadRequest>* LossService::CreateHead(
    grpc::CallbackServerContext* ctx, v1::CreateHeadResponse* response) {
  return new CreateHeadReactor(this, ctx, response);
}

grpc::ServerUnaryReactor* LossService::Step(grpc::CallbackServerContext* ctx,
                                            const v1::StepRequest* request,
                                            v1::StepResponse* response) {
  return new StepReactor(this, ctx, request, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossService::ExportHead(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
  return new ExportHeadReactor(this, ctx, request);
}

grpc::ServerUnaryReactor* LossService::GetHeadInfo(grpc::CallbackServerContext* ctx,
                                                   const v1::HeadRequest* request,
                                                   v1::HeadInfo* response) {
  return Unary(this, ctx, "GetHeadInfo", *request, [&] {
    auto s = engine_->heads().Info(request->head(), Principal(ctx));
    if (!s.ok()) return s.status();
    *response = HeadInfoToWire(*s, options_.instance);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* LossService::DropHead(grpc::CallbackServerContext* ctx,
                                                const v1::HeadRequest* request,
                                                v1::DropHeadResponse*) {
  return Unary(this, ctx, "DropHead", *request,
               [&] { return engine_->heads().Drop(request->head(), Principal(ctx)); });
}

}  // namespace lossd
