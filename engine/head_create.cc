// SPDX-License-Identifier: Apache-2.0
// Creating a head, or importing one (an export of this server or another, or a torch
// optimizer's state): validate the spec, reserve --head_bytes, allocate, take the parts in
// byte order (the master also cast into the compute copy), and name the head once every byte
// has arrived. A head is never half made: an uncommitted one gives everything back.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "engine/head_internal.h"
#include "engine/heads.h"

namespace lossd {
namespace {

absl::Status CheckRange(double v, double lo, double hi, absl::string_view field) {
  if (!(v >= lo && v <= hi)) {  // false for NaN
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.", field, " must be in [", lo, ", ", hi, "], got ", v));
  }
  return absl::OkStatus();
}

// torch's own refusals (SGD, AdamW constructors) and what lossd adds: finite values.
absl::Status CheckOptimizer(const HeadOptimizer& o) {
  const double inf = INFINITY;
  LOSSD_RETURN_IF_ERROR(CheckRange(o.lr, 0, inf - 1, "lr"));
  LOSSD_RETURN_IF_ERROR(CheckRange(o.weight_decay, 0, inf - 1, "weight_decay"));
  LOSSD_RETURN_IF_ERROR(CheckRange(o.bias_weight_decay, 0, inf - 1, "bias_weight_decay"));
  if (o.kind == OptimizerKind::kSgd) {
    LOSSD_RETURN_IF_ERROR(CheckRange(o.momentum, 0, inf - 1, "momentum"));
    LOSSD_RETURN_IF_ERROR(CheckRange(o.dampening, 0, 1, "dampening"));
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer.nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD), got "
          "momentum ", o.momentum, ", dampening ", o.dampening));
    }
    return absl::OkStatus();
  }
  if (o.kind != OptimizerKind::kAdamW) {
    return absl::InvalidArgumentError("optimizer.kind must be SGD or AdamW");
  }
  LOSSD_RETURN_IF_ERROR(CheckRange(o.beta1, 0, std::nextafter(1.0, 0.0), "beta1"));
  LOSSD_RETURN_IF_ERROR(CheckRange(o.beta2, 0, std::nextafter(1.0, 0.0), "beta2"));
  return CheckRange(o.eps, 0, inf - 1, "eps");
}

// A group names 2 to kMaxGroup members, this server's index among them and the group's id.
absl::Status CheckGroup(const HeadGroup& g) {
  constexpr size_t kMaxGroup = 1024;
  if (g.members.empty()) return absl::OkStatus();
  if (g.members.size() > kMaxGroup || g.member >= g.members.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head.group needs 1 to ", kMaxGroup, " members and member < their count, got ",
        g.members.size(), " members, member ", g.member));
  }
  for (size_t i = 0; i < g.members.size(); ++i) {
    if (g.members[i].empty() || g.members[i].size() > 256) {
      return absl::InvalidArgumentError(absl::StrCat(
          "head.group.members[", i, "] must be an endpoint of 1 to 256 characters"));
    }
  }
  if (g.members.size() > 1 && (g.id.empty() || g.id.size() > 128)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head.group.id must be 1 to 128 characters for a group of ", g.members.size(),
        " members (the creator's name for this group's life), got ", g.id.size()));
  }
  return absl::OkStatus();
}

absl::Status CheckSpec(const HeadSpec& s, const HeadStore::Options& o) {
  LOSSD_RETURN_IF_ERROR(ValidateHeadName(s.name, "head.name"));
  if (s.v < 1 || s.h < 1 || s.v > o.max_v || s.h > o.max_h) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head.w.shape must be (V, H) with 1 <= V <= ", o.max_v, " and 1 <= H <= ", o.max_h,
        ", got (", s.v, ", ", s.h, ")"));
  }
  if (!IsFloatDType(s.master_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head.w.dtype must be fp32 (the master) or bf16/fp16 (the master is their upcast), got ",
        DTypeName(s.master_dtype)));
  }
  if (!IsFloatDType(s.compute_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head.compute_dtype must be bf16, fp16 or fp32, got ", DTypeName(s.compute_dtype)));
  }
  if (s.optimizer_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head.optimizer_step must be >= 0, got ", s.optimizer_step));
  }
  if (s.with_state && s.optimizer.states() == 0) {
    return absl::InvalidArgumentError(
        "head.with_state is set, but this optimizer keeps no state (SGD without momentum)");
  }
  LOSSD_RETURN_IF_ERROR(CheckGroup(s.group));
  return CheckOptimizer(s.optimizer);
}

