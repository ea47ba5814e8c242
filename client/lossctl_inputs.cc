// SPDX-License-Identifier: Apache-2.0
#include "client/lossctl_inputs.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/lossctl_kinds.h"
#include "client/npy.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"

namespace lossd {
namespace client {
namespace {

absl::StatusOr<DType> ParseDType(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "fp16" || s == "f16" || s == "float16") return DType::kF16;
  if (s == "fp32" || s == "f32" || s == "float32") return DType::kF32;
  if (s == "int32") return DType::kI32;
  if (s == "int64") return DType::kI64;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", s, "'"));
}

// A dtype flag: --dtype and --grad_dtype name float dtypes, --target_dtype an integer one
// (a float target dtype would have the random targets written past their buffer).
absl::StatusOr<DType> ParseDTypeFlag(const char* flag, const std::string& s, bool is_float) {
  absl::StatusOr<DType> dt = ParseDType(s);
  if (!dt.ok()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", dt.status().message()));
  if (IsFloatDType(*dt) != is_float) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " must be ", is_float ? "bf16, fp16 or fp32" : "int32 or int64", ", got '", s,
        "'"));
  }
  return dt;
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path, const char* flag) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

absl::StatusOr<ClientOptions> OptionsFromFlags() {
  ClientOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  const double deadline = absl::GetFlag(FLAGS_deadline_seconds);
  o.deadline = deadline > 0 ? absl::Seconds(deadline) : absl::InfiniteDuration();
  o.part_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_part_bytes));
  o.response_part_bytes = static_cast<uint32_t>(absl::GetFlag(FLAGS_response_part_bytes));
  // Room for the largest part either way.
  const int64_t limit = std::max<int64_t>({256 << 20, absl::GetFlag(FLAGS_part_bytes) + (1 << 20),
                                           absl::GetFlag(FLAGS_response_part_bytes) + (1 << 20)});
  o.max_send_message_bytes = o.max_receive_message_bytes =
      static_cast<int>(std::min<int64_t>(limit, INT32_MAX));
  o.connections = absl::GetFlag(FLAGS_connections);
  o.stripes = absl::GetFlag(FLAGS_stripes);
  o.overlap = absl::GetFlag(FLAGS_overlap);
  o.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  o.tls = absl::GetFlag(FLAGS_tls);
  const std::pair<const char*, std::string*> pem_files[] = {{"--tls_ca", &o.tls_root_certs},
                                                            {"--tls_cert", &o.tls_client_cert},
                                                            {"--tls_key", &o.tls_client_key}};
  const std::string pem_paths[] = {absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
                                   absl::GetFlag(FLAGS_tls_key)};
  for (int i = 0; i < 3; ++i) {
    if (pem_paths[i].empty()) continue;
    LOSSD_ASSIGN_OR_RETURN(auto pem, ReadTextFile(pem_paths[i], pem_files[i].first));
    *pem_files[i].second = std::move(pem);
  }
  o.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  o.auth_token = absl::GetFlag(FLAGS_auth_token);
  if (!absl::GetFlag(FLAGS_auth_token_file).empty()) {
    LOSSD_ASSIGN_OR_RETURN(
        auto text, ReadTextFile(absl::GetFlag(FLAGS_auth_token_file), "--auth_token_file"));
    o.auth_token = std::string(absl::StripAsciiWhitespace(
        std::pair<std::string, std::string>(absl::StrSplit(text, '\n')).first));
  }
  const std::string md = absl::GetFlag(FLAGS_metadata);
  if (!md.empty()) {
    for (absl::string_view kv : absl::StrSplit(md, ',')) {
      std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
      if (p.first.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("--metadata: bad entry '", kv, "'"));
      }
      o.metadata.push_back(std::move(p));
    }
  }
  return o;
}

