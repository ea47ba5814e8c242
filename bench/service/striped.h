// SPDX-License-Identifier: Apache-2.0
// Striped weight upload and ranged gradient download for the service benchmark, on N channels
// (N TCP connections) with lossd's raw wire format: PutWeights as N streams that each send one
// byte range of W (upload_id/stripes/w_begin/w_end), FetchGradients as N byte ranges of dW|db.
// N = 1 is the plain, unstriped call. Never allocates tensor memory; blocks until done.
#ifndef LOSSD_BENCH_SERVICE_STRIPED_H_
#define LOSSD_BENCH_SERVICE_STRIPED_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"

namespace lossd {
namespace bench {

class StripedTransfer {
 public:
  // `connections` channels to `target`, each its own TCP connection.
  StripedTransfer(const std::string& target, int connections, size_t part_bytes,
                  absl::Duration deadline);

  int connections() const { return static_cast<int>(stubs_.size()); }

  // Uploads bf16 W, striped over every connection; returns the handle. W must stay alive and
  // unchanged for the process's life (its bytes are sent without a copy).
  absl::StatusOr<std::string> PutWeights(const uint8_t* w,  // (V, H) bf16 row-major
                                         int64_t v, int64_t h);

  // Fetches the fp32 accumulator's dW | db (total_bytes) into dst, one byte range per
  // connection (the whole tensor in one call when there is one connection).
  // `header_seconds` (nullable): the longest wait, over the stripes, from the call's start to
  // its GradientsHeader, which the server sends once its device-to-host snapshot is taken.
  absl::Status FetchGradients(const std::string& accumulator, uint64_t total_bytes,
                              uint8_t* dst,  // (total_bytes) dW | db bytes
                              double* header_seconds = nullptr);

 private:
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  const size_t part_bytes_;
  const absl::Duration deadline_;
};

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_SERVICE_STRIPED_H_
