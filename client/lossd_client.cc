#include "client/lossd_client.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <deque>
#include <functional>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/part_codec.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/client_callback.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace client {

#define LOSSD_CLIENT_RETURN_IF_ERROR(expr)         \
  do {                                             \
    const absl::Status _lossd_status = (expr);     \
    if (!_lossd_status.ok()) return _lossd_status; \
  } while (0)

namespace {

constexpr char kComputeMethod[] = "/lossd.v1.Loss/Compute";
constexpr char kPutWeightsMethod[] = "/lossd.v1.Loss/PutWeights";
constexpr char kFetchGradientsMethod[] = "/lossd.v1.Loss/FetchGradients";
// A channel argument that differs between a client's channels, so that gRPC gives each its
// own subchannel (and TCP connection) even in a local subchannel pool.
constexpr char kConnectionIndexArg[] = "lossd.connection_index";

v1::DType ToProto(DType t) {
  switch (t) {
    case DType::kBF16:
      return v1::DTYPE_BF16;
    case DType::kF16:
      return v1::DTYPE_FP16;
    case DType::kF32:
      return v1::DTYPE_FP32;
    case DType::kI32:
      return v1::DTYPE_INT32;
    case DType::kI64:
      return v1::DTYPE_INT64;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::DType t) {
  switch (t) {
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP16:
      return DType::kF16;
    case v1::DTYPE_FP32:
      return DType::kF32;
    case v1::DTYPE_INT32:
      return DType::kI32;
    case v1::DTYPE_INT64:
      return DType::kI64;
    default:
      return absl::InternalError(absl::StrCat("server sent an unknown dtype ", t));
  }
}

v1::Reduction ToProto(Reduction r) {
  switch (r) {
    case Reduction::kMean:
      return v1::REDUCTION_MEAN;
    case Reduction::kSum:
      return v1::REDUCTION_SUM;
    case Reduction::kNone:
      return v1::REDUCTION_NONE;
  }
  return v1::REDUCTION_MEAN;
}

void FillSpec(const HostTensor& t, v1::TensorSpec* spec) {
  spec->set_dtype(ToProto(t.dtype()));
  for (int64_t d : t.shape()) spec->add_shape(d);
}

std::string TensorIdName(int32_t id) {
  if (id >= static_cast<int32_t>(OutputTensor::kLoss) &&
      id <= static_cast<int32_t>(OutputTensor::kDb)) {
    return OutputTensorName(static_cast<OutputTensor>(id));
  }
  return absl::StrCat("tensor#", id);
}

// Drives one streaming call (any of the three streaming kinds: on the wire they are all a
// stream each way) to its end: sends every message in order and half-closes, and hands each
// received message to `on_message`. Writes and reads run at once, so a server that answers
// early (an error after the header) is heard at once.
//
// Received messages are handled on the thread that called Run(), not in gRPC's reactions:
// copying a multi-MiB part into its (often freshly allocated, page-faulting) output buffer is
// long work that would otherwise hold up gRPC's event threads; here it overlaps with gRPC
// reading the next part. Up to kMaxQueued messages wait; beyond that reading pauses, so flow
// control holds the server back.
class StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  using Handler = std::function<absl::Status(const grpc::ByteBuffer&)>;

  StreamCall(std::vector<grpc::ByteBuffer> out, Handler on_message)
      : out_(std::move(out)), on_message_(std::move(on_message)) {}

  // Blocks until the call is over. Returns the handler's first error (the call is cancelled
  // then), else the call's status.
  absl::Status Run(grpc::GenericStub* stub, const char* method, grpc::ClientContext* ctx) {
    ctx_ = ctx;
    stub->PrepareBidiStreamingCall(ctx, method, grpc::StubOptions(), this);
    // The hold keeps the call open while this thread may still restart a paused read.
    AddHold();
    reading_ = true;
    StartRead(&in_);
    StartNextWrite();
    StartCall();

    absl::Status handler_status;
    for (;;) {
      grpc::ByteBuffer msg;
      bool restart = false;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &StreamCall::HasWork));
        if (queue_.empty()) break;  // the response stream has ended
        msg = std::move(queue_.front());
        queue_.pop_front();
        if (!reading_ && !read_ended_) restart = reading_ = true;
      }
      if (restart) StartRead(&in_);
      handler_status = on_message_(msg);
      if (!handler_status.ok()) {
        absl::MutexLock lock(&mu_);
        stop_reading_ = true;
        queue_.clear();
        break;
      }
    }
    if (!handler_status.ok()) ctx_->TryCancel();
    RemoveHold();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    // gRPC has released these by now, except for slices the transport still holds (the
    // caller's SliceTracker waits for those).
    out_.clear();
    queue_.clear();
    if (!handler_status.ok()) return handler_status;
    return FromGrpcStatus(status_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call is broken; OnDone brings the status
    ++next_;
    StartNextWrite();
  }

  void OnReadDone(bool ok) override {
    bool restart = false;
    {
      absl::MutexLock lock(&mu_);
      if (!ok) {  // end of the response stream
        reading_ = false;
        read_ended_ = true;
        return;
      }
      queue_.push_back(std::move(in_));
      in_ = grpc::ByteBuffer();
      restart = queue_.size() < kMaxQueued && !stop_reading_;
      reading_ = restart;
    }
    // Only one read is ever outstanding, so in_ is free to reuse.
    if (restart) StartRead(&in_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;
  }

 private:
  static constexpr size_t kMaxQueued = 8;

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || read_ended_; }

  void StartNextWrite() {
    if (next_ + 1 < out_.size()) {
      StartWrite(&out_[next_]);
    } else if (next_ + 1 == out_.size()) {
      StartWriteLast(&out_[next_], grpc::WriteOptions());
    } else if (out_.empty()) {
      StartWritesDone();
    }
  }

  std::vector<grpc::ByteBuffer> out_;
  size_t next_ = 0;      // touched only by StartNextWrite, before StartCall and in OnWriteDone
  grpc::ByteBuffer in_;  // the outstanding read's target
  Handler on_message_;
  grpc::ClientContext* ctx_ = nullptr;

  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;  // a read is outstanding
  bool read_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_reading_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// Runs one streaming call on a ClientContext of its own, destroyed before this returns: the
