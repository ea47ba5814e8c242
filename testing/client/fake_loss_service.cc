// SPDX-License-Identifier: Apache-2.0
#include "testing/client/fake_loss_service.h"

#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace lossd {
namespace client {
namespace {

size_t SpecBytes(const v1::TensorSpec& spec) {
  size_t n = spec.dtype() == v1::DTYPE_BF16 || spec.dtype() == v1::DTYPE_FP16 ? 2
             : spec.dtype() == v1::DTYPE_INT64                                ? 8
                                                                              : 4;
  for (int64_t d : spec.shape()) n *= static_cast<size_t>(d);
  return n;
}

v1::ComputeResponse PartMessage(int id, uint64_t offset, std::string data) {
  v1::ComputeResponse msg;
  msg.mutable_part()->set_tensor(static_cast<v1::TensorId>(id));
  msg.mutable_part()->set_offset(offset);
  msg.mutable_part()->set_data(std::move(data));
  return msg;
}

}  // namespace

grpc::Status FakeLossService::Compute(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::ComputeResponse, v1::ComputeRequest>* stream) {
  v1::ComputeRequest req;
  if (!stream->Read(&req) || !req.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "first message must be a header");
  }
  const v1::ComputeHeader h = req.header();
  {
    absl::MutexLock lock(&mu);
    peers.insert(ctx->peer());
    last_header = h;
    auto it = ctx->client_metadata().find("authorization");
    last_metadata =
        it == ctx->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
    it = ctx->client_metadata().find("x-request-id");
    last_request_id =
        it == ctx->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
  }
  if (mode == Mode::kError) return grpc::Status(error_code, error_message);
  absl::Notification* held_now = nullptr;
  absl::Notification* release_now = nullptr;
  {
    absl::MutexLock lock(&mu);
    std::swap(held_now, held);
    std::swap(release_now, release);
  }
  if (held_now != nullptr) held_now->Notify();
  if (release_now != nullptr) release_now->WaitForNotification();
  std::string instance_now;
  {
    absl::MutexLock lock(&mu);
    instance_now = instance;
  }
  if (!h.accumulator_instance().empty() && h.accumulator_instance() != instance_now) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("header.accumulator_instance '", h.accumulator_instance(),
                                     "' is not this server (instance '", instance_now, "')"));
  }
  Assembler in;
  while (stream->Read(&req)) {
    if (!req.has_part()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no part");
    in.Add(req.part());
  }
  if (!in.error.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, in.error);
  const std::pair<int, const v1::TensorSpec*> inputs[] = {
      {v1::TENSOR_X, &h.x()},
      {v1::TENSOR_W, &h.w()},
      {v1::TENSOR_BIAS, &h.bias()},
      {v1::TENSOR_TARGETS, &h.targets()},
      {v1::TENSOR_CLASS_WEIGHTS, &h.class_weights()},
      {v1::TENSOR_GRAD_OUTPUT, &h.grad_output()},
      {v1::TENSOR_DLOGP, &h.dlogp()},
      {v1::TENSOR_DENTROPY, &h.dentropy()},
      {v1::TENSOR_ADVANTAGES, &h.advantages()},
      {v1::TENSOR_OLD_LOGP, &h.old_logp()},
      {v1::TENSOR_REF_LOGP, &h.ref_logp()},
      {v1::TENSOR_IS_RATIO, &h.is_ratio()},
      {v1::TENSOR_TEACHER_X, &h.teacher_x()},
      {v1::TENSOR_TEACHER_W, &h.teacher_w()},
      {v1::TENSOR_TEACHER_BIAS, &h.teacher_bias()},
      {v1::TENSOR_TEACHER_TOPK_IDS, &h.teacher_topk_ids()},
      {v1::TENSOR_TEACHER_TOPK_LOGP, &h.teacher_topk_logp()}};
  for (const auto& [id, spec] : inputs) {
    const size_t want = spec->dtype() == v1::DTYPE_UNSPECIFIED ? 0 : SpecBytes(*spec);
    if (in.data[id].size() != want) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("tensor ", id, ": ", in.data[id].size(), " bytes, spec says ", want));
    }
  }
  {
    absl::MutexLock lock(&mu);
    last_parts = in.parts;
    last_data = in.data;
    last_max_part = in.max_part;
  }
  if (mode == Mode::kSleep) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (!ctx->IsCancelled() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  }
  const int64_t bt = h.x().shape(0);
  std::string w_bytes = in.data[v1::TENSOR_W];
  v1::TensorSpec w_spec = h.w();
  if (!h.head().empty()) {
    const grpc::Status s = heads.ForCompute(h, &w_bytes, &w_spec);
    if (!s.ok()) return s;
  } else if (!h.weight_handle().empty()) {
    absl::MutexLock lock(&mu);
    auto it = weights.find(h.weight_handle());
    if (it == weights.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown weight handle");
    }
    w_spec = it->second.first.w();
    w_bytes = it->second.second.data[v1::TENSOR_W];
  }

  v1::ComputeResponse summary;
  v1::ComputeSummary* s = summary.mutable_summary();
  int64_t tokens = 0;
  std::vector<int64_t> targets(bt);
  for (int64_t i = 0; i < bt; ++i) {
    const std::string& t = in.data[v1::TENSOR_TARGETS];
    if (!h.has_targets()) {  // distill without targets: every row counts
      targets[i] = 0;
    } else if (h.targets().dtype() == v1::DTYPE_INT32) {
      int32_t v;
      std::memcpy(&v, t.data() + 4 * i, 4);
      targets[i] = v;
    } else {
      std::memcpy(&targets[i], t.data() + 8 * i, 8);
    }
    tokens += targets[i] != h.options().ignore_index();
  }
  // As lossd reports an overflow: a grad_scale past fp32's reach leaves Inf in dX and dW.
  if (h.options().has_grad_scale() && h.options().grad_scale() > 1e38f) {
    s->add_nonfinite(v1::TENSOR_DX);
    s->add_nonfinite(v1::TENSOR_DW);
  }
  s->set_loss(1.5f);
  s->set_z_loss(0.25f);
  s->set_accuracy(0.125f);
  s->set_tokens(tokens);
  s->set_compute_seconds(0.5);
  s->set_backend("fake");
  s->set_instance(instance_now);
  std::vector<std::pair<int, std::string>> outs;
  auto announce = [&](int id, v1::DType dtype, std::vector<int64_t> shape, std::string bytes) {
    s->add_tensors(static_cast<v1::TensorId>(id));
    v1::TensorSpec* spec = s->add_specs();
    spec->set_dtype(dtype);
    for (int64_t d : shape) spec->add_shape(d);
    outs.emplace_back(id, std::move(bytes));
  };
  const v1::DType grad =
      h.options().grad_dtype() == v1::DTYPE_UNSPECIFIED ? h.x().dtype() : h.options().grad_dtype();
  if (h.outputs().dx()) {
    std::string dx = in.data[v1::TENSOR_X];
    if (grad != h.x().dtype()) dx.assign(bt * h.x().shape(1) * 4, '\x3f');
    announce(v1::TENSOR_DX, grad, {bt, h.x().shape(1)}, dx);
  }
  if (!h.head().empty()) {
    s->set_head_version(h.head_version());
    s->set_head_added(heads.Added(h, tokens));
  } else if (!h.accumulator().empty()) {
    absl::MutexLock lock(&mu);
    Accumulator& a = accumulators[h.accumulator()];
    a.v = w_spec.shape(0);
    a.h = w_spec.shape(1);
    a.bias = h.has_bias();
    ++a.micro_batches;
    a.tokens += tokens;
    s->set_accumulated_micro_batches(a.micro_batches);
  } else if (h.outputs().dw()) {
    if (grad != w_spec.dtype()) w_bytes.assign(w_spec.shape(0) * w_spec.shape(1) * 4, '\x3f');
    announce(v1::TENSOR_DW, grad, {w_spec.shape(0), w_spec.shape(1)}, w_bytes);
  }
  if (h.outputs().lse()) {
    std::string lse(bt * 4, '\0');
    for (int64_t i = 0; i < bt; ++i) {
      const float f = static_cast<float>(targets[i]);
      std::memcpy(&lse[4 * i], &f, 4);
    }
    announce(v1::TENSOR_LSE, v1::DTYPE_FP32, {bt}, lse);
  }
  if (h.outputs().predictions()) {
    std::string p(bt * 8, '\0');
    std::memcpy(&p[0], targets.data(), bt * 8);
    announce(v1::TENSOR_PREDICTIONS, v1::DTYPE_INT64, {bt}, p);
  }
  if (h.kind() == v1::LOSS_KIND_LOGPROB) {
    // logp = -targets as fp32; entropy = the dentropy sent, else dlogp's bytes, else ones.
    std::string logp(bt * 4, '\0');
    for (int64_t i = 0; i < bt; ++i) {
      const float f = -static_cast<float>(targets[i]);
      std::memcpy(&logp[4 * i], &f, 4);
    }
    announce(v1::TENSOR_LOGP, v1::DTYPE_FP32, {bt}, logp);
    if (h.outputs().entropy()) {
      std::string e = in.data[v1::TENSOR_DENTROPY];
      if (e.empty()) e = in.data[v1::TENSOR_DLOGP];
      if (e.empty()) {
        const float one = 1.0f;
        for (int64_t i = 0; i < bt; ++i) e.append(reinterpret_cast<const char*>(&one), 4);
      }
      announce(v1::TENSOR_ENTROPY, v1::DTYPE_FP32, {bt}, e);
    }
  }
  if (h.kind() == v1::LOSS_KIND_POLICY) {
    s->set_kl(0.375f);
    s->set_clip_fraction(0.0625f);
  }

  const Mode m = mode;
  const bool overlap = h.overlap();
  if (m == Mode::kNoSummary) return grpc::Status::OK;
  if (m == Mode::kBadShape) s->mutable_specs(0)->set_shape(0, bt + 1);
  if (m == Mode::kPartFirst) stream->Write(PartMessage(outs[0].first, 0, "ab"));
  if (overlap) {
    v1::ComputeResponse preliminary;
    v1::ComputeSummary* p = preliminary.mutable_summary();
    *p->mutable_tensors() = s->tensors();
    *p->mutable_specs() = s->specs();
    p->set_backend(s->backend());
    p->set_instance(s->instance());
    p->set_preliminary(true);
    stream->Write(preliminary);
  } else {
    stream->Write(summary);
    if (m == Mode::kTwoSummaries) stream->Write(summary);
  }
  const size_t part = h.response_part_bytes() == 0 ? (1 << 20) : h.response_part_bytes();
  for (auto& [id, bytes] : outs) {
    if (id == outs[0].first) {
      if (m == Mode::kShort) bytes.pop_back();
      if (m == Mode::kOverflow) bytes.push_back('!');
    }
    std::vector<v1::ComputeResponse> msgs;
    for (size_t off = 0; off < bytes.size(); off += part) {
      msgs.push_back(PartMessage(id, off, bytes.substr(off, part)));
    }
    if (m == Mode::kOutOfOrder && msgs.size() >= 2) std::swap(msgs[0], msgs[1]);
    for (const auto& msg : msgs) stream->Write(msg);
  }
  if (m == Mode::kUnannounced) {
    stream->Write(PartMessage(v1::TENSOR_Z_LOSS, 0, std::string(4, '\0')));
  }
  if (overlap && m != Mode::kNoFinal) {
    stream->Write(summary);
    if (m == Mode::kTwoSummaries) stream->Write(summary);
  }
  return grpc::Status::OK;
}

