// SPDX-License-Identifier: Apache-2.0
#include "client/health_check.h"

#include <condition_variable>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace lossd {
namespace client {

std::string EncodeHealthCheckRequest(absl::string_view service) {
  std::string out;
  if (service.empty()) return out;  // proto3: an empty string is not sent
  google::protobuf::io::StringOutputStream raw(&out);
  google::protobuf::io::CodedOutputStream coded(&raw);
  coded.WriteTag(1 << 3 | 2);  // field 1, length-delimited
  coded.WriteVarint32(static_cast<uint32_t>(service.size()));
  coded.WriteRaw(service.data(), static_cast<int>(service.size()));
  coded.Trim();
  return out;
}

absl::StatusOr<std::string> DecodeHealthCheckResponse(absl::string_view bytes) {
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                           static_cast<int>(bytes.size()));
  uint32_t status = 0;  // absent: UNKNOWN
  bool ok = true;
  while (ok) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) {
      ok = in.ConsumedEntireMessage();
      break;
    }
    ok = tag == (1 << 3 | 0) ? in.ReadVarint32(&status)
                             : google::protobuf::internal::WireFormatLite::SkipField(&in, tag);
  }
  if (!ok) return absl::InternalError("malformed HealthCheckResponse");
  switch (status) {
    case 0:
      return std::string("UNKNOWN");
    case 1:
      return std::string("SERVING");
    case 2:
      return std::string("NOT_SERVING");
    case 3:
      return std::string("SERVICE_UNKNOWN");
  }
  return absl::StrCat("status ", status);
}

absl::StatusOr<std::string> CheckHealth(grpc::GenericStub& stub, grpc::ClientContext* ctx,
                                        absl::string_view service) {
  const std::string request_bytes = EncodeHealthCheckRequest(service);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> l(mu);
                   status = std::move(s);
                   done = true;
                   cv.notify_one();
                 });
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
  }
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("Health.Check: ", status.error_message()));
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("unreadable health response");
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return DecodeHealthCheckResponse(bytes);
}

}  // namespace client
}  // namespace lossd