// context holds the call, and the call keeps any slice it did not send (after an early error)
// until it is destroyed, so a SliceTracker could not finish waiting while it lives.
absl::Status RunStream(grpc::GenericStub* stub, const char* method,
                       const std::function<void(grpc::ClientContext*)>& prepare,
                       std::vector<grpc::ByteBuffer> out, StreamCall::Handler on_message) {
  grpc::ClientContext ctx;
  prepare(&ctx);
  StreamCall stream(std::move(out), std::move(on_message));
  return stream.Run(stub, method, &ctx);
}

// Appends the parts of one tensor, in byte order: each at most part_bytes rounded down to
// whole elements (at least one), because a server may refuse a part that splits an element.
void AppendParts(v1::TensorId id, const HostTensor& t, size_t part_bytes, SliceTracker* tracker,
                 std::vector<grpc::ByteBuffer>* out, uint64_t* bytes) {
  const size_t size = t.num_bytes();
  const size_t elem = DTypeSize(t.dtype());
  const size_t step = std::max(elem, part_bytes - part_bytes % elem);
  for (size_t off = 0; off < size; off += step) {
    out->push_back(EncodePart(id, off, t.data() + off, std::min(step, size - off), tracker));
  }
  *bytes += size;
}

// One announced output tensor being received.
struct Incoming {
  int32_t id = 0;
  HostTensor tensor;
  size_t size = 0;
  size_t received = 0;
};

