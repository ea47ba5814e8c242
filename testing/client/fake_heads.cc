// SPDX-License-Identifier: Apache-2.0
#include "testing/client/fake_heads.h"

#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/dtype.h"

namespace lossd {
namespace client {
namespace {

using grpc::StatusCode;

DType CoreDType(v1::DType t) {
  return t == v1::DTYPE_BF16 ? DType::kBF16 : t == v1::DTYPE_FP16 ? DType::kF16 : DType::kF32;
}

int64_t Elements(const v1::TensorSpec& s) {
  int64_t n = 1;
  for (int64_t d : s.shape()) n *= d;
  return n;
}

v1::TensorSpec Spec(v1::DType dtype, std::vector<int64_t> shape) {
  v1::TensorSpec s;
  s.set_dtype(dtype);
  for (int64_t d : shape) s.add_shape(d);
  return s;
}

// `bytes` of dtype `from` as `to` (float dtypes).
std::string Convert(const std::string& bytes, v1::DType from, v1::DType to) {
  const DType f = CoreDType(from), t = CoreDType(to);
  const size_t n = bytes.size() / DTypeSize(f);
  std::string out(n * DTypeSize(t), '\0');
  for (size_t i = 0; i < n; ++i) StoreFromFloat(out.data(), t, i, LoadAsFloat(bytes.data(), f, i));
  return out;
}

// The state tensor ids of W (the bias's are each + 1) an optimizer keeps.
std::vector<int> StateIds(const v1::OptimizerConfig& o) {
  if (o.kind() == v1::OPTIMIZER_SGD) {
    return o.momentum() != 0 ? std::vector<int>{v1::TENSOR_HEAD_EXP_AVG_W} : std::vector<int>{};
  }
  std::vector<int> ids = {v1::TENSOR_HEAD_EXP_AVG_W, v1::TENSOR_HEAD_EXP_AVG_SQ_W};
  if (o.amsgrad()) ids.push_back(v1::TENSOR_HEAD_MAX_EXP_AVG_SQ_W);
  return ids;
}

}  // namespace

std::string FakeHeads::NotFound(const std::string& name) const {
  return absl::StrCat("head '", name, "' not found on this server (instance '", instance_, "')");
}

grpc::Status FakeHeads::Create(grpc::ServerReader<v1::CreateHeadRequest>* reader,
                               v1::CreateHeadResponse* resp) {
  v1::CreateHeadRequest req;
  if (!reader->Read(&req) || !req.has_header()) {
    return Refuse(StatusCode::INVALID_ARGUMENT, "first message must be a HeadHeader");
  }
  const v1::HeadHeader h = req.header();
  std::map<int, std::string> data;
  std::map<int, int> parts;
  while (reader->Read(&req)) {
    std::string& d = data[req.part().tensor()];
    if (req.part().offset() != d.size()) {
      return Refuse(StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("tensor ", req.part().tensor(), " part at ",
                                 req.part().offset(), ", expected ", d.size()));
    }
    d += req.part().data();
    ++parts[req.part().tensor()];
  }
  if (h.name().empty() || h.w().shape_size() != 2) {
    return Refuse(StatusCode::INVALID_ARGUMENT, "header.name and a (V, H) header.w");
  }
  const int64_t n = Elements(h.w()), v = h.w().shape(0);
  const bool bias = h.has_bias();
  std::vector<std::pair<int, size_t>> want = {
      {v1::TENSOR_HEAD_MASTER_W, n * DTypeSize(CoreDType(h.w().dtype()))}};
  if (bias) want.emplace_back(v1::TENSOR_HEAD_MASTER_BIAS, v * DTypeSize(CoreDType(h.w().dtype())));
  if (h.with_state()) {
    for (int id : StateIds(h.optimizer())) {
      want.emplace_back(id, n * 4);
      if (bias) want.emplace_back(id + 1, v * 4);
    }
  }
  for (const auto& [id, bytes] : want) {
    if (data[id].size() != bytes) {
      return Refuse(StatusCode::INVALID_ARGUMENT, absl::StrCat("tensor ", id, ": ",
                                                               data[id].size(), " bytes of ",
                                                               bytes));
    }
  }
  absl::MutexLock lock(&mu_);
  last_create_header_ = h;
  last_create_parts_ = parts;
  auto it = heads_.find(h.name());
  if (it != heads_.end()) {
    if (it->second.header.version() != h.version()) {
      return Refuse(StatusCode::ALREADY_EXISTS,
                    absl::StrCat("head '", h.name(), "' exists (version ",
                                 it->second.header.version(), ") and differs from this one"));
    }
    resp->set_created(false);
    InfoLocked(it->second, resp->mutable_head());
    return grpc::Status::OK;
  }
  Head& head = heads_[h.name()];
  head.header = h;
  for (const auto& [id, bytes] : want) head.tensors[id] = data[id];
  for (int id : {v1::TENSOR_HEAD_MASTER_W, v1::TENSOR_HEAD_MASTER_BIAS}) {
    if (head.tensors.count(id)) {
      head.tensors[id] = Convert(head.tensors[id], h.w().dtype(), v1::DTYPE_FP32);
    }
  }
  for (int id : StateIds(h.optimizer())) {  // zeros where no state came
    for (int k = id; k <= id + (bias ? 1 : 0); ++k) {
      if (!head.tensors.count(k)) head.tensors[k].assign((k == id ? n : v) * 4, '\0');
    }
  }
  resp->set_created(true);
  InfoLocked(head, resp->mutable_head());
  return grpc::Status::OK;
}

void FakeHeads::InfoLocked(const Head& head, v1::HeadInfo* info) const {
  const v1::HeadHeader& h = head.header;
  info->set_name(h.name());
  *info->mutable_w() = Spec(h.compute_dtype(), {h.w().shape(0), h.w().shape(1)});
  info->set_has_bias(h.has_bias());
  info->set_compute_dtype(h.compute_dtype());
  *info->mutable_optimizer() = h.optimizer();
  info->set_version(h.version());
  info->set_optimizer_step(h.optimizer_step());
  uint64_t bytes = 0;
  for (const auto& [id, t] : head.tensors) bytes += t.size();
  info->set_bytes(bytes);
  info->set_contributions(head.keys.size());
  info->set_tokens(head.tokens);
  info->set_ranks_waiting(head.waiting.size());
  info->set_instance(instance_);
  info->set_last_used_unix_ms(3);
  // As lossd: a group's head names its group (one server's names none).
  if (h.group().members_size() > 1) *info->mutable_group() = h.group();
}

void FakeHeads::ApplyLocked(Head& head, const v1::StepRequest& req, v1::StepResponse* resp) {
  resp->set_grad_norm(static_cast<double>(head.keys.size()));  // not a norm: a count to see
  resp->set_finite(true);
  resp->set_clip_coef(req.has_clip_coef() ? req.clip_coef() : 1.0f);
  resp->set_contributions(head.keys.size());
  resp->set_tokens(head.tokens);
  resp->set_instance(instance_);
  if (req.phase() != v1::STEP_REDUCE) {
    if (!req.skip()) {
      for (int id : {v1::TENSOR_HEAD_MASTER_W, v1::TENSOR_HEAD_MASTER_BIAS}) {
        auto t = head.tensors.find(id);
        if (t == head.tensors.end()) continue;
        for (size_t i = 0; i < t->second.size(); i += 4) {
          float f;
          std::memcpy(&f, &t->second[i], 4);
          f += 1.0f;
          std::memcpy(&t->second[i], &f, 4);
        }
      }
      head.header.set_optimizer_step(head.header.optimizer_step() + 1);
    }
    resp->set_applied(!req.skip());
    head.header.set_version(head.header.version() + 1);
    head.keys.clear();
    head.tokens = 0;
  }
  resp->set_version(head.header.version());
}

grpc::Status FakeHeads::Step(grpc::ServerContext* ctx, const v1::StepRequest& req,
                             v1::StepResponse* resp) {
  absl::MutexLock lock(&mu_);
  last_step_ = req;
  auto it = heads_.find(req.head());
  if (it == heads_.end()) {
    return Refuse(StatusCode::NOT_FOUND, NotFound(req.head()));
  }
  Head& head = it->second;
  if (!req.head_instance().empty() && req.head_instance() != instance_) {
    return Refuse(StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("head_instance '", req.head_instance(),
                               "' is not this server (instance '", instance_, "')"));
  }
  if (req.version() != head.header.version()) {
    return Refuse(StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("head '", req.head(), "' is at version ", head.header.version(),
                               ", not ", req.version()));
  }
  if (!head.waiting.empty() && head.waiting.begin()->second.world_size() != req.world_size()) {
    return Refuse(StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("world_size ", req.world_size(), " differs from rank ",
                               head.waiting.begin()->first, "'s ",
                               head.waiting.begin()->second.world_size()));
  }
  head.waiting[req.rank()] = req;
  if (head.waiting.size() == req.world_size()) {
    ApplyLocked(head, req, resp);
    head.last = *resp;
    head.waiting.clear();
    ++head.generation;
    return grpc::Status::OK;
  }
  const uint64_t generation = head.generation;
  const std::string name = req.head();
  const absl::Time end = absl::Now() + absl::Seconds(10);
  auto moved = [this, &name, generation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto h = heads_.find(name);
    return h == heads_.end() || h->second.generation != generation;
  };
  while (!ctx->IsCancelled() && absl::Now() < end) {
    mu_.AwaitWithTimeout(absl::Condition(&moved), absl::Milliseconds(20));
    auto h = heads_.find(name);
    if (h == heads_.end()) return Refuse(StatusCode::NOT_FOUND, "head dropped");
    if (h->second.generation != generation) {
      *resp = h->second.last;
      return grpc::Status::OK;
    }
  }
  return Refuse(StatusCode::DEADLINE_EXCEEDED, "the step's other ranks never came");
}

std::vector<std::tuple<int, v1::TensorSpec, std::string>> FakeHeads::ExportTensorsLocked(
    const Head& head) const {
  const v1::HeadHeader& h = head.header;
  const int64_t v = h.w().shape(0), hh = h.w().shape(1);
  std::vector<std::tuple<int, v1::TensorSpec, std::string>> out;
  for (const auto& [id, bytes] : head.tensors) {  // ids 32..39 in order
    const bool is_bias = (id & 1) != 0;
    out.emplace_back(id, Spec(v1::DTYPE_FP32, is_bias ? std::vector<int64_t>{v}
                                                      : std::vector<int64_t>{v, hh}),
                     bytes);
  }
  out.emplace_back(v1::TENSOR_HEAD_COPY_W, Spec(h.compute_dtype(), {v, hh}),
                   Convert(head.tensors.at(v1::TENSOR_HEAD_MASTER_W), v1::DTYPE_FP32,
                           h.compute_dtype()));
  if (h.has_bias()) {
    out.emplace_back(v1::TENSOR_HEAD_COPY_BIAS, Spec(h.compute_dtype(), {v}),
                     Convert(head.tensors.at(v1::TENSOR_HEAD_MASTER_BIAS), v1::DTYPE_FP32,
                             h.compute_dtype()));
  }
  return out;
}

grpc::Status FakeHeads::Export(const v1::ExportHeadRequest& req,
                               grpc::ServerWriter<v1::ExportHeadResponse>* writer) {
  // Messages made under the lock and written after it, so a client that calls in (a Step)
  // while it reads the parts is not held up.
  std::vector<v1::ExportHeadResponse> msgs;
  const grpc::Status s = ExportMessages(req, &msgs);
  if (!s.ok()) return s;
  for (const v1::ExportHeadResponse& m : msgs) writer->Write(m);
  return grpc::Status::OK;
}

grpc::Status FakeHeads::ExportMessages(const v1::ExportHeadRequest& req,
                                       std::vector<v1::ExportHeadResponse>* out) {
  absl::MutexLock lock(&mu_);
  export_requests_.push_back(req);
  auto it = heads_.find(req.head());
  if (it == heads_.end()) {
    return Refuse(StatusCode::NOT_FOUND, NotFound(req.head()));
  }
  const Head& head = it->second;
  if (req.has_version() && req.version() != head.header.version()) {
    return Refuse(StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("head '", req.head(), "' is at version ", head.header.version(),
                               ", not ", req.version()));
  }
  const auto tensors = ExportTensorsLocked(head);
  uint64_t total = 0;
  v1::ExportHeadResponse msg;
  v1::ExportHeader* eh = msg.mutable_header();
  *eh->mutable_head() = head.header;
  *eh->mutable_head()->mutable_w() = Spec(v1::DTYPE_FP32, {head.header.w().shape(0),
                                                           head.header.w().shape(1)});
  if (head.header.has_bias()) {
    *eh->mutable_head()->mutable_bias() = Spec(v1::DTYPE_FP32, {head.header.w().shape(0)});
  }
  eh->mutable_head()->set_with_state(!StateIds(head.header.optimizer()).empty());
  for (const auto& [id, spec, bytes] : tensors) {
    eh->add_tensors(static_cast<v1::TensorId>(id));
    *eh->add_specs() = spec;
    total += bytes.size();
  }
  const uint64_t begin = req.range_begin();
  const uint64_t end = req.range_end() == 0 && begin == 0 ? total : req.range_end();
  if (begin > end || end > total) {
    return Refuse(StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("range [", begin, ", ", end, ") of ", total, " bytes"));
  }
  eh->set_range_begin(begin);
  eh->set_range_end(end);
  eh->set_instance(instance_);
  out->push_back(msg);
  const size_t part = req.response_part_bytes() == 0 ? 1000 : req.response_part_bytes();
  uint64_t at = 0;
  for (const auto& [id, spec, bytes] : tensors) {
    const uint64_t lo = std::max(begin, at), hi = std::min(end, at + bytes.size());
    for (uint64_t off = lo; off < hi; off += part) {
      v1::ExportHeadResponse p;
      p.mutable_part()->set_tensor(static_cast<v1::TensorId>(id));
      p.mutable_part()->set_offset(off - at);
      p.mutable_part()->set_data(bytes.substr(off - at, std::min<uint64_t>(part, hi - off)));
      out->push_back(std::move(p));
    }
    at += bytes.size();
  }
  return grpc::Status::OK;
}

grpc::Status FakeHeads::Info(const std::string& name, v1::HeadInfo* info) {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(name);
  if (it == heads_.end()) return Refuse(StatusCode::NOT_FOUND, NotFound(name));
  InfoLocked(it->second, info);
  return grpc::Status::OK;
}

grpc::Status FakeHeads::Drop(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (heads_.erase(name) == 0) {
    return Refuse(StatusCode::NOT_FOUND, NotFound(name));
  }
  return grpc::Status::OK;
}

void FakeHeads::List(v1::ListResponse* resp) {
  absl::MutexLock lock(&mu_);
  for (const auto& [name, head] : heads_) {
    v1::HeadInfo info;
    InfoLocked(head, &info);
    v1::StateEntry* e = resp->add_entries();
    e->set_kind(v1::STATE_HEAD);
    e->set_name(name);
    e->set_bytes(info.bytes());
    e->set_last_used_unix_ms(3);
    e->set_micro_batches(head.keys.size());
    e->set_version(head.header.version());
  }
}

grpc::Status FakeHeads::ForCompute(const v1::ComputeHeader& h, std::string* copy,
                                   v1::TensorSpec* spec) {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(h.head());
  if (it == heads_.end()) {
    return Refuse(StatusCode::NOT_FOUND, NotFound(h.head()));
  }
  const Head& head = it->second;
  if (!h.head_instance().empty() && h.head_instance() != instance_) {
    return Refuse(StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("header.head_instance '", h.head_instance(),
                               "' is not this server (instance '", instance_, "')"));
  }
  if (h.head_version() != head.header.version()) {
    return Refuse(StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("head '", h.head(), "' is at version ", head.header.version(),
                               ", and this Compute names version ", h.head_version()));
  }
  *spec = Spec(head.header.compute_dtype(), {head.header.w().shape(0), head.header.w().shape(1)});
  *copy = Convert(head.tensors.at(v1::TENSOR_HEAD_MASTER_W), v1::DTYPE_FP32,
                  head.header.compute_dtype());
  return grpc::Status::OK;
}

bool FakeHeads::Added(const v1::ComputeHeader& h, int64_t tokens) {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(h.head());
  if (it == heads_.end()) return false;
  if (!it->second.keys.emplace(h.rank(), h.micro_batch()).second) return false;
  it->second.tokens += tokens;
  return true;
}

v1::HeadHeader FakeHeads::last_create_header() {
  absl::MutexLock lock(&mu_);
  return last_create_header_;
}

std::map<int, int> FakeHeads::last_create_parts() {
  absl::MutexLock lock(&mu_);
  return last_create_parts_;
}

v1::StepRequest FakeHeads::last_step() {
  absl::MutexLock lock(&mu_);
  return last_step_;
}

std::vector<v1::ExportHeadRequest> FakeHeads::export_requests() {
  absl::MutexLock lock(&mu_);
  return export_requests_;
}

bool FakeHeads::Has(const std::string& name) {
  absl::MutexLock lock(&mu_);
  return heads_.count(name) > 0;
}

std::string FakeHeads::Tensor(const std::string& name, int id) {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(name);
  if (it == heads_.end()) return "";
  auto t = it->second.tensors.find(id);
  return t == it->second.tensors.end() ? "" : t->second;
}

}  // namespace client
}  // namespace lossd
