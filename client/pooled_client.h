// SPDX-License-Identifier: Apache-2.0
// A client of a pool of lossd replicas: the same calls as LossClient, each sent to the
// replica that holds its state, chosen by rendezvous hashing (client/rendezvous.h) of what
// owns the state: a hosted head, else an accumulator, else a weights name, else the trainer's
// rank (PoolOptions::rank, for stateless calls). Every trainer of a job, C++ or Python, sends
// one key to one replica; losing a replica moves only the keys it held. Never adds anything
// twice: a Compute into an accumulator or a head is never resent to another replica; that
// state's loss is an error that says how to redo it. docs/replica_pool.md has the contract.
//
//   PoolOptions o;
//   o.targets = "dns:///lossd-headless.lossd.svc:50051";   // or "10.0.0.5:50051,10.0.0.6:50051"
//   o.rank = 3;                                              // this trainer's rank
//   auto pool = PooledClient::Create(o);                     // resolves now; INVALID_ARGUMENT
//   (*pool)->PutWeights("w-rank3", w, nullptr);              // a name the trainer chooses
//   ComputeRequest r = ...;  r.weight_handle = "w-rank3";    // the name, not a server handle
//   r.accumulator = "rank3-step-12";
//   (*pool)->Compute(r);                                     // on the accumulator's replica
//
// A replica is lost when a call to it fails and a probe (a TCP connection, then a ServerInfo,
// within PoolOptions::probe_deadline) finds it unreachable, or answering as another server
// instance than the one that held the state (NOT_FOUND for a handle it held is checked so):
// - weights move to the next replica by the same order, uploaded again only from bytes the
//   pool can prove are the ones uploaded (WeightsRetention); otherwise FAILED_PRECONDITION
//   asking for PutWeights again. A Compute with weights and no accumulator or head is
//   stateless, so it is sent again where the weights went;
// - an accumulator's partial sum is lost: ABORTED saying the step must be redone; every call
//   naming it fails so until DropAccumulator. So is a Compute into it cut off (UNAVAILABLE)
//   while its replica answers: it may or may not have been added. One that holds nothing yet
//   (new, or just reset by a fetch) moves quietly with the Compute that found its replica
//   gone, when no other Compute into it is under way;
// - a head's pending step is lost: ABORTED naming the rank that imports the head from its
//   last export (PoolOptions::import_rank); Compute, Step and ExportHead of it fail so until
//   this client's CreateHead, ImportHead or GetHeadInfo finds it again. A pool meeting a head
//   for the first time looks for it along its order, so it finds a head that moved.
// An accumulator or head lost on a replica is placed anew on the replica after it in its
// order, wrapping around (OrderAfterLoss), never on the one that lost it even when it is back
// (restarted): a function of the replica list and the lost replica only, computed alike by
// both clients, so every rank of a job imports and looks for a head in one place whichever
// rank met the loss first. A CreateHead or ImportHead of a head placed on a replica first asks
// that replica's instance: one that restarted lost the head, and the call goes to the home
// after the loss instead of making a second head there. Weights and ranks, which hold nothing
// another process looks for, stay on a replica restarted in place.
// A two-phase log-prob backward (ComputeRequest::ticket) goes to the replica whose forward
// took the ticket (the pool remembers it until ComputeResult::ticket_expires_unix_ms, for the
// newest PoolOptions::tickets_kept), never to another: no other replica holds the ticket. A
// ticket the pool does not know (not taken through it, expired, forgotten) or whose replica is
// gone (unreachable, restarted) is NOT_FOUND naming the ticket and that replica, sent nowhere:
// the caller sends the one-phase call, routed as any other (docs/rl_clients.md).
// Counters (moves, uploads and re-uploads, re-resolutions, losses, calls per replica):
// counters(); each move, re-upload and loss is logged once (PoolOptions::log, else stderr).
#ifndef LOSSD_CLIENT_POOLED_CLIENT_H_
#define LOSSD_CLIENT_POOLED_CLIENT_H_

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/call_queue.h"
#include "client/lossd_client.h"
#include "client/replica_pool.h"

