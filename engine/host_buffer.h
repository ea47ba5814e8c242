// SPDX-License-Identifier: Apache-2.0
// Host byte buffers for requests and responses, drawn from a process-wide pool of recently
// freed buffers of the same size, and from a backend's pinned memory where it has any. Never
// zero-filled (every user overwrites a buffer in full); knows nothing of requests or backends
// beyond the HostMemory it is handed.
#ifndef LOSSD_ENGINE_HOST_BUFFER_H_
#define LOSSD_ENGINE_HOST_BUFFER_H_

#include <cstdint>
#include <memory>

#include "kernels/backend.h"

namespace lossd {

// A host byte buffer that is not zero-filled on allocation (it is overwritten in full).
// Large ones come from and go back to a process-wide pool of recently freed buffers of the
// same size: trainers send the same shapes call after call, and a fresh multi-MiB buffer
// page-faults on every first touch (a 1 GiB W: 262k faults).
struct HostBufferDeleter {
  uint64_t bytes = 0;
  void operator()(uint8_t* p) const;
};
using HostBuffer = std::unique_ptr<uint8_t[], HostBufferDeleter>;
HostBuffer NewHostBuffer(uint64_t bytes);
// Most bytes the pool keeps idle (default 2 GiB); 0 turns it off.
void SetHostBufferPoolBytes(uint64_t bytes);
uint64_t HostBufferPoolIdleBytes();
// Where the pool's new large buffers come from: a backend's pinned memory (the Engine sets
// its backend's), or null for ordinary memory. Buffers already made keep their origin and go
// back to it.
void SetHostBufferMemory(HostMemory* memory);

}  // namespace lossd

#endif  // LOSSD_ENGINE_HOST_BUFFER_H_
