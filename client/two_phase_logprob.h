// SPDX-License-Identifier: Apache-2.0
// The two-phase log-prob with its fallback, over a LossClient or a PooledClient: Forward
// returns the log-probs and keeps X on the server under a ticket; Backward sends only dlogp
// and dentropy under it, and where the ticket cannot serve sends ONE one-phase call (X, the
// weight, the targets and the upstream gradients) that returns the same outputs, bit for bit.
// Never retries anything else, and never sends a backward twice where it may already have
// added to an accumulator. docs/rl_clients.md has the contract (the C++ form of lossd.rl's).
//
//   TwoPhaseLogprob lp(client.get());                       // or a PooledClient*
//   ComputeRequest call;                                    // the one-phase call, less dlogp
//   call.kind = LossKind::kLogprob;  call.x = ...;  call.weight_handle = "lm_head";
//   call.targets = ...;  call.options.temperature = 0.9f;
//   call.want.entropy = true;  call.want.dx = true;  call.want.dw = false;
//   absl::StatusOr<LogprobForward> f = lp.Forward(call);   // f->result(): logp, entropy
//   ... the loss, from logp and entropy: dlogp, dentropy ...
//   absl::StatusOr<ComputeResult> g = lp.Backward(*f, {dlogp, dentropy});  // dX (dW, db)
//
// The one-phase call stands in (the same outputs; counted in counts(), its reason in
// last_fallback(), the first of each kind logged once through TwoPhaseOptions::log):
// - at Forward, where the server does not list "logprob_two_phase", or will not keep the
//   forward (RESOURCE_EXHAUSTED: its ticket budget is full, or --max_tickets=0; the forward is
//   then sent again keeping nothing, and the forwards of the next pause_after_refusal ask
//   for no ticket), or answers without a ticket: Backward sends X again;
// - at Backward, where the ticket is gone: NOT_FOUND (expired, consumed, unknown; a pool's
//   ticket it cannot route) or FAILED_PRECONDITION (issued by another server instance: a
//   restart, another replica; a head that stepped past the forward's version, which the
//   one-phase call then meets too, and returns);
// - a second Backward of one forward: a ticket serves one backward.
// Any other error comes back as it is.
#ifndef LOSSD_CLIENT_TWO_PHASE_LOGPROB_H_
#define LOSSD_CLIENT_TWO_PHASE_LOGPROB_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/lossd_client.h"

namespace lossd {
namespace client {

class PooledClient;  // client/pooled_client.h

// What a LogprobForward holds to send the one-phase call, should its ticket not serve.
enum class KeepInputs {
  // Views of the request's tensors: no copy, no memory. The caller keeps what the request's
  // tensors view (or the request itself, where its tensors own their bytes) alive and
  // unchanged until the forward's last Backward returns or the LogprobForward is destroyed.
  kCallerMemory,
  // Owned copies of x, the targets, and w and bias where they came inline: BT·H·(x's dtype
  // bytes) + BT·(target bytes), plus V·H (+V) in x's dtype with an inline W, held by the
  // LogprobForward until it is destroyed (64 MiB at BT=8192, H=4096 bf16 by handle or head).
  // For a caller that reuses its buffers before the backward.
  kCopy,
};

struct TwoPhaseOptions {
  // How long the server keeps a forward for its backward (cut to its --ticket_max_ms); 0 =
  // every call one-phase (no ticket asked; Backward sends X again).
  uint32_t keep_ms = 60000;
  KeepInputs keep_inputs = KeepInputs::kCallerMemory;
  // After a server would not keep a forward (RESOURCE_EXHAUSTED), the forwards of this long
  // ask for no ticket: a refusal may come after X arrived, so asking again at once would send
  // most forwards twice while the tickets held are freed by their backwards.
  absl::Duration pause_after_refusal = absl::Seconds(5);
  // Receives one line the first time each kind of fallback happens (a forward not kept, a
  // ticket gone), naming the server's message; null = nothing is logged (counts() and
  // last_fallback() still tell).
  std::function<void(const std::string&)> log;
  // Tests: the clock of pause_after_refusal (null = absl::Now).
  std::function<absl::Time()> now;
};

// What happened, since the helper was made (the names of lossd.rl's two_phase_counts).
struct TwoPhaseCounts {
  uint64_t tickets = 0;    // forwards that took a ticket
  uint64_t not_kept = 0;   // forwards that wanted a ticket and got none (sent one-phase)
  uint64_t two_phase = 0;  // backwards by ticket
  uint64_t gone = 0;       // backwards whose ticket was gone (then sent one-phase)
  uint64_t one_phase = 0;  // backwards that sent X again, for any reason
};

// The upstream gradients of one forward's log-probs and entropy, (BT) fp32 each; at least
// one. Views or owned; alive until Backward returns.
struct LogprobGradients {
  std::optional<HostTensor> dlogp;
  std::optional<HostTensor> dentropy;
};

// One forward's result and what its backward needs: the ticket (if one was kept) and the
// call to send one-phase. Movable, not copyable; used by one thread at a time.
class LogprobForward {
 public:
  LogprobForward(LogprobForward&&) = default;
  LogprobForward& operator=(LogprobForward&&) = default;
  LogprobForward(const LogprobForward&) = delete;
  LogprobForward& operator=(const LogprobForward&) = delete;

