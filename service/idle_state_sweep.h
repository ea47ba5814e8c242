// SPDX-License-Identifier: Apache-2.0
// The idle TTL of server state (--state_idle_ttl): a timer thread that drops weight handles
// and accumulators no call has named for the TTL, whoever owns them, and logs each one. It
// only forgets names: memory a running call holds goes when that call lets go.
#ifndef LOSSD_SERVICE_IDLE_STATE_SWEEP_H_
#define LOSSD_SERVICE_IDLE_STATE_SWEEP_H_

#include <cstddef>
#include <functional>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"

namespace lossd {

class IdleStateSweep {
 public:
  using Log = std::function<void(const std::string& line)>;
  // `ttl` > 0. Sweeps every `period`; zero: a quarter of the TTL, within [10 ms, 30 s], so
  // state goes at most that long after its TTL. `engine` outlives the sweep.
  IdleStateSweep(Engine* engine, absl::Duration ttl, Log log,
                 absl::Duration period = absl::ZeroDuration());
  ~IdleStateSweep();  // stops the thread and waits for it

  // One sweep now, on the caller's thread; returns how many were dropped.
  size_t SweepOnce();

 private:
  Engine* const engine_;
  const absl::Duration ttl_;
  const Log log_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once everything above is set
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_IDLE_STATE_SWEEP_H_
