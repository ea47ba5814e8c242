// SPDX-License-Identifier: Apache-2.0
// The host buffer pool: large buffers are reused by size within the cap and come from (and go
// back to) a backend's pinned memory where one is set; small and oversized ones bypass it.
#include "engine/host_buffer.h"

#include <cstdint>
#include <cstring>

#include "gtest/gtest.h"

namespace lossd {
namespace {

// Hands out heap memory and counts what it gave and got back, like a backend's pinned memory.
class CountingHostMemory : public HostMemory {
 public:
  void* Allocate(size_t bytes) override {
    ++allocated;
    return new uint8_t[bytes];
  }
  void Free(void* p) override {
    ++freed;
    delete[] static_cast<uint8_t*>(p);
  }
  int allocated = 0, freed = 0;
};

// Large buffers come from the backend's memory when it has some, cycle through the pool like
// any other, and go back to it (not to the heap) when dropped, even after the memory source
// was switched off; sizes the pool cannot keep, and small ones, never touch it.
TEST(HostBufferPoolTest, LargeBuffersComeFromAndGoBackToTheBackendsHostMemory) {
  CountingHostMemory memory;
  SetHostBufferPoolBytes(8 << 20);
  SetHostBufferMemory(&memory);
  uint8_t* first = nullptr;
  {
    HostBuffer a = NewHostBuffer(3 << 20);
    first = a.get();
    std::memset(a.get(), 0x5A, 3 << 20);  // usable memory
  }
  EXPECT_EQ(memory.allocated, 1);
  EXPECT_EQ(memory.freed, 0) << "kept idle in the pool";
  {
    HostBuffer b = NewHostBuffer(3 << 20);
    EXPECT_EQ(b.get(), first) << "the idle pinned buffer is reused";
    HostBuffer big = NewHostBuffer(9 << 20);  // above the cap: from the heap
    HostBuffer small = NewHostBuffer(1000);    // below 1 MiB: from the heap
  }
  EXPECT_EQ(memory.allocated, 1);
  SetHostBufferMemory(nullptr);
  SetHostBufferPoolBytes(0);  // drops the idle pinned buffer: back to its memory
  EXPECT_EQ(memory.freed, 1);
  {
    HostBuffer c = NewHostBuffer(3 << 20);  // no memory source now: heap
  }
  EXPECT_EQ(memory.allocated, 1);
  SetHostBufferPoolBytes(2ull << 30);
}

TEST(HostBufferPoolTest, AFreedLargeBufferIsReusedForTheSameSizeWithinTheCap) {
  SetHostBufferPoolBytes(8 << 20);
  const uint64_t before = HostBufferPoolIdleBytes();
  uint8_t* first = nullptr;
  {
    HostBuffer a = NewHostBuffer(3 << 20);
    first = a.get();
  }
  EXPECT_EQ(HostBufferPoolIdleBytes(), before + (3 << 20));
  HostBuffer b = NewHostBuffer(3 << 20);
  EXPECT_EQ(b.get(), first) << "the same size must reuse the idle buffer";
  EXPECT_EQ(HostBufferPoolIdleBytes(), before);
  {
    HostBuffer big = NewHostBuffer(9 << 20);  // larger than the cap: never kept
  }
  EXPECT_EQ(HostBufferPoolIdleBytes(), before);
  {
    HostBuffer small = NewHostBuffer(1000);  // small ones are left to malloc
  }
  EXPECT_EQ(HostBufferPoolIdleBytes(), before);
  SetHostBufferPoolBytes(0);
  EXPECT_EQ(HostBufferPoolIdleBytes(), 0u);
  SetHostBufferPoolBytes(2ull << 30);
}

}  // namespace
}  // namespace lossd
