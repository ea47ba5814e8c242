// SPDX-License-Identifier: Apache-2.0
#include "testing/server_harness.h"

#include <algorithm>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference.h"
#include "service/state_sample.h"

namespace lossd {
namespace testing_harness {
namespace {

prometheus::Exposer* SharedExposer() {
  static prometheus::Exposer* exposer = new prometheus::Exposer("127.0.0.1:0");
  return exposer;
}

v1::TensorSpec Spec(DType dt, std::vector<int64_t> shape) {
  v1::TensorSpec s;
  switch (dt) {
    case DType::kBF16: s.set_dtype(v1::DTYPE_BF16); break;
    case DType::kF16: s.set_dtype(v1::DTYPE_FP16); break;
    case DType::kF32: s.set_dtype(v1::DTYPE_FP32); break;
    case DType::kI32: s.set_dtype(v1::DTYPE_INT32); break;
    case DType::kI64: s.set_dtype(v1::DTYPE_INT64); break;
  }
  for (int64_t d : shape) s.add_shape(d);
  return s;
}

void AddParts(std::vector<v1::ComputeRequest>* out, v1::TensorId id, const void* data,
              size_t bytes, size_t part_bytes) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  for (size_t off = 0; off < bytes; off += part_bytes) {
    v1::ComputeRequest r;
    r.mutable_part()->set_tensor(id);
    r.mutable_part()->set_offset(off);
    r.mutable_part()->set_data(p + off, std::min(part_bytes, bytes - off));
    out->push_back(std::move(r));
  }
}

}  // namespace

Harness::Harness(HarnessOptions o) {
  static std::atomic<int> counter{0};
  if (o.engine.instance.empty()) o.engine.instance = absl::StrCat("test", counter++);
  o.service.instance = o.engine.instance;
  o.service.version = "test";
  if (!o.head_group_address.empty()) {
    const absl::Status s = ConfigureHeadGroups(
        {o.head_group_address, o.head_group_timeout, "", ""}, nullptr, &o.engine,
        &group_service_);
    if (!s.ok()) {
      ADD_FAILURE() << s;
      return;
    }
  }
  engine_ = std::make_unique<Engine>(o.backend ? o.backend() : NewCpuBackend(o.cpu_threads),
                                     o.engine);
  Engine* e = engine_.get();
  // The server's own sample (service/state_sample), so tests read what lossd exports.
  metrics_ = std::make_unique<ServerMetrics>([e] { return SampleState(*e); });
  // Metrics of the most recent harness are the ones served.
  static std::shared_ptr<prometheus::Registry> last_registry;
  static std::shared_ptr<prometheus::Collectable> last_state;
  if (last_registry) SharedExposer()->RemoveCollectable(last_registry);
  if (last_state) SharedExposer()->RemoveCollectable(last_state);
  last_registry = metrics_->registry();
  last_state = metrics_->state_collector();
  SharedExposer()->RegisterCollectable(last_registry);
  SharedExposer()->RegisterCollectable(last_state);

  LossServerOptions so;
  host_ = o.host;
  so.address = absl::StrCat(o.host, ":", o.port);
  so.service = o.service;
  so.credentials = o.server_credentials;
  so.reflection = o.reflection;
  so.health_address = o.health_address;
  so.head_group_service = group_service_.get();
  auto server = LossServer::Start(engine_.get(), metrics_.get(), so);
  if (!server.ok()) {
    ADD_FAILURE() << server.status();
    return;
  }
  server_ = std::move(*server);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  if (!o.server_credentials) {
    channel_ = grpc::CreateCustomChannel(absl::StrCat(host_, ":", server_->port()),
                                         grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Loss::NewStub(channel_);
  }
}

std::unique_ptr<v1::Loss::Stub> Harness::NewStub(
    std::shared_ptr<grpc::ChannelCredentials> creds) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a fresh connection per stub
  return v1::Loss::NewStub(grpc::CreateCustomChannel(
      absl::StrCat(host_, ":", server_->port()), creds, args));
}

Harness::~Harness() {
  stub_.reset();
  channel_.reset();
  if (server_) server_->Shutdown(absl::Seconds(5));
}

std::string Harness::ScrapeMetrics() {
  const int port = SharedExposer()->GetListeningPorts().at(0);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string page;
  char buf[65536];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    page.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return page;
}

uint64_t Harness::WaitForIdleMemory(double seconds) {
  auto until = std::chrono::steady_clock::now() +
               std::chrono::milliseconds(static_cast<int>(seconds * 1000));
  uint64_t used = engine_->budget().in_use();
  while (used != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    used = engine_->budget().in_use();
  }
  return used;
}

double MetricValue(const std::string& page, const std::string& name,
                   const std::string& labels) {
  const std::string key = labels.empty() ? name + " " : name + "{" + labels + "} ";
  std::istringstream in(page);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(key.size()));
  }
  return -1;
}

