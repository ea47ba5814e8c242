// SPDX-License-Identifier: Apache-2.0
#include "wire/part_codec.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace lossd {
namespace wire {
namespace {

constexpr int kWireVarint = 0;
constexpr int kWireFixed64 = 1;
constexpr int kWireLength = 2;
constexpr int kWireFixed32 = 5;

// TensorPart fields.
constexpr int kPartTensorField = 1;
constexpr int kPartOffsetField = 2;
constexpr int kPartDataField = 3;

size_t PutVarint(uint64_t v, uint8_t* out) {
  size_t n = 0;
  while (v >= 0x80) {
    out[n++] = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  out[n++] = static_cast<uint8_t>(v);
  return n;
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed stream message: ", what));
}

}  // namespace

// Walks the slices of a received message as one byte sequence.
class FrameReader {
 public:
  explicit FrameReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices_) total_ += s.size();
  }

  size_t pos() const { return pos_; }
  size_t total() const { return total_; }

  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes
  }

  // Consumes n bytes; with `pieces`, records where they lie.
  bool Take(size_t n, std::vector<std::pair<const uint8_t*, size_t>>* pieces) {
    if (n > total_ - pos_) return false;
    pos_ += n;
    while (n > 0) {
      const grpc::Slice& s = slices_[seg_];
      const size_t here = std::min(n, s.size() - off_);
      if (pieces != nullptr && here > 0) pieces->emplace_back(s.begin() + off_, here);
      n -= here;
      off_ += here;
      if (off_ == s.size()) {
        ++seg_;
        off_ = 0;
      }
    }
    return true;
  }

  bool TakeString(size_t n, std::string* out) {
    std::vector<std::pair<const uint8_t*, size_t>> pieces;
    if (!Take(n, &pieces)) return false;
    for (const auto& p : pieces) out->append(reinterpret_cast<const char*>(p.first), p.second);
    return true;
  }

  // Skips one field's value of the given wire type.
  bool SkipValue(int wire_type) {
    uint64_t v;
    switch (wire_type) {
      case kWireVarint:
        return ReadVarint(&v);
      case kWireFixed64:
        return Take(8, nullptr);
      case kWireLength:
        return ReadVarint(&v) && Take(v, nullptr);
      case kWireFixed32:
        return Take(4, nullptr);
      default:
        return false;  // groups are not proto3
    }
  }

 private:
  bool ReadByte(uint8_t* b) {
    if (pos_ >= total_) return false;
    while (off_ >= slices_[seg_].size()) {  // skip empty slices
      ++seg_;
      off_ = 0;
    }
    *b = slices_[seg_].begin()[off_];
    Take(1, nullptr);
    return true;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t total_ = 0;
  size_t pos_ = 0;
  size_t seg_ = 0;
  size_t off_ = 0;
};

grpc::Slice SliceTracker::Wrap(const void* data, size_t size) {
  {
    absl::MutexLock lock(&mu_);
    ++live_;
  }
  // gRPC never writes through a send slice; the cast only satisfies grpc_slice's type.
  return grpc::Slice(const_cast<void*>(data), size, &SliceTracker::Release, this);
}

void SliceTracker::Release(void* self) {
  auto* tracker = static_cast<SliceTracker*>(self);
  absl::MutexLock lock(&tracker->mu_);
  --tracker->live_;
}

void SliceTracker::WaitUntilReleased() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int64_t* live) { return *live == 0; }, &live_));
}

grpc::ByteBuffer EncodePart(int32_t tensor_id, uint64_t offset, const void* data, size_t size,
                            SliceTracker* tracker) {
  if (size == 0) return EncodePartSlice(tensor_id, offset, grpc::Slice());
  return EncodePartSlice(tensor_id, offset,
                         tracker != nullptr
                             ? tracker->Wrap(data, size)
                             : grpc::Slice(data, size, grpc::Slice::STATIC_SLICE));
}

