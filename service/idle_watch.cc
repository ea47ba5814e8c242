// SPDX-License-Identifier: Apache-2.0
#include "service/idle_watch.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {

int64_t IdleWatch::Entry::Now() { return absl::GetCurrentTimeNanos(); }

void IdleWatch::Entry::Arm() {
  last_ns_.store(Now(), std::memory_order_relaxed);
  // Release: what the caller set before arming is visible to the expiry (which reads armed_
  // with acquire).
  armed_.store(true, std::memory_order_release);
}

int64_t IdleWatch::Entry::LastActivity() const {
  int64_t t = last_ns_.load(std::memory_order_relaxed);
  if (const std::atomic<int64_t>* f = follow_.load()) {
    t = std::max(t, f->load(std::memory_order_relaxed));
  }
  return t;
}

std::string IdleWatch::Entry::Reason() const {
  if (write_stalled_.load()) {
    return absl::StrCat("the client took no response message for ",
                        absl::FormatDuration(timeout_), " (--stream_idle_timeout)");
  }
  return absl::StrCat("no message from the client for ", absl::FormatDuration(timeout_),
                      " (--stream_idle_timeout)");
}

IdleWatch::IdleWatch(absl::Duration timeout, absl::Duration tick)
    : timeout_(timeout),
      tick_(std::max(absl::Milliseconds(5), std::min(tick, timeout / 4))) {
  if (timeout_ > absl::ZeroDuration()) thread_ = std::thread([this] { Loop(); });
}

IdleWatch::~IdleWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<IdleWatch::Entry> IdleWatch::Watch(std::function<void()> expire) {
  std::shared_ptr<Entry> e(new Entry(std::move(expire), timeout_));
  if (timeout_ <= absl::ZeroDuration()) return e;  // never checked
  absl::MutexLock lock(&mu_);
  entries_.push_back(e);
  return e;
}

void IdleWatch::Unwatch(const std::shared_ptr<Entry>& e) {
  if (e == nullptr) return;
  absl::MutexLock lock(&mu_);
  if (!e->watched_) return;
  e->watched_ = false;
  entries_.erase(std::remove(entries_.begin(), entries_.end(), e), entries_.end());
  // From inside expire_ (on this watch's thread) there is nothing to wait for; from anywhere
  // else, an expire_ already running must return before the caller may free what it uses.
  if (std::this_thread::get_id() == thread_.get_id()) return;
  while (e->firing_) fired_.Wait(&mu_);
}

void IdleWatch::Loop() {
  const int64_t limit = absl::ToInt64Nanoseconds(timeout_);
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), tick_);
    if (stop_) break;
    const int64_t now = Entry::Now();
    std::vector<std::shared_ptr<Entry>> due;
    for (const auto& e : entries_) {
      if (e->expired_.load()) continue;
      const bool idle =
          e->armed_.load(std::memory_order_acquire) && now - e->LastActivity() >= limit;
      // A write the client has not taken: flow control holds it because the client stopped
      // reading (the transport's buffers are full), whatever else the stream is doing.
      const bool stalled = e->writing_.load(std::memory_order_acquire) &&
                           now - e->write_since_ns_.load(std::memory_order_relaxed) >= limit;
      if (idle || stalled) {
        if (!idle) e->write_stalled_.store(true);
        e->expired_.store(true);
        e->firing_ = true;
        due.push_back(e);
      }
    }
    if (due.empty()) continue;
    // Outside the lock: the expiry (a TryCancel) may run the stream's callbacks inline,
    // OnDone's Unwatch among them.
    mu_.Unlock();
    for (const auto& e : due) {
      e->expire_();
      expired_count_.fetch_add(1);
    }
    mu_.Lock();
    for (const auto& e : due) e->firing_ = false;
    fired_.SignalAll();
  }
}

}  // namespace lossd
