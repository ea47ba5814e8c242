// SPDX-License-Identifier: Apache-2.0
// FusedLoss's set-up and its entry point; the GEMM layer is in fused_loss_gemm.cc, the
// row-chunk path in fused_loss_chunks.cc, the whole-batch path in fused_loss_whole.cc.
#include "kernels/cuda/fused_loss.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/fused_loss_internal.h"
#include "kernels/cuda/ref_exp_gemm.h"

namespace lossd {
namespace cuda {

absl::StatusOr<TargetSummary> SummarizeTargets(const void* targets, DType target_dtype, int64_t bt,
                                               int64_t v, int64_t ignore_index,
                                               const float* class_weights,
                                               std::vector<int32_t>* targets32) {
  if (target_dtype != DType::kI32 && target_dtype != DType::kI64) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda: target_dtype must be int32 or int64; got ", DTypeName(target_dtype)));
  }
  if (bt > 0 && targets == nullptr) {
    return absl::InvalidArgumentError("cuda: targets must be non-null");
  }
  TargetSummary s;
  targets32->assign(bt, -1);
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = LoadAsInt(targets, target_dtype, i);
    if (t == ignore_index) continue;
    if (t < 0 || t >= v) {
      return absl::InvalidArgumentError(absl::StrCat("cuda: targets[", i, "] = ", t,
                                                     " is outside [0, ", v,
                                                     ") and is not ignore_index ", ignore_index));
    }
    (*targets32)[i] = static_cast<int32_t>(t);
    ++s.tokens;
    s.weight_sum += class_weights != nullptr ? class_weights[t] : 1.0;
  }
  if (class_weights != nullptr) {
    for (int64_t j = 0; j < v; ++j) {
      s.class_weight_sum += class_weights[j];
      s.class_weight_max_abs =
          std::max(s.class_weight_max_abs, std::fabs(static_cast<double>(class_weights[j])));
    }
  } else {
    s.class_weight_sum = static_cast<double>(v);
  }
  return s;
}

// The cross-entropy parameters of rows [r0, r0 + n) of a problem; the caller says where the
// logits are (logits, or the blocked layout's segments).
CrossEntropyParams RowParams(const DeviceLossArgs& a, const GradScales& scales, bool write_grad,
                             int64_t r0, int64_t n) {
  CrossEntropyParams p{};
  p.elem = static_cast<int32_t>(a.dtype);
  p.rows = n;
  p.v = a.v;
  p.bias = a.bias;
  p.targets = a.targets + r0;
  p.class_weights = a.class_weights;
  p.row_scale = a.options.reduction == Reduction::kNone && a.row_grad != nullptr
                    ? a.row_grad + r0
                    : nullptr;
  p.ce_scale = scales.ce;
  p.z_scale = scales.z;
  p.label_smoothing = a.options.label_smoothing;
  p.z_loss_scale = a.options.z_loss_scale;
  p.token_scaling = a.options.token_scaling ? 1 : 0;
  p.softcap = a.options.softcap;
  p.class_weight_sum = static_cast<float>(a.summary.class_weight_sum);
  p.write_grad = write_grad ? 1 : 0;
  p.row_lse = a.row_lse + r0;
  p.row_ce = a.row_ce + r0;
  p.row_z = a.row_z + r0;
  p.row_pred = a.row_pred + r0;
  return p;
}

RowLossParams RowLossParamsOf(const DeviceLossArgs& a, bool write_grad, int64_t r0, int64_t n) {
  const RowLossInputs& in = a.row_loss;
  // Row r0's entry of a per-row array, or null.
  auto at = [r0](const float* x) { return x != nullptr ? x + r0 : nullptr; };
  RowLossParams p{};
  p.elem = static_cast<int32_t>(a.dtype);
  p.rows = n;
  p.v = a.v;
  p.bias = a.bias;
  p.targets = a.targets + r0;
  p.softcap = a.options.softcap;
  p.inv_temperature = 1.0f / a.options.temperature;
  p.kind = a.kind == LossKind::kPolicy    ? kRowLossPolicy
           : a.kind == LossKind::kDistill ? kRowLossDistill
                                          : kRowLossLogprob;
  p.write_grad = write_grad ? 1 : 0;
  p.coef_logp = at(in.coef_logp);
  p.coef_entropy = at(in.coef_entropy);
  p.row_weight = at(in.row_weight);
  p.advantages = at(in.advantages);
  p.old_logp = at(in.old_logp);
  p.ref_logp = at(in.ref_logp);
  p.is_ratio = at(in.is_ratio);
  p.policy = in.policy;
  p.teacher_bias = in.teacher_bias;
  p.jsd_beta = in.jsd_beta;
  p.distill_coef = in.distill_coef;
  p.hard_coef = in.hard_coef;
  p.row_lse = a.row_lse + r0;
  p.row_logp = a.row_ce + r0;
  p.row_entropy = a.row_z + r0;
  p.row_pred = a.row_pred + r0;
  return p;
}

