// SPDX-License-Identifier: Apache-2.0
// The gloo communicator of a head group: gloo's reduce-scatter (halving-doubling), allgather
// and allgatherv, and barrier over its TCP transport, rendezvous through a HeadGroupStore.
// gloo reports failures by throwing; every call is caught here and becomes a Status.
#include "engine/head_group.h"

#include <chrono>
#include <csignal>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "engine/head_group_marked.h"
#include "gloo/allgather.h"
#include "gloo/allgatherv.h"
#include "gloo/barrier.h"
#include "gloo/reduce_scatter.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace lossd {

absl::Status MemoryGroupStore::Set(const std::string& key, const std::string& value) {
  absl::MutexLock lock(&mu_);
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> MemoryGroupStore::Get(const std::string& key,
                                                  absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto has = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return values_.count(key) > 0; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&has), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("no member set '", key, "' within ",
                                                    absl::FormatDuration(timeout)));
  }
  return values_[key];
}

bool MemoryGroupStore::Has(const std::string& key) {
  absl::MutexLock lock(&mu_);
  return values_.count(key) > 0;
}

absl::Status MemoryGroupStore::Delete(const std::string& key) {
  absl::MutexLock lock(&mu_);
  values_.erase(key);
  return absl::OkStatus();
}

size_t MemoryGroupStore::size() {
  absl::MutexLock lock(&mu_);
  return values_.size();
}

namespace {

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// gloo's view of a HeadGroupStore, under the group's key prefix. gloo expects a failed
// wait to throw; connectFullMesh passes the exception up to ConnectGloo, which catches it.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<HeadGroupStore> store, std::string prefix, absl::Duration timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_->Set(prefix_ + key, std::string(data.begin(), data.end()));
    if (!s.ok()) throw std::runtime_error(std::string(s.message()));
    set_.push_back(prefix_ + key);
  }
  // The keys this member set (its addresses), for ForgetKeys.
  const std::vector<std::string>& keys_set() const { return set_; }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> v = store_->Get(prefix_ + key, timeout_);
    if (!v.ok()) throw std::runtime_error(std::string(v.status().message()));
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, Millis(timeout_)); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const absl::Time end = absl::Now() + absl::Milliseconds(timeout.count());
    for (const std::string& k : keys) {
      absl::StatusOr<std::string> v = store_->Get(prefix_ + k, end - absl::Now());
      if (!v.ok()) throw std::runtime_error(std::string(v.status().message()));
    }
  }

 private:
  std::shared_ptr<HeadGroupStore> store_;
  const std::string prefix_;
  const absl::Duration timeout_;
  std::vector<std::string> set_;
};

// Deletes this member's rendezvous keys, once every member has read them (the group formed
// and passed a barrier) or the forming failed: an export forms a communicator under the same
// prefix again when it is retried, and must not find the addresses of a failed attempt.
// (The joined mark stays after a failure: the other members name who never joined by it.)
void ForgetKeys(HeadGroupStore& store, const StoreAdapter& adapter) {
  for (const std::string& k : adapter.keys_set()) store.Delete(k).IgnoreError();
}

class GlooComm : public MarkedComm {
  using Ctx = std::shared_ptr<gloo::Context>;

 public:
  GlooComm(std::shared_ptr<gloo::Context> ctx, std::shared_ptr<HeadGroupStore> store,
           HeadGroup group)
      : MarkedComm(std::move(store), std::move(group)), ctx_(std::move(ctx)) {}

  absl::Status ReduceScatter(float* buf, int64_t n) override {
    if (n >= (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a head group reduces tensors of fewer than 2^31 elements (gloo's counts are int), "
          "got ", n));
    }
    std::vector<int> counts(size());
    for (uint32_t m = 0; m < size(); ++m) counts[m] = HeadSliceOf(n, m, size()).n();
    return Gloo("reduce-scatter of the summed gradient", [&](const Ctx& ctx) {
      gloo::ReduceScatterHalvingDoubling<float> rs(ctx, {buf}, static_cast<int>(n), counts);
      rs.run();
      // gloo leaves this member's slice at the front of buf; the head keeps slices in place.
      const HeadSlice s = HeadSliceOf(n, member(), size());
      if (s.lo != 0) std::memmove(buf + s.lo, buf, s.n() * sizeof(float));
    });
  }

