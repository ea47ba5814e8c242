// SPDX-License-Identifier: Apache-2.0
// lossd's stop on SIGTERM or SIGINT, in the order a load balancer needs: not ready first
// (/readyz 503, gRPC health NOT_SERVING on every port) while calls are still taken for a
// grace period, so that endpoints drop this server before it refuses anything; then the
// listener closes and the calls in flight finish; then the hosted heads are exported.
// Never exits the process itself.
#ifndef LOSSD_SERVICE_DRAIN_H_
#define LOSSD_SERVICE_DRAIN_H_

#include <signal.h>

#include <atomic>
#include <string>

#include "absl/time/time.h"
#include "engine/engine.h"
#include "service/loss_server.h"

namespace lossd {

struct DrainOptions {
  // NOT_SERVING while still accepting and serving (--shutdown_grace); a second signal cuts it
  // short. Zero: the listener closes at once.
  absl::Duration shutdown_grace = absl::Seconds(5);
  // Then how long calls in flight may finish (--drain_seconds) before they are cancelled.
  absl::Duration drain = absl::Seconds(30);
  // Where the hosted heads are written once the calls are done; empty = nowhere.
  std::string head_export_dir;
};

// Blocks SIGTERM and SIGINT in the calling thread and the threads it starts, for
// ServeUntilSignalled's wait (the drain runs in normal code, not in a handler), and sends one
// that the kernel hands a thread started earlier on to the calling thread: OpenBLAS starts its
// pool when the library loads, before main, with nothing blocked, and a SIGTERM delivered
// there before the wait began ended lossd at once (exit 143, no drain). Call it first in main,
// from the thread that will call ServeUntilSignalled. Returns the set.
sigset_t TakeStopSignals();

// Waits for one of `signals` (TakeStopSignals), then drains as above, logging each step.
// `ready` is what /readyz reports; it turns false first.
void ServeUntilSignalled(const sigset_t& signals, LossServer& server, Engine& engine,
                         std::atomic<bool>& ready, const DrainOptions& options);

}  // namespace lossd

#endif  // LOSSD_SERVICE_DRAIN_H_
