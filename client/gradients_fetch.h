// SPDX-License-Identifier: Apache-2.0
// The streams of one FetchGradients call in the C++ client: the whole accumulator on one
// stream, a one-value look that learns its size and counters, and byte ranges of dW | db on
// several streams at once, each received straight into place and checked against the wire
// contract (GradientsStream) and the look (CheckSameGradients). Decides neither how many
// streams nor how many ranges: LossClient::FetchGradients does, from its options and the
// server's memory budget.
#ifndef LOSSD_CLIENT_GRADIENTS_FETCH_H_
#define LOSSD_CLIENT_GRADIENTS_FETCH_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client_types.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "lossd/v1/lossd.pb.h"
#include "wire/part_codec.h"

namespace lossd {
namespace client {

// Checks a GradientsHeader's specs (fp32 dW (V, H), optional fp32 db (V)); returns their
// byte sizes.
absl::Status CheckGradientsHeader(const v1::GradientsHeader& g, uint64_t* dw_bytes,
                                  uint64_t* db_bytes);

// Allocates the result's dW (and db) for a header already checked, and copies its counters.
absl::Status AllocateGradients(const v1::GradientsHeader& g, FetchGradientsResult* r);

// ABORTED unless a range's header says what the first look said: a Compute that added to the
// accumulator in between would make the ranges disagree.
absl::Status CheckSameGradients(const std::string& name, const v1::GradientsHeader& first,
                                const v1::GradientsHeader& g);

// One FetchGradients stream (everything, or a byte range of the concatenation dW | db),
// received straight into place: checks that the parts come in byte order, never leave the
// range or cross from one tensor into the other, and cover the range exactly.
class GradientsStream {
 public:
  // Where dW and db land (null: the bytes are checked and dropped).
  struct Dest {
    uint8_t* dw = nullptr;  // (V, H) fp32
    uint8_t* db = nullptr;  // (V) fp32
  };
  // Called with the (checked) header; says where the bytes go, or fails the stream.
  using HeaderFn = std::function<absl::StatusOr<Dest>(const v1::GradientsHeader&)>;

  // [begin, end): the range asked for; 0, 0 = everything.
  GradientsStream(uint64_t begin, uint64_t end, HeaderFn on_header)
      : begin_(begin), end_(end), on_header_(std::move(on_header)) {}

  absl::Status OnMessage(const grpc::ByteBuffer& msg);
  absl::Status CheckComplete() const;

  const v1::GradientsHeader& header() const { return header_; }
  bool has_header() const { return have_header_; }
  uint64_t total_bytes() const { return dw_bytes_ + db_bytes_; }

 private:
  absl::Status OnHeader();

  uint64_t begin_, end_;
  HeaderFn on_header_;
  wire::StreamFrame frame_;
  bool have_header_ = false;
  v1::GradientsHeader header_;
  uint64_t dw_bytes_ = 0, db_bytes_ = 0;
  uint64_t next_ = 0;  // the next expected byte of dW | db
  Dest dest_;
};

// The requests of one FetchGradients call, all naming the accumulator and its instance.
class GradientsFetch {
 public:
  using Prepare = std::function<void(grpc::ClientContext*)>;

  // `prepare` sets each stream's deadline and metadata.
  GradientsFetch(std::string accumulator, std::string instance, uint32_t response_part_bytes,
                 Prepare prepare);

  // A one-value ranged fetch (changes nothing on the server): learns the accumulator's size
  // and counters, which every later range must match.
  absl::Status TakeLook(grpc::GenericStub* stub);
  bool has_look() const { return look_.has_value(); }
  const v1::GradientsHeader& look_header() const { return look_->header(); }
  uint64_t total_bytes() const { return look_->total_bytes(); }  // dW | db, after TakeLook

  // The whole accumulator on one stream into *result (allocated once its header arrives);
  // `reset` zeroes it on the server after. *had_header: the server answered with a header
  // (so it may have reset the accumulator) before whatever went wrong.
  absl::Status FetchWhole(grpc::GenericStub* stub, bool reset, FetchGradientsResult* result,
                          bool* had_header);

  // `ranges` ranges of whole fp32 values of dW | db straight into `dest`, one stream per
  // stub at once, each fetching its share of the ranges one after another. Each must match
  // the look (after TakeLook). Ranges change nothing on the server: safe to fetch again.
  absl::Status FetchRanges(const std::vector<grpc::GenericStub*>& stubs, uint64_t ranges,
                           GradientsStream::Dest dest);

 private:
  std::vector<grpc::ByteBuffer> Request(bool reset, uint64_t begin, uint64_t end) const;

  const std::string accumulator_;
  const std::string instance_;
  const uint32_t response_part_bytes_;
  const Prepare prepare_;
  std::optional<GradientsStream> look_;
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_GRADIENTS_FETCH_H_
