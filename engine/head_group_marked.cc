// SPDX-License-Identifier: Apache-2.0
#include "engine/head_group_marked.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"

namespace lossd {

JoinMarks::JoinMarks(HeadGroupStore& store, const HeadGroup& group)
    : store_(store), group_(group) {}

std::string JoinMarks::Key(uint32_t m) const { return absl::StrCat(group_.id, "/joined/", m); }

void JoinMarks::Mark() { store_.Set(Key(group_.member), "1").IgnoreError(); }  // for messages

void JoinMarks::Clear() { store_.Delete(Key(group_.member)).IgnoreError(); }

std::string JoinMarks::NeverJoined(absl::Duration timeout) const {
  std::vector<std::string> absent;
  for (uint32_t m = 0; m < group_.size(); ++m) {
    if (!store_.Has(Key(m))) absent.push_back(NamedMember(group_, m));
  }
  if (absent.empty()) return "";
  return absl::StrCat(": member", absent.size() > 1 ? "s " : " ", absl::StrJoin(absent, ", "),
                      " never joined within ", absl::FormatDuration(timeout));
}

std::string NamedMember(const HeadGroup& group, uint32_t m) {
  return absl::StrCat(m, " (", group.members[m], ")");
}

MarkedComm::MarkedComm(std::shared_ptr<HeadGroupStore> store, HeadGroup group)
    : store_(std::move(store)), group_(std::move(group)) {}

MarkedComm::~MarkedComm() {
  absl::MutexLock lock(&mu_);
  if (seq_ > 0 && aborted_.empty()) {  // an aborted group's store may be gone with it
    store_->Delete(absl::StrCat(group_.id, "/at/", seq_, "/", member())).IgnoreError();
  }
}

std::string MarkedComm::AbortReason() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

// The reason goes to the store only where it answers (a stalled store would hold this
// member's error for the store call's own deadline).
void MarkedComm::AbortAndTell(const std::string& why, bool store_answers) {
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.empty()) return;
    aborted_ = why;
  }
  CloseTransport();
  if (store_answers) store_->Set(AbortedKey(member()), why).IgnoreError();  // best effort
}

std::string MarkedComm::AbortedKey(uint32_t m) const {
  return absl::StrCat(group_.id, "/aborted/", m);
}

absl::Status MarkedComm::Run(const char* what, const std::function<absl::Status()>& f) {
  uint64_t seq;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "head group '", group_.id, "' was aborted earlier (", aborted_, "); import the "
          "head's last export into a new group"));
    }
    seq = ++seq_;
  }
  const std::string at = absl::StrCat(group_.id, "/at/", seq, "/");
  // Only for the message; a mark that could not be set says the store is gone.
  absl::Status marked = store_->Set(absl::StrCat(at, member()), "1");
  absl::Status s = f();
  if (s.ok()) {
    // Every member took part in this collective, so each had passed the one before: no
    // member can still need this member's mark of it. The store holds O(S) marks, not one
    // per collective run.
    if (seq > 1) {
      store_->Delete(absl::StrCat(group_.id, "/at/", seq - 1, "/", member())).IgnoreError();
    }
    return s;
  }
  bool store_answers = true;
  const std::string why = absl::StrCat(
      "the ", what, " of head group '", group_.id, "' failed on member ", member(), " (",
      group_.members[member()], ")", Who(at, marked, store_answers), ": ", s.message());
  AbortAndTell(why, store_answers);
  return absl::UnavailableError(why);
}

// What the store tells of the other members after a collective failed: those that had left
// the group (a collective of theirs failed earlier: their reason names the member lost),
// those that never arrived at this one, or that the store itself is gone. First it reads
// this member's own mark of this collective: a store that cannot return it (a remote store
// past its call's deadline also says DEADLINE_EXCEEDED) cannot tell who came.
std::string MarkedComm::Who(const std::string& at, absl::Status marked, bool& store_answers) {
  if (marked.ok()) {
    marked = store_->Get(absl::StrCat(at, member()), absl::ZeroDuration()).status();
  }
  if (!marked.ok()) {
    store_answers = false;
    return StoreGone(marked);
  }
  std::vector<std::string> left, absent;
  for (uint32_t m = 0; m < size(); ++m) {
    if (m == member()) continue;
    const std::string name = absl::StrCat(m, " (", group_.members[m], ")");
    absl::StatusOr<std::string> why = store_->Get(AbortedKey(m), absl::ZeroDuration());
    if (why.ok()) {
      left.push_back(absl::StrCat("member ", name, " left the group before (", *why, ")"));
      continue;
    }
    // A key not set reads as DEADLINE_EXCEEDED (Get never waits here); any other error is
    // the store's own.
    absl::StatusOr<std::string> came = why;
    if (absl::IsDeadlineExceeded(why.status())) {
      came = store_->Get(absl::StrCat(at, m), absl::ZeroDuration());
    }
    if (absl::IsDeadlineExceeded(came.status())) {
      absent.push_back(name);
    } else if (!came.ok()) {
      store_answers = false;
      return StoreGone(came.status());
    }
  }
  if (!absent.empty()) {
    left.push_back(absl::StrCat("member", absent.size() > 1 ? "s " : " ",
                                absl::StrJoin(absent, ", "), " never arrived"));
  }
  return left.empty() ? std::string(", every member had arrived")
                      : absl::StrCat(": ", absl::StrJoin(left, "; "));
}

// lossd keeps the store on member 0: when it cannot answer, member 0 is the one lost.
std::string MarkedComm::StoreGone(const absl::Status& s) const {
  return absl::StrCat(": the group's store (member 0, ", group_.members[0], ") cannot be "
                      "reached, so it cannot tell which members arrived: ", s.message());
}

}  // namespace lossd
