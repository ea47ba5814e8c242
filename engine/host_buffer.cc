// SPDX-License-Identifier: Apache-2.0
#include "engine/host_buffer.h"

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace lossd {
namespace {

// Idle buffers by exact size, most recently freed last. Only buffers of at least 1 MiB are
// kept: smaller ones are cheap for malloc, which keeps them itself below the mmap threshold.
class HostBufferPool {
 public:
  static HostBufferPool& Get() {
    static HostBufferPool* pool = new HostBufferPool();  // never destroyed: freed at exit
    return *pool;
  }

  uint8_t* Take(uint64_t bytes) {
    if (bytes >= kMinPooled) {
      HostMemory* memory = nullptr;
      {
        absl::MutexLock lock(&mu_);
        auto it = idle_.find(bytes);
        if (it != idle_.end() && !it->second.empty()) {
          uint8_t* p = it->second.back();
          it->second.pop_back();
          idle_bytes_ -= bytes;
          return p;
        }
        // Only what the pool can keep is pinned: pinning and unpinning cost more than a copy
        // saves when the buffer is used once (a 2 GiB gradient snapshot, say).
        if (bytes <= cap_) memory = memory_;
      }
      // Pinning is slow (the pages are faulted in and locked): outside the lock.
      if (memory != nullptr) {
        if (auto* p = static_cast<uint8_t*>(memory->Allocate(bytes)); p != nullptr) {
          absl::MutexLock lock(&mu_);
          owner_[p] = memory;
          return p;
        }
      }
    }
    return new uint8_t[bytes == 0 ? 1 : bytes];
  }

  void SetMemory(HostMemory* memory) {
    absl::MutexLock lock(&mu_);
    memory_ = memory;
  }

  void Give(uint8_t* p, uint64_t bytes) {
    if (bytes >= kMinPooled) {
      absl::MutexLock lock(&mu_);
      // Make room by dropping other sizes first: the sizes in use now are the likely next.
      for (auto it = idle_.begin(); idle_bytes_ + bytes > cap_ && it != idle_.end(); ++it) {
        if (it->first == bytes) continue;
        while (!it->second.empty() && idle_bytes_ + bytes > cap_) {
          ReleaseLocked(it->second.back());
          it->second.pop_back();
          idle_bytes_ -= it->first;
        }
      }
      if (idle_bytes_ + bytes <= cap_) {
        idle_[bytes].push_back(p);
        idle_bytes_ += bytes;
        return;
      }
      ReleaseLocked(p);
      return;
    }
    delete[] p;
  }

  void SetCap(uint64_t cap) {
    absl::MutexLock lock(&mu_);
    cap_ = cap;
    for (auto& [size, list] : idle_) {
      while (!list.empty() && idle_bytes_ > cap_) {
        ReleaseLocked(list.back());
        list.pop_back();
        idle_bytes_ -= size;
      }
    }
  }

  uint64_t idle_bytes() {
    absl::MutexLock lock(&mu_);
    return idle_bytes_;
  }

 private:
  // Back to wherever the buffer came from: its HostMemory, or the heap.
  void ReleaseLocked(uint8_t* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = owner_.find(p);
    if (it == owner_.end()) {
      delete[] p;
      return;
    }
    it->second->Free(p);
    owner_.erase(it);
  }

  static constexpr uint64_t kMinPooled = 1 << 20;
  absl::Mutex mu_;
  HostMemory* memory_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::flat_hash_map<uint8_t*, HostMemory*> owner_ ABSL_GUARDED_BY(mu_);  // pinned buffers
  uint64_t cap_ ABSL_GUARDED_BY(mu_) = 2ull << 30;
  uint64_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, std::vector<uint8_t*>> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void HostBufferDeleter::operator()(uint8_t* p) const { HostBufferPool::Get().Give(p, bytes); }

HostBuffer NewHostBuffer(uint64_t bytes) {
  return HostBuffer(HostBufferPool::Get().Take(bytes), HostBufferDeleter{bytes});
}

void SetHostBufferPoolBytes(uint64_t bytes) { HostBufferPool::Get().SetCap(bytes); }

void SetHostBufferMemory(HostMemory* memory) { HostBufferPool::Get().SetMemory(memory); }

uint64_t HostBufferPoolIdleBytes() { return HostBufferPool::Get().idle_bytes(); }

}  // namespace lossd
