// SPDX-License-Identifier: Apache-2.0
#include "client/gradients_fetch.h"

#include <new>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client_wire.h"
#include "client/output_receiver.h"
#include "client/stream_call.h"
#include "core/status_macros.h"

namespace lossd {
namespace client {

absl::Status CheckGradientsHeader(const v1::GradientsHeader& g, uint64_t* dw_bytes,
                                  uint64_t* db_bytes) {
  const std::vector<int64_t> dw = ShapeOf(g.dw());
  absl::StatusOr<size_t> dw_size = TensorByteSize(DType::kF32, dw);
  if (g.dw().dtype() != v1::DTYPE_FP32 || dw.size() != 2 || !dw_size.ok()) {
    return absl::InternalError(absl::StrCat("server announced dw as dtype ", g.dw().dtype(),
                                            " shape [", absl::StrJoin(dw, ", "),
                                            "], expected fp32 (V, H)"));
  }
  *dw_bytes = *dw_size;
  *db_bytes = 0;
  if (g.has_db()) {
    const std::vector<int64_t> db = ShapeOf(g.db());
    if (g.db().dtype() != v1::DTYPE_FP32 || db != std::vector<int64_t>{dw[0]}) {
      return absl::InternalError(absl::StrCat("server announced db as dtype ", g.db().dtype(),
                                              " shape [", absl::StrJoin(db, ", "),
                                              "], expected fp32 (", dw[0], ")"));
    }
    *db_bytes = static_cast<uint64_t>(dw[0]) * sizeof(float);
  }
  return absl::OkStatus();
}

absl::Status AllocateGradients(const v1::GradientsHeader& g, FetchGradientsResult* r) {
  try {
    r->dw = HostTensor::Owned(DType::kF32, ShapeOf(g.dw()));
    if (g.has_db()) r->db = HostTensor::Owned(DType::kF32, ShapeOf(g.db()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate the fp32 gradients ",
                     ShapeString(DType::kF32, ShapeOf(g.dw()))));
  }
  r->micro_batches = g.micro_batches();
  r->tokens = g.tokens();
  r->instance = g.instance();
  return absl::OkStatus();
}

absl::Status CheckSameGradients(const std::string& name, const v1::GradientsHeader& first,
                                const v1::GradientsHeader& g) {
  const bool same = g.dw().SerializeAsString() == first.dw().SerializeAsString() &&
                    g.has_db() == first.has_db() &&
                    g.db().SerializeAsString() == first.db().SerializeAsString() &&
                    g.micro_batches() == first.micro_batches() && g.tokens() == first.tokens() &&
                    g.instance() == first.instance();
  if (same) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(
      "accumulator '", name, "' changed while its ranges were fetched (micro_batches ",
      first.micro_batches(), " then ", g.micro_batches(), ", tokens ", first.tokens(), " then ",
      g.tokens(), "): a Compute added to it in between; fetch again"));
}

absl::Status GradientsStream::OnMessage(const grpc::ByteBuffer& msg) {
  absl::Status parsed = frame_.Parse(msg);
  if (!parsed.ok()) return absl::InternalError(parsed.message());
  if (frame_.kind() == wire::StreamFrame::Kind::kHeader) return OnHeader();
  if (frame_.kind() != wire::StreamFrame::Kind::kPart) {
    return absl::InternalError("server sent a message with neither header nor part");
  }
  if (!have_header_) return absl::InternalError("server sent a part before its header");
  const bool is_db = frame_.tensor() == v1::TENSOR_DB;
  if (frame_.tensor() != v1::TENSOR_DW && !(is_db && db_bytes_ > 0)) {
    return absl::InternalError(absl::StrCat("server sent a part of ",
                                            TensorIdName(frame_.tensor()),
                                            ", which it did not announce"));
  }
  const uint64_t limit = is_db ? db_bytes_ : dw_bytes_;
  const uint64_t off = frame_.offset(), size = frame_.data_size();
  if (off > limit || size > limit - off) {
    return absl::DataLossError(absl::StrCat(TensorIdName(frame_.tensor()), ": part [", off,
                                            ", ", off + size, ") runs past its ", limit,
                                            " bytes"));
  }
  const uint64_t at = (is_db ? dw_bytes_ : 0) + off;  // in dW | db
  if (at != next_) {
    return absl::InternalError(absl::StrCat("parts out of order: ", TensorIdName(frame_.tensor()),
                                            " part at byte offset ", off, " (", at,
                                            " in dw|db), expected ", next_));
  }
  if (size > end_ - next_) {
    return absl::DataLossError(absl::StrCat("a part [", at, ", ", at + size,
                                            ") of dw|db runs past the range's end ", end_));
  }
  uint8_t* dst = is_db ? dest_.db : dest_.dw;
  if (dst != nullptr) frame_.CopyDataTo(dst + off);
  next_ += size;
  return absl::OkStatus();
}

absl::Status GradientsStream::CheckComplete() const {
  if (!have_header_) return absl::InternalError("server ended the stream without a header");
  if (next_ != end_) {
    return absl::DataLossError(absl::StrCat("stream ended early: got dw|db bytes [", begin_,
                                            ", ", next_, ") of [", begin_, ", ", end_, ")"));
  }
  return absl::OkStatus();
}

absl::Status GradientsStream::OnHeader() {
  if (have_header_) return absl::InternalError("server sent a second GradientsHeader");
  have_header_ = true;
  if (!header_.ParseFromString(frame_.header_bytes())) {
    return absl::InternalError("cannot parse the server's GradientsHeader");
  }
  LOSSD_RETURN_IF_ERROR(CheckGradientsHeader(header_, &dw_bytes_, &db_bytes_));
  if (begin_ == 0 && end_ == 0) end_ = total_bytes();
  if (end_ > total_bytes()) {
    return absl::InternalError(absl::StrCat("server answered the range [", begin_, ", ", end_,
                                            ") of an accumulator of ", total_bytes(),
                                            " bytes"));
  }
  next_ = begin_;
  absl::StatusOr<Dest> dest = on_header_(header_);
  if (!dest.ok()) return dest.status();
  dest_ = *dest;
  return absl::OkStatus();
}

GradientsFetch::GradientsFetch(std::string accumulator, std::string instance,
                               uint32_t response_part_bytes, Prepare prepare)
    : accumulator_(std::move(accumulator)),
      instance_(std::move(instance)),
      response_part_bytes_(response_part_bytes),
      prepare_(std::move(prepare)) {}

std::vector<grpc::ByteBuffer> GradientsFetch::Request(bool reset, uint64_t begin,
                                                      uint64_t end) const {
  v1::FetchGradientsRequest req;
  req.set_accumulator(accumulator_);
  req.set_accumulator_instance(instance_);
  req.set_reset(reset);
  req.set_response_part_bytes(response_part_bytes_);
  req.set_range_begin(begin);
  req.set_range_end(end);
  std::vector<grpc::ByteBuffer> out;
  out.push_back(wire::EncodeMessage(req));
  return out;
}

absl::Status GradientsFetch::TakeLook(grpc::GenericStub* stub) {
  look_.emplace(0, sizeof(float), [](const v1::GradientsHeader&) {
    return GradientsStream::Dest{};
  });
  LOSSD_RETURN_IF_ERROR(
      RunStream(stub, kFetchGradientsMethod, prepare_, Request(false, 0, sizeof(float)),
                [this](const grpc::ByteBuffer& msg) { return look_->OnMessage(msg); }));
  return look_->CheckComplete();
}

absl::Status GradientsFetch::FetchWhole(grpc::GenericStub* stub, bool reset,
                                        FetchGradientsResult* result, bool* had_header) {
  std::optional<PagePopulator> populate;  // joined before this returns
  GradientsStream whole(0, 0, [&](const v1::GradientsHeader& g)
                                  -> absl::StatusOr<GradientsStream::Dest> {
    LOSSD_RETURN_IF_ERROR(AllocateGradients(g, result));
    populate.emplace(result->dw.mutable_data(), result->dw.num_bytes());
    return GradientsStream::Dest{result->dw.mutable_data(),
                                 result->db.has_value() ? result->db->mutable_data() : nullptr};
  });
  absl::Status s =
      RunStream(stub, kFetchGradientsMethod, prepare_, Request(reset, 0, 0),
                [&](const grpc::ByteBuffer& msg) { return whole.OnMessage(msg); });
  if (s.ok()) s = whole.CheckComplete();
  *had_header = whole.has_header();
  return s;
}

absl::Status GradientsFetch::FetchRanges(const std::vector<grpc::GenericStub*>& stubs,
                                         uint64_t ranges, GradientsStream::Dest dest) {
  const int streams = static_cast<int>(stubs.size());
  const uint64_t values = look_->total_bytes() / sizeof(float);
  StripeGroup group(streams, absl::ZeroDuration());
  return group.Run([&](int i) -> absl::Status {
    for (uint64_t j = i; j < ranges; j += streams) {
      const uint64_t begin = sizeof(float) * (values * j / ranges);
      const uint64_t end = sizeof(float) * (values * (j + 1) / ranges);
      GradientsStream range(begin, end, [&](const v1::GradientsHeader& g)
                                            -> absl::StatusOr<GradientsStream::Dest> {
        LOSSD_RETURN_IF_ERROR(CheckSameGradients(accumulator_, look_->header(), g));
        return dest;
      });
      LOSSD_RETURN_IF_ERROR(RunStream(
          stubs[i], kFetchGradientsMethod, prepare_, Request(false, begin, end),
          [&](const grpc::ByteBuffer& msg) { return range.OnMessage(msg); }, &group, i));
      LOSSD_RETURN_IF_ERROR(range.CheckComplete());
    }
    return absl::OkStatus();
  });
}

}  // namespace client
}  // namespace lossd
