// SPDX-License-Identifier: Apache-2.0
#include "client/npy.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace lossd {
namespace client {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;
// Magic, two version bytes and the 2-byte (v1) or 4-byte (v2, v3) header length.
constexpr size_t kPreambleV1 = kMagicSize + 2 + 2;
constexpr size_t kPreambleV2 = kMagicSize + 2 + 4;
// Header length limit, as NumPy's: anything larger is not a real .npy file.
constexpr size_t kMaxHeaderBytes = 1 << 20;

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed .npy: ", what));
}

struct NpyLayout {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  size_t data_offset = 0;  // bytes before the data: preamble + header
  // '<f8' in the file: the tensor is fp32 (lossd has no float64) and the data is 8-byte doubles.
  bool from_f64 = false;
};

// Reads the preamble: how many bytes the preamble and header take together.
absl::StatusOr<size_t> HeaderEnd(absl::string_view bytes) {
  if (bytes.size() < kPreambleV1 || std::memcmp(bytes.data(), kMagic, kMagicSize) != 0) {
    return Malformed("missing the \\x93NUMPY magic");
  }
  const auto* u = reinterpret_cast<const uint8_t*>(bytes.data());
  const int major = u[6];
  const int minor = u[7];
  if (minor != 0 || major < 1 || major > 3) {
    return Malformed(absl::StrCat("unsupported format version ", major, ".", minor));
  }
  if (major == 1) {
    return kPreambleV1 + (u[8] | (u[9] << 8));
  }
  if (bytes.size() < kPreambleV2) return Malformed("truncated preamble");
  const size_t len = static_cast<size_t>(u[8]) | static_cast<size_t>(u[9]) << 8 |
                     static_cast<size_t>(u[10]) << 16 | static_cast<size_t>(u[11]) << 24;
  if (len > kMaxHeaderBytes) return Malformed(absl::StrCat("header length ", len));
  return kPreambleV2 + len;
}

