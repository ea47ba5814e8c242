// SPDX-License-Identifier: Apache-2.0
// Reads and writes NumPy .npy files (format versions 1.0, 2.0 and 3.0, C order, little-endian)
// as HostTensors. Never reads Fortran-order or big-endian data; converts element types only in
// one case: float64 ('<f8', NumPy's default float) is read as fp32, rounded to nearest, and a
// finite value beyond fp32's range is refused. Nothing is ever written as float64.
//
// dtype <-> descr: fp16 '<f2', fp32 '<f4', int32 '<i4', int64 '<i8'. NumPy has no bfloat16,
// so bf16 tensors are written as '<u2' (the raw bf16 bit patterns): in Python,
// `torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)` or `ml_dtypes.bfloat16` views
// recover them. lossd has no uint16 type, so reading '<u2' (or 2-byte raw '|V2', as
// ml_dtypes' bfloat16 arrays are saved) always gives bf16.
#ifndef LOSSD_CLIENT_NPY_H_
#define LOSSD_CLIENT_NPY_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/host_tensor.h"

namespace lossd {
namespace client {

// The descr string written for a dtype ("<f4", ...).
absl::string_view NpyDescr(DType dtype);

// The whole .npy file for a tensor, as bytes (header + data).
std::string EncodeNpy(const HostTensor& tensor);
// The header alone (magic, version, length, dict, padding to a multiple of 64 bytes).
std::string EncodeNpyHeader(DType dtype, const std::vector<int64_t>& shape);

// Parses a .npy file held in memory into an owning tensor. INVALID_ARGUMENT (naming what is
// wrong) for a bad magic, an unknown version, a malformed header, an unsupported descr, Fortran
// order, or a data size that differs from the shape's.
absl::StatusOr<HostTensor> DecodeNpy(absl::string_view file_bytes);

// File versions: the data moves straight between the file and the tensor's storage.
// NOT_FOUND / PERMISSION_DENIED etc. for I/O errors, INVALID_ARGUMENT for malformed files.
absl::StatusOr<HostTensor> ReadNpy(const std::string& path);
absl::Status WriteNpy(const std::string& path, const HostTensor& tensor);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_NPY_H_
