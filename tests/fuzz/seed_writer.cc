// SPDX-License-Identifier: Apache-2.0
// Writes the committed seed corpus of the lossd fuzz targets: small valid requests over every
// dtype, reduction and option, and invalid ones (bad shapes, parts out of order or past their
// tensor, NaN, targets out of range, streams cut short), one file each, into
// <out>/compute_stream, <out>/options and <out>/put_weights.
// Usage: seed_writer <out_dir>. Deterministic: the same files on every run.
#include <algorithm>
#include <sys/stat.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "lossd/v1/lossd.pb.h"
#include "tests/fuzz/fuzz_env.h"

namespace lossd {
namespace fuzz {
namespace {

struct Rng {
  uint64_t s = 7;
  uint32_t Next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(s >> 33);
  }
  float Uniform(float lo, float hi) { return lo + (hi - lo) * (Next() % 10001) / 10000.0f; }
};

DType FromWire(v1::DType d) {
  switch (d) {
    case v1::DTYPE_FP16: return DType::kF16;
    case v1::DTYPE_FP32: return DType::kF32;
    case v1::DTYPE_INT32: return DType::kI32;
    case v1::DTYPE_INT64: return DType::kI64;
    default: return DType::kBF16;
  }
}

v1::TensorSpec Spec(v1::DType dt, std::vector<int64_t> shape) {
  v1::TensorSpec s;
  s.set_dtype(dt);
  for (int64_t d : shape) s.add_shape(d);
  return s;
}

std::string Floats(v1::DType dt, int64_t n, Rng* rng, float lo, float hi) {
  std::string b(n * DTypeSize(FromWire(dt)), '\0');
  for (int64_t i = 0; i < n; ++i) StoreFromFloat(&b[0], FromWire(dt), i, rng->Uniform(lo, hi));
  return b;
}

std::string Targets(v1::DType dt, int64_t bt, int64_t v, Rng* rng) {
  std::string b(bt * (dt == v1::DTYPE_INT32 ? 4 : 8), '\0');
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = (i % 5 == 4) ? -100 : static_cast<int64_t>(rng->Next() % v);
    if (dt == v1::DTYPE_INT32) {
      reinterpret_cast<int32_t*>(&b[0])[i] = static_cast<int32_t>(t);
    } else {
      reinterpret_cast<int64_t*>(&b[0])[i] = t;
    }
  }
  return b;
}

// One Compute stream: its header and its tensors, split into parts of `part_bytes`.
struct Stream {
  v1::ComputeHeader header;
  std::vector<std::pair<v1::TensorId, std::string>> tensors;
  size_t part_bytes = 64;

