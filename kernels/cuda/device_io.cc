// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/device_io.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/cuda/nonfinite.h"

namespace lossd {
namespace cuda {
namespace {

int32_t Elem(DType t) { return static_cast<int32_t>(t); }

// The outputs' final device copies, for the non-finite check: dX, then dW and db as they are
// returned (cast to the gradient dtype where they are) or as the accumulator holds them.
struct FinalOutputs {
  const void* dx = nullptr;
  const void* dw = nullptr;
  const void* db = nullptr;
  int32_t dx_elem = 0, dw_elem = 0, db_elem = 0;
};

// Queues one read of each final output on `stream`, after the Compute's writes; *flags (device,
// zeroed here) gets LossStats' NonFiniteBits.
absl::Status EnqueueNonFiniteChecks(const FinalOutputs& f, int64_t bt, int64_t h, int64_t v,
                                    uint32_t* flags, cudaStream_t stream) {
  LOSSD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flags, 0, 4, stream));
  if (f.dx != nullptr) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        LaunchNonFiniteCheck(f.dx, f.dx_elem, bt * h, kNonFiniteDx, flags, stream));
  }
  if (f.dw != nullptr) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        LaunchNonFiniteCheck(f.dw, f.dw_elem, v * h, kNonFiniteDw, flags, stream));
  }
  if (f.db != nullptr) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        LaunchNonFiniteCheck(f.db, f.db_elem, v, kNonFiniteDb, flags, stream));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<void*> CallBuffers::Alloc(uint64_t n) {
  absl::StatusOr<std::unique_ptr<BackendBuffer>> b = allocate_(n);
  if (!b.ok()) return b.status();
  held_->push_back(*std::move(b));
  return held_->back()->data();
}

absl::Status CallBuffers::Upload(const void* src, uint64_t n, void** dst) {
  absl::StatusOr<void*> d = Alloc(n);
  if (!d.ok()) return d.status();
  *dst = *d;
  if (n == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(*dst, src, n, cudaMemcpyHostToDevice, stream_),
                    "cudaMemcpyAsync(host to device)");
}

absl::Status CallBuffers::Download(void* dst, const void* src, uint64_t n) {
  if (n == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream_),
                    "cudaMemcpyAsync(device to host)");
}

// The engine's arguments but the device pointers: shape, options and the targets' summary,
// with the largest upstream gradient for reduction none.
DeviceLossArgs MakeArgs(const LossProblem& p, const TargetSummary& summary) {
  const int64_t bt = p.bt;
  DeviceLossArgs a;
  a.bt = bt;
  a.h = p.h;
  a.v = p.v;
  a.dtype = p.dtype;
  a.options = p.options;
  a.summary = summary;
  if (p.options.reduction == Reduction::kNone && p.grad_output != nullptr) {
    for (int64_t i = 0; i < bt; ++i) {
      a.summary.row_grad_max_abs =
          std::max(a.summary.row_grad_max_abs, std::fabs(static_cast<double>(p.grad_output[i])));
    }
  }
  return a;
}

// The inputs on the device: X (or, overlapped, a zeroed X the hooks fill in: *x_device), W and
// the bias unless they live there already, the targets, class weights and upstream gradient.
absl::Status UploadInputs(CallBuffers& m, const LossProblem& p,
                          const std::vector<int32_t>& targets32,  // (BT) -1 for ignored rows
                          DeviceLossArgs* a, void** x_device) {
  const int64_t bt = p.bt, h = p.h, v = p.v;
  const size_t elem = DTypeSize(p.dtype);
  cudaStream_t stream = m.stream();
  void* ptr = nullptr;
  if (p.rows == nullptr) {
    LOSSD_RETURN_IF_ERROR(m.Upload(p.x, bt * h * elem, &ptr));
  } else {
    // Rows go up as they arrive (StreamedChunkHooks). Until then X holds zeros, not the pool's
    // leftovers: the autotuning trials read it, and their X^T 0 must be 0 (fused_loss_chunks.cc).
    absl::StatusOr<void*> d = m.Alloc(bt * h * elem);
    if (!d.ok()) return d.status();
    ptr = *x_device = *d;
    if (bt > 0) {
      LOSSD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, 0, bt * h * elem, stream));
    }
  }
  a->x = ptr;
  if (p.w_memory == Memory::kHost) {
    LOSSD_RETURN_IF_ERROR(m.Upload(p.w, v * h * elem, &ptr));
    a->w = ptr;
    if (p.bias != nullptr) {
      LOSSD_RETURN_IF_ERROR(m.Upload(p.bias, v * elem, &ptr));
      a->bias = ptr;
    }
  } else {
    a->w = p.w;
    a->bias = p.bias;
  }
  LOSSD_RETURN_IF_ERROR(m.Upload(targets32.data(), bt * 4, &ptr));
  a->targets = static_cast<const int32_t*>(ptr);
  if (p.class_weights != nullptr) {
    LOSSD_RETURN_IF_ERROR(m.Upload(p.class_weights, v * 4, &ptr));
    a->class_weights = static_cast<const float*>(ptr);
  }
  if (p.grad_output != nullptr) {
    LOSSD_RETURN_IF_ERROR(m.Upload(p.grad_output, bt * 4, &ptr));
    a->row_grad = static_cast<const float*>(ptr);
  }
  return absl::OkStatus();
}

