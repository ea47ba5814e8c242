// SPDX-License-Identifier: Apache-2.0
// A plain host tensor for the lossd client: a dtype, a shape, and either owned bytes or a view
// of caller memory. Never talks to the network, never converts dtypes, never copies a view.
#ifndef LOSSD_CLIENT_HOST_TENSOR_H_
#define LOSSD_CLIENT_HOST_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace lossd {
namespace client {

// An allocator that leaves new elements uninitialised. Gradient buffers of several GiB are
// written exactly once by the receiver; zero-filling them first would double the memory
// traffic of a download.
template <typename T>
class DefaultInitAllocator : public std::allocator<T> {
 public:
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() noexcept = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}  // NOLINT(runtime/explicit)

  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// Owned tensor storage: a std::vector of bytes whose resize() does not zero-fill.
using ByteVector = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;

// Bytes of a dense tensor of this dtype and shape; INVALID_ARGUMENT for a negative dimension or
// a size that overflows.
absl::StatusOr<size_t> TensorByteSize(DType dtype, const std::vector<int64_t>& shape);

// "bf16[8, 16]".
std::string ShapeString(DType dtype, const std::vector<int64_t>& shape);

// A dense row-major little-endian tensor in host memory. Owning tensors hold a ByteVector;
// views point at caller memory, which must hold num_bytes() bytes and outlive every use of the
// view (for a request: until the call returns). Copying an owning tensor copies its bytes;
// copying a view copies the pointer.
class HostTensor {
 public:
  HostTensor() = default;

  // An owning tensor with uninitialised bytes. An invalid shape gives an empty buffer that
  // Validate() reports.
  static HostTensor Owned(DType dtype, std::vector<int64_t> shape);
  // An owning tensor that takes `bytes`; Validate() checks the size against the shape.
  static HostTensor FromBytes(DType dtype, std::vector<int64_t> shape, ByteVector bytes);
  // Views of caller memory, no copy: `data` holds the tensor, row-major, little-endian.
  static HostTensor View(DType dtype, std::vector<int64_t> shape, const void* data);
  static HostTensor MutableView(DType dtype, std::vector<int64_t> shape, void* data);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_[i]; }
  size_t rank() const { return shape_.size(); }
  int64_t num_elements() const;
  // Bytes the shape implies (0 for an invalid shape).
  size_t num_bytes() const;

  bool is_view() const { return view_set_; }
  const uint8_t* data() const { return view_set_ ? view_ : bytes_.data(); }
  // Null for a read-only view.
  uint8_t* mutable_data() { return view_set_ ? mutable_view_ : bytes_.data(); }
  template <typename T>
  const T* data_as() const {
    return reinterpret_cast<const T*>(data());
  }
  template <typename T>
  T* mutable_data_as() {
    return reinterpret_cast<T*>(mutable_data());
  }

  // OK when the shape is valid and the storage holds exactly num_bytes() (a view: non-null
  // whenever num_bytes() > 0). `name` goes into the message.
  absl::Status Validate(const std::string& name) const;

  std::string DebugString() const { return ShapeString(dtype_, shape_); }

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  ByteVector bytes_;
  const uint8_t* view_ = nullptr;
  uint8_t* mutable_view_ = nullptr;
  bool view_set_ = false;
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_HOST_TENSOR_H_