// Whether an existing head is the one this spec would import (same shape, optimizer and
// version): a repeated import.
bool SameHead(Head& head, const HeadSpec& s) {
  absl::MutexLock lock(&head.mu);
  return head.v == s.v && head.h == s.h && head.has_bias == s.has_bias &&
         head.dtype == s.compute_dtype && head.optimizer == s.optimizer &&
         head.version == s.version && head.optimizer_step == s.optimizer_step &&
         head.group.size() == s.group.size() &&
         (s.group.size() == 1 || head.group == s.group);
}

absl::StatusOr<std::unique_ptr<BackendBuffer>> ZeroedBuffer(Backend& b, uint64_t bytes) {
  LOSSD_ASSIGN_OR_RETURN(std::unique_ptr<BackendBuffer> buf, b.Allocate(bytes));
  LOSSD_RETURN_IF_ERROR(b.Zero(*buf));
  return buf;
}

// The head's memory: master and state (zeroed: no state sent means torch's fresh state),
// the gradient sum (zeroed) and the compute copy.
absl::Status AllocateHead(Backend& b, const HeadSpec& s, Head& head) {
  const int states = s.optimizer.states();
  auto param = [&](HeadParam& p, int64_t n) -> absl::Status {
    p.n = n;
    p.slice = HeadSliceOf(n, s.group.member, s.group.size());
    const uint64_t bytes = static_cast<uint64_t>(p.slice.n()) * 4;
    LOSSD_ASSIGN_OR_RETURN(p.master, ZeroedBuffer(b, bytes));
    for (int i = 0; i < states; ++i) {
      LOSSD_ASSIGN_OR_RETURN(p.state[i], ZeroedBuffer(b, bytes));
    }
    return absl::OkStatus();
  };
  LOSSD_RETURN_IF_ERROR(param(head.w, s.v * s.h));
  if (s.has_bias) LOSSD_RETURN_IF_ERROR(param(head.bias, s.v));
  head.copy = std::make_shared<WeightEntry>();
  head.copy->dtype = s.compute_dtype;
  head.copy->v = s.v;
  head.copy->h = s.h;
  head.copy->owner = head.owner;
  LOSSD_ASSIGN_OR_RETURN(head.copy->w, b.Allocate(s.v * s.h * DTypeSize(s.compute_dtype)));
  if (s.has_bias) {
    LOSSD_ASSIGN_OR_RETURN(head.copy->bias, b.Allocate(s.v * DTypeSize(s.compute_dtype)));
  }
  head.grad = std::make_shared<Accumulator>();
  head.grad->name = absl::StrCat("head:", s.name);
  head.grad->v = s.v;
  head.grad->h = s.h;
  head.grad->has_bias = s.has_bias;
  head.grad->owner = head.owner;
  LOSSD_ASSIGN_OR_RETURN(head.grad->dw, ZeroedBuffer(b, s.v * s.h * 4));
  if (s.has_bias) {
    LOSSD_ASSIGN_OR_RETURN(head.grad->db, ZeroedBuffer(b, s.v * 4));
  }
  return absl::OkStatus();
}

}  // namespace

PendingHead::~PendingHead() {
  if (store == nullptr) return;
  absl::MutexLock lock(&store->mu);
  store->creating.erase(spec.name);
}

std::vector<std::pair<HeadTensor, uint64_t>> HeadStore::ImportTensors(const HeadSpec& s) {
  const uint64_t nw = static_cast<uint64_t>(s.v) * static_cast<uint64_t>(s.h);
  const uint64_t nb = s.has_bias ? static_cast<uint64_t>(s.v) : 0;
  std::vector<std::pair<HeadTensor, uint64_t>> t;
  t.emplace_back(HeadTensor::kMasterW, nw * DTypeSize(s.master_dtype));
  if (nb) t.emplace_back(HeadTensor::kMasterBias, nb * DTypeSize(s.master_dtype));
  if (!s.with_state) return t;
  const HeadTensor state_w[] = {HeadTensor::kExpAvgW, HeadTensor::kExpAvgSqW,
                                HeadTensor::kMaxExpAvgSqW};
  for (int i = 0; i < s.optimizer.states(); ++i) {
    t.emplace_back(state_w[i], nw * 4);
    if (nb) t.emplace_back(static_cast<HeadTensor>(static_cast<int>(state_w[i]) + 1), nb * 4);
  }
  return t;
}