v1::ComputeHeader HeaderFor(const RandomProblem& rp, const std::string& weight_handle) {
  const RandomProblemSpec& s = rp.spec();
  v1::ComputeHeader h;
  *h.mutable_x() = Spec(s.dtype, {s.bt, s.h});
  if (weight_handle.empty()) {
    *h.mutable_w() = Spec(s.dtype, {s.v, s.h});
    if (!rp.bias.empty()) *h.mutable_bias() = Spec(s.dtype, {s.v});
  } else {
    h.set_weight_handle(weight_handle);
  }
  *h.mutable_targets() = Spec(s.target_dtype, {s.bt});
  if (!rp.class_weights.empty()) *h.mutable_class_weights() = Spec(DType::kF32, {s.v});
  if (!rp.grad_output.empty()) *h.mutable_grad_output() = Spec(DType::kF32, {s.bt});
  v1::LossOptions* o = h.mutable_options();
  o->set_ignore_index(s.options.ignore_index);
  o->set_reduction(static_cast<v1::Reduction>(static_cast<int>(s.options.reduction)));
  o->set_label_smoothing(s.options.label_smoothing);
  o->set_lse_square_scale(s.options.z_loss_scale);
  o->set_softcap(s.options.softcap);
  o->set_grad_scale(s.options.grad_scale);
  o->set_chunk_rows(s.options.chunk_rows);
  o->set_token_scaling(s.options.token_scaling);
  v1::Outputs* w = h.mutable_outputs();
  w->set_dx(true);
  w->set_dw(true);
  w->set_db(true);
  w->set_lse(true);
  w->set_z_loss(true);
  w->set_accuracy(true);
  w->set_predictions(true);
  return h;
}

std::vector<v1::ComputeRequest> PartsFor(const RandomProblem& rp, size_t part_bytes,
                                         bool include_weights) {
  std::vector<v1::ComputeRequest> out;
  LossProblem p = rp.problem();
  AddParts(&out, v1::TENSOR_X, rp.x.data(), rp.x.size(), part_bytes);
  if (include_weights) {
    AddParts(&out, v1::TENSOR_W, rp.w.data(), rp.w.size(), part_bytes);
    if (!rp.bias.empty()) AddParts(&out, v1::TENSOR_BIAS, rp.bias.data(), rp.bias.size(), part_bytes);
  }
  AddParts(&out, v1::TENSOR_TARGETS, p.targets, p.bt * DTypeSize(p.target_dtype), part_bytes);
  if (!rp.class_weights.empty()) {
    AddParts(&out, v1::TENSOR_CLASS_WEIGHTS, rp.class_weights.data(),
             rp.class_weights.size() * 4, part_bytes);
  }
  if (!rp.grad_output.empty()) {
    AddParts(&out, v1::TENSOR_GRAD_OUTPUT, rp.grad_output.data(), rp.grad_output.size() * 4,
             part_bytes);
  }
  return out;
}