grpc::Status FakeLossService::PutWeights(grpc::ServerContext* ctx,
                                         grpc::ServerReader<v1::PutWeightsRequest>* reader,
                                         v1::PutWeightsResponse* resp) {
  v1::PutWeightsRequest req;
  if (!reader->Read(&req) || !req.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "first message must be a header");
  }
  Assembler in;
  const v1::WeightsHeader header = req.header();
  while (reader->Read(&req)) in.Add(req.part());
  if (!in.error.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, in.error);
  if (in.data[v1::TENSOR_W].size() != SpecBytes(header.w())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "w size");
  }
  absl::MutexLock lock(&mu);
  const std::string handle = absl::StrCat("fake-", weights.size());
  resp->set_handle(handle);
  resp->set_bytes(in.data[v1::TENSOR_W].size() + in.data[v1::TENSOR_BIAS].size());
  weights[handle] = {header, std::move(in)};
  return grpc::Status::OK;
}

grpc::Status FakeLossService::DropWeights(grpc::ServerContext*, const v1::DropWeightsRequest* req,
                                          v1::DropWeightsResponse*) {
  absl::MutexLock lock(&mu);
  if (weights.erase(req->handle()) == 0) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("unknown weight handle '", req->handle(), "'"));
  }
  return grpc::Status::OK;
}