// The outputs on the device: the per-row statistics (and the flag word after them), dX, and dW
// and db: straight into a device accumulator, through a device copy of a host accumulator, or
// into a fresh fp32 buffer (cast at the end when the gradient is 16-bit).
absl::Status AllocateOutputs(CallBuffers& m, const LossProblem& p, const LossOutputs& out,
                             DeviceLossArgs* a, DeviceOutputs* d_out) {
  const int64_t bt = p.bt, h = p.h, v = p.v;
  const size_t gsize = DTypeSize(out.grad_dtype);
  void* ptr = nullptr;
  absl::StatusOr<void*> rows_mem = m.Alloc(4 * Align(bt * 4) + Align(4));
  if (!rows_mem.ok()) return rows_mem.status();
  char* rows_base = d_out->rows_base = static_cast<char*>(*rows_mem);
  a->row_lse = reinterpret_cast<float*>(rows_base);
  a->row_ce = reinterpret_cast<float*>(rows_base + Align(bt * 4));
  a->row_z = reinterpret_cast<float*>(rows_base + 2 * Align(bt * 4));
  a->row_pred = reinterpret_cast<int32_t*>(rows_base + 3 * Align(bt * 4));
  if (out.dx != nullptr) {
    absl::StatusOr<void*> d = m.Alloc(bt * h * gsize);
    if (!d.ok()) return d.status();
    a->dx = *d;
    a->dx_dtype = out.grad_dtype;
  }
  if (out.dw_accum != nullptr) {
    a->accumulate_dw = true;
    if (out.accum_memory == Memory::kBackend) {
      a->dw_acc = out.dw_accum;
    } else {
      LOSSD_RETURN_IF_ERROR(m.Upload(out.dw_accum, v * h * 4, &ptr));
      a->dw_acc = static_cast<float*>(ptr);
    }
  } else if (out.dw != nullptr) {
    absl::StatusOr<void*> d = m.Alloc(v * h * 4);
    if (!d.ok()) return d.status();
    a->dw_acc = static_cast<float*>(*d);
    if (out.grad_dtype != DType::kF32) {
      absl::StatusOr<void*> c = m.Alloc(v * h * gsize);
      if (!c.ok()) return c.status();
      d_out->dw_cast = *c;
    }
  }
  if (p.bias == nullptr) return absl::OkStatus();
  if (out.db_accum != nullptr) {
    a->accumulate_db = true;
    if (out.accum_memory == Memory::kBackend) {
      a->db_acc = out.db_accum;
    } else {
      LOSSD_RETURN_IF_ERROR(m.Upload(out.db_accum, v * 4, &ptr));
      a->db_acc = static_cast<float*>(ptr);
    }
  } else if (out.db != nullptr) {
    absl::StatusOr<void*> d = m.Alloc(v * 4);
    if (!d.ok()) return d.status();
    a->db_acc = static_cast<float*>(*d);
    absl::StatusOr<void*> c = m.Alloc(v * 4);
    if (!c.ok()) return c.status();
    d_out->db_cast = *c;
  }
  return absl::OkStatus();
}