std::vector<v1::ComputeRequest> XLast(std::vector<v1::ComputeRequest> parts) {
  std::stable_partition(parts.begin(), parts.end(), [](const v1::ComputeRequest& r) {
    return r.part().tensor() != v1::TENSOR_X;
  });
  return parts;
}

ComputeReply RunCompute(v1::Loss::Stub& stub, const std::vector<v1::ComputeRequest>& messages,
                        double deadline_seconds) {
  ComputeReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(deadline_seconds * 1000)));
  auto stream = stub.Compute(&ctx);
  // Writes may fail once the server has answered early with an error; the status says why.
  std::thread writer([&] {
    for (const auto& m : messages) {
      if (!stream->Write(m)) break;
    }
    stream->WritesDone();
  });
  v1::ComputeResponse r;
  bool have_summary = false;
  while (stream->Read(&r)) {
    if (r.has_summary()) {
      // Overlapped (header.overlap): a preliminary summary announces the outputs and the
      // final one comes after the parts; the buffers are made once, at the first.
      const bool announced = have_summary;
      reply.summary = r.summary();
      have_summary = true;
      if (announced) continue;
      for (int i = 0; i < r.summary().tensors_size(); ++i) {
        uint64_t n = 1;
        for (int64_t d : r.summary().specs(i).shape()) n *= d;
        const v1::DType dt = r.summary().specs(i).dtype();
        const uint64_t es = dt == v1::DTYPE_INT64 ? 8 : dt == v1::DTYPE_FP32 || dt == v1::DTYPE_INT32 ? 4 : 2;
        reply.tensors[r.summary().tensors(i)].assign(n * es, 0xFF);
      }
    } else if (r.has_part() && have_summary) {
      auto& t = reply.tensors[r.part().tensor()];
      if (r.part().offset() + r.part().data().size() <= t.size()) {
        std::memcpy(t.data() + r.part().offset(), r.part().data().data(), r.part().data().size());
      } else {
        ADD_FAILURE() << "response part runs past its tensor";
      }
    }
  }
  writer.join();
  reply.status = stream->Finish();
  return reply;
}

ComputeReply RunCompute(v1::Loss::Stub& stub, const v1::ComputeHeader& header,
                        const std::vector<v1::ComputeRequest>& parts, double deadline_seconds) {
  std::vector<v1::ComputeRequest> messages;
  messages.reserve(parts.size() + 1);
  v1::ComputeRequest h;
  *h.mutable_header() = header;
  messages.push_back(std::move(h));
  messages.insert(messages.end(), parts.begin(), parts.end());
  return RunCompute(stub, messages, deadline_seconds);
}

grpc::Status PutWeights(v1::Loss::Stub& stub, const RandomProblem& rp, size_t part_bytes,
                        std::string* handle) {
  grpc::ClientContext ctx;
  v1::PutWeightsResponse resp;
  auto writer = stub.PutWeights(&ctx, &resp);
  v1::PutWeightsRequest h;
  *h.mutable_header()->mutable_w() = Spec(rp.spec().dtype, {rp.spec().v, rp.spec().h});
  if (!rp.bias.empty()) *h.mutable_header()->mutable_bias() = Spec(rp.spec().dtype, {rp.spec().v});
  writer->Write(h);
  auto send = [&](v1::TensorId id, const std::vector<uint8_t>& bytes) {
    for (size_t off = 0; off < bytes.size(); off += part_bytes) {
      v1::PutWeightsRequest r;
      r.mutable_part()->set_tensor(id);
      r.mutable_part()->set_offset(off);
      r.mutable_part()->set_data(bytes.data() + off, std::min(part_bytes, bytes.size() - off));
      if (!writer->Write(r)) return;
    }
  };
  send(v1::TENSOR_W, rp.w);
  if (!rp.bias.empty()) send(v1::TENSOR_BIAS, rp.bias);
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (s.ok()) *handle = resp.handle();
  return s;
}