// A recursive-descent reader for the header's Python dict literal.
class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : s_(text) {}

  absl::Status Parse(NpyLayout* out) {
    bool have_descr = false, have_order = false, have_shape = false;
    SkipSpace();
    if (!Eat('{')) return Malformed("header is not a dict");
    for (;;) {
      SkipSpace();
      if (Eat('}')) break;
      std::string key;
      if (!ReadString(&key)) return Malformed("expected a quoted key");
      SkipSpace();
      if (!Eat(':')) return Malformed(absl::StrCat("expected ':' after '", key, "'"));
      SkipSpace();
      if (key == "descr") {
        if (have_descr) return Malformed("duplicate 'descr'");
        have_descr = true;
        std::string descr;
        if (!ReadString(&descr)) return Malformed("'descr' is not a string");
        LOSSD_RETURN_IF_ERROR(DescrToDType(descr, out));
      } else if (key == "fortran_order") {
        if (have_order) return Malformed("duplicate 'fortran_order'");
        have_order = true;
        if (Eat("True")) {
          return absl::InvalidArgumentError(
              "unsupported .npy: Fortran-order arrays; save a C-contiguous array");
        }
        if (!Eat("False")) return Malformed("'fortran_order' is not True or False");
      } else if (key == "shape") {
        if (have_shape) return Malformed("duplicate 'shape'");
        have_shape = true;
        LOSSD_RETURN_IF_ERROR(ReadShape(&out->shape));
      } else {
        return Malformed(absl::StrCat("unexpected key '", key, "'"));
      }
      SkipSpace();
      if (Eat(',')) continue;
      SkipSpace();
      if (Eat('}')) break;
      return Malformed("expected ',' or '}' in the header dict");
    }
    SkipSpace();
    if (pos_ != s_.size()) return Malformed("text after the header dict");
    if (!have_descr || !have_order || !have_shape) {
      return Malformed("header lacks one of 'descr', 'fortran_order', 'shape'");
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status DescrToDType(const std::string& descr, NpyLayout* layout) {
    DType* dtype = &layout->dtype;
    layout->from_f64 = descr == "<f8";
    if (descr == "<f8") {
      *dtype = DType::kF32;
    } else if (descr == "<f2") {
      *dtype = DType::kF16;
    } else if (descr == "<f4") {
      *dtype = DType::kF32;
    } else if (descr == "<i4") {
      *dtype = DType::kI32;
    } else if (descr == "<i8") {
      *dtype = DType::kI64;
    } else if (descr == "<u2" || descr == "|V2" || descr == "<V2") {
      *dtype = DType::kBF16;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "unsupported .npy descr '", descr,
          "': expected '<f2', '<f4', '<f8' (read as fp32), '<i4', '<i8' or '<u2' (bf16 bits), "
          "little-endian"));
    }
    return absl::OkStatus();
  }

  absl::Status ReadShape(std::vector<int64_t>* shape) {
    shape->clear();
    if (!Eat('(')) return Malformed("'shape' is not a tuple");
    for (;;) {
      SkipSpace();
      if (Eat(')')) return absl::OkStatus();
      size_t start = pos_;
      while (pos_ < s_.size() && absl::ascii_isdigit(static_cast<unsigned char>(s_[pos_]))) {
        ++pos_;
      }
      int64_t d = 0;
      if (pos_ == start || !absl::SimpleAtoi(s_.substr(start, pos_ - start), &d)) {
        return Malformed("'shape' holds something other than non-negative integers");
      }
      Eat('L');  // Python 2 wrote long integers as 3L
      shape->push_back(d);
      SkipSpace();
      if (Eat(',')) continue;
      SkipSpace();
      if (Eat(')')) return absl::OkStatus();
      return Malformed("expected ',' or ')' in 'shape'");
    }
  }

  bool ReadString(std::string* out) {
    if (pos_ >= s_.size() || (s_[pos_] != '\'' && s_[pos_] != '"')) return false;
    const char quote = s_[pos_++];
    size_t end = s_.find(quote, pos_);
    if (end == absl::string_view::npos) return false;
    *out = std::string(s_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return true;
  }

  void SkipSpace() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\t' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Eat(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool Eat(absl::string_view word) {
    if (s_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return true;
    }
    return false;
  }

  absl::string_view s_;
  size_t pos_ = 0;
};

// Parses preamble + header; `bytes` holds at least the whole header.
absl::StatusOr<NpyLayout> ParseLayout(absl::string_view bytes) {
  absl::StatusOr<size_t> end = HeaderEnd(bytes);
  if (!end.ok()) return end.status();
  if (bytes.size() < *end) return Malformed("truncated header");
  const size_t preamble = bytes[6] == 1 ? kPreambleV1 : kPreambleV2;
  NpyLayout layout;
  layout.data_offset = *end;
  LOSSD_RETURN_IF_ERROR(HeaderParser(bytes.substr(preamble, *end - preamble)).Parse(&layout));
  absl::StatusOr<size_t> data_bytes = TensorByteSize(layout.dtype, layout.shape);
  if (!data_bytes.ok()) return Malformed(data_bytes.status().message());
  return layout;
}

// Bytes of data the file holds for its layout (float64 data is twice the fp32 tensor's).
size_t FileDataBytes(const NpyLayout& layout) {
  const size_t tensor_bytes = *TensorByteSize(layout.dtype, layout.shape);
  return layout.from_f64 ? 2 * tensor_bytes : tensor_bytes;
}

absl::Status DataSizeMismatch(const NpyLayout& layout, size_t want, size_t have) {
  const std::string shape = layout.from_f64
                                ? absl::StrCat("float64[", absl::StrJoin(layout.shape, ", "), "]")
                                : ShapeString(layout.dtype, layout.shape);
  return Malformed(
      absl::StrCat("shape ", shape, " needs ", want, " data bytes, the file holds ", have));
}

