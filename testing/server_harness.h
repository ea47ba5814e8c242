// SPDX-License-Identifier: Apache-2.0
// Test harness: a real lossd server (engine + CPU backend + gRPC on loopback + /metrics) in
// the test process, and a raw client that speaks the wire directly so tests control every
// message (including the malformed ones). Test-only.
#ifndef LOSSD_TESTING_SERVER_HARNESS_H_
#define LOSSD_TESTING_SERVER_HARNESS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "testing/test_util.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "prometheus/exposer.h"
#include "engine/engine.h"
#include "service/head_group_store.h"
#include "service/loss_server.h"
#include "service/metrics.h"

namespace lossd {
namespace testing_harness {

struct HarnessOptions {
  EngineOptions engine;
  ServiceOptions service;
  int cpu_threads = 2;
  // The backend; empty = a CPU backend of cpu_threads.
  std::function<std::unique_ptr<Backend>()> backend;
  std::shared_ptr<grpc::ServerCredentials> server_credentials;  // null = plaintext
  bool reflection = false;  // LossServerOptions::reflection
  std::string health_address;  // LossServerOptions::health_address
  // Where it listens: any 127.0.0.0/8 address (Linux routes all of them to loopback, so
  // several servers can share one port on distinct addresses); port 0 picks a free one.
  std::string host = "127.0.0.1";
  int port = 0;
  // Where set, the server forms head groups (lossd's --head_group_address): gloo listens on
  // this address, and the server serves the group rendezvous (HeadGroupRendezvous) beside
  // Loss. head_group_timeout: --head_group_timeout.
  std::string head_group_address;
  absl::Duration head_group_timeout = absl::Seconds(30);
};

class Harness {
 public:
  explicit Harness(HarnessOptions o = {});
  ~Harness();

  v1::Loss::Stub& stub() { return *stub_; }
  // A stub on a new channel to this server with the given credentials.
  std::unique_ptr<v1::Loss::Stub> NewStub(std::shared_ptr<grpc::ChannelCredentials> creds);
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  Engine& engine() { return *engine_; }
  LossServer& server() { return *server_; }
  int port() const { return server_->port(); }
  const std::string& host() const { return host_; }
  // False when the server could not start (the failure was added to the test).
  bool started() const { return server_ != nullptr; }
  // GET /metrics from the process-wide exposer (shared: destroying one takes ~2 s).
  std::string ScrapeMetrics();
  // Waits until admitted memory is back to 0 (or `seconds` pass); returns the last value.
  uint64_t WaitForIdleMemory(double seconds = 5);

 private:
  std::string host_;
  std::unique_ptr<GroupStoreService> group_service_;  // before the server (it outlives it)
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<LossServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Loss::Stub> stub_;
};

// The value of the sample `name{labels}` in a Prometheus text page (-1 when absent). `labels`
// is matched as written by prometheus-cpp, e.g. R"(code="OK",method="Compute")".
double MetricValue(const std::string& page, const std::string& name,
                   const std::string& labels = "");

// A decoded Compute response.
struct ComputeReply {
  grpc::Status status;
  v1::ComputeSummary summary;
  std::map<int, std::vector<uint8_t>> tensors;  // by v1::TensorId
};

// Wire messages for a RandomProblem: header (with inline W unless handle is given) and parts.
v1::ComputeHeader HeaderFor(const RandomProblem& rp, const std::string& weight_handle = "");
std::vector<v1::ComputeRequest> PartsFor(const RandomProblem& rp, size_t part_bytes,
                                         bool include_weights = true);

// The same parts with every input but X first: the order that lets an overlapped Compute
// (header.overlap) start before X is in.
std::vector<v1::ComputeRequest> XLast(std::vector<v1::ComputeRequest> parts);

// Sends `messages` in order on one Compute stream, closes it and collects the reply (either
// order: summary then parts, or overlapped: preliminary summary, parts, final summary).
ComputeReply RunCompute(v1::Loss::Stub& stub, const std::vector<v1::ComputeRequest>& messages,
                        double deadline_seconds = 60);
// Header + parts in one call.
ComputeReply RunCompute(v1::Loss::Stub& stub, const v1::ComputeHeader& header,
                        const std::vector<v1::ComputeRequest>& parts,
                        double deadline_seconds = 60);

// Uploads W (and bias) of a RandomProblem with PutWeights; returns the handle or the status.
grpc::Status PutWeights(v1::Loss::Stub& stub, const RandomProblem& rp, size_t part_bytes,
                        std::string* handle);

// LossOutputs that view a reply's tensors (and its scalars, kept in `scalars`).
struct ReplyScalars {
  float loss = 0, z_loss = 0, accuracy = 0;
  int64_t tokens = 0;
};
LossOutputs OutputsOf(ComputeReply& reply, const LossProblem& p, DType grad_dtype,
                      ReplyScalars* scalars);

// A reply to rp's Compute (from HeaderFor's header: every output wanted) is OK, holds exactly
// the outputs that header asks for at their exact sizes, and they (gradients in grad_dtype)
// match the float64 reference within the tolerance table; otherwise the failure says which
// (status, a missing or misshapen output, the reference or the mismatching elements).
::testing::AssertionResult ReplyMatchesReference(const RandomProblem& rp, ComputeReply& reply,
                                                 DType grad_dtype);

// The fixture of a suite whose tests share one server: h_ is made before the suite's first
// test and never destroyed (a server torn down between suites costs seconds). One per
// `Suite` (class Suite : public SuiteHarness<Suite>); suites derived from Suite share its.
template <typename Suite>
class SuiteHarness : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (h_ == nullptr) h_ = new Harness();
  }
  static inline Harness* h_ = nullptr;
};

}  // namespace testing_harness
}  // namespace lossd

#endif  // LOSSD_TESTING_SERVER_HARNESS_H_