LossOutputs OutputsOf(ComputeReply& reply, const LossProblem& p, DType grad_dtype,
                      ReplyScalars* scalars) {
  LossOutputs out;
  out.grad_dtype = grad_dtype;
  scalars->loss = reply.summary.loss();
  scalars->z_loss = reply.summary.z_loss();
  scalars->accuracy = reply.summary.accuracy();
  scalars->tokens = reply.summary.tokens();
  auto tensor = [&](v1::TensorId id) -> void* {
    auto it = reply.tensors.find(id);
    return it == reply.tensors.end() ? nullptr : it->second.data();
  };
  if (p.options.reduction == Reduction::kNone) {
    out.loss = static_cast<float*>(tensor(v1::TENSOR_LOSS));
    out.z_loss = static_cast<float*>(tensor(v1::TENSOR_Z_LOSS));
  } else {
    out.loss = &scalars->loss;
    out.z_loss = &scalars->z_loss;
  }
  out.lse = static_cast<float*>(tensor(v1::TENSOR_LSE));
  out.predictions = static_cast<int64_t*>(tensor(v1::TENSOR_PREDICTIONS));
  out.accuracy = &scalars->accuracy;
  out.tokens = &scalars->tokens;
  out.dx = tensor(v1::TENSOR_DX);
  out.dw = tensor(v1::TENSOR_DW);
  out.db = tensor(v1::TENSOR_DB);
  return out;
}

::testing::AssertionResult ReplyMatchesReference(const RandomProblem& rp, ComputeReply& reply,
                                                 DType grad_dtype) {
  if (!reply.status.ok()) {
    return ::testing::AssertionFailure()
           << "status " << reply.status.error_code() << ": " << reply.status.error_message();
  }
  LossProblem p = rp.problem();
  // Every output HeaderFor asks for must be there at its exact size: MatchesReference skips
  // an output it is not given, so a reply that left one out would otherwise pass.
  const uint64_t g = DTypeSize(grad_dtype);
  std::map<int, uint64_t> want = {
      {v1::TENSOR_DX, static_cast<uint64_t>(p.bt) * p.h * g},
      {v1::TENSOR_DW, static_cast<uint64_t>(p.v) * p.h * g},
      {v1::TENSOR_LSE, static_cast<uint64_t>(p.bt) * 4},
      {v1::TENSOR_PREDICTIONS, static_cast<uint64_t>(p.bt) * 8}};
  if (p.bias != nullptr) want[v1::TENSOR_DB] = static_cast<uint64_t>(p.v) * g;
  if (p.options.reduction == Reduction::kNone) {
    want[v1::TENSOR_LOSS] = static_cast<uint64_t>(p.bt) * 4;
    want[v1::TENSOR_Z_LOSS] = static_cast<uint64_t>(p.bt) * 4;
  }
  for (const auto& [id, bytes] : want) {
    auto it = reply.tensors.find(id);
    const std::string name = v1::TensorId_Name(static_cast<v1::TensorId>(id));
    if (it == reply.tensors.end()) {
      return ::testing::AssertionFailure() << "the reply has no " << name;
    }
    if (it->second.size() != bytes) {
      return ::testing::AssertionFailure()
             << name << " has " << it->second.size() << " bytes, not " << bytes;
    }
  }
  if (reply.tensors.size() != want.size()) {
    return ::testing::AssertionFailure()
           << "the reply has " << reply.tensors.size() << " tensors, not " << want.size();
  }
  ReferenceOutputs ref;
  absl::Status s = ReferenceCompute(p, &ref);
  if (!s.ok()) return ::testing::AssertionFailure() << "reference: " << s;
  ReplyScalars scalars;
  LossOutputs got = OutputsOf(reply, p, grad_dtype, &scalars);
  return MatchesReference(p, rp.stats(), ref, got);
}

}  // namespace testing_harness
}  // namespace lossd