namespace lossd {
namespace client {

// What the pool may upload again when weights must move to another replica.
enum class WeightsRetention {
  // The views given to PutWeights, and a checksum of their bytes taken at upload: before an
  // upload elsewhere the bytes are hashed again and must match (W updated in place does not).
  // The caller keeps that memory alive until DropWeights, PutWeights of the same name, or
  // the pool's end.
  kVerifyCallerMemory,
  kCopy,  // the pool copies W (and the bias) at upload: memory for W's size, always provable
  kNone,  // nothing kept: a move is always an error asking for PutWeights again
};

// Thread-safe: share one among a trainer's threads.
class PooledClient {
 public:
  // INVALID_ARGUMENT naming the field for bad options; UNAVAILABLE when the targets resolve
  // to no replica. Connects lazily.
  static absl::StatusOr<std::unique_ptr<PooledClient>> Create(const PoolOptions& options);
  ~PooledClient();

  // Uploads W (and the bias) under `name` (1..128 bytes) to the name's replica. The result's
  // handle is `name`: give it as ComputeRequest::weight_handle. Putting a name again replaces
  // its weights (and drops the old ones' handles).
  absl::StatusOr<PutWeightsResult> PutWeights(
      const std::string& name, const HostTensor& w, const HostTensor* bias,
      WeightsRetention keep = WeightsRetention::kVerifyCallerMemory, const CallOptions& call = {});
  absl::Status DropWeights(const std::string& name, const CallOptions& call = {});
  // weight_handle, when set, is a PutWeights name. Goes where the head, else the accumulator,
  // else the weights, else RankKey(PoolOptions::rank) lives (weights are uploaded to that
  // replica when a head or accumulator decides). A two-phase backward (ticket set) goes to
  // its forward's replica; with an accumulator, only if the accumulator lives there too (one
  // not placed yet is placed there), else NOT_FOUND before sending (the one-phase call goes to
  // the accumulator).
  absl::StatusOr<ComputeResult> Compute(const ComputeRequest& request,
                                        const CallOptions& call = {});
  // Compute without waiting (pipelined calls, docs/pipelining.md): `done` gets what Compute
  // would have returned (the same routing, retries, moves and errors), on one of the pool's
  // call threads. At most PoolOptions::client.max_in_flight calls run at once; further calls
  // wait in order. The request's views must stay alive and unchanged until `done` runs;
  // `done` must not destroy this pool. A pool destroyed first runs its started calls to their
  // end and answers the others CANCELLED.
  void ComputeAsync(ComputeRequest request, CallOptions call, LossClient::ComputeDone done);
  // The same, as a std::future.
  std::future<absl::StatusOr<ComputeResult>> ComputeAsync(ComputeRequest request,
                                                          CallOptions call = {});
  absl::StatusOr<FetchGradientsResult> FetchGradients(const std::string& accumulator,
                                                      bool reset, const CallOptions& call = {});
  // Forgets the accumulator (also a lost one: the trainer has heard and will redo the step).
  absl::Status DropAccumulator(const std::string& accumulator, const CallOptions& call = {});

