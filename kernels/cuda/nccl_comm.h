// SPDX-License-Identifier: Apache-2.0
// A head group's communicator on NCCL (lossd::BackendComm) for the CUDA backend, with NCCL
// loaded at run time by dlopen: nothing here includes nccl.h or links NCCL, so the plugin
// builds without it and loads, and serves every Compute, on a host without it; only the head
// group calls below fail there, naming the library they looked for. Never aborts the process.
#ifndef LOSSD_KERNELS_CUDA_NCCL_COMM_H_
#define LOSSD_KERNELS_CUDA_NCCL_COMM_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace lossd {
namespace cuda {

// The environment variable naming the NCCL library to dlopen, and the name tried without it
// (the dynamic loader's search path). On a GPU host NCCL comes with torch, in
// site-packages/nvidia/nccl/lib/libnccl.so.2; the operator points LOSSD_NCCL_LIBRARY there.
inline constexpr char kNcclLibraryEnv[] = "LOSSD_NCCL_LIBRARY";
inline constexpr char kNcclDefaultLibrary[] = "libnccl.so.2";

// The file NcclAvailable dlopens: $LOSSD_NCCL_LIBRARY if set and non-empty, else
// libnccl.so.2.
std::string NcclLibraryPath();

// OK when NCCL (2.14 or newer: the non-blocking communicator) loads and has every function
// used here. The library is dlopened once per process and the answer kept: setting the
// variable later changes nothing. FAILED_PRECONDITION naming the path, dlerror (or the
// missing function, or the version found) and the variable to set.
absl::Status NcclAvailable();

// A new communicator id (ncclGetUniqueId, kBackendCommIdBytes bytes): member 0 makes it and
// the others receive it. It names a socket this process listens on while members join.
absl::StatusOr<std::string> NcclNewCommId();

// Joins the communicator `id` names as `rank` of `size`, on CUDA `device`; returns once every
// member has joined. INVALID_ARGUMENT for an id of the wrong size, size 0 or above INT_MAX,
// rank >= size or timeout_ms <= 0; DEADLINE_EXCEEDED when the members have not all joined
// within timeout_ms (the half-formed communicator is aborted); UNAVAILABLE naming NCCL's
// error otherwise. Its collectives (kernels/backend.h) run on a stream of their own, each
// bounded by timeout_ms.
absl::StatusOr<std::unique_ptr<BackendComm>> NcclConnect(int device, const std::string& id,
                                                         uint32_t size, uint32_t rank,
                                                         int64_t timeout_ms);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_NCCL_COMM_H_
