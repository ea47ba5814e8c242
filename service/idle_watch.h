// SPDX-License-Identifier: Apache-2.0
// Cancels streams on which lossd waits for its client for a while (--stream_idle_timeout):
// nothing arrives, or a response message is not taken. A client that opens a Compute or a
// PutWeights and then stalls, or that stops reading a Compute's or a FetchGradients' results,
// would otherwise hold what the stream was given (its share of the memory budget, its
// weight-cache reservation, its in-flight slot) until its deadline, or for ever without one,
// while other clients queue behind it. Only waiting for the client counts: a stream waiting
// for memory or for the executor is disarmed and has no write in flight.
#ifndef LOSSD_SERVICE_IDLE_WATCH_H_
#define LOSSD_SERVICE_IDLE_WATCH_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lossd {

class IdleWatch {
 public:
  class Entry {
   public:
    // From now lossd waits for the client: the clock starts (again).
    void Arm();
    // lossd waits for itself (memory, the executor, a write) or is done receiving.
    void Disarm() { armed_.store(false, std::memory_order_relaxed); }
    // A message arrived.
    void Touch() { last_ns_.store(Now(), std::memory_order_relaxed); }
    // A response message was handed to gRPC: the client must take it (gRPC completes the
    // write once flow control lets it out) within the timeout, armed or not.
    void WriteStarted() {
      write_since_ns_.store(Now(), std::memory_order_relaxed);
      writing_.store(true, std::memory_order_release);
    }
    // The write completed (or failed); the client took it.
    void WriteDone() { writing_.store(false, std::memory_order_relaxed); }
    // Also counts `other`'s time as activity of this stream (the stripes of one upload: a
    // stripe waiting for its siblings is not idle while they still send). `other` must
    // outlive the entry's Unwatch.
    void Follow(const std::atomic<int64_t>* other) { follow_.store(other); }
    // The watch cancelled this stream.
    bool expired() const { return expired_.load(); }
    // The wait that expired, for the stream's status: "no message from the client for 60s",
    // or "the client took no response message for 60s".
    std::string Reason() const;

    static int64_t Now();

   private:
    friend class IdleWatch;
    explicit Entry(std::function<void()> expire, absl::Duration timeout)
        : expire_(std::move(expire)), timeout_(timeout) {}
    int64_t LastActivity() const;

    const std::function<void()> expire_;
    const absl::Duration timeout_;
    std::atomic<int64_t> last_ns_{Now()};
    std::atomic<bool> armed_{false};
    std::atomic<bool> expired_{false};
    std::atomic<int64_t> write_since_ns_{0};
    std::atomic<bool> writing_{false};
    std::atomic<bool> write_stalled_{false};  // expired for a write the client did not take
    std::atomic<const std::atomic<int64_t>*> follow_{nullptr};
    bool firing_ = false;   // guarded by the watch's mu_
    bool watched_ = true;   // guarded by the watch's mu_
  };

  // timeout <= 0: nothing expires (the thread does not run). `tick`: how often entries are
  // checked (at most a quarter of the timeout).
  explicit IdleWatch(absl::Duration timeout, absl::Duration tick = absl::Seconds(1));
  ~IdleWatch();
  IdleWatch(const IdleWatch&) = delete;
  IdleWatch& operator=(const IdleWatch&) = delete;

  // A new, disarmed entry; `expire` runs once, on the watch's thread, when the entry has been
  // armed and idle for the timeout, or a write of it has been in flight for the timeout (for
  // a gRPC stream: its context's TryCancel).
  std::shared_ptr<Entry> Watch(std::function<void()> expire);
  // Forgets the entry; once it returns, `expire` is not running and never will. Safe from
  // inside `expire` itself (gRPC may run a cancelled call's OnDone inline).
  void Unwatch(const std::shared_ptr<Entry>& e);

  absl::Duration timeout() const { return timeout_; }
  size_t expired_count() const { return expired_count_.load(); }

 private:
  void Loop();

  const absl::Duration timeout_;
  const absl::Duration tick_;
  absl::Mutex mu_;
  absl::CondVar fired_;  // an entry's expire returned
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> expired_count_{0};
  std::thread thread_;
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_IDLE_WATCH_H_