// dw[i] = i + micro_batches (fp32), db[j] = -j.

grpc::Status FakeLossService::FetchGradients(
    grpc::ServerContext*, const v1::FetchGradientsRequest* req,
    grpc::ServerWriter<v1::FetchGradientsResponse>* writer) {
  Accumulator a;
  std::string instance_now;
  {
    absl::MutexLock lock(&mu);
    instance_now = instance;
    if (!req->accumulator_instance().empty() && req->accumulator_instance() != instance) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("accumulator_instance '", req->accumulator_instance(),
                                       "' is not this server (instance '", instance, "')"));
    }
    auto it = accumulators.find(req->accumulator());
    if (it == accumulators.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("no accumulator '", req->accumulator(), "'"));
    }
    a = it->second;
    if (req->reset()) it->second.micro_batches = 0;
  }
  v1::FetchGradientsResponse head;
  v1::GradientsHeader* g = head.mutable_header();
  g->mutable_dw()->set_dtype(v1::DTYPE_FP32);
  g->mutable_dw()->add_shape(a.v);
  g->mutable_dw()->add_shape(a.h);
  if (a.bias) {
    g->mutable_db()->set_dtype(v1::DTYPE_FP32);
    g->mutable_db()->add_shape(a.v);
  }
  g->set_micro_batches(a.micro_batches);
  g->set_tokens(a.tokens);
  g->set_instance(instance_now);
  writer->Write(head);
  std::string dw(a.v * a.h * 4, '\0');
  for (int64_t i = 0; i < a.v * a.h; ++i) {
    const float f = static_cast<float>(i + a.micro_batches);
    std::memcpy(&dw[4 * i], &f, 4);
  }
  const size_t part = req->response_part_bytes() == 0 ? 1000 : req->response_part_bytes();
  for (size_t off = 0; off < dw.size(); off += part) {
    v1::FetchGradientsResponse msg;
    msg.mutable_part()->set_tensor(v1::TENSOR_DW);
    msg.mutable_part()->set_offset(off);
    msg.mutable_part()->set_data(dw.substr(off, part));
    writer->Write(msg);
  }
  if (a.bias) {
    std::string db(a.v * 4, '\0');
    for (int64_t j = 0; j < a.v; ++j) {
      const float f = -static_cast<float>(j);
      std::memcpy(&db[4 * j], &f, 4);
    }
    v1::FetchGradientsResponse msg;
    msg.mutable_part()->set_tensor(v1::TENSOR_DB);
    msg.mutable_part()->set_data(db);
    writer->Write(msg);
  }
  return grpc::Status::OK;
}

