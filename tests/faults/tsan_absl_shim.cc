// SPDX-License-Identifier: Apache-2.0
// ThreadSanitizer support for the system's Abseil (built without TSan): interposes the
// out-of-line absl::Mutex / CondVar / Notification entry points, calls the real ones and tells
// TSan about the happens-before edges they create (release before unlocking or waiting,
// acquire after locking or waking). Without it TSan cannot see absl::Mutex at all and reports
// every mutex-protected member as a race. Linked into every binary only by --config=tsan
// (--custom_malloc), with -rdynamic so that gRPC's own calls reach it too. Also carries the
// suppressions (tests/faults/tsan.supp, races inside uninstrumented system libraries only).
// Never part of a production binary.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "tests/faults/tsan_shim_util.h"

namespace {

// The real function of `mangled` in the next object (libabsl_synchronization.so).
template <typename F>
F Real(const char* mangled) {
  return lossd_tsan::RealSymbol<F>("tsan_absl_shim", mangled);
}

#define LOSSD_ABSL_SYM(name) "_ZN4absl7debian3" name
#define LOSSD_ABSL_CSYM(name) "_ZNK4absl7debian3" name

// Memory accesses inside the real calls are not reported: absl evaluates Conditions (our code)
// there, in whichever thread holds or hands over the lock, which is synchronised by absl
// itself but falls outside the acquire/release pair this shim can place around the call.
struct IgnoreAccesses {
  IgnoreAccesses() { __tsan_ignore_thread_begin(); }
  ~IgnoreAccesses() { __tsan_ignore_thread_end(); }
};

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static auto real = Real<void (*)(Mutex*)>(LOSSD_ABSL_SYM("5Mutex4LockEv"));
  {
    IgnoreAccesses ignore;
    real(this);
  }
  __tsan_acquire(this);
}

void Mutex::Unlock() {
  static auto real = Real<void (*)(Mutex*)>(LOSSD_ABSL_SYM("5Mutex6UnlockEv"));
  __tsan_release(this);
  {
    IgnoreAccesses ignore;
    real(this);
  }
}

bool Mutex::TryLock() {
  static auto real = Real<bool (*)(Mutex*)>(LOSSD_ABSL_SYM("5Mutex7TryLockEv"));
  bool locked;
  {
    IgnoreAccesses ignore;
    locked = real(this);
  }
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::ReaderLock() {
  static auto real = Real<void (*)(Mutex*)>(LOSSD_ABSL_SYM("5Mutex10ReaderLockEv"));
  {
    IgnoreAccesses ignore;
    real(this);
  }
  __tsan_acquire(this);
}

void Mutex::ReaderUnlock() {
  static auto real = Real<void (*)(Mutex*)>(LOSSD_ABSL_SYM("5Mutex12ReaderUnlockEv"));
  __tsan_release(this);
  {
    IgnoreAccesses ignore;
    real(this);
  }
}

void Mutex::LockWhen(const Condition& cond) {
  static auto real =
      Real<void (*)(Mutex*, const Condition&)>(LOSSD_ABSL_SYM("5Mutex8LockWhenERKNS0_9ConditionE"));
  {
    IgnoreAccesses ignore;
    real(this, cond);
  }
  __tsan_acquire(this);
}

void Mutex::Await(const Condition& cond) {
  static auto real =
      Real<void (*)(Mutex*, const Condition&)>(LOSSD_ABSL_SYM("5Mutex5AwaitERKNS0_9ConditionE"));
  __tsan_release(this);
  {
    IgnoreAccesses ignore;
    real(this, cond);
  }
  __tsan_acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      LOSSD_ABSL_SYM("5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  __tsan_release(this);
  bool r;
  {
    IgnoreAccesses ignore;
    r = real(this, cond, timeout);
  }
  __tsan_acquire(this);
  return r;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      LOSSD_ABSL_SYM("5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  __tsan_release(this);
  bool r;
  {
    IgnoreAccesses ignore;
    r = real(this, cond, deadline);
  }
  __tsan_acquire(this);
  return r;
}

void CondVar::Wait(Mutex* mu) {
  static auto real = Real<void (*)(CondVar*, Mutex*)>(LOSSD_ABSL_SYM("7CondVar4WaitEPNS0_5MutexE"));
  __tsan_release(mu);
  {
    IgnoreAccesses ignore;
    real(this, mu);
  }
  __tsan_acquire(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  static auto real = Real<bool (*)(CondVar*, Mutex*, absl::Duration)>(
      LOSSD_ABSL_SYM("7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE"));
  __tsan_release(mu);
  bool r;
  {
    IgnoreAccesses ignore;
    r = real(this, mu, timeout);
  }
  __tsan_acquire(mu);
  return r;
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  static auto real = Real<bool (*)(CondVar*, Mutex*, absl::Time)>(
      LOSSD_ABSL_SYM("7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE"));
  __tsan_release(mu);
  bool r;
  {
    IgnoreAccesses ignore;
    r = real(this, mu, deadline);
  }
  __tsan_acquire(mu);
  return r;
}

void Notification::Notify() {
  static auto real = Real<void (*)(Notification*)>(LOSSD_ABSL_SYM("12Notification6NotifyEv"));
  __tsan_release(this);
  {
    IgnoreAccesses ignore;
    real(this);
  }
}

void Notification::WaitForNotification() const {
  static auto real = Real<void (*)(const Notification*)>(
      LOSSD_ABSL_CSYM("12Notification19WaitForNotificationEv"));
  {
    IgnoreAccesses ignore;
    real(this);
  }
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(absl::Duration timeout) const {
  static auto real = Real<bool (*)(const Notification*, absl::Duration)>(
      LOSSD_ABSL_CSYM("12Notification30WaitForNotificationWithTimeoutENS0_8DurationE"));
  bool r;
  {
    IgnoreAccesses ignore;
    r = real(this, timeout);
  }
  if (r) __tsan_acquire(const_cast<Notification*>(this));
  return r;
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  static auto real = Real<bool (*)(const Notification*, absl::Time)>(
      LOSSD_ABSL_CSYM("12Notification31WaitForNotificationWithDeadlineENS0_4TimeE"));
  bool r;
  {
    IgnoreAccesses ignore;
    r = real(this, deadline);
  }
  if (r) __tsan_acquire(const_cast<Notification*>(this));
  return r;
}

ABSL_NAMESPACE_END
}  // namespace absl

// Suppressions: only races whose stacks lie inside uninstrumented system libraries.
extern "C" const char* __tsan_default_suppressions() {
  return
#include "tests/faults/tsan_supp.inc"
      ;
}