  std::vector<v1::ComputeRequest> Messages() const {
    std::vector<v1::ComputeRequest> out(1);
    *out[0].mutable_header() = header;
    for (const auto& [id, bytes] : tensors) {
      for (size_t off = 0; off < bytes.size(); off += part_bytes) {
        v1::ComputeRequest r;
        r.mutable_part()->set_tensor(id);
        r.mutable_part()->set_offset(off);
        r.mutable_part()->set_data(bytes.substr(off, part_bytes));
        out.push_back(std::move(r));
      }
    }
    return out;
  }
};

struct Shape {
  int64_t bt = 4, h = 8, v = 16;
  v1::DType dtype = v1::DTYPE_BF16;
  v1::DType target_dtype = v1::DTYPE_INT64;
  bool bias = false, class_weights = false, grad_output = false;
  std::string handle;  // W by handle (the preloaded one) instead of inline
};

Stream MakeStream(const Shape& s, Rng* rng) {
  Stream st;
  v1::ComputeHeader& h = st.header;
  *h.mutable_x() = Spec(s.dtype, {s.bt, s.h});
  st.tensors.push_back({v1::TENSOR_X, Floats(s.dtype, s.bt * s.h, rng, -2, 2)});
  if (s.handle.empty()) {
    *h.mutable_w() = Spec(s.dtype, {s.v, s.h});
    st.tensors.push_back({v1::TENSOR_W, Floats(s.dtype, s.v * s.h, rng, -0.7f, 0.7f)});
    if (s.bias) {
      *h.mutable_bias() = Spec(s.dtype, {s.v});
      st.tensors.push_back({v1::TENSOR_BIAS, Floats(s.dtype, s.v, rng, -0.5f, 0.5f)});
    }
  } else {
    h.set_weight_handle(s.handle);
  }
  *h.mutable_targets() = Spec(s.target_dtype, {s.bt});
  st.tensors.push_back({v1::TENSOR_TARGETS, Targets(s.target_dtype, s.bt, s.v, rng)});
  if (s.class_weights) {
    *h.mutable_class_weights() = Spec(v1::DTYPE_FP32, {s.v});
    st.tensors.push_back({v1::TENSOR_CLASS_WEIGHTS, Floats(v1::DTYPE_FP32, s.v, rng, 0.25f, 2)});
  }
  if (s.grad_output) {
    *h.mutable_grad_output() = Spec(v1::DTYPE_FP32, {s.bt});
    st.tensors.push_back({v1::TENSOR_GRAD_OUTPUT, Floats(v1::DTYPE_FP32, s.bt, rng, -2, 2)});
  }
  v1::Outputs* o = h.mutable_outputs();
  o->set_dx(true);
  o->set_dw(true);
  o->set_db(true);
  o->set_lse(true);
  o->set_z_loss(true);
  o->set_accuracy(true);
  o->set_predictions(true);
  return st;
}

void Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  mkdir(dir.c_str(), 0755);
  std::ofstream f(dir + "/" + name, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string Records(const std::vector<v1::ComputeRequest>& messages) {
  std::string out;
  for (const auto& m : messages) AppendRecord(&out, m.SerializeAsString());
  return out;
}

// Raw protobuf wire encoding, for messages protobuf itself would write differently.
std::string WireVarint(uint64_t v) {
  std::string out;
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>(v | 0x80));
  out.push_back(static_cast<char>(v));
  return out;
}
std::string WireTag(int field, int wire_type) { return WireVarint(field << 3 | wire_type); }
std::string WireVarintField(int field, uint64_t v) { return WireTag(field, 0) + WireVarint(v); }
std::string WireBytesField(int field, const std::string& bytes) {
  return WireTag(field, 2) + WireVarint(bytes.size()) + bytes;
}

// A valid stream whose messages use encodings protobuf accepts but does not write, which the
// in-place parser of the raw Compute method must read as protobuf does: the header in two
// occurrences that merge, part fields in reverse order, unknown fields of every wire type at
// both levels, a part's data given twice (the last wins), a part in two occurrences that merge.
std::string WireVariants(const Stream& st) {
  const std::vector<v1::ComputeRequest> m = st.Messages();
  std::string out;
  v1::ComputeHeader first = m[0].header(), second = m[0].header();
  first.clear_targets();
  first.clear_outputs();
  second.clear_x();
  second.clear_w();
  second.clear_bias();  // in both, its repeated shape would merge to (V, V)
  AppendRecord(&out, WireBytesField(1, first.SerializeAsString()) +
                         WireBytesField(1, second.SerializeAsString()));
  for (size_t i = 1; i < m.size(); ++i) {
    const v1::TensorPart& p = m[i].part();
    const std::string tensor = WireVarintField(1, static_cast<uint64_t>(p.tensor()));
    const std::string offset = WireVarintField(2, p.offset());
    const std::string data = WireBytesField(3, p.data());
    std::string record;
    switch (i % 4) {
      case 0:
        record = WireBytesField(2, data + offset + tensor);
        break;
      case 1:
        record = WireVarintField(7, 1) +
                 WireBytesField(2, WireVarintField(15, 7) + tensor + WireTag(9, 5) + "abcd" +
                                       offset + WireBytesField(14, "skip") + data +
                                       WireTag(13, 1) + "12345678") +
                 WireTag(8, 5) + "wxyz";
        break;
      case 2:
        record = WireBytesField(2, tensor + WireBytesField(3, "decoy") + offset + data);
        break;
      default:
        record = WireBytesField(2, tensor + offset) + WireBytesField(2, data);
        break;
    }
    AppendRecord(&out, record);
  }
  return out;
}

void WriteCompute(const std::string& root, const std::string& name, const Stream& s) {
  Write(root + "/compute_stream", name, Records(s.Messages()));
  Write(root + "/options", name, s.header.SerializeAsString());
}

// Valid streams: the plain case, every option, odd parts, a handle with an accumulator,
// every target ignored. Draws from `rng` in this order.
void WriteValidComputeSeeds(const std::string& root, Rng* rng) {
  {  // The plain case.
    Shape s;
    WriteCompute(root, "valid_bf16_mean", MakeStream(s, rng));
  }
  {
    Shape s;
    s.dtype = v1::DTYPE_FP32;
    s.bias = s.class_weights = s.grad_output = true;
    Stream st = MakeStream(s, rng);
    st.header.mutable_options()->set_reduction(v1::REDUCTION_NONE);
    st.header.mutable_options()->set_label_smoothing(0.1f);
    WriteCompute(root, "valid_fp32_none_everything", st);
  }
  {
    Shape s;
    s.dtype = v1::DTYPE_FP16;
    s.bias = true;
    s.target_dtype = v1::DTYPE_INT32;
    s.bt = 7;
    s.h = 5;
    s.v = 13;
    Stream st = MakeStream(s, rng);
    v1::LossOptions* o = st.header.mutable_options();
    o->set_reduction(v1::REDUCTION_SUM);
    o->set_lse_square_scale(1e-3f);
    o->set_softcap(15.0f);
    o->set_chunk_rows(3);
    o->set_grad_dtype(v1::DTYPE_FP32);
    st.part_bytes = 7;  // odd parts
    WriteCompute(root, "valid_fp16_sum_softcap_chunked", st);
  }
  {
    Shape s;
    s.h = kPreloadH;
    s.v = kPreloadV;
    s.handle = kPreloadHandle;
    Stream st = MakeStream(s, rng);
    st.header.set_accumulator("step-1");
    st.header.mutable_options()->set_grad_scale(0.25f);
    WriteCompute(root, "valid_handle_accumulator", st);
  }
  {
    Shape s;
    s.bt = 3;
    Stream st = MakeStream(s, rng);
    st.header.mutable_options()->set_ignore_index(5);
    // Every row's target is the ignore_index: loss 0 and zero gradients, never NaN.
    for (int i = 0; i < 3; ++i) reinterpret_cast<int64_t*>(&st.tensors[2].second[0])[i] = 5;
    WriteCompute(root, "valid_all_ignored", st);
  }
}

// Invalid streams, each refused for how its messages come: order, extent, an early close,
// an output's part, a second header. Draws from `rng` after the valid ones.
void WriteBadStreamSeeds(const std::string& root, Rng* rng) {
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    auto m = st.Messages();
    std::swap(m[1], m[2]);
    Write(root + "/compute_stream", "bad_parts_out_of_order", Records(m));
  }
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    auto m = st.Messages();
    m[1].mutable_part()->mutable_data()->append("xx");
    Write(root + "/compute_stream", "bad_part_past_shape", Records(m));
  }
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    auto m = st.Messages();
    m.pop_back();
    Write(root + "/compute_stream", "bad_stream_closed_early", Records(m));
  }
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    auto m = st.Messages();
    m[1].mutable_part()->set_tensor(v1::TENSOR_DW);
    Write(root + "/compute_stream", "bad_output_tensor_part", Records(m));
  }
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    auto m = st.Messages();
    m.insert(m.begin() + 2, m[0]);
    Write(root + "/compute_stream", "bad_second_header", Records(m));
  }
}