  // Hosted heads, on the head's replica. CreateHead and ImportHead go to the next replica
  // when the head's is unreachable (a whole head, idempotent by version: nothing partial).
  // A head served by a head group (HeadInfo::group, learnt from CreateHead, ImportHead,
  // GetHeadInfo or the first call's lookup) has no one replica: rank r's Computes and Steps
  // go to members[HeadGroupMemberOf(r, S)] and nowhere else; a member lost is ABORTED naming
  // it and saying to import the last export into a new group; a member answering that the
  // rank is another's (FAILED_PRECONDITION "go to member") is returned, never resent.
  // CreateHead with request.group.members set creates the head on every member at once
  // (each its index; the members must be this pool's replicas; group.member is ignored) and
  // returns member 0's answer; ImportHead with a group likewise (a new id after a loss).
  // ExportHead of a group's head asks every member at once (member 0 streams it); DropHead
  // drops it on every member; GetHeadInfo learns the group again (after an import into a
  // new group) and asks the member of PoolOptions::rank.
  absl::StatusOr<CreateHeadResult> CreateHead(const CreateHeadRequest& request,
                                              const CallOptions& call = {});
  absl::StatusOr<CreateHeadResult> ImportHead(const HeadExport& exported,
                                              const CallOptions& call = {});
  absl::StatusOr<CreateHeadResult> ImportHead(const HeadExport& exported, const HeadGroup& group,
                                              const CallOptions& call = {});
  absl::StatusOr<StepResult> Step(const StepRequest& request, const CallOptions& call = {});
  absl::StatusOr<HeadExport> ExportHead(const std::string& head,
                                        const ExportHeadOptions& options = {},
                                        const CallOptions& call = {});
  // The same, its bytes handed to `sink` as they come (LossClient::ExportHeadTo).
  absl::StatusOr<HeadExport> ExportHeadTo(
      const std::string& head, const std::function<absl::Status(const HeadExport&)>& on_layout,
      const HeadExportSink& sink, const ExportHeadOptions& options = {},
      const CallOptions& call = {});
  absl::StatusOr<HeadInfo> GetHeadInfo(const std::string& head, const CallOptions& call = {});
  absl::Status DropHead(const std::string& head, const CallOptions& call = {});

  // ServerInfo of the rank's replica (RankKey(PoolOptions::rank); the next one while it is
  // unreachable).
  absl::StatusOr<ServerInfoResult> ServerInfo(const CallOptions& call = {});
  // Every replica's List (the caller's weight handles, accumulators and heads there), or why
  // it did not answer.
  std::map<std::string, absl::StatusOr<std::vector<StateEntry>>> List(
      const CallOptions& call = {});

  PoolCounters counters() const { return pool_->counters(); }
  std::vector<std::string> endpoints() const { return pool_->endpoints(); }
  // The replica `key` (WeightsKey, AccumulatorKey, HeadKey, RankKey) is placed on, "" when
  // none (diagnostics and tests).
  std::string ReplicaOf(const std::string& key) const;
  // The replica a two-phase backward of `ticket` goes to, "" when the pool does not know the
  // ticket (diagnostics and tests), and how many tickets it remembers (expired ones dropped).
  std::string ReplicaOfTicket(const std::string& ticket);
  size_t TicketsRemembered();

 private:
  // Where a key's state is: its replica and that replica's instance when it was placed.
  struct Placement {
    std::string endpoint;  // "" while lost or not placed
    std::string instance;
    std::string previous;  // the replica it was on before it was lost
    bool lost = false;
    std::string why;  // the loss's error message
    // Accumulators: nothing summed since it began or was reset, and the Computes into it
    // under way. Only an empty one moves quietly, and only when no other Compute into it
    // is under way (one may have been added just before its replica went).
    bool empty = true;
    int in_flight = 0;
    // Replicas it was lost on (a two-phase backward's accumulator is not placed there
    // again). Placed anew, it goes by OrderAfterLoss(`previous`).
    std::set<std::string> excluded;
  };
  struct Weights;
  // Where a forward took a ticket: its replica and that replica's instance then.
  struct TicketHome {
    std::string endpoint;
    std::string instance;
    int64_t expires_unix_ms = 0;  // the server's word; 0 (none given) = kept until the cap
  };

  explicit PooledClient(std::unique_ptr<ReplicaPool> pool);

