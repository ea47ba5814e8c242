// SPDX-License-Identifier: Apache-2.0
// The hosted heads of the fake lossd service (testing/client/fake_loss_service.h), for client
// tests: it keeps what CreateHead sent (the master as fp32), answers Info, List and Drop, checks
// the version, instance and idempotency key of a Compute naming a head, and exports in byte ranges.
// Its Step is no optimizer: an applied step adds 1 to every master value, so a test sees that it
// ran; a barrier over world_size ranks is real. The real server's tests own the math.
#ifndef LOSSD_TESTING_CLIENT_FAKE_HEADS_H_
#define LOSSD_TESTING_CLIENT_FAKE_HEADS_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace client {

class FakeHeads {
 public:
  struct Head {
    v1::HeadHeader header;  // as created; version and optimizer_step kept current
    std::map<int, std::string> tensors;  // by v1::TensorId: fp32 master and state
    std::set<std::pair<uint32_t, uint64_t>> keys;  // (rank, micro_batch) of this step
    int64_t tokens = 0;
    std::map<uint32_t, v1::StepRequest> waiting;  // the barrier: ranks arrived, by rank
    uint64_t generation = 0;  // bumped when a barrier completes
    v1::StepResponse last;    // the last completed barrier's answer
  };

  // The server instance (FakeLossService sets it from its own).
  void set_instance(const std::string& instance) {
    absl::MutexLock lock(&mu_);
    instance_ = instance;
  }

  grpc::Status Create(grpc::ServerReader<v1::CreateHeadRequest>* reader,
                      v1::CreateHeadResponse* resp);
  grpc::Status Step(grpc::ServerContext* ctx, const v1::StepRequest& req,
                    v1::StepResponse* resp);
  grpc::Status Export(const v1::ExportHeadRequest& req,
                      grpc::ServerWriter<v1::ExportHeadResponse>* writer);
  grpc::Status Info(const std::string& name, v1::HeadInfo* info);
  grpc::Status Drop(const std::string& name);
  void List(v1::ListResponse* resp);

  // A Compute naming header.head(): checks the head, its instance and version, and gives the
  // compute copy (bytes and spec) to echo. Then Added() records the key (false: already there).
  grpc::Status ForCompute(const v1::ComputeHeader& h, std::string* copy, v1::TensorSpec* spec);
  bool Added(const v1::ComputeHeader& h, int64_t tokens);

  // What the tests look at.
  v1::HeadHeader last_create_header();
  std::map<int, int> last_create_parts();  // parts per tensor id
  v1::StepRequest last_step();
  std::vector<v1::ExportHeadRequest> export_requests();
  bool Has(const std::string& name);
  std::string Tensor(const std::string& name, int id);  // "" when absent

 private:
  grpc::Status Refuse(grpc::StatusCode code, const std::string& message) const {
    return grpc::Status(code, message);
  }
  grpc::Status ExportMessages(const v1::ExportHeadRequest& req,
                              std::vector<v1::ExportHeadResponse>* out);
  // lossd's NOT_FOUND message for a head.
  std::string NotFound(const std::string& name) const ABSL_NO_THREAD_SAFETY_ANALYSIS;
  void InfoLocked(const Head& head, v1::HeadInfo* info) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The export's tensors in order: (id, spec, bytes).
  std::vector<std::tuple<int, v1::TensorSpec, std::string>> ExportTensorsLocked(
      const Head& head) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyLocked(Head& head, const v1::StepRequest& req, v1::StepResponse* resp)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::string instance_ ABSL_GUARDED_BY(mu_) = "fake-instance";
  std::map<std::string, Head> heads_ ABSL_GUARDED_BY(mu_);
  v1::HeadHeader last_create_header_ ABSL_GUARDED_BY(mu_);
  std::map<int, int> last_create_parts_ ABSL_GUARDED_BY(mu_);
  v1::StepRequest last_step_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ExportHeadRequest> export_requests_ ABSL_GUARDED_BY(mu_);
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_TESTING_CLIENT_FAKE_HEADS_H_