// Invalid requests in well-formed streams: a NaN, a target out of range, mismatched shapes,
// limits, another instance's handle, options, an accumulator's name. Draws from `rng` after
// the bad streams.
void WriteBadRequestSeeds(const std::string& root, Rng* rng) {
  {
    Shape s;
    s.dtype = v1::DTYPE_FP32;
    Stream st = MakeStream(s, rng);
    float nan = std::nanf("");
    std::memcpy(&st.tensors[0].second[12], &nan, 4);
    WriteCompute(root, "bad_nan_in_x", st);
  }
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    reinterpret_cast<int64_t*>(&st.tensors[2].second[0])[1] = 16;
    WriteCompute(root, "bad_target_out_of_range", st);
  }
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    st.header.mutable_w()->set_shape(1, 7);
    WriteCompute(root, "bad_hidden_mismatch", st);
  }
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    st.header.mutable_x()->set_shape(0, 1 << 20);
    WriteCompute(root, "bad_over_limits", st);
  }
  {
    Shape s;
    s.h = kPreloadH;
    s.v = kPreloadV;
    s.handle = "w-another-1";
    WriteCompute(root, "bad_handle_other_instance", MakeStream(s, rng));
  }
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    st.header.mutable_options()->set_label_smoothing(1.5f);
    st.header.mutable_options()->set_reduction(static_cast<v1::Reduction>(9));
    WriteCompute(root, "bad_options", st);
  }
  {
    Shape s;
    Stream st = MakeStream(s, rng);
    st.header.set_accumulator("bad name!");
    WriteCompute(root, "bad_accumulator_name", st);
  }
}