  // The key's replica, or the first by its order when not placed. ABORTED (the loss's
  // message) for a lost key when `refuse_lost`.
  absl::StatusOr<Placement> Route(const std::string& key, bool refuse_lost);
  // Records the key on `endpoint`; a move (counted, logged) when it was elsewhere before.
  // `keep_lost`: a call that began before another thread found the key lost (and succeeded
  // on the lost replica just before it went) leaves the loss standing.
  void Place(const std::string& key, const std::string& endpoint, const std::string& instance,
             const std::string& reason, bool keep_lost = false);
  // Counts a Compute into an accumulator under way (+1) or done (-1; `filled`: it added).
  void Track(const std::string& key, int delta, bool filled);
  // Forgets an empty accumulator's replica (to move it) when this is the only Compute into
  // it under way; false when it holds, or may hold, a sum.
  bool MoveIfEmpty(const std::string& key, const std::string& endpoint);
  // Where a key not placed goes: the first of its order (replicas marked down last), or,
  // after it was lost on `lost_on`, the first of HomeOrder.
  std::string FirstFor(const std::string& key, const std::string& lost_on);
  // OrderAfterLoss(key, the replicas, lost_on), those marked down last, then `lost_on`
  // itself (a pool of one replica places it there again).
  std::vector<std::string> HomeOrder(const std::string& key, const std::string& lost_on);
  // pool_->LostReason; a lost replica takes every weights handle on it along.
  std::optional<std::string> Lost(const std::string& endpoint, const absl::Status& failure,
                                  const std::string& instance);
  // Marks the key lost on `p.endpoint`, counts and logs it, and returns ABORTED `why`.
  absl::Status MarkLost(const std::string& key, const Placement& p, const std::string& why);
  // Why a replica is lost, for messages: "is unreachable" or "restarted (instance ...)".
  std::string LossReason(const std::string& endpoint, const std::string& instance);

  std::shared_ptr<Weights> FindWeights(const std::string& name);
  // The handle of `name`'s weights on `endpoint`, uploading them there (from verified bytes
  // after the first upload) when it has none.
  absl::StatusOr<std::string> WeightsOn(const std::string& name, const std::string& endpoint,
                                        const CallOptions& call);
  void ForgetWeightsOn(const std::string& name, const std::string& endpoint);
  // One Compute on `endpoint`, the weights name swapped for its handle there; a NOT_FOUND
  // for the handle (evicted, restarted server) uploads it again and retries once, which adds
  // nothing twice: the server refused the first before computing.
  // `state_instance`: the instance holding the Compute's accumulator or head, if known.
  absl::StatusOr<ComputeResult> ComputeOn(const std::string& endpoint, const ComputeRequest& r,
                                          const CallOptions& call,
                                          const std::string& state_instance = "");
  absl::StatusOr<ComputeResult> ComputeStateless(const std::string& key, const ComputeRequest& r,
                                                 const CallOptions& call);
  absl::StatusOr<ComputeResult> ComputeInto(const std::string& key, const ComputeRequest& r,
                                            const CallOptions& call);
  // Where a key lost on `p.endpoint` is placed anew.
  std::string NextAfterLoss(const std::string& key, const Placement& p);
  // Names the replica the import goes to: NextAfterLoss.
  std::string HeadLostMessage(const std::string& head, const Placement& p,
                              const std::string& reason);
  std::string AccumulatorLostMessage(const std::string& acc, const std::string& endpoint,
                                     const std::string& reason, const std::string& next);
  // Route for a head: a pool meeting a head for the first time looks for it along the head's
  // order (GetHeadInfo), so a trainer that starts, or first calls, after the head moved finds
  // it where the others moved it; when no replica has it, the first by its order.
  absl::StatusOr<Placement> HeadRoute(const std::string& head, bool refuse_lost,
                                      const CallOptions& call);
  // An export (`run` on the head's replica's client), with a lost replica's error.
  absl::StatusOr<HeadExport> ExportOn(
      const std::string& head, const CallOptions& call,
      const std::function<absl::StatusOr<HeadExport>(LossClient*)>& run);
  // CreateHead or ImportHead: `create` on the head's replica (where it is, else its home),
  // the home after the loss where that replica restarted or is unreachable.
  absl::StatusOr<CreateHeadResult> CreateOrImport(
      const std::string& head,
      const std::function<absl::StatusOr<CreateHeadResult>(LossClient*)>& create,
      const CallOptions& call);

