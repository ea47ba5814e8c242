// SPDX-License-Identifier: Apache-2.0
#include "client/output_receiver.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client_wire.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it with EINVAL
#endif

namespace lossd {
namespace client {

PagePopulator::PagePopulator(void* data, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
  if (end <= begin || end - begin < (64u << 20)) return;  // small: not worth a thread
  thread_ = std::thread([this, begin, end] {
    constexpr uintptr_t kStep = 16u << 20;
    for (uintptr_t p = begin; p < end && !stop_.load(std::memory_order_relaxed); p += kStep) {
      if (madvise(reinterpret_cast<void*>(p), std::min(kStep, end - p), MADV_POPULATE_WRITE) !=
          0) {
        return;  // unsupported, or out of memory: the receive faults pages in itself
      }
    }
  });
}

PagePopulator::~PagePopulator() {
  stop_.store(true, std::memory_order_relaxed);
  if (thread_.joinable()) thread_.join();
}

void OutputPrefetcher::Add(int32_t id, DType dtype, std::vector<int64_t> shape) {
  absl::StatusOr<size_t> size = TensorByteSize(dtype, shape);
  if (!size.ok() || *size < kMinBytes) return;
  try {
    ready_.push_back({id, HostTensor::Owned(dtype, std::move(shape))});
  } catch (const std::bad_alloc&) {
  }
}

void OutputPrefetcher::Start() {
  if (ready_.empty()) return;
  std::vector<std::pair<uint8_t*, size_t>> spans;
  for (auto& [id, t] : ready_) spans.emplace_back(t.mutable_data(), t.num_bytes());
  toucher_ = std::thread([this, spans] {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&go_));
    }
    for (const auto& [p, n] : spans) {
      for (size_t i = 0; i < n; i += 4096) p[i] = 0;
    }
  });
}

void OutputPrefetcher::Sent() {
  absl::MutexLock lock(&mu_);
  go_ = true;
}

std::optional<HostTensor> OutputPrefetcher::Take(int32_t id, DType dtype,
                                                 const std::vector<int64_t>& shape) {
  for (auto it = ready_.begin(); it != ready_.end(); ++it) {
    if (it->first != id) continue;
    if (it->second.dtype() != dtype || it->second.shape() != shape) return std::nullopt;
    Join();  // the pages are touched before anyone writes the data
    HostTensor t = std::move(it->second);
    ready_.erase(it);
    return t;
  }
  return std::nullopt;
}

void OutputPrefetcher::Join() {
  Sent();  // a call that ends before its inputs are all sent still lets the thread finish
  if (toucher_.joinable()) toucher_.join();
}

absl::Status TensorReceiver::Announce(int32_t id, DType dtype, std::vector<int64_t> shape,
                                      const OutputBuffer* into, OutputPrefetcher* prefetched) {
  for (const Incoming& in : incoming_) {
    if (in.id == id) {
      return absl::InternalError(
          absl::StrCat("server announced output ", TensorIdName(id), " twice"));
    }
  }
  Incoming in;
  in.id = id;
  absl::StatusOr<size_t> size = TensorByteSize(dtype, shape);
  if (!size.ok()) {
    return absl::InternalError(absl::StrCat("server announced output ", TensorIdName(id),
                                            " with a bad shape: ", size.status().message()));
  }
  in.size = *size;
  if (into != nullptr && into->data != nullptr) {
    if (into->capacity < in.size) {
      return absl::InvalidArgumentError(
          absl::StrCat("output_into[", TensorIdName(id), "] holds ", into->capacity,
                       " bytes; the ", ShapeString(dtype, shape), " result needs ", in.size));
    }
    in.tensor = HostTensor::MutableView(dtype, std::move(shape), into->data);
  } else if (std::optional<HostTensor> t = prefetched != nullptr
                                               ? prefetched->Take(id, dtype, shape)
                                               : std::nullopt) {
    in.tensor = std::move(*t);
  } else {
    try {
      in.tensor = HostTensor::Owned(dtype, std::move(shape));
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", in.size, " bytes for output ", TensorIdName(id)));
    }
  }
  incoming_.push_back(std::move(in));
  return absl::OkStatus();
}

absl::Status TensorReceiver::Accept(const wire::StreamFrame& f) {
  Incoming* in = nullptr;
  for (Incoming& i : incoming_) {
    if (i.id == f.tensor()) in = &i;
  }
  if (in == nullptr) {
    return absl::InternalError(absl::StrCat("server sent a part of ", TensorIdName(f.tensor()),
                                            ", which it did not announce"));
  }
  if (f.offset() != in->received) {
    return absl::InternalError(absl::StrCat("parts out of order: ", TensorIdName(in->id),
                                            " part at byte offset ", f.offset(), ", expected ",
                                            in->received));
  }
  if (f.data_size() > in->size - in->received) {
    return absl::DataLossError(absl::StrCat(TensorIdName(in->id), ": part [", f.offset(), ", ",
                                            f.offset() + f.data_size(), ") runs past the ",
                                            in->size, " bytes of ", in->tensor.DebugString()));
  }
  f.CopyDataTo(in->tensor.mutable_data() + in->received);
  in->received += f.data_size();
  bytes_ += f.data_size();
  return absl::OkStatus();
}

absl::Status TensorReceiver::CheckComplete() const {
  for (const Incoming& in : incoming_) {
    if (in.received != in.size) {
      return absl::DataLossError(absl::StrCat("stream ended early: ", TensorIdName(in.id),
                                              " got ", in.received, " of ", in.size, " bytes of ",
                                              in.tensor.DebugString()));
    }
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace lossd