  // The forward's reply: kLogp and, when wanted, kEntropy; its ticket when one was kept.
  const ComputeResult& result() const { return result_; }
  ComputeResult& mutable_result() { return result_; }
  // The ticket its next Backward names; "" when none was kept or one Backward used it.
  const std::string& ticket() const { return ticket_; }

 private:
  friend class TwoPhaseLogprob;
  LogprobForward() = default;

  ComputeRequest call_;  // the one-phase call less dlogp/dentropy (views, or owned copies)
  ComputeResult result_;
  std::string ticket_;
  // A Backward by the ticket failed in a way that may hide a success (the reply lost: a
  // deadline, a cut connection): the server may have consumed the ticket and added to the
  // accumulator, so a NOT_FOUND now does not prove that nothing was added.
  absl::Status unsure_;
};

// Thread-safe: share one among a trainer's threads (each LogprobForward used by one at a
// time). The client given outlives the helper.
class TwoPhaseLogprob {
 public:
  explicit TwoPhaseLogprob(LossClient* client, TwoPhaseOptions options = {});
  explicit TwoPhaseLogprob(PooledClient* pool, TwoPhaseOptions options = {});

  // `call` is the whole one-phase call less its upstream gradients: kind logprob, x, the
  // weight (w and bias, weight_handle, or head and head_version), targets, options
  // (temperature, softcap, ignore_index, chunk_rows, grad_scale), grad_dtype, want (entropy
  // for the forward; dx, dw, db for the backward), and for the backward an accumulator or a
  // head's rank and micro_batch, and output_into (kLogp and kEntropy land the forward's,
  // kDx, kDw and kDb the backward's). The forward asks for no gradient and names no
  // accumulator or step key: the backward does. INVALID_ARGUMENT for dlogp, dentropy,
  // keep_ms or ticket set (the helper's), another kind, and for a head
  // where the forward could not be kept (keep_ms 0 in the options, a server without the
  // feature or refusing the keep: a head's forward that keeps nothing would add to its step
  // under the backward's step key); the client's and the server's own refusals as they are.
  absl::StatusOr<LogprobForward> Forward(const ComputeRequest& call, const CallOptions& opts = {});

  // The backward of `forward`: by its ticket, else (the ticket gone, or none kept) the
  // one-phase call. The result holds what the one-phase call returns (logp, entropy when
  // wanted, dx, dw, db as `call.want` asked; dW and db into the accumulator or head's step
  // where one is named). ABORTED, sending nothing, where an earlier Backward of this forward
  // into an accumulator failed unsure (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, UNKNOWN,
  // INTERNAL, DATA_LOSS: the server may have added it before the reply was lost) and no
  // ticket can tell (gone, or a one-phase call failed so): a one-phase call could add the
  // micro-batch twice (redo the step). A head's step key makes its one-phase call safe to
  // send again. A Backward that succeeds ends the doubt; a Backward after a successful one
  // is sent one-phase, and adds again. INVALID_ARGUMENT without dlogp and dentropy.
  absl::StatusOr<ComputeResult> Backward(LogprobForward& forward, const LogprobGradients& grads,
                                         const CallOptions& opts = {});

  TwoPhaseCounts counts() const;
  // Why the latest fallback happened (the server's status, or the helper's for a forward
  // answered without a ticket); OK before any.
  absl::Status last_fallback() const;

 private:
  using ComputeFn =
      std::function<absl::StatusOr<ComputeResult>(const ComputeRequest&, const CallOptions&)>;
  using FeatureFn = std::function<absl::Status(const CallOptions&)>;
  TwoPhaseLogprob(ComputeFn compute, FeatureFn feature, TwoPhaseOptions options);

  absl::Time Now() const { return options_.now ? options_.now() : absl::Now(); }
  // The forward `fwd` asked to keep (unless paused or the server lacks the feature): its
  // reply (with a ticket, or without from a server that ignored keep_ms), or nullopt when
  // nothing was sent or the keep was refused (RESOURCE_EXHAUSTED: the pause begins), with
  // *not_kept saying why. Any other error comes back.
  absl::StatusOr<std::optional<ComputeResult>> TryKeep(ComputeRequest fwd,
                                                       const CallOptions& opts,
                                                       absl::Status* not_kept);
  // Counts `event` (a member of counts_) and, for a fallback, records `why` as the last one
  // and logs it the first time `event` has one.
  void Note(uint64_t TwoPhaseCounts::*event, const absl::Status& why = absl::OkStatus());
  absl::StatusOr<ComputeResult> OnePhase(LogprobForward& forward, const LogprobGradients& grads,
                                         const CallOptions& opts);

  const ComputeFn compute_;
  const FeatureFn feature_;
  const TwoPhaseOptions options_;
  mutable absl::Mutex mu_;
  TwoPhaseCounts counts_ ABSL_GUARDED_BY(mu_);
  absl::Status last_fallback_ ABSL_GUARDED_BY(mu_);
  // Whether a not-kept forward, and a gone ticket, were logged.
  bool logged_not_kept_ ABSL_GUARDED_BY(mu_) = false;
  bool logged_gone_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time paused_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_TWO_PHASE_LOGPROB_H_