  absl::Status AllGather(void* buf, int64_t n, size_t elem_bytes) override {
    std::vector<size_t> bytes(size());
    for (uint32_t m = 0; m < size(); ++m) bytes[m] = HeadSliceOf(n, m, size()).n() * elem_bytes;
    const HeadSlice s = HeadSliceOf(n, member(), size());
    uint8_t* out = static_cast<uint8_t*>(buf);
    // gloo copies its input into the output: a separate input, so the two never overlap.
    std::vector<uint8_t> mine(out + s.lo * elem_bytes, out + s.hi * elem_bytes);
    return Gloo("all-gather of the new compute copy", [&](const Ctx& ctx) {
      gloo::AllgathervOptions o(ctx);
      o.setInput<uint8_t>(mine.data(), mine.size());
      o.setOutput<uint8_t>(out, bytes);
      gloo::allgatherv(o);
    });
  }

  absl::StatusOr<std::vector<double>> AllGatherValues(
      const std::vector<double>& values) override {
    std::vector<double> in = values, out(values.size() * size());
    absl::Status s = Gloo("all-gather of the step's arguments and norms", [&](const Ctx& ctx) {
      gloo::AllgatherOptions o(ctx);
      o.setInput<double>(in.data(), in.size());
      o.setOutput<double>(out.data(), out.size());
      gloo::allgather(o);
    });
    if (!s.ok()) return s;
    return out;
  }

  absl::Status Barrier() override {
    return Gloo("barrier", [&](const Ctx& ctx) {
      gloo::BarrierOptions o(ctx);
      gloo::barrier(o);
    });
  }

 private:
  // Closes every connection of this member (a collective running on another thread keeps
  // its own reference until it returns).
  void CloseTransport() override {
    Ctx closing;
    absl::MutexLock lock(&mu_);
    closing.swap(ctx_);
  }

  // One gloo collective under MarkedComm::Run. op runs on its own reference to the context:
  // an Abort elsewhere closes it only after. gloo reports failures by throwing; the
  // reference is dropped before Run names who failed, so the peers see the connections
  // close at once.
  absl::Status Gloo(const char* what, const std::function<void(const Ctx&)>& op) {
    return Run(what, [&]() -> absl::Status {
      Ctx ctx;
      {
        absl::MutexLock lock(&mu_);
        ctx = ctx_;
      }
      if (ctx == nullptr) return absl::FailedPreconditionError("the communicator was closed");
      try {
        op(ctx);
        return absl::OkStatus();
      } catch (const std::exception& e) {
        ctx.reset();
        return absl::UnavailableError(e.what());
      }
    });
  }

  absl::Mutex mu_;
  Ctx ctx_ ABSL_GUARDED_BY(mu_);  // null once aborted
};

}  // namespace

absl::StatusOr<std::shared_ptr<HeadComm>> ConnectGloo(std::shared_ptr<HeadGroupStore> store,
                                                      const HeadGroup& group,
                                                      const GlooOptions& options) {
  // gloo's TCP transport writes to its sockets without MSG_NOSIGNAL: a peer that closed
  // its connections mid-collective (a member lost, or one that left) would raise SIGPIPE and
  // kill this member instead of failing the collective with EPIPE, which names who was lost.
  static std::once_flag ignore_sigpipe;
  std::call_once(ignore_sigpipe, [] { std::signal(SIGPIPE, SIG_IGN); });
  const uint32_t size = group.size();
  if (group.members.size() < 2 || group.member >= size || group.id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a head group needs 2 or more members, this server's index among them and an id; got ",
        group.members.size(), " members, member ", group.member, ", id '", group.id, "'"));
  }
  JoinMarks joins(*store, group);
  StoreAdapter adapter(store, absl::StrCat(group.id, "/gloo/"), options.timeout);
  try {
    gloo::transport::tcp::attr attr(options.hostname.c_str());
    std::shared_ptr<gloo::transport::Device> dev = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(static_cast<int>(group.member),
                                                           static_cast<int>(size));
    ctx->setTimeout(Millis(options.timeout));
    joins.Mark();
    ctx->connectFullMesh(adapter, dev);
    // A member returns from connectFullMesh once its own pairs are connected, which a peer
    // may do before reading this member's address: only after a barrier has every member
    // read every key.
    gloo::BarrierOptions formed(ctx);
    gloo::barrier(formed);
    ForgetKeys(*store, adapter);
    joins.Clear();
    return std::shared_ptr<HeadComm>(std::make_shared<GlooComm>(ctx, store, group));
  } catch (const std::exception& e) {
    ForgetKeys(*store, adapter);
    return absl::DeadlineExceededError(absl::StrCat(
        "member ", NamedMember(group, group.member), " could not form head group '", group.id,
        "'", joins.NeverJoined(options.timeout), ": ", e.what()));
  }
}

}  // namespace lossd
