// SPDX-License-Identifier: Apache-2.0
// Where the C++ client's received tensors land: buffers prepared ahead of a reply
// (OutputPrefetcher: allocated and paged in while the server computes; PagePopulator: pages
// faulted in on a helper thread), and TensorReceiver, which takes announced tensors part by
// part straight into caller memory or those buffers, checking order and sizes. Never reads a
// message off the wire itself and never copies a part twice.
#ifndef LOSSD_CLIENT_OUTPUT_RECEIVER_H_
#define LOSSD_CLIENT_OUTPUT_RECEIVER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "client/client_types.h"
#include "client/host_tensor.h"
#include "core/dtype.h"
#include "wire/part_codec.h"

namespace lossd {
namespace client {

// Faults in the pages of a freshly allocated receive buffer on a helper thread, front to
// back, ahead of the copies into it. MADV_POPULATE_WRITE maps pages without touching their
// contents, so it is safe while received bytes already land. Without it a 2 GiB gradient
// fetch page-faults inside every receive copy (1.3-1.6 GiB/s against 2.2-2.8 into touched
// memory, bench/RESULTS.md). Where the kernel lacks it, it does nothing.
class PagePopulator {
 public:
  PagePopulator(void* data, size_t bytes);  // `bytes` bytes at `data`
  ~PagePopulator();
  PagePopulator(const PagePopulator&) = delete;
  PagePopulator& operator=(const PagePopulator&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Owned output buffers of the sizes a request implies, allocated when the call starts and
// written once per page on a helper thread once the inputs are sent, while the server
// computes (the client is idle then; touching pages during the upload would compete with it
// for cores), so the received parts land in memory that is already mapped: a fresh 64 MiB
// buffer takes 16k page faults, which otherwise happen inside the receive copy (about 20 ms
// a call on a 2-core machine). Only for outputs without an output_into buffer, of >= 1 MiB.
class OutputPrefetcher {
 public:
  OutputPrefetcher() = default;
  OutputPrefetcher(const OutputPrefetcher&) = delete;
  OutputPrefetcher& operator=(const OutputPrefetcher&) = delete;
  ~OutputPrefetcher() { Join(); }

  static constexpr size_t kMinBytes = 1 << 20;

  // Allocates an output expected as (dtype, shape); nothing when it is small or memory is
  // short (the receiver then allocates as usual).
  void Add(int32_t id, DType dtype, std::vector<int64_t> shape);
  // Touches every page of the buffers added so far on a thread of its own, after Sent().
  void Start();
  // The inputs are sent: touching may begin. Safe from any thread, any number of times.
  void Sent();
  // The buffer prepared for `id` if it has this dtype and shape, else nullopt.
  std::optional<HostTensor> Take(int32_t id, DType dtype, const std::vector<int64_t>& shape);

 private:
  void Join();

  std::vector<std::pair<int32_t, HostTensor>> ready_;
  std::thread toucher_;
  absl::Mutex mu_;
  bool go_ ABSL_GUARDED_BY(mu_) = false;
};

// One announced output tensor being received.
struct Incoming {
  int32_t id = 0;
  HostTensor tensor;
  size_t size = 0;
  size_t received = 0;
};

// Receives announced tensors part by part, straight into their buffers, checking that each
// tensor's parts come in byte order and add up to exactly its size.
class TensorReceiver {
 public:
  // `into` (nullable): caller memory to receive into. Else a buffer from `prefetched`
  // (nullable) when it holds one of this shape, else a new one.
  absl::Status Announce(int32_t id, DType dtype, std::vector<int64_t> shape,
                        const OutputBuffer* into, OutputPrefetcher* prefetched = nullptr);
  // One part (a parsed kPart frame) of an announced tensor.
  absl::Status Accept(const wire::StreamFrame& f);
  // DATA_LOSS unless every announced tensor arrived whole.
  absl::Status CheckComplete() const;

  std::vector<Incoming>& incoming() { return incoming_; }
  uint64_t bytes() const { return bytes_; }

 private:
  std::vector<Incoming> incoming_;
  uint64_t bytes_ = 0;
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_OUTPUT_RECEIVER_H_
