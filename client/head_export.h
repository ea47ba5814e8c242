// SPDX-License-Identifier: Apache-2.0
// ExportHead in the C++ client: a head's tensors streamed in byte ranges of their
// concatenation, each range its own stream, received part by part into a sink (files, caller
// buffers, allocated tensors) so neither the server nor the client needs the whole export in
// one buffer. Checks every range against the wire contract and against the first look (the
// same version and layout). Never retries, never writes to the server.
#ifndef LOSSD_CLIENT_HEAD_EXPORT_H_
#define LOSSD_CLIENT_HEAD_EXPORT_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/head_calls.h"
#include "client/head_types.h"
#include "grpcpp/generic/generic_stub.h"

namespace lossd {
namespace client {

inline constexpr char kExportHeadMethod[] = "/lossd.v1.Loss/ExportHead";

// One export of head `name`; `instance`: the head's server instance ("" = no check).
struct ExportCall {
  std::string name;
  std::string instance;
  uint32_t response_part_bytes = 0;
  ExportHeadOptions options;
};

// A look (the first 4 bytes, the version options.version or the current one) says the
// version and the layout; `on_layout` hears them (a HeadExport without tensors: allocate, open
// files); then ranges of options.range_bytes, one after another, each naming that version and
// announcing the same layout (ABORTED otherwise), hand their bytes to `sink`.
using ExportLayoutFn = std::function<absl::Status(const HeadExport&)>;
absl::StatusOr<HeadExport> RunExport(grpc::GenericStub* stub, const ContextPreparer& prepare,
                                     const ExportCall& call, const ExportLayoutFn& on_layout,
                                     const HeadExportSink& sink);

// RunExport into tensors: caller memory where options.into names it (INVALID_ARGUMENT when
// too small, before any range is fetched), else allocated.
absl::StatusOr<HeadExport> RunExportToTensors(grpc::GenericStub* stub,
                                              const ContextPreparer& prepare,
                                              const ExportCall& call);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_HEAD_EXPORT_H_