// Overlapped streams (header.overlap, X last, one row of X a part), from an RNG of their own
// so that the seeds above keep their bytes.
void WriteOverlappedComputeSeeds(const std::string& root) {
  Rng orng;
  auto overlapped = [&](const Shape& s, int64_t chunk_rows) {
    Stream st = MakeStream(s, &orng);
    st.header.set_overlap(true);
    st.header.mutable_options()->set_chunk_rows(chunk_rows);
    std::rotate(st.tensors.begin(), st.tensors.begin() + 1, st.tensors.end());  // X last
    st.part_bytes = static_cast<size_t>(s.h) * (s.dtype == v1::DTYPE_FP32 ? 4 : 2);
    return st;
  };
  {
    Shape s;
    s.bt = 9;
    s.bias = true;
    WriteCompute(root, "valid_overlap_chunked", overlapped(s, 2));
  }
  {
    Shape s;
    s.h = kPreloadH;
    s.v = kPreloadV;
    s.handle = kPreloadHandle;
    s.bt = 6;
    Stream st = overlapped(s, 2);
    st.header.set_accumulator("step-overlap");
    WriteCompute(root, "valid_overlap_handle_accumulator", st);
  }
  {
    Shape s;
    s.bt = 8;
    s.dtype = v1::DTYPE_FP32;
    Stream st = overlapped(s, 2);
    float nan = std::nanf("");
    std::memcpy(&st.tensors.back().second[6 * s.h * 4 + 12], &nan, 4);  // x[6, 3]
    WriteCompute(root, "bad_overlap_nan_late", st);
  }
  {
    Shape s;
    s.bt = 8;
    auto m = overlapped(s, 2).Messages();
    m.resize(m.size() - 3);  // the last three rows of X never come
    Write(root + "/compute_stream", "bad_overlap_cut_off", Records(m));
  }
}

