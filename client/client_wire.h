// SPDX-License-Identifier: Apache-2.0
// The C++ client's side of the wire: its plain types to and from lossd.v1 messages (dtypes,
// reductions, tensor specs), the names of tensors in messages, and the outgoing parts of a
// tensor (whole elements, caller memory, no copy). Never opens a call; never owns tensor
// memory (the wire::SliceTracker keeps the caller's bytes pinned until gRPC lets go).
#ifndef LOSSD_CLIENT_CLIENT_WIRE_H_
#define LOSSD_CLIENT_CLIENT_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client_types.h"
#include "client/host_tensor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "grpcpp/support/byte_buffer.h"
#include "lossd/v1/lossd.pb.h"
#include "wire/part_codec.h"

namespace lossd {
namespace client {

inline constexpr char kComputeMethod[] = "/lossd.v1.Loss/Compute";
inline constexpr char kPutWeightsMethod[] = "/lossd.v1.Loss/PutWeights";
inline constexpr char kFetchGradientsMethod[] = "/lossd.v1.Loss/FetchGradients";

v1::DType ToProto(DType t);
// INTERNAL for a dtype this client does not know.
absl::StatusOr<DType> FromProto(v1::DType t);
v1::Reduction ToProto(Reduction r);
v1::LossKind ToProto(LossKind k);
v1::PolicyLossType ToProto(PolicyLossType t);
// The last of the consecutive output tensor ids (OutputTensor::kLoss is the first).
inline constexpr OutputTensor kLastOutputTensor = OutputTensor::kEntropy;
// `t`'s dtype and shape into `spec`.
void FillSpec(const HostTensor& t, v1::TensorSpec* spec);
std::vector<int64_t> ShapeOf(const v1::TensorSpec& spec);
// An output's name ("dx", ...), else "tensor#<id>": for messages about what a server sent.
std::string TensorIdName(int32_t id);

ServerInfoResult ServerInfoFromProto(const v1::ServerInfoResponse& resp);

// A random 128-bit upload id, in hex: stripes of one upload share it, and no two uploads
// (from any client) should.
std::string RandomUploadId();

// Appends the parts of one tensor, in byte order: each at most part_bytes rounded down to
// whole elements (at least one), because a server may refuse a part that splits an element.
// The same for the bytes [begin, end) of a tensor (whole elements), offsets into the tensor.
// *bytes grows by the data bytes appended.
void AppendRange(v1::TensorId id, const HostTensor& t, size_t begin, size_t end,
                 size_t part_bytes, wire::SliceTracker* tracker, std::vector<grpc::ByteBuffer>* out,
                 uint64_t* bytes);
void AppendParts(v1::TensorId id, const HostTensor& t, size_t part_bytes,
                 wire::SliceTracker* tracker,
                 std::vector<grpc::ByteBuffer>* out, uint64_t* bytes);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_CLIENT_WIRE_H_
