// SPDX-License-Identifier: Apache-2.0
#include "client/head_export.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client_wire.h"
#include "client/stream_call.h"
#include "core/status_macros.h"
#include "lossd/v1/lossd.pb.h"
#include "wire/part_codec.h"

namespace lossd {
namespace client {
namespace {

// The look's range: one fp32 value of the master, which always comes first.
constexpr uint64_t kLookBytes = sizeof(float);

bool IsHeadTensorId(int32_t id) {
  return id >= static_cast<int32_t>(HeadTensor::kMasterW) &&
         id <= static_cast<int32_t>(HeadTensor::kCopyBias);
}

// One ExportHead stream: the range [begin, end) of the concatenation, its parts checked and
// handed to a sink in byte order.
class ExportRangeStream {
 public:
  // sink null: the bytes are checked and dropped. expect (nullable): the look's header, which
  // this range's must repeat but for its range.
  ExportRangeStream(uint64_t begin, uint64_t end, const HeadExportSink* sink,
                    const v1::ExportHeader* expect)
      : begin_(begin), end_(end), next_(begin), sink_(sink), expect_(expect) {}

  absl::Status OnMessage(const grpc::ByteBuffer& msg) {
    absl::Status parsed = frame_.Parse(msg);
    if (!parsed.ok()) return absl::InternalError(parsed.message());
    if (frame_.kind() == wire::StreamFrame::Kind::kHeader) return OnHeader();
    if (frame_.kind() != wire::StreamFrame::Kind::kPart) {
      return absl::InternalError("server sent an ExportHead message with neither header nor part");
    }
    if (!have_header_) return absl::InternalError("server sent a part before its ExportHeader");
    return OnPart();
  }

  absl::Status CheckComplete() const {
    if (!have_header_) return absl::InternalError("server ended ExportHead without a header");
    if (next_ != end_) {
      return absl::DataLossError(absl::StrCat("ExportHead ended early: got bytes [", begin_,
                                              ", ", next_, ") of [", begin_, ", ", end_, ")"));
    }
    return absl::OkStatus();
  }

  const v1::ExportHeader& header() const { return header_; }
  uint64_t total() const { return total_; }

 private:
  absl::Status OnHeader();
  absl::Status OnPart();

