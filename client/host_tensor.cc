// SPDX-License-Identifier: Apache-2.0
#include "client/host_tensor.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lossd {
namespace client {

absl::StatusOr<size_t> TensorByteSize(DType dtype, const std::vector<int64_t>& shape) {
  size_t bytes = DTypeSize(dtype);
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(dtype)));
  }
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension in shape ", ShapeString(dtype, shape)));
    }
    if (d != 0 && bytes > std::numeric_limits<size_t>::max() / static_cast<size_t>(d)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(dtype, shape), " overflows a byte count"));
    }
    bytes *= static_cast<size_t>(d);
  }
  return bytes;
}

std::string ShapeString(DType dtype, const std::vector<int64_t>& shape) {
  return absl::StrCat(DTypeName(dtype), "[", absl::StrJoin(shape, ", "), "]");
}

HostTensor HostTensor::Owned(DType dtype, std::vector<int64_t> shape) {
  HostTensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.bytes_.resize(t.num_bytes());
  return t;
}

HostTensor HostTensor::FromBytes(DType dtype, std::vector<int64_t> shape, ByteVector bytes) {
  HostTensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.bytes_ = std::move(bytes);
  return t;
}

HostTensor HostTensor::View(DType dtype, std::vector<int64_t> shape, const void* data) {
  HostTensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.view_ = static_cast<const uint8_t*>(data);
  t.view_set_ = true;
  return t;
}

HostTensor HostTensor::MutableView(DType dtype, std::vector<int64_t> shape, void* data) {
  HostTensor t = View(dtype, std::move(shape), data);
  t.mutable_view_ = static_cast<uint8_t*>(data);
  return t;
}

int64_t HostTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

size_t HostTensor::num_bytes() const {
  absl::StatusOr<size_t> bytes = TensorByteSize(dtype_, shape_);
  return bytes.ok() ? *bytes : 0;
}

absl::Status HostTensor::Validate(const std::string& name) const {
  absl::StatusOr<size_t> bytes = TensorByteSize(dtype_, shape_);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", bytes.status().message()));
  }
  if (view_set_) {
    if (view_ == nullptr && *bytes > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": null data for a view of ", DebugString()));
    }
    return absl::OkStatus();
  }
  if (bytes_.size() != *bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": holds ", bytes_.size(), " bytes, its shape ", DebugString(), " needs ", *bytes));
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace lossd