// Queues, after the engine's work on the same stream, the copies of the results back to the
// host (into `host` and the caller's outputs), the casts of a 16-bit dW and db, and the
// non-finite checks of the final outputs with their flag word. `streamed`: dX came down chunk
// by chunk already (StreamedChunkHooks::DxEnqueued).
absl::Status DownloadResults(CallBuffers& m, const LossProblem& p, const LossOutputs& out,
                             const DeviceLossArgs& a, const DeviceOutputs& d_out, bool streamed,
                             HostRows* host) {
  const int64_t bt = p.bt, h = p.h, v = p.v;
  const size_t gsize = DTypeSize(out.grad_dtype);
  cudaStream_t stream = m.stream();
  void* const dw_cast = d_out.dw_cast;
  void* const db_cast = d_out.db_cast;
  LOSSD_RETURN_IF_ERROR(m.Download(host->lse.data(), a.row_lse, bt * 4));
  LOSSD_RETURN_IF_ERROR(m.Download(host->ce.data(), a.row_ce, bt * 4));
  LOSSD_RETURN_IF_ERROR(m.Download(host->zl.data(), a.row_z, bt * 4));
  LOSSD_RETURN_IF_ERROR(m.Download(host->pred.data(), a.row_pred, bt * 4));
  if (out.dx != nullptr && !streamed) {
    LOSSD_RETURN_IF_ERROR(m.Download(out.dx, a.dx, bt * h * gsize));
  }
  FinalOutputs final_out;
  final_out.dx = out.dx != nullptr ? a.dx : nullptr;
  final_out.dx_elem = Elem(out.grad_dtype);
  final_out.dw = a.dw_acc;  // fp32: the accumulator, or dW before its cast
  final_out.dw_elem = Elem(DType::kF32);
  final_out.db = a.db_acc;
  final_out.db_elem = Elem(DType::kF32);
  if (out.dw_accum != nullptr) {
    if (out.accum_memory == Memory::kHost) {
      LOSSD_RETURN_IF_ERROR(m.Download(out.dw_accum, a.dw_acc, v * h * 4));
    }
  } else if (out.dw != nullptr) {
    if (dw_cast != nullptr) {
      LOSSD_CUDA_RETURN_IF_ERROR(
          LaunchCastFromFloat(a.dw_acc, dw_cast, Elem(out.grad_dtype), v * h, stream));
      final_out.dw = dw_cast;  // fp16 overflows where fp32 did not
      final_out.dw_elem = Elem(out.grad_dtype);
      LOSSD_RETURN_IF_ERROR(m.Download(out.dw, dw_cast, v * h * gsize));
    } else {
      LOSSD_RETURN_IF_ERROR(m.Download(out.dw, a.dw_acc, v * h * 4));
    }
  }
  if (p.bias != nullptr) {
    if (out.db_accum != nullptr) {
      if (out.accum_memory == Memory::kHost) {
        LOSSD_RETURN_IF_ERROR(m.Download(out.db_accum, a.db_acc, v * 4));
      }
    } else if (out.db != nullptr) {
      LOSSD_CUDA_RETURN_IF_ERROR(
          LaunchCastFromFloat(a.db_acc, db_cast, Elem(out.grad_dtype), v, stream));
      final_out.db = db_cast;
      final_out.db_elem = Elem(out.grad_dtype);
      LOSSD_RETURN_IF_ERROR(m.Download(out.db, db_cast, v * gsize));
    }
  }
  uint32_t* flags = reinterpret_cast<uint32_t*>(d_out.rows_base + 4 * Align(bt * 4));
  LOSSD_RETURN_IF_ERROR(EnqueueNonFiniteChecks(final_out, bt, h, v, flags, stream));
  return m.Download(&host->nonfinite, flags, 4);
}

// The losses, lse, predictions, accuracy and token count from the per-row statistics:
// reductions on the host, in double and in row order (deterministic and exact enough).
void WriteHostOutputs(const LossProblem& p, const LossOutputs& out, const TargetSummary& s,
                      const std::vector<int32_t>& targets32,  // (BT) -1 for ignored rows
                      const HostRows& host) {
  const int64_t bt = p.bt;
  const bool none = p.options.reduction == Reduction::kNone;
  const std::vector<float>& ce = host.ce;
  const std::vector<float>& zl = host.zl;
  const std::vector<int32_t>& pred = host.pred;
  double ce_total = 0, z_total = 0;
  int64_t correct = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (targets32[i] < 0) continue;
    ce_total += ce[i];
    z_total += zl[i];
    if (pred[i] == targets32[i]) ++correct;
  }
  double ce_loss = ce_total, z_loss = z_total;
  if (p.options.reduction == Reduction::kMean) {
    ce_loss = s.weight_sum != 0 ? ce_total / s.weight_sum : 0.0;
    z_loss = s.tokens != 0 ? z_total / static_cast<double>(s.tokens) : 0.0;
  }
  if (out.loss != nullptr) {
    if (none) {
      for (int64_t i = 0; i < bt; ++i) out.loss[i] = ce[i] + zl[i];
    } else {
      out.loss[0] = static_cast<float>(ce_loss + z_loss);
    }
  }
  if (out.z_loss != nullptr) {
    if (none) {
      for (int64_t i = 0; i < bt; ++i) out.z_loss[i] = zl[i];
    } else {
      out.z_loss[0] = static_cast<float>(z_loss);
    }
  }
  if (out.lse != nullptr) std::memcpy(out.lse, host.lse.data(), bt * sizeof(float));
  if (out.predictions != nullptr) {
    for (int64_t i = 0; i < bt; ++i) out.predictions[i] = pred[i];
  }
  if (out.accuracy != nullptr) {
    *out.accuracy = s.tokens != 0 ? static_cast<float>(static_cast<double>(correct) /
                                                       static_cast<double>(s.tokens))
                                  : 0.0f;
  }
  if (out.tokens != nullptr) *out.tokens = s.tokens;
}

}  // namespace cuda
}  // namespace lossd