grpc::Status FakeLossService::DropAccumulator(grpc::ServerContext*,
                                              const v1::DropAccumulatorRequest* req,
                                              v1::DropAccumulatorResponse*) {
  absl::MutexLock lock(&mu);
  if (accumulators.erase(req->accumulator()) == 0) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("no accumulator '", req->accumulator(), "'"));
  }
  return grpc::Status::OK;
}

grpc::Status FakeLossService::List(grpc::ServerContext*, const v1::ListRequest*,
                                   v1::ListResponse* resp) {
  absl::MutexLock lock(&mu);
  for (const auto& [handle, w] : weights) {
    v1::StateEntry* e = resp->add_entries();
    e->set_kind(v1::STATE_WEIGHTS);
    e->set_name(handle);
    uint64_t bytes = 0;
    for (const auto& [tensor, data] : w.second.data) bytes += data.size();
    e->set_bytes(bytes);
    e->set_last_used_unix_ms(1);
  }
  for (const auto& [name, a] : accumulators) {
    v1::StateEntry* e = resp->add_entries();
    e->set_kind(v1::STATE_ACCUMULATOR);
    e->set_name(name);
    e->set_bytes(static_cast<uint64_t>(a.v) * a.h * 4 + (a.bias ? a.v * 4 : 0));
    e->set_last_used_unix_ms(2);
    e->set_micro_batches(a.micro_batches);
  }
  heads.List(resp);
  return grpc::Status::OK;
}

grpc::Status FakeLossService::ServerInfo(grpc::ServerContext* ctx, const v1::ServerInfoRequest*,
                                         v1::ServerInfoResponse* resp) {
  {
    absl::MutexLock lock(&mu);
    peers.insert(ctx->peer());
    ++server_info_calls;
    for (const std::string& f : features) resp->add_features(f);
  }
  resp->set_version("0.0-fake");
  resp->set_instance("fake-instance");
  resp->set_backend("cpu");
  resp->set_device("fake device");
  resp->set_compute_path("cpu");
  resp->set_memory_total_bytes(1000);
  resp->set_max_part_bytes(16 << 20);
  resp->set_max_bt(1 << 20);
  resp->set_accumulators(3);
  return grpc::Status::OK;
}

}  // namespace client
}  // namespace lossd