// Rounds float64 data to the fp32 tensor `t`, to nearest. A finite value beyond fp32's range
// is refused rather than turned into an infinity the file did not hold; NaN and infinities
// stay what they are (the server judges those as it does for any input).
absl::Status NarrowF64(const char* data, HostTensor* t) {
  float* out = reinterpret_cast<float*>(t->mutable_data());
  const size_t n = t->num_bytes() / sizeof(float);
  for (size_t i = 0; i < n; ++i) {
    double v;
    std::memcpy(&v, data + i * sizeof(double), sizeof(double));
    if (std::isfinite(v) && std::fabs(v) > std::numeric_limits<float>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "float64 element ", i, " (", v, ") is outside fp32's range; lossd reads float64 .npy "
          "files as fp32"));
    }
    out[i] = static_cast<float>(v);
  }
  return absl::OkStatus();
}

absl::Status IoError(int err, absl::string_view what, const std::string& path) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, " ", path));
}

}  // namespace

absl::string_view NpyDescr(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "<u2";
    case DType::kF16:
      return "<f2";
    case DType::kF32:
      return "<f4";
    case DType::kI32:
      return "<i4";
    case DType::kI64:
      return "<i8";
  }
  return "?";
}

std::string EncodeNpyHeader(DType dtype, const std::vector<int64_t>& shape) {
  std::string shape_text = "(" + absl::StrJoin(shape, ", ");
  if (shape.size() == 1) shape_text += ",";
  shape_text += ")";
  std::string dict = absl::StrCat("{'descr': '", NpyDescr(dtype),
                                  "', 'fortran_order': False, 'shape': ", shape_text, ", }");
  // NumPy pads with spaces and ends with '\n' so the data starts 64-byte aligned; version 1
  // stores the length in 2 bytes, so longer headers (huge ranks only) need version 2.
  size_t preamble = kPreambleV1;
  if (dict.size() + 1 + 64 > 0xffff) preamble = kPreambleV2;
  size_t total = preamble + dict.size() + 1;
  total = (total + 63) / 64 * 64;
  const size_t header_len = total - preamble;
  dict.append(header_len - dict.size() - 1, ' ');
  dict.push_back('\n');
  std::string out(kMagic, kMagicSize);
  out.push_back(static_cast<char>(preamble == kPreambleV1 ? 1 : 2));
  out.push_back(0);
  out.push_back(static_cast<char>(header_len & 0xff));
  out.push_back(static_cast<char>((header_len >> 8) & 0xff));
  if (preamble == kPreambleV2) {
    out.push_back(static_cast<char>((header_len >> 16) & 0xff));
    out.push_back(static_cast<char>((header_len >> 24) & 0xff));
  }
  return out + dict;
}

std::string EncodeNpy(const HostTensor& tensor) {
  std::string out = EncodeNpyHeader(tensor.dtype(), tensor.shape());
  out.append(reinterpret_cast<const char*>(tensor.data()), tensor.num_bytes());
  return out;
}

absl::StatusOr<HostTensor> DecodeNpy(absl::string_view file_bytes) {
  absl::StatusOr<NpyLayout> layout = ParseLayout(file_bytes);
  if (!layout.ok()) return layout.status();
  const size_t want = FileDataBytes(*layout);
  const size_t have = file_bytes.size() - layout->data_offset;
  if (have != want) return DataSizeMismatch(*layout, want, have);
  HostTensor t = HostTensor::Owned(layout->dtype, layout->shape);
  if (layout->from_f64) {
    LOSSD_RETURN_IF_ERROR(NarrowF64(file_bytes.data() + layout->data_offset, &t));
    return t;
  }
  if (want > 0) std::memcpy(t.mutable_data(), file_bytes.data() + layout->data_offset, want);
  return t;
}

