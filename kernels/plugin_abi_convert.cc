#include "kernels/plugin_abi_convert.h"

#include <cstdio>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lossd {
namespace {

// NUL-terminated `s` in dst[0, capacity), cut to fit.
void CopyCut(absl::string_view s, char* dst, size_t capacity) {
  if (dst == nullptr || capacity == 0) return;
  const size_t n = s.size() < capacity - 1 ? s.size() : capacity - 1;
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

template <typename E>
int32_t I(E e) {
  return static_cast<int32_t>(e);
}

}  // namespace

int32_t WriteStatus(const absl::Status& s, LossdStatus* out) {
  const int32_t code = static_cast<int32_t>(s.code());
  if (out != nullptr) {
    out->code = code;
    if (!s.ok()) CopyCut(s.message(), out->message, out->message_capacity);
  }
  return code;
}

StatusBuffer::StatusBuffer() : status_{0, message_, sizeof(message_)} { message_[0] = '\0'; }

absl::Status StatusBuffer::ToStatus(int32_t code) const {
  if (code == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(code), message_);
}

LossdWorkspaceShape ToC(const WorkspaceShape& s) {
  LossdWorkspaceShape c{};
  c.bt = s.bt;
  c.h = s.h;
  c.v = s.v;
  c.dtype = I(s.dtype);
  c.grad_dtype = I(s.grad_dtype);
  c.w_memory = I(s.w_memory);
  c.has_bias = s.has_bias;
  c.has_class_weights = s.has_class_weights;
  c.has_grad_output = s.has_grad_output;
  c.rows_streamed = s.rows_streamed;
  c.chunk_rows = s.chunk_rows;
  c.want_dx = s.want_dx;
  c.dw = I(s.dw);
  c.db = I(s.db);
  c.accum_memory = I(s.accum_memory);
  return c;
}

WorkspaceShape FromC(const LossdWorkspaceShape& c) {
  WorkspaceShape s;
  s.bt = c.bt;
  s.h = c.h;
  s.v = c.v;
  s.dtype = static_cast<DType>(c.dtype);
  s.grad_dtype = static_cast<DType>(c.grad_dtype);
  s.w_memory = static_cast<Memory>(c.w_memory);
  s.has_bias = c.has_bias != 0;
  s.has_class_weights = c.has_class_weights != 0;
  s.has_grad_output = c.has_grad_output != 0;
  s.rows_streamed = c.rows_streamed != 0;
  s.chunk_rows = c.chunk_rows;
  s.want_dx = c.want_dx != 0;
  s.dw = static_cast<GradOut>(c.dw);
  s.db = static_cast<GradOut>(c.db);
  s.accum_memory = static_cast<Memory>(c.accum_memory);
  return s;
}

LossdLossOptions ToC(const LossOptions& o) {
  LossdLossOptions c{};
  c.ignore_index = o.ignore_index;
  c.reduction = I(o.reduction);
  c.label_smoothing = o.label_smoothing;
  c.z_loss_scale = o.z_loss_scale;
  c.softcap = o.softcap;
  c.grad_scale = o.grad_scale;
  c.chunk_rows = o.chunk_rows;
  c.token_scaling = o.token_scaling;
  return c;
}

LossOptions FromC(const LossdLossOptions& c) {
  LossOptions o;
  o.ignore_index = c.ignore_index;
  o.reduction = static_cast<Reduction>(c.reduction);
  o.label_smoothing = c.label_smoothing;
  o.z_loss_scale = c.z_loss_scale;
  o.softcap = c.softcap;
  o.grad_scale = c.grad_scale;
  o.chunk_rows = c.chunk_rows;
  o.token_scaling = c.token_scaling != 0;
  return o;
}

LossdProblem ToC(const LossProblem& p, const LossdRowStream* rows) {
  LossdProblem c{};
  c.bt = p.bt;
  c.h = p.h;
  c.v = p.v;
  c.dtype = I(p.dtype);
  c.w_memory = I(p.w_memory);
  c.x = p.x;
  c.w = p.w;
  c.bias = p.bias;
  c.targets = p.targets;
  c.target_dtype = I(p.target_dtype);
  c.class_weights = p.class_weights;
  c.grad_output = p.grad_output;
  c.options = ToC(p.options);
  c.rows = rows;
  return c;
}

LossProblem FromC(const LossdProblem& c, RowStream* rows) {
  LossProblem p;
  p.bt = c.bt;
  p.h = c.h;
  p.v = c.v;
  p.dtype = static_cast<DType>(c.dtype);
  p.w_memory = static_cast<Memory>(c.w_memory);
  p.x = c.x;
  p.w = c.w;
  p.bias = c.bias;
  p.targets = c.targets;
  p.target_dtype = static_cast<DType>(c.target_dtype);
  p.class_weights = c.class_weights;
  p.grad_output = c.grad_output;
  p.options = FromC(c.options);
  p.rows = rows;
  return p;
}

LossdOutputs ToC(const LossOutputs& o) {
  LossdOutputs c{};
  c.grad_dtype = I(o.grad_dtype);
  c.loss = o.loss;
  c.z_loss = o.z_loss;
  c.lse = o.lse;
  c.predictions = o.predictions;
  c.accuracy = o.accuracy;
  c.tokens = o.tokens;
  c.dx = o.dx;
  c.dw = o.dw;
  c.db = o.db;
  c.dw_accum = o.dw_accum;
  c.db_accum = o.db_accum;
  c.accum_memory = I(o.accum_memory);
  return c;
}

LossOutputs FromC(const LossdOutputs& c) {
  LossOutputs o;
  o.grad_dtype = static_cast<DType>(c.grad_dtype);
  o.loss = c.loss;
  o.z_loss = c.z_loss;
  o.lse = c.lse;
  o.predictions = c.predictions;
  o.accuracy = c.accuracy;
  o.tokens = c.tokens;
  o.dx = c.dx;
  o.dw = c.dw;
  o.db = c.db;
  o.dw_accum = c.dw_accum;
  o.db_accum = c.db_accum;
  o.accum_memory = static_cast<Memory>(c.accum_memory);
  return o;
}

LossdStats ToC(const LossStats& s) {
  LossdStats c{};
  c.compute_seconds = s.compute_seconds;
  c.peak_extra_bytes = s.peak_extra_bytes;
  c.chunk_rows = s.chunk_rows;
  c.gemm_tunings = s.gemm_tunings;
  c.nonfinite = s.nonfinite;
  return c;
}

LossStats FromC(const LossdStats& c) {
  LossStats s;
  s.compute_seconds = c.compute_seconds;
  s.peak_extra_bytes = c.peak_extra_bytes;
  s.chunk_rows = c.chunk_rows;
  s.gemm_tunings = c.gemm_tunings;
  s.nonfinite = c.nonfinite;
  return s;
}

LossdBackendInfo ToC(const BackendInfo& i) {
  LossdBackendInfo c{};
  CopyCut(i.name, c.name, sizeof(c.name));
  CopyCut(i.device, c.device, sizeof(c.device));
  c.memory_total_bytes = i.memory_total_bytes;
  c.memory_used_bytes = i.memory_used_bytes;
  c.memory_peak_bytes = i.memory_peak_bytes;
  c.memory_held_bytes = i.memory_held_bytes;
  c.memory_budget_bytes = i.memory_budget_bytes;
  c.healthy = i.healthy;
  return c;
}

BackendInfo FromC(const LossdBackendInfo& c) {
  BackendInfo i;
  // The arrays are NUL-terminated by ToC; strnlen guards a plugin that did not.
  i.name.assign(c.name, strnlen(c.name, sizeof(c.name)));
  i.device.assign(c.device, strnlen(c.device, sizeof(c.device)));
  i.memory_total_bytes = c.memory_total_bytes;
  i.memory_used_bytes = c.memory_used_bytes;
  i.memory_peak_bytes = c.memory_peak_bytes;
  i.memory_held_bytes = c.memory_held_bytes;
  i.memory_budget_bytes = c.memory_budget_bytes;
  i.healthy = c.healthy != 0;
  return i;
}

}  // namespace lossd
