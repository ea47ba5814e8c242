// SPDX-License-Identifier: Apache-2.0
// A FIFO of calls run on at most `threads` threads of its own, started as calls come: how
// LossClient::ComputeAsync keeps at most ClientOptions::max_in_flight calls running while the
// caller's thread goes on. Adding a call never blocks; the queue never runs a call twice and
// never drops one without telling it (its `cancel` runs instead).
#ifndef LOSSD_CLIENT_CALL_QUEUE_H_
#define LOSSD_CLIENT_CALL_QUEUE_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace lossd {
namespace client {

class CallQueue {
 public:
  struct Call {
    std::function<void()> run;     // on one of the queue's threads, in the order added
    std::function<void()> cancel;  // instead of run, where the queue goes before it starts
  };

  explicit CallQueue(int threads);
  // Calls not started get their `cancel` (on the destroying thread); those running run to
  // their end, and the threads are joined.
  ~CallQueue();
  CallQueue(const CallQueue&) = delete;
  CallQueue& operator=(const CallQueue&) = delete;

  void Add(Call call);
  int threads() const { return max_threads_; }

 private:
  void Work();

  const int max_threads_;
  absl::Mutex mu_;
  std::deque<Call> queue_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;  // threads waiting for a call
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_CALL_QUEUE_H_
