#include "bench/service/raw_wire.h"

#include <atomic>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/slice.h"

namespace lossd {
namespace bench {
namespace {

constexpr int kVarint = 0;
constexpr int kLengthDelimited = 2;

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

void PutTag(int field, int wire_type, std::string* out) {
  PutVarint(static_cast<uint64_t>(field) << 3 | wire_type, out);
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Reads bytes across the slices of a received buffer.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) { Settle(); }

  bool done() const { return slice_ == slices_.size(); }

  bool ReadByte(uint8_t* b) {
    if (done()) return false;
    *b = slices_[slice_].begin()[pos_++];
    Settle();
    return true;
  }

  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b = 0;
      if (!ReadByte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  // Skips n bytes; `pieces` (nullable) collects where they lie.
  bool Take(uint64_t n, std::vector<std::pair<const uint8_t*, size_t>>* pieces) {
    while (n > 0) {
      if (done()) return false;
      const size_t avail = slices_[slice_].size() - pos_;
      const size_t k = n < avail ? static_cast<size_t>(n) : avail;
      if (pieces != nullptr) pieces->emplace_back(slices_[slice_].begin() + pos_, k);
      pos_ += k;
      n -= k;
      Settle();
    }
    return true;
  }

  // Bytes already consumed, counted from the start.
  uint64_t consumed() const { return consumed_before_ + pos_; }

 private:
  // Moves past empty or finished slices.
  void Settle() {
    while (slice_ < slices_.size() && pos_ == slices_[slice_].size()) {
      consumed_before_ += slices_[slice_].size();
      ++slice_;
      pos_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t pos_ = 0;
  uint64_t consumed_before_ = 0;
};

bool SkipField(SliceReader* r, int wire_type) {
  uint64_t v = 0;
  switch (wire_type) {
    case 0:
      return r->ReadVarint(&v);
    case 1:
      return r->Take(8, nullptr);
    case 2:
      return r->ReadVarint(&v) && r->Take(v, nullptr);
    case 5:
      return r->Take(4, nullptr);
    default:
      return false;
  }
}

// Drives one call to its end; writes and reads run at once, so an early error is heard.
class RawStream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  RawStream(std::vector<grpc::ByteBuffer> out,
            const std::function<absl::Status(const grpc::ByteBuffer&)>& on_message)
      : out_(std::move(out)), on_message_(on_message) {}

  absl::Status Run(grpc::GenericStub* stub, const std::string& method, grpc::ClientContext* ctx) {
    ctx_ = ctx;
    stub->PrepareBidiStreamingCall(ctx, method, grpc::StubOptions(), this);
    StartRead(&in_);
    WriteNext();
    StartCall();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    if (!handler_status_.ok()) return handler_status_;
    if (status_.ok()) return absl::OkStatus();
    return absl::Status(static_cast<absl::StatusCode>(status_.error_code()),
                        status_.error_message());
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call is broken; OnDone brings the status
    ++next_;
    WriteNext();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    absl::Status s = on_message_(in_);
    if (!s.ok()) {
      {
        absl::MutexLock lock(&mu_);
        handler_status_ = std::move(s);
      }
      ctx_->TryCancel();
      return;
    }
    StartRead(&in_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;
  }

 private:
  void WriteNext() {
    if (next_ + 1 < out_.size()) {
      StartWrite(&out_[next_]);
    } else if (next_ + 1 == out_.size()) {
      StartWriteLast(&out_[next_], grpc::WriteOptions());
    } else if (out_.empty()) {
      StartWritesDone();
    }
  }

  std::vector<grpc::ByteBuffer> out_;
  size_t next_ = 0;
  grpc::ByteBuffer in_;
  const std::function<absl::Status(const grpc::ByteBuffer&)>& on_message_;
  grpc::ClientContext* ctx_ = nullptr;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Status handler_status_ ABSL_GUARDED_BY(mu_);
};

void NoRelease(void*) {}

}  // namespace

grpc::Slice BorrowedSlice(const void* data, size_t size) {
  return grpc::Slice(const_cast<void*>(data), size, NoRelease, nullptr);
}

grpc::ByteBuffer EncodeBorrowedPart(int32_t tensor, uint64_t offset, const void* data,
                                  size_t size) {
  const size_t inner = 1 + VarintSize(static_cast<uint32_t>(tensor)) + 1 + VarintSize(offset) +
                       1 + VarintSize(size) + size;
  std::string head;
  PutTag(kBenchPartField, kLengthDelimited, &head);
  PutVarint(inner, &head);
  PutTag(1, kVarint, &head);
  PutVarint(static_cast<uint32_t>(tensor), &head);
  PutTag(2, kVarint, &head);
  PutVarint(offset, &head);
  PutTag(3, kLengthDelimited, &head);
  PutVarint(size, &head);
  grpc::Slice slices[2] = {
      grpc::Slice(head),
      BorrowedSlice(data, size),
  };
  return grpc::ByteBuffer(slices, size > 0 ? 2 : 1);
}

grpc::ByteBuffer EncodeSmallMessage(const google::protobuf::MessageLite& message) {
  grpc::Slice s(message.SerializeAsString());
  return grpc::ByteBuffer(&s, 1);
}

absl::Status ReceivedFrame::Parse(const grpc::ByteBuffer& buffer) {
  kind_ = Kind::kNone;
  header_.clear();
  tensor_ = 0;
  offset_ = 0;
  data_size_ = 0;
  data_.clear();
  slices_.clear();
  if (!buffer.Dump(&slices_).ok()) return absl::InvalidArgumentError("cannot read the message");
  SliceReader r(slices_);
  auto bad = [](const char* what) {
    return absl::InvalidArgumentError(absl::StrCat("malformed streamed message: ", what));
  };
  while (!r.done()) {
    uint64_t tag = 0;
    if (!r.ReadVarint(&tag)) return bad("truncated tag");
    const int field = static_cast<int>(tag >> 3), type = static_cast<int>(tag & 7);
    if (field == kBenchHeaderField && type == kLengthDelimited) {
      uint64_t len = 0;
      std::vector<std::pair<const uint8_t*, size_t>> pieces;
      if (!r.ReadVarint(&len) || !r.Take(len, &pieces)) return bad("truncated header");
      header_.clear();
      for (const auto& p : pieces) header_.append(reinterpret_cast<const char*>(p.first), p.second);
      kind_ = Kind::kHeader;
      data_.clear();
      data_size_ = 0;
    } else if (field == kBenchPartField && type == kLengthDelimited) {
      uint64_t len = 0;
      if (!r.ReadVarint(&len)) return bad("truncated part length");
      const uint64_t end = r.consumed() + len;
      kind_ = Kind::kPart;
      tensor_ = 0;
      offset_ = 0;
      data_.clear();
      data_size_ = 0;
      while (r.consumed() < end) {
        uint64_t t = 0;
        if (!r.ReadVarint(&t)) return bad("truncated part field");
        const int f = static_cast<int>(t >> 3), ty = static_cast<int>(t & 7);
        uint64_t v = 0;
        if (f == 1 && ty == kVarint) {
          if (!r.ReadVarint(&v)) return bad("truncated tensor id");
          tensor_ = static_cast<int32_t>(v);
        } else if (f == 2 && ty == kVarint) {
          if (!r.ReadVarint(&offset_)) return bad("truncated offset");
        } else if (f == 3 && ty == kLengthDelimited) {
          data_.clear();
          if (!r.ReadVarint(&v) || !r.Take(v, &data_)) return bad("truncated data");
          data_size_ = static_cast<size_t>(v);
        } else if (!SkipField(&r, ty)) {
          return bad("unreadable field in a part");
        }
      }
      if (r.consumed() != end) return bad("a part runs past its length");
    } else if (!SkipField(&r, type)) {
      return bad("unreadable field");
    }
  }
  return absl::OkStatus();
}

void ReceivedFrame::CopyDataTo(uint8_t* dst) const {
  for (const auto& p : data_) {
    std::memcpy(dst, p.first, p.second);
    dst += p.second;
  }
}

absl::Status RunStream(grpc::GenericStub* stub, const std::string& method,
                       std::vector<grpc::ByteBuffer> out,
                       const std::function<absl::Status(const grpc::ByteBuffer&)>& on_message,
                       absl::Duration deadline) {
  grpc::ClientContext ctx;
  if (deadline != absl::InfiniteDuration()) {
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(deadline));
  }
  RawStream stream(std::move(out), on_message);
  return stream.Run(stub, method, &ctx);
}

std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const std::string& target, int n) {
  // Process-wide, so channels made by different calls never compare equal either.
  static std::atomic<int> next_index{0};
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int k = 0; k < n; ++k) {
    const int i = next_index.fetch_add(1);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("lossd.bench.connection_index", i);
    channels.push_back(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }
  return channels;
}

}  // namespace bench
}  // namespace lossd
