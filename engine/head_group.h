// SPDX-License-Identifier: Apache-2.0
// A head group's communicator: the collectives the S members of one hosted head run at its
// step (reduce-scatter of the summed gradient, all-gather of the new compute copy, a small
// all-reduce for the norm and the step's counts), over fp32 or byte buffers in host memory.
// Never hand-written: the gloo implementation below calls gloo's own algorithms over its TCP
// transport; a CUDA backend's NCCL implementation would sit behind the same interface.
#ifndef LOSSD_ENGINE_HEAD_GROUP_H_
#define LOSSD_ENGINE_HEAD_GROUP_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lossd {

class Backend;

// What CreateHead names for a group: every member's endpoint (as the pool resolves them, in
// the group's order), which one this server is, and an id the creator chooses for this
// group's life (the rendezvous keys live under it, so a member that restarts never rejoins
// an old group by itself). members.size() <= 1 is today's one-server head.
struct HeadGroup {
  std::vector<std::string> members;
  uint32_t member = 0;
  std::string id;
  uint32_t size() const { return members.empty() ? 1 : static_cast<uint32_t>(members.size()); }
  bool operator==(const HeadGroup& o) const {
    return members == o.members && member == o.member && id == o.id;
  }
};

// The member that serves rank `rank`'s Computes and Step: rank % size. Every rank and pool
// computes it alike from HeadInfo; round robin keeps each member's share within one rank of
// the others' for any world size.
inline uint32_t HeadGroupMemberOf(uint32_t rank, uint32_t size) { return rank % size; }
// How many of ranks [0, world_size) member `member` serves.
inline uint32_t HeadGroupRanksOf(uint32_t member, uint32_t size, uint32_t world_size) {
  return world_size / size + (member < world_size % size ? 1 : 0);
}
// Member m's slice [lo, hi) of a tensor of n elements: contiguous blocks, balanced to one
// element, the same on every member.
struct HeadSlice {
  int64_t lo = 0, hi = 0;
  int64_t n() const { return hi - lo; }
};
inline HeadSlice HeadSliceOf(int64_t n, uint32_t member, uint32_t size) {
  return HeadSlice{n * member / size, n * (member + 1) / size};
}

// The members' collectives. Every member calls each collective in the same order; a call
// that does not complete within the communicator's timeout, or that loses a peer's
// connection, fails: UNAVAILABLE naming the collective and what the store tells of the other
// members (those that left the group before, with their reason; those that never arrived;
// or that the store itself cannot be reached). The communicator then aborts: it refuses
// every later call, so a group that failed mid-collective is never reused.
class HeadComm {
 public:
  virtual ~HeadComm() = default;
  virtual uint32_t member() const = 0;
  virtual uint32_t size() const = 0;
  // buf: (n) fp32, the same n on every member. Sums it over the members; afterwards member
  // m's slice HeadSliceOf(n, m, size) of buf holds that slice of the sum (the rest of buf is
  // unspecified).
  virtual absl::Status ReduceScatter(float* buf, int64_t n) = 0;
  // buf: (n) elements of elem_bytes each, the same n on every member; member m's slice
  // HeadSliceOf(n, m, size) holds its part. Afterwards every member's buf holds every part.
  virtual absl::Status AllGather(void* buf, int64_t n, size_t elem_bytes) = 0;
  // values: (k) per member. Afterwards (k * size) values: member 0's, then member 1's, ...,
  // on every member (so a sum over them in member order is the same everywhere, bit for bit).
  virtual absl::StatusOr<std::vector<double>> AllGatherValues(const std::vector<double>& values) = 0;
  virtual absl::Status Barrier() = 0;
  // Refuses every later call (a member failed): the communicator is never used again. Its
  // connections close and `why` is left in the store, so a member that comes to a collective
  // later fails at once and names it.
  virtual void Abort(const std::string& why) = 0;
  // Why it was aborted (the first reason: the collective that failed and the members that
  // never arrived); empty while it works.
  virtual std::string AbortReason() const = 0;
};

// The key/value store the members rendezvous through. Keys are set once and never change.
class HeadGroupStore {
 public:
  virtual ~HeadGroupStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // The key's value once some member has set it; DEADLINE_EXCEEDED after `timeout`.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
  // Whether the key is set now (never waits).
  virtual bool Has(const std::string& key) = 0;
  // Forgets the key (absent: OK).
  virtual absl::Status Delete(const std::string& key) = 0;
};

// A store in this process's memory, shared by the members of a test that run as threads.
class MemoryGroupStore : public HeadGroupStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;
  bool Has(const std::string& key) override;
  absl::Status Delete(const std::string& key) override;
  size_t size();

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

struct GlooOptions {
  // The address this member's gloo TCP device listens on (an ephemeral port; the peers learn
  // it through the store). Must be reachable by every other member.
  std::string hostname = "127.0.0.1";
  // Every collective's (and the rendezvous') limit: a member that does not take part within
  // it fails the collective on every member.
  absl::Duration timeout = absl::Minutes(1);
};

// Forms the communicator of `group` (this server is group.member) through `store`, under
// the key prefix group.id: blocks until every member has joined or options.timeout passed
// (DEADLINE_EXCEEDED naming the members that never joined).
absl::StatusOr<std::shared_ptr<HeadComm>> ConnectGloo(std::shared_ptr<HeadGroupStore> store,
                                                      const HeadGroup& group,
                                                      const GlooOptions& options);

// What forms a group's communicator for buffers in `memory_of`'s memory (null: host memory,
// as an export's gather uses), blocking until every member joined or it gave up. The
// service makes one from its store and transport (ConnectHeadGroup picks the collectives).
using ConnectHeadGroupFn = std::function<absl::StatusOr<std::shared_ptr<HeadComm>>(
    const HeadGroup&, Backend* memory_of)>;

// Forms the communicator of `group` on `backend`'s own collectives (NCCL on the CUDA
// backend; Backend::ConnectComm): member 0 makes the communicator's id and hands it to the
// others through `store` (under group.id), then every member joins, all within `timeout`
// (DEADLINE_EXCEEDED naming the members that never joined). Its collectives take buffers in
// `backend`'s memory (Allocate's), which must outlive the communicator. A group of one
// member forms one too (the same code path as S > 1, with nothing to exchange).
absl::StatusOr<std::shared_ptr<HeadComm>> ConnectBackendComm(Backend& backend,
                                                             std::shared_ptr<HeadGroupStore> store,
                                                             const HeadGroup& group,
                                                             absl::Duration timeout);

// The communicator a head group uses for buffers in `memory_of`'s memory: on the CPU backend
// (its memory is the host's) or for host memory (memory_of null: an export's gather), gloo
// over TCP; on any other backend, that backend's own (ConnectBackendComm).
absl::StatusOr<std::shared_ptr<HeadComm>> ConnectHeadGroup(Backend* memory_of,
                                                           std::shared_ptr<HeadGroupStore> store,
                                                           const HeadGroup& group,
                                                           const GlooOptions& options);

}  // namespace lossd

#endif  // LOSSD_ENGINE_HEAD_GROUP_H_