grpc::ByteBuffer EncodePartSlice(int32_t tensor_id, uint64_t offset, grpc::Slice data) {
  const size_t size = data.size();
  // TensorPart body: tensor (varint), offset (varint), data; each omitted when 0 or empty,
  // as protobuf does, so the bytes equal protobuf's own encoding.
  // Enums are int32 on the wire: a negative one takes 10 bytes, as protobuf encodes it.
  const uint64_t tensor = static_cast<uint64_t>(static_cast<int64_t>(tensor_id));
  size_t body = 0;
  if (tensor_id != 0) body += 1 + VarintSize(tensor);
  if (offset != 0) body += 1 + VarintSize(offset);
  if (size != 0) body += 1 + VarintSize(size) + size;

  uint8_t prefix[48];
  size_t n = 0;
  prefix[n++] = static_cast<uint8_t>(kStreamPartField << 3 | kWireLength);
  n += PutVarint(body, prefix + n);
  if (tensor_id != 0) {
    prefix[n++] = static_cast<uint8_t>(kPartTensorField << 3 | kWireVarint);
    n += PutVarint(tensor, prefix + n);
  }
  if (offset != 0) {
    prefix[n++] = static_cast<uint8_t>(kPartOffsetField << 3 | kWireVarint);
    n += PutVarint(offset, prefix + n);
  }
  if (size == 0) {
    grpc::Slice only(prefix, n);
    return grpc::ByteBuffer(&only, 1);
  }
  prefix[n++] = static_cast<uint8_t>(kPartDataField << 3 | kWireLength);
  n += PutVarint(size, prefix + n);
  grpc::Slice slices[2] = {grpc::Slice(prefix, n), std::move(data)};
  return grpc::ByteBuffer(slices, 2);
}

grpc::ByteBuffer EncodeMessage(const google::protobuf::MessageLite& message) {
  std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

absl::Status DecodeMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message) {
  grpc::Slice slice;
  if (!buffer.DumpToSingleSlice(&slice).ok() ||
      !message->ParseFromArray(slice.begin(), static_cast<int>(slice.size()))) {
    return Malformed(absl::StrCat("cannot parse a ", message->GetTypeName()));
  }
  return absl::OkStatus();
}

void StreamFrame::CopyDataTo(uint8_t* dst) const {
  for (const auto& piece : data_) {
    std::memcpy(dst, piece.first, piece.second);
    dst += piece.second;
  }
}

absl::Status StreamFrame::Parse(const grpc::ByteBuffer& buffer) {
  kind_ = Kind::kNone;
  header_.clear();
  tensor_ = 0;
  offset_ = 0;
  data_size_ = 0;
  unknown_field_ = 0;
  unknown_in_part_ = false;
  data_.clear();
  slices_.clear();
  if (!buffer.Valid()) return Malformed("empty buffer");
  if (!buffer.Dump(&slices_).ok()) return Malformed("cannot read the buffer");
  FrameReader r(slices_);
  while (r.pos() < r.total()) {
    uint64_t tag;
    if (!r.ReadVarint(&tag)) return Malformed("truncated tag");
    const uint64_t field = tag >> 3;
    const int wire = static_cast<int>(tag & 7);
    if (field == 0) return Malformed("field number 0");
    if (field == kStreamHeaderField || field == kStreamPartField) {
      uint64_t len;
      if (wire != kWireLength) return Malformed("oneof member with a non-length wire type");
      if (!r.ReadVarint(&len) || len > r.total() - r.pos()) {
        return Malformed("truncated oneof member");
      }
      if (field == kStreamHeaderField) {
        // A repeated message field merges, and so does concatenating its serialized bytes.
        if (kind_ != Kind::kHeader) header_.clear();
        kind_ = Kind::kHeader;
        r.TakeString(len, &header_);
        continue;
      }
      if (kind_ != Kind::kPart) {
        tensor_ = 0;
        offset_ = 0;
        data_size_ = 0;
        data_.clear();
      }
      kind_ = Kind::kPart;
      const size_t end = r.pos() + len;
      while (r.pos() < end) {
        uint64_t ptag, v;
        if (!r.ReadVarint(&ptag)) return Malformed("truncated TensorPart tag");
        const uint64_t pfield = ptag >> 3;
        const int pwire = static_cast<int>(ptag & 7);
        if (pfield == kPartTensorField && pwire == kWireVarint) {
          if (!r.ReadVarint(&v)) return Malformed("truncated TensorPart.tensor");
          tensor_ = static_cast<int32_t>(v);
        } else if (pfield == kPartOffsetField && pwire == kWireVarint) {
          if (!r.ReadVarint(&v)) return Malformed("truncated TensorPart.offset");
          offset_ = v;
        } else if (pfield == kPartDataField && pwire == kWireLength) {
          if (!r.ReadVarint(&v) || v > end - r.pos()) {
            return Malformed("truncated TensorPart.data");
          }
          data_.clear();
          data_size_ = v;
          r.Take(v, &data_);
        } else if (pfield == 0 || !r.SkipValue(pwire)) {
          return Malformed("bad field in TensorPart");
        } else if (unknown_field_ == 0) {
          unknown_field_ = pfield;
          unknown_in_part_ = true;
        }
        if (r.pos() > end) return Malformed("TensorPart field runs past its message");
      }
      continue;
    }
    if (!r.SkipValue(wire)) return Malformed("truncated unknown field");
    if (unknown_field_ == 0) unknown_field_ = field;
  }
  return absl::OkStatus();
}

}  // namespace wire
}  // namespace lossd
