// SPDX-License-Identifier: Apache-2.0
// A FIFO of calls run on at most `threads` threads of its own, started as calls come: how
// LossClient::ComputeAsync keeps at most ClientOptions::max_in_flight calls running while the
// caller's thread goes on. Adding a call never blocks; the queue never runs a call twice and
// never drops one without telling it (its `cancel` runs instead).
#ifndef LOSSD_CLIENT_CALL_QUEUE_H_
#define LOSSD_CLIENT_CALL_QUEUE_H_

#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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

// Runs `call` on one of `queue`'s threads and hands what it returns to `done` there; where the
// queue goes before the call starts, `done` gets CANCELLED saying that `owner` was destroyed
// first. What LossClient::ComputeAsync and PooledClient::ComputeAsync share.
template <typename Result>
void AddCall(CallQueue& queue, std::function<Result()> call,
             std::function<void(Result)> done, const std::string& owner) {
  // Shared: std::function needs a copyable callable, and what the call owns (a request) is
  // not cheap to copy.
  auto fn = std::make_shared<std::function<void(Result)>>(std::move(done));
  CallQueue::Call c;
  c.run = [call = std::move(call), fn] { (*fn)(call()); };
  c.cancel = [fn, owner] {
    (*fn)(absl::CancelledError(
        absl::StrCat("the ", owner, " was destroyed before this ComputeAsync started")));
  };
  queue.Add(std::move(c));
}

// The same, with a std::future for the result.
template <typename Result>
std::future<Result> AddCall(CallQueue& queue, std::function<Result()> call,
                            const std::string& owner) {
  auto promise = std::make_shared<std::promise<Result>>();
  std::future<Result> fut = promise->get_future();
  AddCall<Result>(queue, std::move(call),
                  [promise](Result r) { promise->set_value(std::move(r)); }, owner);
  return fut;
}

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_CALL_QUEUE_H_