absl::StatusOr<HeadCreation> HeadStore::BeginCreate(const HeadSpec& spec,
                                                   const std::string& owner) {
  LOSSD_RETURN_IF_ERROR(CheckSpec(spec, impl_->options));
  if (spec.group.size() > 1) {
    if (!impl_->options.connect_group) {
      return absl::FailedPreconditionError(absl::StrCat(
          "head.group names ", spec.group.size(), " members, but this server forms no head "
          "groups (no group transport configured); create the head with one member"));
    }
    // Asked before a byte of the head is uploaded: a device backend's groups run on its own
    // collectives (NCCL), which it may lack (no library, an older plugin).
    if (const std::string name = impl_->backend->Info().name; name != "cpu") {
      if (absl::Status s = impl_->backend->CommAvailable(); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("a head group on the ", name, " backend runs "
                                                   "on its collectives, which it cannot form: ",
                                                   s.message()));
      }
    }
  }
  const uint64_t bytes = HeadBytes(spec);
  HeadCreation out;
  {
    absl::MutexLock lock(&impl_->mu);
    auto it = impl_->map.find(spec.name);
    if (it != impl_->map.end()) {
      std::shared_ptr<Head> head = it->second;
      LOSSD_RETURN_IF_ERROR(CheckOwner(head->owner, owner, HeadWhat(spec.name)));
      if (!SameHead(*head, spec)) {
        absl::MutexLock head_lock(&head->mu);
        return absl::AlreadyExistsError(absl::StrCat(
            HeadWhat(spec.name), " exists (version ", head->version, ", (V, H) = (", head->v,
            ", ", head->h, ")) and differs from this one (version ", spec.version,
            ", (V, H) = (", spec.v, ", ", spec.h, "), or another optimizer or dtype); drop "
            "it first, or import under another name"));
      }
      out.existing = Impl::Summarize(*head);
      return out;
    }
    if (impl_->creating.contains(spec.name)) {
      return absl::AlreadyExistsError(
          absl::StrCat(HeadWhat(spec.name), " is being created by another call"));
    }
    if (impl_->map.size() + impl_->creating.size() >= impl_->options.max_heads) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this server holds ", impl_->map.size(), " heads (", impl_->creating.size(),
          " more being created), --max_heads=", impl_->options.max_heads, "; drop one"));
    }
    const uint64_t held = impl_->held->load();
    if (held + bytes > impl_->options.budget_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          HeadWhat(spec.name), " needs ", bytes, " bytes (fp32 master, gradient sum and ",
          spec.optimizer.states(), " state tensors, and the compute copy) but heads hold ",
          held, " of --head_bytes=", impl_->options.budget_bytes, "; drop a head or raise "
          "the flag"));
    }
    impl_->held->fetch_add(bytes);
    impl_->creating[spec.name] = 1;
  }
  auto held = impl_->held;
  auto head = std::shared_ptr<Head>(new Head, [held, bytes](Head* h) {
    delete h;
    held->fetch_sub(bytes);
  });
  head->name = spec.name;
  head->owner = owner;
  head->v = spec.v;
  head->h = spec.h;
  head->has_bias = spec.has_bias;
  head->dtype = spec.compute_dtype;
  head->optimizer = spec.optimizer;
  head->bytes = bytes;
  head->last_used_ns.store(NowNs());
  out.pending = std::make_unique<PendingHead>();
  out.pending->store = impl_.get();
  out.pending->spec = spec;
  out.pending->head = head;
  out.pending->expected = ImportTensors(spec);
  out.pending->received.assign(out.pending->expected.size(), 0);
  absl::Status s = AllocateHead(*impl_->backend, spec, *head);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("allocating ", HeadWhat(spec.name), " (", bytes,
                                               " bytes): ", s.message()));
  }
  return out;
}

