// SPDX-License-Identifier: Apache-2.0
// A fake lossd service for client tests, served over real gRPC: it reassembles what a client
// sends (refusing out-of-order parts), echoes inputs back as outputs (dx = x's bytes, dw = w's
// bytes, lse = targets as fp32, predictions = targets; for kind logprob logp = -targets and
// entropy = dentropy's or dlogp's bytes, else ones; for kind policy kl 0.375 and
// clip_fraction 0.0625), keeps hosted heads (fake_heads.h),
// and can be told to misbehave. It computes no loss; the real server's tests own the math.
#ifndef LOSSD_TESTING_CLIENT_FAKE_LOSS_SERVICE_H_
#define LOSSD_TESTING_CLIENT_FAKE_LOSS_SERVICE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "lossd/v1/lossd.pb.h"
#include "testing/client/fake_heads.h"

namespace lossd {
namespace client {

// How the fake misbehaves in Compute.
enum class Mode {
  kEcho,          // dx = x's bytes, dw = w's bytes, lse = targets as fp32, predictions = targets
  kError,         // fails with error_code / error_message after reading the header
  kSleep,         // sleeps until cancelled (or 10 s), then answers
  kOutOfOrder,    // sends dx's second part before its first
  kShort,         // sends dx one byte short
  kOverflow,      // sends dx with one byte too many
  kUnannounced,   // sends a part of z_loss, which the summary does not list
  kNoSummary,     // sends nothing and returns OK
  kPartFirst,     // sends a part before the summary
  kBadShape,      // announces dx with one row too many
  kTwoSummaries,  // sends the summary twice
  kNoFinal,       // overlap: sends the preliminary summary and the parts, not the final one
};
// A Compute whose header asks for overlap gets a preliminary summary (the outputs, no
// results), the parts, then the final summary, as lossd sends it.

// Reassembles the parts of one stream, checking that each tensor's parts come in byte order.
struct Assembler {
  std::map<int, std::string> data;
  std::map<int, int> parts;
  size_t max_part = 0;
  std::string error;

  void Add(const v1::TensorPart& p) {
    std::string& d = data[p.tensor()];
    if (p.offset() != d.size() && error.empty()) {
      error = absl::StrCat("tensor ", p.tensor(), " part at ", p.offset(), ", expected ", d.size());
    }
    d += p.data();
    ++parts[p.tensor()];
    max_part = std::max(max_part, p.data().size());
  }
};

class FakeLossService final : public v1::Loss::Service {
 public:
  // Behaviour; set before calls, `mode` last. The server's threads read `mode` (atomic) first,
  // so setting it last publishes error_code and error_message to them: the call that follows
  // orders them only through the kernel's sockets, which ThreadSanitizer cannot see.
  std::atomic<Mode> mode{Mode::kEcho};
  grpc::StatusCode error_code = grpc::StatusCode::INVALID_ARGUMENT;
  std::string error_message;

  // What the fake saw, for the tests to check.
  absl::Mutex mu;
  std::set<std::string> peers ABSL_GUARDED_BY(mu);
  v1::ComputeHeader last_header ABSL_GUARDED_BY(mu);
  std::map<int, int> last_parts ABSL_GUARDED_BY(mu);
  std::map<int, std::string> last_data ABSL_GUARDED_BY(mu);  // each input's bytes, by TensorId
  size_t last_max_part ABSL_GUARDED_BY(mu) = 0;
  std::string last_metadata ABSL_GUARDED_BY(mu);
  std::string last_request_id ABSL_GUARDED_BY(mu);  // Compute's x-request-id
  std::map<std::string, std::pair<v1::WeightsHeader, Assembler>> weights ABSL_GUARDED_BY(mu);
  struct Accumulator {
    int64_t v = 0, h = 0;
    bool bias = false;
    uint64_t micro_batches = 0;
    int64_t tokens = 0;
  };
  std::map<std::string, Accumulator> accumulators ABSL_GUARDED_BY(mu);
  // The fake's server instance; a Compute or fetch naming another accumulator_instance is
  // refused with FAILED_PRECONDITION, as lossd does. Change it to play a restart.
  std::string instance ABSL_GUARDED_BY(mu) = "fake-instance";
  // ServerInfo's features, and how many ServerInfo calls the fake has answered.
  std::vector<std::string> features ABSL_GUARDED_BY(mu);
  int server_info_calls ABSL_GUARDED_BY(mu) = 0;
  // When set, the next Compute waits once it has recorded its header, before it reads the
  // instance it answers from: it notifies `held`, then waits for `release`. Both are taken
  // (cleared) by that one call. For tests of calls that overlap.
  absl::Notification* held ABSL_GUARDED_BY(mu) = nullptr;
  absl::Notification* release ABSL_GUARDED_BY(mu) = nullptr;

  grpc::Status Compute(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::ComputeResponse, v1::ComputeRequest>* stream) override;
  grpc::Status PutWeights(grpc::ServerContext* ctx,
                          grpc::ServerReader<v1::PutWeightsRequest>* reader,
                          v1::PutWeightsResponse* resp) override;
  grpc::Status DropWeights(grpc::ServerContext*, const v1::DropWeightsRequest* req,
                           v1::DropWeightsResponse*) override;
  grpc::Status FetchGradients(grpc::ServerContext*, const v1::FetchGradientsRequest* req,
                              grpc::ServerWriter<v1::FetchGradientsResponse>* writer) override;
  grpc::Status DropAccumulator(grpc::ServerContext*, const v1::DropAccumulatorRequest* req,
                               v1::DropAccumulatorResponse*) override;
  grpc::Status ServerInfo(grpc::ServerContext* ctx, const v1::ServerInfoRequest*,
                          v1::ServerInfoResponse* resp) override;
  // Every weight handle, accumulator and head (the fake has no owners); bytes from their
  // shapes.
  grpc::Status List(grpc::ServerContext*, const v1::ListRequest*,
                    v1::ListResponse* resp) override;

  // Hosted heads (testing/client/fake_heads.h). Its instance is "fake-instance" until a test
  // sets another with heads.set_instance.
  FakeHeads heads;
  grpc::Status CreateHead(grpc::ServerContext*, grpc::ServerReader<v1::CreateHeadRequest>* reader,
                          v1::CreateHeadResponse* resp) override {
    return heads.Create(reader, resp);
  }
  grpc::Status Step(grpc::ServerContext* ctx, const v1::StepRequest* req,
                    v1::StepResponse* resp) override {
    return heads.Step(ctx, *req, resp);
  }
  grpc::Status ExportHead(grpc::ServerContext*, const v1::ExportHeadRequest* req,
                          grpc::ServerWriter<v1::ExportHeadResponse>* writer) override {
    return heads.Export(*req, writer);
  }
  grpc::Status GetHeadInfo(grpc::ServerContext*, const v1::HeadRequest* req,
                           v1::HeadInfo* info) override {
    return heads.Info(req->head(), info);
  }
  grpc::Status DropHead(grpc::ServerContext*, const v1::HeadRequest* req,
                        v1::DropHeadResponse*) override {
    return heads.Drop(req->head());
  }
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_TESTING_CLIENT_FAKE_LOSS_SERVICE_H_
