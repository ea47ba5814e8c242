// SPDX-License-Identifier: Apache-2.0
// What every head-group communicator does around its collectives, whatever carries them
// (gloo over TCP, a backend's NCCL): each member marks its arrival at each collective in the
// group's store, so a failure can name the members that never came or that left before; a
// failed collective aborts the communicator, leaves its reason in the store for the members
// that come later, and refuses every later call. Internal to the engine's head groups.
#ifndef LOSSD_ENGINE_HEAD_GROUP_MARKED_H_
#define LOSSD_ENGINE_HEAD_GROUP_MARKED_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/head_group.h"

namespace lossd {

// A member's join mark while it forms a group's communicator (gloo's or the backend's): set
// before it waits for the others, cleared once formed; kept after a failure, so the members
// that failed can name the ones that never came.
class JoinMarks {
 public:
  JoinMarks(HeadGroupStore& store, const HeadGroup& group);
  void Mark();
  void Clear();
  // ": member 2 (host:port) never joined within 30s" (members ... for several), or "" where
  // every member marked its join.
  std::string NeverJoined(absl::Duration timeout) const;

 private:
  std::string Key(uint32_t m) const;

  HeadGroupStore& store_;
  const HeadGroup& group_;
};

// "2 (host:port)": member m and its address, as messages name a member.
std::string NamedMember(const HeadGroup& group, uint32_t m);

class MarkedComm : public HeadComm {
 public:
  MarkedComm(std::shared_ptr<HeadGroupStore> store, HeadGroup group);
  // The last collective's arrival mark: no member needs it once this one is gone.
  ~MarkedComm() override;

  uint32_t member() const override { return group_.member; }
  uint32_t size() const override { return group_.size(); }
  // Publishes the reason for the members that come to a collective later (they read it from
  // the store and name it), and closes this member's transport: whatever failed (a timeout,
  // a peer's closed connection, a transport error), a member that comes later must fail at
  // once, never wait out the timeout on a transport this member no longer serves.
  void Abort(const std::string& why) override { AbortAndTell(why, /*store_answers=*/true); }
  std::string AbortReason() const override;

 protected:
  // Runs one collective `what` (e.g. "barrier"): refused once aborted; each member first
  // marks its arrival in the store (key <id>/at/<seq>/<member>). A failure of f (its status'
  // message says what the transport saw) aborts the communicator and comes back UNAVAILABLE
  // naming the collective, this member and what the store tells of the others.
  absl::Status Run(const char* what, const std::function<absl::Status()>& f);
  // Closes the transport, once, on the first Abort (from any thread, maybe while f runs).
  virtual void CloseTransport() = 0;
  const HeadGroup& group() const { return group_; }

 private:
  void AbortAndTell(const std::string& why, bool store_answers);
  std::string AbortedKey(uint32_t m) const;
  std::string Who(const std::string& at, absl::Status marked, bool& store_answers);
  std::string StoreGone(const absl::Status& s) const;

  std::shared_ptr<HeadGroupStore> store_;
  const HeadGroup group_;
  mutable absl::Mutex mu_;
  std::string aborted_ ABSL_GUARDED_BY(mu_);
  uint64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_HEAD_GROUP_MARKED_H_
