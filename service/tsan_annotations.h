// SPDX-License-Identifier: Apache-2.0
// Happens-before annotations for ThreadSanitizer at hand-offs whose ordering is made inside an
// uninstrumented system library (e.g. gRPC runs a reactor's OnDone only after every other
// reaction has returned, but may run OnCancel from its own uninstrumented code). They only
// tell TSan about an ordering that already exists; they never synchronise anything, and
// compile to nothing unless the build uses TSan.
#ifndef LOSSD_SERVICE_TSAN_ANNOTATIONS_H_
#define LOSSD_SERVICE_TSAN_ANNOTATIONS_H_

#if defined(__SANITIZE_THREAD__)
#define LOSSD_TSAN_ENABLED 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LOSSD_TSAN_ENABLED 1
#endif
#endif

#ifdef LOSSD_TSAN_ENABLED

#include <sanitizer/tsan_interface.h>

namespace lossd {
namespace tsan_internal {

// Releases on `addr` when the scope ends, on every return path.
class ReleaseOnExit {
 public:
  explicit ReleaseOnExit(void* addr) : addr_(addr) {}
  ~ReleaseOnExit() { __tsan_release(addr_); }
  ReleaseOnExit(const ReleaseOnExit&) = delete;
  ReleaseOnExit& operator=(const ReleaseOnExit&) = delete;

 private:
  void* const addr_;
};

}  // namespace tsan_internal
}  // namespace lossd

// Everything this thread did so far happens before whatever follows a later
// LOSSD_TSAN_ACQUIRE(addr) on another thread.
#define LOSSD_TSAN_RELEASE(addr) __tsan_release(static_cast<void*>(addr))
#define LOSSD_TSAN_ACQUIRE(addr) __tsan_acquire(static_cast<void*>(addr))
// LOSSD_TSAN_RELEASE(addr) when the enclosing scope ends.
#define LOSSD_TSAN_RELEASE_ON_EXIT(addr) \
  ::lossd::tsan_internal::ReleaseOnExit lossd_tsan_release_on_exit_(static_cast<void*>(addr))

#else  // !LOSSD_TSAN_ENABLED

#define LOSSD_TSAN_RELEASE(addr) static_cast<void>(0)
#define LOSSD_TSAN_ACQUIRE(addr) static_cast<void>(0)
#define LOSSD_TSAN_RELEASE_ON_EXIT(addr) static_cast<void>(0)

#endif  // LOSSD_TSAN_ENABLED

#endif  // LOSSD_SERVICE_TSAN_ANNOTATIONS_H_