// Uniform in (-scale, scale), as dtype; split over threads (a 1 GiB weight is 512M values).
void FillRandom(HostTensor* t, float scale, uint64_t seed) {
  const int64_t n = t->num_elements();
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), n / (1 << 20)));
  std::vector<std::thread> pool;
  for (int64_t k = 0; k < threads; ++k) {
    pool.emplace_back([=] {
      uint64_t s = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(k) + 1;
      const int64_t begin = n * k / threads, end = n * (k + 1) / threads;
      for (int64_t i = begin; i < end; ++i) {
        // splitmix64: fast and good enough for test data.
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
        StoreFromFloat(t->mutable_data(), t->dtype(), static_cast<size_t>(i), u * scale);
      }
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace

HostTensor RandomFloat(DType dtype, std::vector<int64_t> shape, float scale, uint64_t seed) {
  HostTensor t = HostTensor::Owned(dtype, std::move(shape));
  FillRandom(&t, scale, seed);
  return t;
}

namespace {

HostTensor RandomTargets(DType dtype, int64_t bt, int64_t v, double ignore_fraction,
                         int64_t ignore_index, uint64_t seed) {
  HostTensor t = HostTensor::Owned(dtype, {bt});
  uint64_t s = seed * 0xD1B54A32D192ED03ull + 7;
  for (int64_t i = 0; i < bt; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const uint64_t r = s >> 17;
    int64_t y = static_cast<int64_t>(r % static_cast<uint64_t>(v));
    if (static_cast<double>((s >> 3) & 0xffff) / 65536.0 < ignore_fraction) y = ignore_index;
    if (dtype == DType::kI32) {
      t.mutable_data_as<int32_t>()[i] = static_cast<int32_t>(y);
    } else {
      t.mutable_data_as<int64_t>()[i] = y;
    }
  }
  return t;
}

}  // namespace

absl::StatusOr<HostTensor> CastFloat(HostTensor t, DType dtype, const std::string& name) {
  if (t.dtype() == dtype) return t;
  if (!IsFloatDType(t.dtype()) || !IsFloatDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is ", t.DebugString(), ", cannot convert to ", DTypeName(dtype)));
  }
  HostTensor out = HostTensor::Owned(dtype, t.shape());
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    StoreFromFloat(out.mutable_data(), dtype, i, LoadAsFloat(t.data(), t.dtype(), i));
  }
  return out;
}

absl::StatusOr<std::optional<HostTensor>> ReadOptional(const std::string& path) {
  if (path.empty()) return std::optional<HostTensor>();
  LOSSD_ASSIGN_OR_RETURN(auto t, ReadNpy(path));
  return std::optional<HostTensor>(std::move(t));
}

namespace {

absl::StatusOr<WantedOutputs> ParseWant(const std::string& s) {
  WantedOutputs w;
  w.dx = w.dw = false;
  if (s.empty() || s == "none") return w;
  for (absl::string_view name : absl::StrSplit(s, ',')) {
    if (name == "dx") {
      w.dx = true;
    } else if (name == "dw") {
      w.dw = true;
    } else if (name == "db") {
      w.db = true;
    } else if (name == "lse") {
      w.lse = true;
    } else if (name == "z_loss") {
      w.z_loss = true;
    } else if (name == "accuracy") {
      w.accuracy = true;
    } else if (name == "predictions") {
      w.predictions = true;
    } else if (name == "entropy") {
      w.entropy = true;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--want: unknown output '", name,
                       "' (dx,dw,db,lse,z_loss,accuracy,predictions,entropy)"));
    }
  }
  return w;
}

}  // namespace

// The loss options, grad dtype and wanted outputs (--reduction ... --want) into r.
absl::Status LossOptionsFromFlags(ComputeRequest* r_out) {
  ComputeRequest& r = *r_out;
  const std::string reduction = absl::GetFlag(FLAGS_reduction);
  if (reduction == "mean") {
    r.options.reduction = Reduction::kMean;
  } else if (reduction == "sum") {
    r.options.reduction = Reduction::kSum;
  } else if (reduction == "none") {
    r.options.reduction = Reduction::kNone;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--reduction must be mean, sum or none, got '", reduction, "'"));
  }
  r.options.ignore_index = absl::GetFlag(FLAGS_ignore_index);
  r.options.label_smoothing = static_cast<float>(absl::GetFlag(FLAGS_label_smoothing));
  r.options.z_loss_scale = static_cast<float>(absl::GetFlag(FLAGS_lse_square_scale));
  r.options.softcap = static_cast<float>(absl::GetFlag(FLAGS_softcap));
  r.options.grad_scale = static_cast<float>(absl::GetFlag(FLAGS_grad_scale));
  r.options.chunk_rows = absl::GetFlag(FLAGS_chunk_rows);
  r.options.token_scaling = absl::GetFlag(FLAGS_token_scaling);
  if (!absl::GetFlag(FLAGS_grad_dtype).empty()) {
    LOSSD_ASSIGN_OR_RETURN(
        auto g, ParseDTypeFlag("--grad_dtype", absl::GetFlag(FLAGS_grad_dtype), true));
    r.grad_dtype = g;
  }
  LOSSD_ASSIGN_OR_RETURN(auto want, ParseWant(absl::GetFlag(FLAGS_want)));
  r.want = want;
  return absl::OkStatus();
}

