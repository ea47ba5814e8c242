// SPDX-License-Identifier: Apache-2.0
// One Compute call of the C++ client, apart from the transport: the checks of a
// ComputeRequest made before anything is sent, the ComputeHeader and the parts it sends
// (small tensors and W first, X last), and ComputeReplyReader, which takes the reply's
// summaries and parts into a ComputeResult, checking them against the wire contract and the
// request. Never opens a stream and never retries; owns no caller memory.
#ifndef LOSSD_CLIENT_COMPUTE_CALL_H_
#define LOSSD_CLIENT_COMPUTE_CALL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/client_types.h"
#include "client/output_receiver.h"
#include "grpcpp/support/byte_buffer.h"
#include "lossd/v1/lossd.pb.h"
#include "wire/part_codec.h"

namespace lossd {
namespace client {

// INVALID_ARGUMENT for a request the server would refuse on its face (ranks, one of w, a
// weight handle and a head, a bias with a handle or a head, a head with an accumulator),
// and for caller buffers (output_into) of outputs the call does not return or too small for
// what it returns: refused only once the server has answered,
// the micro-batch would already be in a named accumulator, and a retry would add it twice.
absl::Status ValidateRequest(const ComputeRequest& r);

// False for a distill request whose targets are left default-constructed (every row counts),
// and for a two-phase backward (its targets are its ticket's).
bool HasTargets(const ComputeRequest& r);
// BT: x's rows, or for a two-phase backward its dlogp's (or dentropy's).
int64_t RowsOf(const ComputeRequest& r);

// The ComputeRequest message that opens the stream: specs, options, wanted outputs,
// accumulator (and the instance its sum is on, "" before the first Compute into it), the
// head's fields (and the instance it lives on, "" when unknown).
v1::ComputeRequest ComputeHeaderOf(const ComputeRequest& r, const std::string& instance,
                                   uint32_t response_part_bytes, bool overlap,
                                   const std::string& head_instance = "");

// Appends the parts of every input: small tensors and the weight first, X last (a server can
// start on the first rows of X while the rest is still arriving, but needs everything else
// for that). *bytes grows by the data bytes.
void AppendComputeInputs(const ComputeRequest& r, size_t part_bytes, wire::SliceTracker* tracker,
                         std::vector<grpc::ByteBuffer>* out, uint64_t* bytes);

// dX (and dW with inline weights) have shapes known before the reply: allocates buffers for
// those the caller gave none for, to be paged in while the server computes (Start()s it).
void PrefetchOutputs(const ComputeRequest& r, OutputPrefetcher* prefetched);

// Reads one Compute reply. Without overlap: the summary, then the parts. With overlap: a
// preliminary summary that announces the outputs, the parts, then the final summary (the
// same outputs) last.
class ComputeReplyReader {
 public:
  // `r`, `result` and `prefetched` (nullable) outlive the reader.
  ComputeReplyReader(const ComputeRequest& r, bool overlap, ComputeResult* result,
                     OutputPrefetcher* prefetched)
      : r_(r), overlap_(overlap), result_(result), prefetched_(prefetched) {}

  // One message of the reply; INTERNAL (or DATA_LOSS) for one that breaks the contract.
  absl::Status OnMessage(const grpc::ByteBuffer& msg);
  // After the stream ended well: checks that everything arrived and moves the outputs and
  // bytes_received into the result.
  absl::Status Finish();

 private:
  absl::Status OnSummary();
  // The outputs the (first) summary lists, each checked against the request.
  absl::Status Announce(const v1::ComputeSummary& s);

  const ComputeRequest& r_;
  const bool overlap_;
  ComputeResult* const result_;
  OutputPrefetcher* const prefetched_;
  wire::StreamFrame frame_;
  TensorReceiver receiver_;
  bool have_summary_ = false;  // the outputs are announced
  bool have_results_ = false;  // the final summary arrived
  int announced_ = 0;
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_COMPUTE_CALL_H_