absl::StatusOr<HostTensor> ReadNpy(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (f == nullptr) return IoError(errno, "cannot open", path);
  std::string head(kPreambleV2, '\0');
  head.resize(std::fread(&head[0], 1, head.size(), f.get()));
  absl::StatusOr<size_t> end = HeaderEnd(head);
  if (!end.ok())
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", end.status().message()));
  if (*end > head.size()) {
    const size_t have = head.size();
    head.resize(*end);
    head.resize(have + std::fread(&head[have], 1, *end - have, f.get()));
  }
  absl::StatusOr<NpyLayout> layout = ParseLayout(head);
  if (!layout.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", layout.status().message()));
  }
  // The header's shape against the file's size before anything is allocated: a header that
  // claims (100000, 100000) in a small file would otherwise ask for 37 GiB first.
  struct stat st;
  if (fstat(fileno(f.get()), &st) == 0 && S_ISREG(st.st_mode)) {
    const size_t file_bytes = static_cast<size_t>(st.st_size);
    const size_t in_file = file_bytes > layout->data_offset ? file_bytes - layout->data_offset : 0;
    if (in_file != FileDataBytes(*layout)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " (", file_bytes, " bytes): ",
          DataSizeMismatch(*layout, FileDataBytes(*layout), in_file).message()));
    }
  }
  if (layout->from_f64) {
    // Converted on read: the doubles pass through a buffer (fp32 files go straight into the
    // tensor below). One byte past the data is asked for, to see a file that is too long.
    std::string data = head.substr(layout->data_offset);
    const size_t want = FileDataBytes(*layout);
    const size_t have = data.size();
    if (have <= want) {
      data.resize(want + 1);
      data.resize(have + std::fread(&data[have], 1, want + 1 - have, f.get()));
    }
    if (std::ferror(f.get())) return IoError(errno, "cannot read", path);
    if (data.size() != want) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", DataSizeMismatch(*layout, want, data.size()).message()));
    }
    HostTensor t = HostTensor::Owned(layout->dtype, layout->shape);
    absl::Status s = NarrowF64(data.data(), &t);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
    return t;
  }
  HostTensor t = HostTensor::Owned(layout->dtype, layout->shape);
  const size_t want = t.num_bytes();
  // The preamble read may have run past a short header into the data.
  size_t have = head.size() - layout->data_offset;
  if (have > want) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", DataSizeMismatch(*layout, want, have).message()));
  }
  if (have > 0) std::memcpy(t.mutable_data(), head.data() + layout->data_offset, have);
  if (want > have) have += std::fread(t.mutable_data() + have, 1, want - have, f.get());
  if (std::ferror(f.get())) return IoError(errno, "cannot read", path);
  char extra;
  const size_t trailing = std::fread(&extra, 1, 1, f.get());
  if (have != want || trailing != 0) {
    std::fseek(f.get(), 0, SEEK_END);
    const long size = std::ftell(f.get());  // NOLINT(runtime/int): ftell's type
    const size_t in_file = size >= 0 ? static_cast<size_t>(size) - layout->data_offset : have;
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", DataSizeMismatch(*layout, want, in_file).message()));
  }
  return t;
}

absl::Status WriteNpy(const std::string& path, const HostTensor& tensor) {
  LOSSD_RETURN_IF_ERROR(tensor.Validate(path));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  if (f == nullptr) return IoError(errno, "cannot create", path);
  const std::string header = EncodeNpyHeader(tensor.dtype(), tensor.shape());
  // An empty tensor has no data pointer, and fwrite must not be handed a null one.
  if (std::fwrite(header.data(), 1, header.size(), f.get()) != header.size() ||
      (tensor.num_bytes() > 0 &&
       std::fwrite(tensor.data(), 1, tensor.num_bytes(), f.get()) != tensor.num_bytes())) {
    return IoError(errno, "cannot write", path);
  }
  if (std::fclose(f.release()) != 0) return IoError(errno, "cannot close", path);
  return absl::OkStatus();
}

}  // namespace client
}  // namespace lossd