void WriteComputeSeeds(const std::string& root) {
  Rng rng;
  WriteValidComputeSeeds(root, &rng);
  WriteBadStreamSeeds(root, &rng);
  WriteBadRequestSeeds(root, &rng);
  {  // Last, so that the seeds above keep their random bytes.
    Shape s;
    s.bias = true;
    Write(root + "/compute_stream", "valid_wire_variants", WireVariants(MakeStream(s, &rng)));
  }
  WriteOverlappedComputeSeeds(root);
}

void WritePutWeightsSeeds(const std::string& root) {
  Rng rng;
  const std::string dir = root + "/put_weights";
  auto header = [](v1::DType dt, int64_t v, int64_t h, bool bias) {
    v1::PutWeightsRequest r;
    *r.mutable_header()->mutable_w() = Spec(dt, {v, h});
    if (bias) *r.mutable_header()->mutable_bias() = Spec(dt, {v});
    return r;
  };
  auto parts = [](std::string* out, v1::TensorId id, const std::string& bytes, size_t n) {
    for (size_t off = 0; off < bytes.size(); off += n) {
      v1::PutWeightsRequest r;
      r.mutable_part()->set_tensor(id);
      r.mutable_part()->set_offset(off);
      r.mutable_part()->set_data(bytes.substr(off, n));
      AppendRecord(out, r.SerializeAsString());
    }
  };
  {
    std::string s;
    AppendRecord(&s, header(v1::DTYPE_BF16, 12, 8, true).SerializeAsString());
    parts(&s, v1::TENSOR_W, Floats(v1::DTYPE_BF16, 96, &rng, -1, 1), 64);
    parts(&s, v1::TENSOR_BIAS, Floats(v1::DTYPE_BF16, 12, &rng, -1, 1), 64);
    Write(dir, "valid_bf16_bias", s);
  }
  {
    std::string s;
    AppendRecord(&s, header(v1::DTYPE_FP32, 5, 3, false).SerializeAsString());
    parts(&s, v1::TENSOR_W, Floats(v1::DTYPE_FP32, 15, &rng, -1, 1), 60);
    Write(dir, "valid_fp32_one_part", s);
  }
  {
    std::string s;
    AppendRecord(&s, header(v1::DTYPE_FP16, 6, 4, true).SerializeAsString());
    parts(&s, v1::TENSOR_W, Floats(v1::DTYPE_FP16, 24, &rng, -1, 1), 3);  // odd parts
    parts(&s, v1::TENSOR_BIAS, Floats(v1::DTYPE_FP16, 6, &rng, -1, 1), 5);
    Write(dir, "valid_fp16_odd_parts", s);
  }
  {
    std::string s;
    AppendRecord(&s, header(v1::DTYPE_FP32, 4, 4, false).SerializeAsString());
    std::string w = Floats(v1::DTYPE_FP32, 16, &rng, -1, 1);
    float inf = INFINITY;
    std::memcpy(&w[20], &inf, 4);
    parts(&s, v1::TENSOR_W, w, 32);
    Write(dir, "bad_inf_in_w", s);
  }
  {
    std::string s;
    AppendRecord(&s, header(v1::DTYPE_BF16, 4, 4, false).SerializeAsString());
    parts(&s, v1::TENSOR_W, Floats(v1::DTYPE_BF16, 16, &rng, -1, 1), 16);
    parts(&s, v1::TENSOR_BIAS, Floats(v1::DTYPE_BF16, 4, &rng, -1, 1), 16);
    Write(dir, "bad_bias_without_header_bias", s);
  }
  {
    std::string s;
    AppendRecord(&s, header(v1::DTYPE_BF16, 8, 8, false).SerializeAsString());
    parts(&s, v1::TENSOR_W, Floats(v1::DTYPE_BF16, 40, &rng, -1, 1), 16);  // short
    Write(dir, "bad_cut_off", s);
  }
  {
    std::string s;
    AppendRecord(&s, header(v1::DTYPE_BF16, 1 << 20, 8, false).SerializeAsString());
    Write(dir, "bad_over_limits", s);
  }
  {
    std::string s;
    AppendRecord(&s, header(v1::DTYPE_INT32, 4, 4, false).SerializeAsString());
    Write(dir, "bad_int_weights", s);
  }
}