  const uint64_t begin_, end_;
  uint64_t next_;  // the next expected byte of the concatenation
  const HeadExportSink* const sink_;
  const v1::ExportHeader* const expect_;
  wire::StreamFrame frame_;
  bool have_header_ = false;
  v1::ExportHeader header_;
  std::vector<uint64_t> start_, size_;  // each announced tensor's place in the concatenation
  uint64_t total_ = 0;
};

absl::Status ExportRangeStream::OnHeader() {
  if (have_header_) return absl::InternalError("server sent a second ExportHeader");
  have_header_ = true;
  if (!header_.ParseFromString(frame_.header_bytes())) {
    return absl::InternalError("cannot parse the server's ExportHeader");
  }
  if (header_.tensors_size() != header_.specs_size() || header_.tensors_size() == 0) {
    return absl::InternalError(absl::StrCat("ExportHeader lists ", header_.tensors_size(),
                                            " tensors and ", header_.specs_size(), " specs"));
  }
  for (int i = 0; i < header_.tensors_size(); ++i) {
    const int32_t id = header_.tensors(i);
    absl::StatusOr<DType> dtype = FromProto(header_.specs(i).dtype());
    absl::StatusOr<size_t> bytes =
        dtype.ok() ? TensorByteSize(*dtype, ShapeOf(header_.specs(i))) : dtype.status();
    if (!IsHeadTensorId(id) || !bytes.ok() ||
        std::count(header_.tensors().begin(), header_.tensors().end(), id) != 1) {
      return absl::InternalError(absl::StrCat("ExportHeader lists tensor ", id, " (",
                                              TensorIdName(id), ") at ", i,
                                              ": not a head tensor, twice, or a bad spec"));
    }
    start_.push_back(total_);
    size_.push_back(*bytes);
    total_ += *bytes;
  }
  if (header_.range_begin() != begin_ || header_.range_end() != end_ || end_ > total_) {
    return absl::InternalError(absl::StrCat(
        "server answered the range [", begin_, ", ", end_, ") with [", header_.range_begin(),
        ", ", header_.range_end(), ") of an export of ", total_, " bytes"));
  }
  if (expect_ != nullptr) {
    v1::ExportHeader a = *expect_, b = header_;
    for (v1::ExportHeader* h : {&a, &b}) {
      h->clear_range_begin();
      h->clear_range_end();
    }
    if (a.SerializeAsString() != b.SerializeAsString()) {
      return absl::AbortedError(absl::StrCat(
          "head '", expect_->head().name(), "' changed between the ranges of its export "
          "(version ", expect_->head().version(), " then ", header_.head().version(),
          ", instance '", expect_->instance(), "' then '", header_.instance(),
          "'): export again"));
    }
  }
  return absl::OkStatus();
}

absl::Status ExportRangeStream::OnPart() {
  const int32_t id = frame_.tensor();
  const auto it = std::find(header_.tensors().begin(), header_.tensors().end(), id);
  if (it == header_.tensors().end()) {
    return absl::InternalError(
        absl::StrCat("server sent a part of ", TensorIdName(id), ", which it did not announce"));
  }
  const size_t i = static_cast<size_t>(it - header_.tensors().begin());
  const uint64_t off = frame_.offset(), size = frame_.data_size();
  if (off > size_[i] || size > size_[i] - off) {
    return absl::DataLossError(absl::StrCat(HeadTensorName(static_cast<HeadTensor>(id)),
                                            ": part [", off, ", ", off + size,
                                            ") runs past its ", size_[i], " bytes"));
  }
  if (start_[i] + off != next_) {
    return absl::InternalError(absl::StrCat(
        "export parts out of order: ", HeadTensorName(static_cast<HeadTensor>(id)),
        " part at byte ", off, " (", start_[i] + off, " of the export), expected ", next_));
  }
  if (size > end_ - next_) {
    return absl::DataLossError(absl::StrCat("an export part [", next_, ", ", next_ + size,
                                            ") runs past the range's end ", end_));
  }
  next_ += size;
  if (sink_ == nullptr) return absl::OkStatus();
  uint64_t at = off;
  for (const auto& [data, n] : frame_.data_pieces()) {
    LOSSD_RETURN_IF_ERROR((*sink_)(static_cast<HeadTensor>(id), at, data, n));
    at += n;
  }
  return absl::OkStatus();
}

std::vector<grpc::ByteBuffer> ExportRequest(const ExportCall& call,
                                            std::optional<uint64_t> version, uint64_t begin,
                                            uint64_t end) {
  v1::ExportHeadRequest req;
  req.set_head(call.name);
  if (version.has_value()) req.set_version(*version);
  req.set_response_part_bytes(call.response_part_bytes);
  req.set_range_begin(begin);
  req.set_range_end(end);
  req.set_head_instance(call.instance);
  std::vector<grpc::ByteBuffer> out;
  out.push_back(wire::EncodeMessage(req));
  return out;
}

// The export `look` describes, without tensors.
absl::StatusOr<HeadExport> ExportOf(const ExportRangeStream& look) {
  HeadExport e;
  LOSSD_ASSIGN_OR_RETURN(e.spec, HeadSpecFromProto(look.header().head()));
  for (int i = 0; i < look.header().tensors_size(); ++i) {
    ExportedTensor t;
    t.id = static_cast<HeadTensor>(look.header().tensors(i));
    LOSSD_ASSIGN_OR_RETURN(t.dtype, FromProto(look.header().specs(i).dtype()));
    t.shape = ShapeOf(look.header().specs(i));
    e.layout.push_back(std::move(t));
  }
  e.instance = look.header().instance();
  e.bytes = look.total();
  return e;
}

}  // namespace

absl::StatusOr<HeadExport> RunExport(grpc::GenericStub* stub, const ContextPreparer& prepare,
                                     const ExportCall& call, const ExportLayoutFn& on_layout,
                                     const HeadExportSink& sink) {
  LOSSD_RETURN_IF_ERROR(ValidateHeadName(call.name, "head"));
  ExportRangeStream look(0, kLookBytes, nullptr, nullptr);
  LOSSD_RETURN_IF_ERROR(RunStream(stub, kExportHeadMethod, prepare,
                                  ExportRequest(call, call.options.version, 0, kLookBytes),
                                  [&](const grpc::ByteBuffer& m) { return look.OnMessage(m); }));
  LOSSD_RETURN_IF_ERROR(look.CheckComplete());
  LOSSD_ASSIGN_OR_RETURN(HeadExport e, ExportOf(look));
  LOSSD_RETURN_IF_ERROR(on_layout(e));
  // Whole 4-byte values: every tensor before the copies is fp32, so no range splits one of
  // their elements, and the copies (2 or 4 bytes an element) start at a multiple of 4.
  const uint64_t step = std::max<uint64_t>(
      kLookBytes, call.options.range_bytes - call.options.range_bytes % kLookBytes);
  const uint64_t version = look.header().head().version();
  for (uint64_t begin = 0; begin < e.bytes; begin += step) {
    const uint64_t end = std::min(e.bytes, begin + step);
    ExportRangeStream range(begin, end, &sink, &look.header());
    LOSSD_RETURN_IF_ERROR(RunStream(stub, kExportHeadMethod, prepare,
                                    ExportRequest(call, version, begin, end),
                                    [&](const grpc::ByteBuffer& m) { return range.OnMessage(m); }));
    LOSSD_RETURN_IF_ERROR(range.CheckComplete());
    ++e.ranges;
  }
  return e;
}

absl::StatusOr<HeadExport> RunExportToTensors(grpc::GenericStub* stub,
                                              const ContextPreparer& prepare,
                                              const ExportCall& call) {
  std::map<HeadTensor, HostTensor> tensors;
  auto on_layout = [&](const HeadExport& e) -> absl::Status {
    for (const auto& [id, buf] : call.options.into) {
      const bool exported = std::any_of(e.layout.begin(), e.layout.end(),
                                        [id = id](const ExportedTensor& t) { return t.id == id; });
      if (!exported) {
        return absl::InvalidArgumentError(absl::StrCat("options.into[", HeadTensorName(id),
                                                       "]: the export of head '", e.spec.name,
                                                       "' holds no ", HeadTensorName(id)));
      }
    }
    for (const ExportedTensor& t : e.layout) {
      const size_t need = *TensorByteSize(t.dtype, t.shape);  // checked by the stream
      auto into = call.options.into.find(t.id);
      if (into == call.options.into.end()) {
        try {
          tensors[t.id] = HostTensor::Owned(t.dtype, t.shape);
        } catch (const std::bad_alloc&) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "cannot allocate ", HeadTensorName(t.id), " ", ShapeString(t.dtype, t.shape)));
        }
      } else if (into->second.data == nullptr || into->second.capacity < need) {
        return absl::InvalidArgumentError(absl::StrCat(
            "options.into[", HeadTensorName(t.id), "] holds ", into->second.capacity,
            " bytes; the ", ShapeString(t.dtype, t.shape), " tensor needs ", need));
      } else {
        tensors[t.id] = HostTensor::MutableView(t.dtype, t.shape, into->second.data);
      }
    }
    return absl::OkStatus();
  };
  auto sink = [&](HeadTensor t, uint64_t offset, const uint8_t* data, size_t size) {
    std::memcpy(tensors.at(t).mutable_data() + offset, data, size);
    return absl::OkStatus();
  };
  LOSSD_ASSIGN_OR_RETURN(HeadExport e, RunExport(stub, prepare, call, on_layout, sink));
  e.tensors = std::move(tensors);
  return e;
}

}  // namespace client
}  // namespace lossd