// Receives announced tensors part by part, straight into their buffers, checking that each
// tensor's parts come in byte order and add up to exactly its size.
class TensorReceiver {
 public:
  // `into` (nullable): caller memory to receive into.
  absl::Status Announce(int32_t id, DType dtype, std::vector<int64_t> shape,
                        const OutputBuffer* into) {
    for (const Incoming& in : incoming_) {
      if (in.id == id) {
        return absl::InternalError(
            absl::StrCat("server announced output ", TensorIdName(id), " twice"));
      }
    }
    Incoming in;
    in.id = id;
    absl::StatusOr<size_t> size = TensorByteSize(dtype, shape);
    if (!size.ok()) {
      return absl::InternalError(absl::StrCat("server announced output ", TensorIdName(id),
                                              " with a bad shape: ", size.status().message()));
    }
    in.size = *size;
    if (into != nullptr && into->data != nullptr) {
      if (into->capacity < in.size) {
        return absl::InvalidArgumentError(
            absl::StrCat("output_into[", TensorIdName(id), "] holds ", into->capacity,
                         " bytes; the ", ShapeString(dtype, shape), " result needs ", in.size));
      }
      in.tensor = HostTensor::MutableView(dtype, std::move(shape), into->data);
    } else {
      try {
        in.tensor = HostTensor::Owned(dtype, std::move(shape));
      } catch (const std::bad_alloc&) {
        return absl::ResourceExhaustedError(
            absl::StrCat("cannot allocate ", in.size, " bytes for output ", TensorIdName(id)));
      }
    }
    incoming_.push_back(std::move(in));
    return absl::OkStatus();
  }

  absl::Status Accept(const StreamFrame& f) {
    Incoming* in = nullptr;
    for (Incoming& i : incoming_) {
      if (i.id == f.tensor()) in = &i;
    }
    if (in == nullptr) {
      return absl::InternalError(absl::StrCat("server sent a part of ", TensorIdName(f.tensor()),
                                              ", which it did not announce"));
    }
    if (f.offset() != in->received) {
      return absl::InternalError(absl::StrCat("parts out of order: ", TensorIdName(in->id),
                                              " part at byte offset ", f.offset(), ", expected ",
                                              in->received));
    }
    if (f.data_size() > in->size - in->received) {
      return absl::DataLossError(absl::StrCat(TensorIdName(in->id), ": part [", f.offset(), ", ",
                                              f.offset() + f.data_size(), ") runs past the ",
                                              in->size, " bytes of ", in->tensor.DebugString()));
    }
    f.CopyDataTo(in->tensor.mutable_data() + in->received);
    in->received += f.data_size();
    bytes_ += f.data_size();
    return absl::OkStatus();
  }

  absl::Status CheckComplete() const {
    for (const Incoming& in : incoming_) {
      if (in.received != in.size) {
        return absl::DataLossError(absl::StrCat("stream ended early: ", TensorIdName(in.id),
                                                " got ", in.received, " of ", in.size, " bytes of ",
                                                in.tensor.DebugString()));
      }
    }
    return absl::OkStatus();
  }

  std::vector<Incoming>& incoming() { return incoming_; }
  uint64_t bytes() const { return bytes_; }

 private:
  std::vector<Incoming> incoming_;
  uint64_t bytes_ = 0;
};

std::vector<int64_t> ShapeOf(const v1::TensorSpec& spec) {
  return std::vector<int64_t>(spec.shape().begin(), spec.shape().end());
}