// One valid stream of each loss kind beyond cross-entropy (their own tensors, options and
// outputs), from an rng of its own so that the seeds above stay as they were.
void WriteLossKindSeeds(const std::string& root) {
  Rng rng;
  rng.s = 25;
  Shape s;
  s.dtype = v1::DTYPE_FP32;
  auto kind_stream = [&](v1::LossKind kind) {
    Stream st = MakeStream(s, &rng);
    v1::ComputeHeader& h = st.header;
    h.set_kind(kind);
    h.mutable_outputs()->set_z_loss(false);
    h.mutable_outputs()->set_accuracy(false);
    h.mutable_outputs()->set_predictions(false);
    h.mutable_options()->set_temperature(0.8f);
    return st;
  };
  auto rows = [&](Stream* st, v1::TensorSpec* spec, v1::TensorId id) {
    *spec = Spec(v1::DTYPE_FP32, {s.bt});
    st->tensors.push_back({id, Floats(v1::DTYPE_FP32, s.bt, &rng, -2, 2)});
  };
  Stream logprob = kind_stream(v1::LOSS_KIND_LOGPROB);
  rows(&logprob, logprob.header.mutable_dlogp(), v1::TENSOR_DLOGP);
  rows(&logprob, logprob.header.mutable_dentropy(), v1::TENSOR_DENTROPY);
  logprob.header.mutable_outputs()->set_entropy(true);
  WriteCompute(root, "valid_kind_logprob", logprob);
  Stream policy = kind_stream(v1::LOSS_KIND_POLICY);
  rows(&policy, policy.header.mutable_advantages(), v1::TENSOR_ADVANTAGES);
  rows(&policy, policy.header.mutable_old_logp(), v1::TENSOR_OLD_LOGP);
  policy.header.mutable_policy()->set_loss_type(v1::POLICY_LOSS_GRPO);
  policy.header.mutable_policy()->set_sequences(2);
  WriteCompute(root, "valid_kind_policy", policy);
  Stream distill = kind_stream(v1::LOSS_KIND_DISTILL);
  constexpr int64_t kHt = 6;
  *distill.header.mutable_teacher_x() = Spec(s.dtype, {s.bt, kHt});
  distill.tensors.push_back({v1::TENSOR_TEACHER_X, Floats(s.dtype, s.bt * kHt, &rng, -2, 2)});
  *distill.header.mutable_teacher_w() = Spec(s.dtype, {s.v, kHt});
  distill.tensors.push_back(
      {v1::TENSOR_TEACHER_W, Floats(s.dtype, s.v * kHt, &rng, -0.7f, 0.7f)});
  distill.header.mutable_distill()->set_jsd_beta(0.25f);
  WriteCompute(root, "valid_kind_distill", distill);
  // Last, so the seeds above keep their bytes.
  // The forward of a two-phase log-prob: kept for its backward, no gradient asked.
  Stream kept = kind_stream(v1::LOSS_KIND_LOGPROB);
  kept.header.mutable_outputs()->set_dx(false);
  kept.header.mutable_outputs()->set_dw(false);
  kept.header.mutable_outputs()->set_db(false);
  kept.header.mutable_outputs()->set_entropy(true);
  kept.header.set_keep_ms(60000);
  WriteCompute(root, "valid_kind_logprob_keep", kept);
}

}  // namespace
}  // namespace fuzz
}  // namespace lossd

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <out_dir>\n", argv[0]);
    return 2;
  }
  const std::string root = argv[1];
  mkdir(root.c_str(), 0755);
  lossd::fuzz::WriteComputeSeeds(root);
  lossd::fuzz::WritePutWeightsSeeds(root);
  lossd::fuzz::WriteLossKindSeeds(root);
  return 0;
}
