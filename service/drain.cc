// SPDX-License-Identifier: Apache-2.0
#include "service/drain.h"

#include <pthread.h>

#include <cerrno>
#include <ctime>

#include "absl/time/clock.h"
#include "service/head_files.h"
#include "service/log.h"

namespace lossd {
namespace {

// The thread that waits for the stop signals (TakeStopSignals' caller).
pthread_t stop_thread;

// Runs only in threads that do not block the signal (those started before TakeStopSignals);
// the waiting thread blocks it, so there it stays pending until the wait takes it.
// pthread_kill is async-signal-safe (POSIX.1-2008, since TC2).
void ForwardStopSignal(int sig) { pthread_kill(stop_thread, sig); }

// Sleeps `grace`, or less where one of `signals` arrives first (an operator who presses
// Ctrl-C twice, or a supervisor that repeats SIGTERM, wants it over). Returns that signal, or
// 0 when the grace ran out.
int WaitGrace(const sigset_t& signals, absl::Duration grace) {
  const absl::Time until = absl::Now() + grace;
  for (absl::Duration left = grace; left > absl::ZeroDuration(); left = until - absl::Now()) {
    const timespec ts = absl::ToTimespec(left);
    const int sig = sigtimedwait(&signals, nullptr, &ts);
    if (sig > 0) return sig;
    if (errno != EINTR) break;  // EAGAIN: the time is up
  }
  return 0;
}

}  // namespace

sigset_t TakeStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  stop_thread = pthread_self();
  struct sigaction forward {};
  forward.sa_handler = ForwardStopSignal;
  sigfillset(&forward.sa_mask);
  forward.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &forward, nullptr);
  sigaction(SIGINT, &forward, nullptr);
  return signals;
}

void ServeUntilSignalled(const sigset_t& signals, LossServer& server, Engine& engine,
                         std::atomic<bool>& ready, const DrainOptions& options) {
  int sig = 0;
  ready = true;
  sigwait(&signals, &sig);
  // Not ready, on every probe, before anything is refused.
  ready = false;
  server.StopServing();
  // The fields in the order they had before --shutdown_grace (log queries match them); the
  // listener closes when the grace is over, which "draining" says, so it has no line of its own.
  Log(LogLevel::kInfo, "draining",
      {{"signal", sig},
       {"drain_seconds", absl::ToInt64Seconds(options.drain)},
       {"shutdown_grace", absl::FormatDuration(options.shutdown_grace)}});
  const absl::Time drain_started = absl::Now();
  if (options.shutdown_grace > absl::ZeroDuration()) {
    if (const int again = WaitGrace(signals, options.shutdown_grace); again != 0) {
      Log(LogLevel::kInfo, "second signal: grace cut short", {{"signal", again}});
    }
  }
  server.Shutdown(options.drain);
  LogSuppressedCalls();
  // After the calls: no Step or Compute can change a head while it is written out.
  if (!options.head_export_dir.empty()) {
    const HeadFilesReport r = ExportHeadsToDir(engine, options.head_export_dir);
    Log(r.failed == 0 ? LogLevel::kInfo : LogLevel::kError, "heads exported",
        {{"dir", options.head_export_dir},
         {"exported", r.done},
         {"failed", r.failed}});
  }
  Log(LogLevel::kInfo, "stopped",
      {{"drained_ms", absl::ToInt64Milliseconds(absl::Now() - drain_started)}});
}

}  // namespace lossd