// What Compute expects of each output, from the request.
absl::Status CheckOutputSpec(const ComputeRequest& r, OutputTensor t, DType dtype,
                             const std::vector<int64_t>& shape) {
  const int64_t bt = r.x.dim(0);
  const int64_t h = r.x.dim(1);
  const DType grad = r.grad_dtype.value_or(r.x.dtype());
  DType want_dtype = DType::kF32;
  std::vector<int64_t> want_shape = {bt};
  // V is known only for inline weights; with a handle any V >= 1 is accepted.
  const int64_t v = r.w.has_value() ? r.w->dim(0) : (shape.empty() ? -1 : shape[0]);
  switch (t) {
    case OutputTensor::kLoss:
    case OutputTensor::kLse:
    case OutputTensor::kZLoss:
      break;
    case OutputTensor::kPredictions:
      want_dtype = DType::kI64;
      break;
    case OutputTensor::kDx:
      want_dtype = grad;
      want_shape = {bt, h};
      break;
    case OutputTensor::kDw:
      want_dtype = grad;
      want_shape = {v, h};
      break;
    case OutputTensor::kDb:
      want_dtype = grad;
      want_shape = {v};
      break;
  }
  if (dtype != want_dtype || shape != want_shape || (!shape.empty() && shape[0] < 0)) {
    return absl::InternalError(absl::StrCat("server announced ", OutputTensorName(t), " as ",
                                            ShapeString(dtype, shape), ", expected ",
                                            ShapeString(want_dtype, want_shape)));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const ComputeRequest& r) {
  LOSSD_CLIENT_RETURN_IF_ERROR(r.x.Validate("x"));
  LOSSD_CLIENT_RETURN_IF_ERROR(r.targets.Validate("targets"));
  if (r.x.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("x must be (BT, H), got ", r.x.DebugString()));
  }
  if (r.w.has_value() == !r.weight_handle.empty()) {
    return absl::InvalidArgumentError("give exactly one of w and weight_handle");
  }
  if (r.w.has_value()) LOSSD_CLIENT_RETURN_IF_ERROR(r.w->Validate("w"));
  if (r.bias.has_value()) {
    if (!r.w.has_value()) {
      return absl::InvalidArgumentError(
          "bias goes with inline weights; a weight handle carries its own bias");
    }
    LOSSD_CLIENT_RETURN_IF_ERROR(r.bias->Validate("bias"));
  }
  if (r.class_weights.has_value()) {
    LOSSD_CLIENT_RETURN_IF_ERROR(r.class_weights->Validate("class_weights"));
  }
  if (r.grad_output.has_value()) {
    LOSSD_CLIENT_RETURN_IF_ERROR(r.grad_output->Validate("grad_output"));
  }
  return absl::OkStatus();
}

}  // namespace

const char* OutputTensorName(OutputTensor t) {
  switch (t) {
    case OutputTensor::kLoss:
      return "loss";
    case OutputTensor::kLse:
      return "lse";
    case OutputTensor::kZLoss:
      return "z_loss";
    case OutputTensor::kPredictions:
      return "predictions";
    case OutputTensor::kDx:
      return "dx";
    case OutputTensor::kDw:
      return "dw";
    case OutputTensor::kDb:
      return "db";
  }
  return "unknown";
}