absl::StatusOr<std::unique_ptr<FusedLoss>> FusedLoss::Create(int device) {
  std::unique_ptr<FusedLoss> f(new FusedLoss());
  f->device_ = device;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&f->main_, cudaStreamNonBlocking));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&f->ce_, cudaStreamNonBlocking));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&f->side_, cudaStreamNonBlocking));
  for (cudaEvent_t* e :
       {&f->start_, &f->logits_done_[0], &f->logits_done_[1], &f->ce_done_[0], &f->ce_done_[1],
        &f->dw_done_[0], &f->dw_done_[1], &f->ce_end_, &f->side_end_, &f->dx_last_}) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&f->lt_));
  LOSSD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&f->sm_count_, cudaDevAttrMultiProcessorCount, device));
  // The reference-exp GEMM is sm_90a code: compute capability 9.0 exactly.
  int major = 0, minor = 0;
  LOSSD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  LOSSD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major == 9 && minor == 0) f->ref_exp_gemm_ = MakeRefExpGemm();
  if (f->ref_exp_gemm_ != nullptr) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&f->combined_, cudaEventDisableTiming));
    LOSSD_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(&f->flagged_host_), 3 * sizeof(unsigned int)));
  }
  return f;
}

FusedLoss::~FusedLoss() {
  // Teardown errors have no caller to go to; the device is left as it is.
  cudaSetDevice(device_);
  if (lt_ != nullptr) cublasLtDestroy(lt_);
  for (cudaEvent_t e : {start_, logits_done_[0], logits_done_[1], ce_done_[0], ce_done_[1],
                        dw_done_[0], dw_done_[1], ce_end_, side_end_, dx_last_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (combined_ != nullptr) cudaEventDestroy(combined_);
  if (flagged_host_ != nullptr) cudaFreeHost(flagged_host_);
  if (side_ != nullptr) cudaStreamDestroy(side_);
  if (ce_ != nullptr) cudaStreamDestroy(ce_);
  if (main_ != nullptr) cudaStreamDestroy(main_);
}

absl::Status FusedLoss::Enqueue(const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace) {
  if (a.bt < 0 || a.h <= 0 || a.v <= 0 || a.v > 0x7fffffff || a.bt > 0x7fffffff) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda: bad shape bt=", a.bt, " h=", a.h, " v=", a.v));
  }
  if (!IsFloatDType(a.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda: dtype must be bf16, fp16 or fp32; got ", DTypeName(a.dtype)));
  }
  if (a.dx != nullptr && a.dx_dtype != a.dtype && a.dx_dtype != DType::kF32) {
    return absl::InvalidArgumentError("cuda: gradient dtype must be the input dtype or fp32");
  }
  if (a.db_acc != nullptr && a.bias == nullptr) {
    return absl::InvalidArgumentError("cuda: db wanted but the problem has no bias");
  }
  if (plan.chunk_rows <= 0 || workspace == nullptr) {
    return absl::InvalidArgumentError("cuda: no chunk plan or workspace");
  }
  if (a.hooks != nullptr && plan.blocks > 0) {
    return absl::InvalidArgumentError(
        "cuda: rows that arrive during the compute need a row-chunk plan, not the whole-batch "
        "layout (each of its GEMMs reads every row of X)");
  }
  if (a.kind != LossKind::kCrossEntropy && plan.blocks > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda: loss kind ", LossKindName(a.kind),
        " needs a row-chunk plan, not the whole-batch layout"));
  }
  if (a.kind == LossKind::kDistill &&
      (a.row_loss.teacher_x == nullptr || a.row_loss.teacher_w == nullptr ||
       a.row_loss.teacher_h <= 0 || a.options.softcap != 0.0f)) {
    return absl::InvalidArgumentError(
        "cuda: distill needs the teacher's X, W and hidden size, and no softcap");
  }
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (plan.blocks > 0) return EnqueueWhole(a, plan, workspace);
  if (plan.ref_exp && ref_exp() && RefExpCovers(a)) return EnqueueRefExp(a, plan, workspace);
  return EnqueueChunks(a, plan, workspace);
}

}  // namespace cuda
}  // namespace lossd