  // Head groups (pooled_groups.cc). A head's group and the server instance each member held
  // it on when this pool heard of it.
  struct GroupRoute {
    HeadGroup group;
    std::vector<std::string> instances;  // by member; "" where not known
  };
  // The head's group: known, or looked for where the head is unplaced (GetHeadInfo along
  // its order; a one-server head found so is placed there). nullopt: not a group's head.
  std::optional<GroupRoute> GroupFor(const std::string& head, const CallOptions& call);
  // Records info.group for `head` (a group's head has no placement); `instances`: every
  // member's, from a create (else kept where the group is the same one).
  GroupRoute LearnGroup(const std::string& head, const HeadInfo& info,
                        std::vector<std::string> instances);
  void ForgetGroup(const std::string& head);
  std::string MemberLostMessage(const std::string& head, const GroupRoute& g, uint32_t m,
                                const std::string& reason);
  // `run` on member m's client. rank >= 0: the rank routed there (a member answering that it
  // is another's is returned with the pool's view). A lost member: ABORTED, counted.
  template <typename T>
  absl::StatusOr<T> OnMember(const std::string& head, const GroupRoute& g, uint32_t m,
                             int64_t rank,
                             const std::function<absl::StatusOr<T>(LossClient*)>& run);
  absl::StatusOr<ComputeResult> ComputeInGroup(const GroupRoute& g, const ComputeRequest& r,
                                               const CallOptions& call);
  absl::StatusOr<StepResult> StepInGroup(const GroupRoute& g, const StepRequest& r,
                                         const CallOptions& call);
  absl::StatusOr<HeadInfo> InfoInGroup(const std::string& head, const CallOptions& call);
  absl::StatusOr<HeadExport> ExportInGroup(
      const std::string& head, const GroupRoute& g, const ExportHeadOptions& options,
      const CallOptions& call,
      const std::function<absl::StatusOr<HeadExport>(LossClient*, const ExportHeadOptions&)>&
          run);
  // `create` on every member at once, each with its own index; member 0's result.
  absl::StatusOr<CreateHeadResult> CreateInGroup(
      const std::string& head, const HeadGroup& group,
      const std::function<absl::StatusOr<CreateHeadResult>(LossClient*, const HeadGroup&)>&
          create);
  absl::Status DropInGroup(const std::string& head, const GroupRoute& g,
                           const CallOptions& call);

  // Two-phase tickets (pooled_tickets.cc). A forward that took one (res.ticket set) on
  // `endpoint` remembers it, within PoolOptions::tickets_kept.
  void NoteTicket(const ComputeResult& res, const std::string& endpoint);
  // The ticket's home; NOT_FOUND (local, naming the ticket and its replica) when unknown,
  // expired, or on a replica marked down.
  absl::StatusOr<TicketHome> TicketRoute(const std::string& ticket);
  void ForgetTicket(const std::string& ticket);
  void DropExpiredTicketsLocked(int64_t now_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NOT_FOUND: the ticket went with its replica (`reason`: unreachable, restarted).
  absl::Status TicketGone(const std::string& ticket, const std::string& endpoint,
                          const std::string& reason);
  // A backward: on the ticket's replica, into an accumulator only where it lives there.
  absl::StatusOr<ComputeResult> ComputeTicket(const ComputeRequest& r, const CallOptions& call);
  absl::Status PlaceAccumulatorAtTicket(const ComputeRequest& r, const TicketHome& home);

  std::unique_ptr<ReplicaPool> pool_;
  mutable absl::Mutex mu_;
  std::map<std::string, Placement> placed_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, GroupRoute> groups_ ABSL_GUARDED_BY(mu_);  // head -> its group
  std::map<std::string, std::shared_ptr<Weights>> weights_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, TicketHome> tickets_ ABSL_GUARDED_BY(mu_);
  // (expiry, ticket) of every entry of tickets_: the first expires first.
  std::set<std::pair<int64_t, std::string>> ticket_expiry_ ABSL_GUARDED_BY(mu_);
  // ComputeAsync's threads; declared last, so destroyed first: its running calls end while
  // the pool and its replicas' clients still exist.
  std::unique_ptr<CallQueue> calls_;
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_POOLED_CLIENT_H_