const HostTensor* ComputeResult::Find(OutputTensor t) const {
  auto it = outputs.find(t);
  return it == outputs.end() ? nullptr : &it->second;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

struct LossClient::Connection {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> generic;
  std::unique_ptr<v1::Loss::Stub> stub;
};

absl::StatusOr<std::unique_ptr<LossClient>> LossClient::Create(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("empty target");
  if (options.part_bytes == 0) return absl::InvalidArgumentError("part_bytes must be > 0");
  // A part's message adds a few dozen bytes of framing to its data.
  if (options.max_send_message_bytes >= 0 &&
      options.part_bytes + 64 > static_cast<size_t>(options.max_send_message_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("part_bytes ", options.part_bytes,
                                                   " does not fit max_send_message_bytes ",
                                                   options.max_send_message_bytes));
  }
  if (options.tls_client_cert.empty() != options.tls_client_key.empty()) {
    return absl::InvalidArgumentError("tls_client_cert and tls_client_key go together");
  }
  if (!options.tls && (!options.tls_root_certs.empty() || !options.tls_client_cert.empty() ||
                       !options.tls_server_name.empty())) {
    return absl::InvalidArgumentError("TLS settings given without tls = true");
  }
  if (options.connections < 1 || options.connections > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections must be in [1, 256], got ", options.connections));
  }
  return std::unique_ptr<LossClient>(new LossClient(options));
}

LossClient::LossClient(const ClientOptions& options) : options_(options) {
  for (int i = 0; i < options_.connections; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options_.max_receive_message_bytes);
    args.SetMaxSendMessageSize(options_.max_send_message_bytes);
    // Channels with equal arguments share one connection through gRPC's global subchannel
    // pool; a local pool plus a distinct argument gives each channel its own.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(kConnectionIndexArg, i);
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (options_.tls) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = options_.tls_root_certs;
      ssl.pem_cert_chain = options_.tls_client_cert;
      ssl.pem_private_key = options_.tls_client_key;
      creds = grpc::SslCredentials(ssl);
      if (!options_.tls_server_name.empty()) {
        args.SetSslTargetNameOverride(options_.tls_server_name);
      }
    }
    auto c = std::make_unique<Connection>();
    c->channel = grpc::CreateCustomChannel(options_.target, creds, args);
    c->generic = std::make_unique<grpc::GenericStub>(c->channel);
    c->stub = v1::Loss::NewStub(c->channel);
    connections_.push_back(std::move(c));
  }
}

LossClient::~LossClient() = default;

LossClient::Connection& LossClient::NextConnection() {
  return *connections_[next_.fetch_add(1, std::memory_order_relaxed) % connections_.size()];
}

void LossClient::PrepareContext(const CallOptions& call, grpc::ClientContext* ctx) const {
  const absl::Duration deadline = call.deadline.value_or(options_.deadline);
  if (deadline != absl::InfiniteDuration()) {
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(deadline));
  }
  ctx->set_wait_for_ready(options_.wait_for_ready);
  if (!options_.auth_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.auth_token);
  }
  for (const auto& kv : options_.metadata) ctx->AddMetadata(kv.first, kv.second);
}