namespace {

// X (from --x, or random (--bt, H) in W's or --dtype's dtype) and the targets (from
// --targets, or random below `v`) into r.
absl::Status XAndTargetsFromFlags(int64_t v, ComputeRequest* r_out) {
  ComputeRequest& r = *r_out;
  const std::string dtype_flag = absl::GetFlag(FLAGS_dtype);
  if (!absl::GetFlag(FLAGS_x).empty()) {
    LOSSD_ASSIGN_OR_RETURN(auto x, ReadNpy(absl::GetFlag(FLAGS_x)));
    r.x = std::move(x);
    if (!dtype_flag.empty()) {
      LOSSD_ASSIGN_OR_RETURN(auto dt, ParseDTypeFlag("--dtype", dtype_flag, true));
      LOSSD_ASSIGN_OR_RETURN(auto cx, CastFloat(std::move(r.x), dt, "x"));
      r.x = std::move(cx);
    }
  } else {
    const int64_t bt = absl::GetFlag(FLAGS_bt);
    const int64_t h = r.w.has_value() ? r.w->dim(1) : absl::GetFlag(FLAGS_h);
    if (bt <= 0 || h <= 0) {
      return absl::InvalidArgumentError("give --x (a .npy file) or random shape --bt and --h");
    }
    LOSSD_ASSIGN_OR_RETURN(
        auto flag_dt, ParseDTypeFlag("--dtype", dtype_flag.empty() ? "bf16" : dtype_flag, true));
    const DType dt = r.w.has_value() ? r.w->dtype() : flag_dt;
    r.x = RandomFloat(dt, {bt, h}, 1.0f, absl::GetFlag(FLAGS_seed));
  }
  if (!absl::GetFlag(FLAGS_targets).empty()) {
    LOSSD_ASSIGN_OR_RETURN(auto t, ReadNpy(absl::GetFlag(FLAGS_targets)));
    r.targets = std::move(t);
  } else {
    if (!absl::GetFlag(FLAGS_x).empty()) {
      // Random targets for real hidden states would give a loss that means nothing.
      return absl::InvalidArgumentError(absl::StrCat(
          absl::GetFlag(FLAGS_w).empty() ? "--x is a file" : "--x and --w are files",
          " but --targets is not given: give --targets (a .npy of the (BT) target ids); "
          "random targets go only with random X (--bt)"));
    }
    if (v <= 0) {
      return absl::InvalidArgumentError(
          "random targets need the vocabulary size: give --targets or --v");
    }
    LOSSD_ASSIGN_OR_RETURN(
        auto tdt, ParseDTypeFlag("--target_dtype", absl::GetFlag(FLAGS_target_dtype), false));
    r.targets =
        RandomTargets(tdt, r.x.rank() > 0 ? r.x.dim(0) : 0, v, absl::GetFlag(FLAGS_ignore_fraction),
                      r.options.ignore_index, absl::GetFlag(FLAGS_seed) + 3);
  }
  return absl::OkStatus();
}

// --head and its key (--head_version, --rank, --micro_batch) into r.
absl::Status HeadFromFlags(ComputeRequest* r) {
  r->head = absl::GetFlag(FLAGS_head);
  if (r->head.empty()) return absl::OkStatus();
  LOSSD_RETURN_IF_ERROR(CheckHeadComputeFlags());
  r->head_version = absl::GetFlag(FLAGS_head_version);
  r->rank = absl::GetFlag(FLAGS_rank);
  r->micro_batch = absl::GetFlag(FLAGS_micro_batch);
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckFlagRanges() {
  struct Range {
    const char* flag;
    std::string value;  // as given
    bool ok;
    const char* range;
  };
  auto at_least = [](const char* flag, int64_t v, int64_t lo, const char* range) {
    return Range{flag, absl::StrCat(v), v >= lo, range};
  };
  const double deadline = absl::GetFlag(FLAGS_deadline_seconds);
  const double ignore = absl::GetFlag(FLAGS_ignore_fraction);
  const int64_t response_part = absl::GetFlag(FLAGS_response_part_bytes);
  const Range ranges[] = {
      {"--deadline_seconds", absl::StrCat(deadline), deadline >= 0 && std::isfinite(deadline),
       "finite and >= 0 (0 = none)"},
      at_least("--part_bytes", absl::GetFlag(FLAGS_part_bytes), 1, "> 0"),
      // The wire field is 32 bits: a larger value would wrap into another.
      {"--response_part_bytes", absl::StrCat(response_part),
       response_part == 0 || (response_part >= 1024 && response_part <= UINT32_MAX),
       "0 (the server's default) or in [1024, 4294967295]"},
      at_least("--connections", absl::GetFlag(FLAGS_connections), 1, ">= 1"),
      at_least("--stripes", absl::GetFlag(FLAGS_stripes), 0, ">= 0 (0 = automatic)"),
      at_least("--bt", absl::GetFlag(FLAGS_bt), 0, ">= 0"),
      at_least("--h", absl::GetFlag(FLAGS_h), 0, ">= 0"),
      at_least("--v", absl::GetFlag(FLAGS_v), 0, ">= 0"),
      at_least("--teacher_h", absl::GetFlag(FLAGS_teacher_h), 0, ">= 0"),
      // A fraction of the random targets: outside [0, 1] it would silently mean all or none.
      {"--ignore_fraction", absl::StrCat(ignore), ignore >= 0 && ignore <= 1, "in [0, 1]"},
      at_least("--calls", absl::GetFlag(FLAGS_calls), 1, ">= 1"),
      at_least("--concurrency", absl::GetFlag(FLAGS_concurrency), 1, ">= 1"),
      at_least("--warmup", absl::GetFlag(FLAGS_warmup), 0, ">= 0"),
      at_least("--range_bytes", absl::GetFlag(FLAGS_range_bytes), 1, "> 0"),
  };
  for (const Range& r : ranges) {
    if (!r.ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(r.flag, " must be ", r.range, ", got ", r.value));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckHeadComputeFlags() {
  if (!absl::GetFlag(FLAGS_weight_handle).empty() || !absl::GetFlag(FLAGS_w).empty() ||
      !absl::GetFlag(FLAGS_bias).empty() || absl::GetFlag(FLAGS_with_bias) ||
      !absl::GetFlag(FLAGS_accumulator).empty()) {
    // The head is the weight and takes the gradients; anything beside it would be refused.
    return absl::InvalidArgumentError(
        "--head is the weight and the accumulator: give it without --w, --bias, --with_bias, "
        "--weight_handle or --accumulator");
  }
  return absl::OkStatus();
}

absl::StatusOr<DType> ParseFloatDType(const char* flag, const std::string& s) {
  return ParseDTypeFlag(flag, s, true);
}

absl::StatusOr<ClientOptions> ClientOptionsFromFlags() { return OptionsFromFlags(); }

absl::StatusOr<std::unique_ptr<LossClient>> ClientFromFlags() {
  LOSSD_ASSIGN_OR_RETURN(auto o, OptionsFromFlags());
  return LossClient::Create(o);
}

// The whole request from flags; `v` gets the vocabulary size when known (0 otherwise).
absl::StatusOr<ComputeRequest> RequestFromFlags(int64_t* v_out) {
  *v_out = 0;
  if (!absl::GetFlag(FLAGS_ticket).empty()) return BackwardFromFlags();
  ComputeRequest r;
  LOSSD_RETURN_IF_ERROR(LossOptionsFromFlags(&r));
  r.accumulator = absl::GetFlag(FLAGS_accumulator);
  r.weight_handle = absl::GetFlag(FLAGS_weight_handle);

  if (!r.weight_handle.empty() && (!absl::GetFlag(FLAGS_w).empty() ||
                                   !absl::GetFlag(FLAGS_bias).empty() ||
                                   absl::GetFlag(FLAGS_with_bias))) {
    // The handle carries W and its bias; anything given beside it would be ignored.
    return absl::InvalidArgumentError(
        "--weight_handle carries W and its bias: give it without --w, --bias or --with_bias");
  }
  LOSSD_RETURN_IF_ERROR(HeadFromFlags(&r));
  if (r.weight_handle.empty() && r.head.empty()) {
    LOSSD_RETURN_IF_ERROR(LoadWeights(&r.w, &r.bias));
  }
  if (r.w.has_value() && r.w->rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--w must hold a (V, H) array, got ", r.w->DebugString()));
  }
  int64_t v = r.w.has_value() ? r.w->dim(0) : absl::GetFlag(FLAGS_v);

  LOSSD_RETURN_IF_ERROR(XAndTargetsFromFlags(v, &r));
  LOSSD_ASSIGN_OR_RETURN(auto cw, ReadOptional(absl::GetFlag(FLAGS_class_weights)));
  if (cw.has_value()) {
    LOSSD_ASSIGN_OR_RETURN(auto c, CastFloat(std::move(*cw), DType::kF32, "class_weights"));
    r.class_weights = std::move(c);
  }
  LOSSD_ASSIGN_OR_RETURN(auto go, ReadOptional(absl::GetFlag(FLAGS_grad_output)));
  if (go.has_value()) {
    LOSSD_ASSIGN_OR_RETURN(auto g, CastFloat(std::move(*go), DType::kF32, "grad_output"));
    r.grad_output = std::move(g);
  }
  if (r.bias.has_value() && !r.want.db && absl::GetFlag(FLAGS_want) == "dx,dw") {
    r.want.db = true;  // the default --want includes db when there is a bias
  }
  LOSSD_RETURN_IF_ERROR(KindFromFlags(v, &r));
  *v_out = v;
  return r;
}

// Weights from --w/--bias, or random (--v, --h, --dtype, --with_bias).
absl::Status LoadWeights(std::optional<HostTensor>* w, std::optional<HostTensor>* bias) {
  const std::string dtype_flag = absl::GetFlag(FLAGS_dtype);
  if (!absl::GetFlag(FLAGS_w).empty()) {
    if (absl::GetFlag(FLAGS_with_bias)) {
      return absl::InvalidArgumentError(
          "--with_bias adds a random bias to random weights; with --w give --bias (a .npy)");
    }
    LOSSD_ASSIGN_OR_RETURN(auto wt, ReadNpy(absl::GetFlag(FLAGS_w)));
    LOSSD_ASSIGN_OR_RETURN(auto b, ReadOptional(absl::GetFlag(FLAGS_bias)));
    if (!dtype_flag.empty()) {
      LOSSD_ASSIGN_OR_RETURN(auto dt, ParseDTypeFlag("--dtype", dtype_flag, true));
      LOSSD_ASSIGN_OR_RETURN(auto cw, CastFloat(std::move(wt), dt, "w"));
      wt = std::move(cw);
      if (b.has_value()) {
        LOSSD_ASSIGN_OR_RETURN(auto cb, CastFloat(std::move(*b), dt, "bias"));
        b = std::move(cb);
      }
    }
    *w = std::move(wt);
    *bias = std::move(b);
    return absl::OkStatus();
  }
  const int64_t v = absl::GetFlag(FLAGS_v), h = absl::GetFlag(FLAGS_h);
  if (v <= 0 || h <= 0) {
    return absl::InvalidArgumentError("give --w (a .npy file) or random shape --v and --h");
  }
  if (!absl::GetFlag(FLAGS_bias).empty()) {
    return absl::InvalidArgumentError(
        "--bias goes with --w (both .npy files); random weights take --with_bias");
  }
  LOSSD_ASSIGN_OR_RETURN(
      auto dt, ParseDTypeFlag("--dtype", dtype_flag.empty() ? "bf16" : dtype_flag, true));
  // Scaled so that logits of unit-range X have a standard deviation near 3: a softmax that
  // is neither flat nor one-hot.
  *w = RandomFloat(dt, {v, h}, 9.0f / std::sqrt(static_cast<float>(h)),
                   absl::GetFlag(FLAGS_seed) + 1);
  if (absl::GetFlag(FLAGS_with_bias))
    *bias = RandomFloat(dt, {v}, 1.0f, absl::GetFlag(FLAGS_seed) + 2);
  return absl::OkStatus();
}

// One unit everywhere: the server logs memory in GiB, so lossctl prints sizes and rates in it.
constexpr double kGib = 1024.0 * 1024.0 * 1024.0;

std::string BinarySize(double bytes) {
  if (bytes >= kGib) return absl::StrFormat("%.2f GiB", bytes / kGib);
  if (bytes >= 1024.0 * 1024.0) return absl::StrFormat("%.2f MiB", bytes / (1024.0 * 1024.0));
  if (bytes >= 1024.0) return absl::StrFormat("%.2f KiB", bytes / 1024.0);
  return absl::StrFormat("%.0f B", bytes);
}

double GibPerSecond(double bytes, double seconds) { return bytes / seconds / kGib; }

absl::Status WriteOutput(const std::string& dir, const std::string& name, const HostTensor& t,
                         CommandOutput& out) {
  const std::string path = (std::filesystem::path(dir) / (name + ".npy")).string();
  LOSSD_RETURN_IF_ERROR(WriteNpy(path, t));
  out.Row("wrote", {{"path", path}, {"tensor", t.DebugString()}},
          absl::StrFormat("wrote       %s %s", path, t.DebugString()));
  return absl::OkStatus();
}

absl::Status MakeDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace client
}  // namespace lossd