absl::Status HeadStore::WriteCreate(PendingHead& p, HeadTensor t, uint64_t offset,
                                    const void* data, uint64_t bytes) {
  size_t i = 0;
  while (i < p.expected.size() && p.expected[i].first != t) ++i;
  if (i == p.expected.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", HeadTensorName(t), " is not part of this head's create (its optimizer, bias "
        "and with_state say which are)"));
  }
  const bool master = t == HeadTensor::kMasterW || t == HeadTensor::kMasterBias;
  const DType dt = master ? p.spec.master_dtype : DType::kF32;
  const uint64_t es = DTypeSize(dt);
  const uint64_t total = p.expected[i].second;
  if (offset != p.received[i] || bytes % es != 0 || bytes > total - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "part of ", HeadTensorName(t), " at offset ", offset, " with ", bytes, " bytes: parts "
        "come in byte order (next offset ", p.received[i], "), whole ", es, "-byte elements, "
        "within its ", total, " bytes"));
  }
  const int64_t n = static_cast<int64_t>(bytes / es);
  std::vector<float> f(n);
  for (int64_t k = 0; k < n; ++k) {
    f[k] = LoadAsFloat(data, dt, k);
    if (!std::isfinite(f[k])) {
      return absl::InvalidArgumentError(absl::StrCat(
          HeadTensorName(t), " element ", offset / es + k, " is not finite (", f[k], ")"));
    }
  }
  Head& head = *p.head;
  const uint64_t first = offset / es;  // element index
  Backend& b = *impl_->backend;
  // Master and state: only this server's slice of the parameter is kept (all of it for S = 1).
  const HeadParam& param = static_cast<int>(t) % 2 == 0 ? head.w : head.bias;
  const int64_t lo = std::max<int64_t>(first, param.slice.lo);
  const int64_t hi = std::min<int64_t>(first + n, param.slice.hi);
  if (hi > lo) {
    LOSSD_RETURN_IF_ERROR(b.CopyToBackend(*HeadBuffer(head, t), (lo - param.slice.lo) * 4,
                                          f.data() + (lo - first), (hi - lo) * 4));
  }
  if (master) {
    const DType cd = head.dtype;
    std::vector<uint8_t> copy(n * DTypeSize(cd));
    for (int64_t k = 0; k < n; ++k) StoreFromFloat(copy.data(), cd, k, f[k]);
    BackendBuffer* dst = HeadBuffer(head, t == HeadTensor::kMasterW ? HeadTensor::kCopyW
                                                                    : HeadTensor::kCopyBias);
    LOSSD_RETURN_IF_ERROR(
        b.CopyToBackend(*dst, first * DTypeSize(cd), copy.data(), copy.size()));
  }
  p.received[i] += bytes;
  return absl::OkStatus();
}

absl::StatusOr<HeadSummary> HeadStore::CommitCreate(std::unique_ptr<PendingHead> p) {
  for (size_t i = 0; i < p->expected.size(); ++i) {
    if (p->received[i] != p->expected[i].second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the create of ", HeadWhat(p->spec.name), " ended with ", p->received[i], " of the ",
          p->expected[i].second, " bytes of ", HeadTensorName(p->expected[i].first)));
    }
  }
  std::shared_ptr<Head> head = p->head;
  head->exported_by = p->spec.exported_by;  // before the map publishes the head
  head->group = p->spec.group;
  if (head->group.size() > 1) {
    // Every member blocks here until the others have committed too: a group head is named
    // only once its communicator is formed.
    absl::StatusOr<std::shared_ptr<HeadComm>> comm = impl_->options.connect_group(head->group, impl_->backend);
    if (!comm.ok()) {
      return absl::Status(comm.status().code(),
                          absl::StrCat("forming the group of ", HeadWhat(p->spec.name), ": ",
                                       comm.status().message()));
    }
    head->comm = *std::move(comm);
  }
  head->imported_version = p->spec.version;
  {
    absl::MutexLock lock(&head->mu);
    head->version = p->spec.version;
    head->optimizer_step = p->spec.optimizer_step;
  }
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->map[p->spec.name] = head;
  }
  return Impl::Summarize(*head);  // p's destructor clears the name from `creating`
}

}  // namespace lossd