absl::StatusOr<ComputeResult> LossClient::Compute(const ComputeRequest& r,
                                                  const CallOptions& call) {
  LOSSD_CLIENT_RETURN_IF_ERROR(ValidateRequest(r));
  const absl::Time start = absl::Now();

  v1::ComputeRequest head;
  v1::ComputeHeader* h = head.mutable_header();
  FillSpec(r.x, h->mutable_x());
  if (r.w.has_value()) FillSpec(*r.w, h->mutable_w());
  h->set_weight_handle(r.weight_handle);
  if (r.bias.has_value()) FillSpec(*r.bias, h->mutable_bias());
  FillSpec(r.targets, h->mutable_targets());
  if (r.class_weights.has_value()) FillSpec(*r.class_weights, h->mutable_class_weights());
  if (r.grad_output.has_value()) FillSpec(*r.grad_output, h->mutable_grad_output());
  v1::LossOptions* o = h->mutable_options();
  o->set_ignore_index(r.options.ignore_index);
  o->set_reduction(ToProto(r.options.reduction));
  o->set_label_smoothing(r.options.label_smoothing);
  o->set_lse_square_scale(r.options.z_loss_scale);
  o->set_softcap(r.options.softcap);
  o->set_grad_dtype(r.grad_dtype.has_value() ? ToProto(*r.grad_dtype) : v1::DTYPE_UNSPECIFIED);
  o->set_grad_scale(r.options.grad_scale);
  o->set_chunk_rows(r.options.chunk_rows);
  v1::Outputs* want = h->mutable_outputs();
  want->set_dx(r.want.dx);
  want->set_dw(r.want.dw);
  want->set_db(r.want.db);
  want->set_lse(r.want.lse);
  want->set_z_loss(r.want.z_loss);
  want->set_accuracy(r.want.accuracy);
  want->set_predictions(r.want.predictions);
  h->set_accumulator(r.accumulator);
  h->set_response_part_bytes(options_.response_part_bytes);

  // The tracker outlives the call: it waits (in its destructor too) until gRPC lets go of
  // the caller's memory.
  SliceTracker tracker;
  ComputeResult result;
  std::vector<grpc::ByteBuffer> out;
  out.push_back(EncodeMessage(head));
  // Small tensors and the weight first, X last: a server can start on the first rows of X
  // while the rest is still arriving, but needs everything else for that.
  const size_t pb = options_.part_bytes;
  if (r.w.has_value()) AppendParts(v1::TENSOR_W, *r.w, pb, &tracker, &out, &result.bytes_sent);
  if (r.bias.has_value()) {
    AppendParts(v1::TENSOR_BIAS, *r.bias, pb, &tracker, &out, &result.bytes_sent);
  }
  if (r.class_weights.has_value()) {
    AppendParts(v1::TENSOR_CLASS_WEIGHTS, *r.class_weights, pb, &tracker, &out, &result.bytes_sent);
  }
  AppendParts(v1::TENSOR_TARGETS, r.targets, pb, &tracker, &out, &result.bytes_sent);
  if (r.grad_output.has_value()) {
    AppendParts(v1::TENSOR_GRAD_OUTPUT, *r.grad_output, pb, &tracker, &out, &result.bytes_sent);
  }
  AppendParts(v1::TENSOR_X, r.x, pb, &tracker, &out, &result.bytes_sent);

  bool have_summary = false;
  TensorReceiver receiver;
  StreamFrame frame;
  auto on_message = [&](const grpc::ByteBuffer& msg) -> absl::Status {
    absl::Status parsed = frame.Parse(msg);
    if (!parsed.ok()) return absl::InternalError(parsed.message());
    if (frame.kind() == StreamFrame::Kind::kPart) {
      if (!have_summary) return absl::InternalError("server sent a part before its summary");
      return receiver.Accept(frame);
    }
    if (frame.kind() != StreamFrame::Kind::kHeader) {
      return absl::InternalError("server sent a ComputeResponse with neither summary nor part");
    }
    if (have_summary) return absl::InternalError("server sent a second summary");
    have_summary = true;
    v1::ComputeSummary s;
    if (!s.ParseFromString(frame.header_bytes())) {
      return absl::InternalError("cannot parse the server's ComputeSummary");
    }
    if (s.tensors_size() != s.specs_size()) {
      return absl::InternalError(absl::StrCat("summary lists ", s.tensors_size(), " tensors but ",
                                              s.specs_size(), " specs"));
    }
    result.loss = s.loss();
    result.z_loss = s.z_loss();
    result.accuracy = s.accuracy();
    result.tokens = s.tokens();
    result.compute_seconds = s.compute_seconds();
    result.backend = s.backend();
    result.accumulated_micro_batches = s.accumulated_micro_batches();
    for (int i = 0; i < s.tensors_size(); ++i) {
      const int32_t id = s.tensors(i);
      if (id < static_cast<int32_t>(OutputTensor::kLoss) ||
          id > static_cast<int32_t>(OutputTensor::kDb)) {
        return absl::InternalError(
            absl::StrCat("summary lists ", TensorIdName(id), ", not an output tensor"));
      }
      const OutputTensor t = static_cast<OutputTensor>(id);
      absl::StatusOr<DType> dtype = FromProto(s.specs(i).dtype());
      if (!dtype.ok()) return dtype.status();
      std::vector<int64_t> shape = ShapeOf(s.specs(i));
      LOSSD_CLIENT_RETURN_IF_ERROR(CheckOutputSpec(r, t, *dtype, shape));
      auto into = r.output_into.find(t);
      LOSSD_CLIENT_RETURN_IF_ERROR(receiver.Announce(
          id, *dtype, std::move(shape), into == r.output_into.end() ? nullptr : &into->second));
    }
    return absl::OkStatus();
  };

  const absl::Status status = RunStream(
      NextConnection().generic.get(), kComputeMethod,
      [&](grpc::ClientContext* ctx) { PrepareContext(call, ctx); }, std::move(out), on_message);
  tracker.WaitUntilReleased();
  LOSSD_CLIENT_RETURN_IF_ERROR(status);
  if (!have_summary) return absl::InternalError("server ended the stream without a summary");
  LOSSD_CLIENT_RETURN_IF_ERROR(receiver.CheckComplete());
  for (Incoming& in : receiver.incoming()) {
    result.outputs.emplace(static_cast<OutputTensor>(in.id), std::move(in.tensor));
  }
  result.bytes_received = receiver.bytes();
  result.wall_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

absl::StatusOr<PutWeightsResult> LossClient::PutWeights(const HostTensor& w, const HostTensor* bias,
                                                        const CallOptions& call) {
  LOSSD_CLIENT_RETURN_IF_ERROR(w.Validate("w"));
  if (bias != nullptr) LOSSD_CLIENT_RETURN_IF_ERROR(bias->Validate("bias"));
  v1::PutWeightsRequest head;
  FillSpec(w, head.mutable_header()->mutable_w());
  if (bias != nullptr) FillSpec(*bias, head.mutable_header()->mutable_bias());

  SliceTracker tracker;
  uint64_t sent = 0;
  std::vector<grpc::ByteBuffer> out;
  out.push_back(EncodeMessage(head));
  AppendParts(v1::TENSOR_W, w, options_.part_bytes, &tracker, &out, &sent);
  if (bias != nullptr) {
    AppendParts(v1::TENSOR_BIAS, *bias, options_.part_bytes, &tracker, &out, &sent);
  }

  int replies = 0;
  v1::PutWeightsResponse reply;
  auto on_message = [&](const grpc::ByteBuffer& msg) -> absl::Status {
    if (++replies > 1) return absl::InternalError("server sent more than one PutWeights reply");
    absl::Status s = DecodeMessage(msg, &reply);
    return s.ok() ? s : absl::InternalError(s.message());
  };
  const absl::Status status = RunStream(
      NextConnection().generic.get(), kPutWeightsMethod,
      [&](grpc::ClientContext* ctx) { PrepareContext(call, ctx); }, std::move(out), on_message);
  tracker.WaitUntilReleased();
  LOSSD_CLIENT_RETURN_IF_ERROR(status);
  if (replies != 1) return absl::InternalError("server ended PutWeights without a reply");
  if (reply.handle().empty()) return absl::InternalError("server returned an empty handle");
  return PutWeightsResult{reply.handle(), reply.bytes()};
}

absl::Status LossClient::DropWeights(const std::string& handle, const CallOptions& call) {
  v1::DropWeightsRequest req;
  req.set_handle(handle);
  v1::DropWeightsResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(call, &ctx);
  return FromGrpcStatus(NextConnection().stub->DropWeights(&ctx, req, &resp));
}

absl::StatusOr<FetchGradientsResult> LossClient::FetchGradients(const std::string& accumulator,
                                                                bool reset,
                                                                const CallOptions& call) {
  v1::FetchGradientsRequest req;
  req.set_accumulator(accumulator);
  req.set_reset(reset);
  req.set_response_part_bytes(options_.response_part_bytes);
  std::vector<grpc::ByteBuffer> out;
  out.push_back(EncodeMessage(req));

  FetchGradientsResult result;
  bool have_header = false;
  bool have_db = false;
  TensorReceiver receiver;
  StreamFrame frame;
  auto on_message = [&](const grpc::ByteBuffer& msg) -> absl::Status {
    absl::Status parsed = frame.Parse(msg);
    if (!parsed.ok()) return absl::InternalError(parsed.message());
    if (frame.kind() == StreamFrame::Kind::kPart) {
      if (!have_header) return absl::InternalError("server sent a part before its header");
      return receiver.Accept(frame);
    }
    if (frame.kind() != StreamFrame::Kind::kHeader) {
      return absl::InternalError("server sent a message with neither header nor part");
    }
    if (have_header) return absl::InternalError("server sent a second GradientsHeader");
    have_header = true;
    v1::GradientsHeader g;
    if (!g.ParseFromString(frame.header_bytes())) {
      return absl::InternalError("cannot parse the server's GradientsHeader");
    }
    result.micro_batches = g.micro_batches();
    result.tokens = g.tokens();
    result.instance = g.instance();
    std::vector<int64_t> dw = ShapeOf(g.dw());
    if (g.dw().dtype() != v1::DTYPE_FP32 || dw.size() != 2) {
      return absl::InternalError(absl::StrCat("server announced dw as dtype ", g.dw().dtype(),
                                              " rank ", dw.size(), ", expected fp32 (V, H)"));
    }
    const int64_t v = dw[0];
    LOSSD_CLIENT_RETURN_IF_ERROR(
        receiver.Announce(v1::TENSOR_DW, DType::kF32, std::move(dw), nullptr));
    if (g.has_db()) {
      std::vector<int64_t> db = ShapeOf(g.db());
      if (g.db().dtype() != v1::DTYPE_FP32 || db != std::vector<int64_t>{v}) {
        return absl::InternalError(absl::StrCat("server announced db as dtype ", g.db().dtype(),
                                                " shape [", absl::StrJoin(db, ", "),
                                                "], expected fp32 (", v, ")"));
      }
      have_db = true;
      LOSSD_CLIENT_RETURN_IF_ERROR(
          receiver.Announce(v1::TENSOR_DB, DType::kF32, std::move(db), nullptr));
    }
    return absl::OkStatus();
  };
  const absl::Status status = RunStream(
      NextConnection().generic.get(), kFetchGradientsMethod,
      [&](grpc::ClientContext* ctx) { PrepareContext(call, ctx); }, std::move(out), on_message);
  LOSSD_CLIENT_RETURN_IF_ERROR(status);
  if (!have_header) return absl::InternalError("server ended the stream without a header");
  LOSSD_CLIENT_RETURN_IF_ERROR(receiver.CheckComplete());
  result.dw = std::move(receiver.incoming()[0].tensor);
  if (have_db) result.db = std::move(receiver.incoming()[1].tensor);
  return result;
}

absl::Status LossClient::DropAccumulator(const std::string& accumulator, const CallOptions& call) {
  v1::DropAccumulatorRequest req;
  req.set_accumulator(accumulator);
  v1::DropAccumulatorResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(call, &ctx);
  return FromGrpcStatus(NextConnection().stub->DropAccumulator(&ctx, req, &resp));
}

absl::StatusOr<ServerInfoResult> LossClient::ServerInfo(const CallOptions& call) {
  v1::ServerInfoRequest req;
  v1::ServerInfoResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(call, &ctx);
  LOSSD_CLIENT_RETURN_IF_ERROR(FromGrpcStatus(NextConnection().stub->ServerInfo(&ctx, req, &resp)));
  ServerInfoResult info;
  info.version = resp.version();
  info.instance = resp.instance();
  info.backend = resp.backend();
  info.device = resp.device();
  info.memory_total_bytes = resp.memory_total_bytes();
  info.memory_budget_bytes = resp.memory_budget_bytes();
  info.memory_in_use_bytes = resp.memory_in_use_bytes();
  info.weight_cache_budget_bytes = resp.weight_cache_budget_bytes();
  info.weight_cache_bytes = resp.weight_cache_bytes();
  info.max_part_bytes = resp.max_part_bytes();
  info.max_bt = resp.max_bt();
  info.max_h = resp.max_h();
  info.max_v = resp.max_v();
  info.max_in_flight = resp.max_in_flight();
  info.accumulators = resp.accumulators();
  return info;
}

void TuneMallocForLargeMessages() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
}

}  // namespace client
}  // namespace lossd
