// SPDX-License-Identifier: Apache-2.0
// The lossd.v1.Loss gRPC service on the callback API: thin reactors that assemble stream
// parts into host buffers, hand validated work to the engine (whose executor runs the
// compute, so no reactor ever blocks on it), stream results back, and record metrics at the
// edge. Never includes CUDA headers.
#ifndef LOSSD_SERVICE_LOSS_SERVICE_H_
#define LOSSD_SERVICE_LOSS_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "service/auth.h"
#include "engine/engine.h"
#include "service/idle_watch.h"
#include "service/metrics.h"

namespace lossd {

struct ServiceOptions {
  std::string version;
  std::string instance;
  uint32_t max_part_bytes = 16u << 20;           // largest part data a client may send
  uint32_t default_response_part_bytes = 4u << 20;
  uint32_t max_in_flight = 256;                  // RPCs at once; more get UNAVAILABLE
  uint32_t max_in_flight_per_client = 64;        // per client (token, else peer address)
  uint64_t max_parts_per_request = 1u << 20;     // tensor parts one stream may send
  // Overlapped Computes: start before X is all in even while other computes are queued or
  // running (false: only on an idle executor; see engine/overlap_start.h).
  bool overlap_start_when_busy = false;
  // A stream on which lossd waits for the client and nothing arrives for this long is
  // cancelled (IdleWatch); zero: never.
  absl::Duration stream_idle_timeout = absl::Seconds(60);
  // When set, every Loss RPC must carry a valid bearer token (health checks need none).
  std::shared_ptr<const TokenAuthenticator> auth;
  // Test seams, empty in the server: a Compute reactor runs `compute_header_hook` on its
  // thread as it starts handling the header, and `compute_cancel_hook` as its OnCancel
  // returns, so a test can land a cancel inside the header's handling (a window no client
  // timing hits reliably).
  std::function<void()> compute_header_hook;
  std::function<void()> compute_cancel_hook;
};

// Compute, FetchGradients and ExportHead are raw methods (byte buffers, parsed and built in place without
// copying tensor data); the rest are typed.
using LossServiceBase = v1::Loss::WithRawCallbackMethod_Compute<
    v1::Loss::WithCallbackMethod_PutWeights<v1::Loss::WithCallbackMethod_DropWeights<
        v1::Loss::WithRawCallbackMethod_FetchGradients<
            v1::Loss::WithCallbackMethod_DropAccumulator<
                v1::Loss::WithCallbackMethod_ServerInfo<v1::Loss::WithCallbackMethod_List<
                    v1::Loss::WithCallbackMethod_CreateHead<v1::Loss::WithCallbackMethod_Step<
                        v1::Loss::WithRawCallbackMethod_ExportHead<
                            v1::Loss::WithCallbackMethod_GetHeadInfo<
                                v1::Loss::WithCallbackMethod_DropHead<
                                    v1::Loss::Service>>>>>>>>>>>>;

class LossService final : public LossServiceBase {
 public:
  LossService(Engine* engine, ServerMetrics* metrics, ServiceOptions options);

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Compute(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerReadReactor<v1::PutWeightsRequest>* PutWeights(
      grpc::CallbackServerContext* ctx, v1::PutWeightsResponse* response) override;
  grpc::ServerUnaryReactor* DropWeights(grpc::CallbackServerContext* ctx,
                                        const v1::DropWeightsRequest* request,
                                        v1::DropWeightsResponse* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchGradients(
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* DropAccumulator(grpc::CallbackServerContext* ctx,
                                            const v1::DropAccumulatorRequest* request,
                                            v1::DropAccumulatorResponse* response) override;
  grpc::ServerUnaryReactor* ServerInfo(grpc::CallbackServerContext* ctx,
                                       const v1::ServerInfoRequest* request,
                                       v1::ServerInfoResponse* response) override;
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx,
                                 const v1::ListRequest* request,
                                 v1::ListResponse* response) override;
  // Hosted heads (engine/heads.h).
  grpc::ServerReadReactor<v1::CreateHeadRequest>* CreateHead(
      grpc::CallbackServerContext* ctx, v1::CreateHeadResponse* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* ctx,
                                 const v1::StepRequest* request,
                                 v1::StepResponse* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* ExportHead(
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* GetHeadInfo(grpc::CallbackServerContext* ctx,
                                        const v1::HeadRequest* request,
                                        v1::HeadInfo* response) override;
  grpc::ServerUnaryReactor* DropHead(grpc::CallbackServerContext* ctx,
                                     const v1::HeadRequest* request,
                                     v1::DropHeadResponse* response) override;

  // Shared by the reactors.
  Engine* engine() { return engine_; }
  ServerMetrics* metrics() { return metrics_; }
  const ServiceOptions& options() const { return options_; }
  IdleWatch& idle_watch() { return idle_watch_; }
  // Who owns the state this call creates or names (service/principal.h).
  std::string Principal(const grpc::CallbackServerContext* ctx) const;
  // Admits one more RPC: UNAUTHENTICATED without a valid token, UNAVAILABLE while draining,
  // at --max_in_flight or at --max_in_flight_per_client. On OK, `client` is set to the
  // client's key; pair with Leave(client).
  absl::Status Enter(grpc::CallbackServerContext* ctx, const char* method, std::string* client);
  void Leave(const std::string& client);
  // For a call that only waits (a Step at its barrier: no memory, no thread): the token and
  // the drain are checked, but it takes no in-flight slot. Counting it would let a
  // data-parallel job wider than --max_in_flight_per_client (its ranks share one token)
  // fill its own slots with waiting ranks and refuse the rank the barrier waits for. Pair
  // with LeaveWaiting().
  absl::Status EnterWaiting(grpc::CallbackServerContext* ctx, const char* method);
  void LeaveWaiting();

 private:
  void LeaveClient(const std::string& client);
  Engine* const engine_;
  ServerMetrics* const metrics_;
  const ServiceOptions options_;
  std::atomic<uint32_t> in_flight_{0};
  IdleWatch idle_watch_;
  absl::Mutex clients_mu_;
  absl::flat_hash_map<std::string, uint32_t> client_in_flight_ ABSL_GUARDED_BY(clients_mu_);
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_LOSS_SERVICE_H_
