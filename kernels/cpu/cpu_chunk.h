// SPDX-License-Identifier: Apache-2.0
// One chunk of the CPU backend's Compute: the logits GEMM, the row pass and the gradient
// GEMMs over C rows, in tasks whose bounds depend on the shape only, so the results never
// depend on the thread count. It never allocates a buffer (the caller's CpuWorkspace holds them)
// and never validates: the caller has.
#ifndef LOSSD_KERNELS_CPU_CPU_CHUNK_H_
#define LOSSD_KERNELS_CPU_CPU_CHUNK_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cpu/cpu_task_pool.h"
#include "kernels/cpu/row_pass.h"

namespace lossd {

// 64-byte aligned fp32 buffer that reports allocation failure instead of throwing.
class FloatBuffer {
 public:
  FloatBuffer() = default;
  FloatBuffer(const FloatBuffer&) = delete;
  FloatBuffer& operator=(const FloatBuffer&) = delete;
  ~FloatBuffer() { std::free(data_); }

  bool Allocate(size_t n) {
    std::free(data_);
    const size_t bytes = ((std::max<size_t>(n, 1) * sizeof(float)) + 63) / 64 * 64;
    data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    size_ = data_ != nullptr ? n : 0;
    return data_ != nullptr;
  }
  float* data() { return data_; }
  size_t size() const { return size_; }

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
};

// The per-call buffers of one Compute, in fp32, and where each input and output is read or
// written from: the caller's buffers where they already are fp32, else a buffer here.
struct CpuWorkspace {
  FloatBuffer w_copy, bias_f, z_buf, x_copy, dx_scratch, dw_scratch, db_f;
  const float* wf = nullptr;   // (V, H) W in fp32
  float* dw_f = nullptr;       // (V, H) fp32 dW sum, or null when dW is not wanted
  float* db_acc = nullptr;     // (V) fp32 db sum, or null when db is not wanted
  bool dw_overwrite = false;   // the first chunk writes dW, later ones add
};

// What every chunk of one Compute reads; rows receives the row pass's results.
struct CpuChunkPass {
  const LossProblem& p;
  const LossOutputs& out;
  CpuTaskPool& pool;
  CpuWorkspace& ws;
  const RowPassParams& rp;
  const std::vector<int64_t>& targets;  // (BT) -1 for an ignored row
  double ce_scale, z_scale, g_alpha;
  std::vector<RowResult>& rows;         // (BT)
  // From the backend's plan: X_c is widened into ws.x_copy; dX is wanted; dX_c goes through
  // ws.dx_scratch (a 16-bit dX).
  bool x_copy, want_dx, dx_scratch;
  // The other loss kinds (kernels/cpu/cpu_kinds.h). before_rows: run after the chunk's logits
  // GEMM and before its rows (distill: the teacher's logits). row: replaces the cross-entropy
  // row pass (rp, targets and rows unused); called once per row i with its z (V), from any
  // thread, and leaves G over z when a gradient is wanted.
  std::function<void(int64_t c0, int64_t rows_c)> before_rows = nullptr;
  using RowFn = std::function<void(int64_t i, float* z)>;
  RowFn row = nullptr;
};

// Rows [c0, c0 + rows_c) of the problem: waits for them (overlapped path), z = X_c W^T in
// ws.z_buf, then the row pass over every row, which leaves G over z and its results in
// c.rows. *xc is set to X_c in fp32 (the caller's X or ws.x_copy). An error is the row
// stream's.
absl::Status ChunkForward(const CpuChunkPass& c, int64_t c0, int64_t rows_c, const float** xc);

// z (rows x V, row-major) = X_c W^T for X_c (rows x H) and W (V x H) in fp32, in tasks of V
// columns; the logits GEMM of every kind, exposed for distillation's teacher.
void ChunkLogitsGemm(CpuTaskPool& pool, const float* xc, int64_t rows, int64_t h,
                     const float* wf, int64_t v, float* z);

// dst (rows x H fp32) = rows [r0, r0 + rows) of src (dtype t, H wide), in parallel blocks.
void WidenRows(CpuTaskPool& pool, const void* src, DType t, int64_t r0, int64_t rows, int64_t h,
               float* dst);

// dX_c = G W, dW += G^T X_c and db += colsum G for the chunk at c0, from G in ws.z_buf and
// xc = X_c in fp32 (ChunkForward's), each added in a fixed order.
void ChunkBackward(const CpuChunkPass& c, int64_t c0, int64_t rows_c, const float* xc);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_CPU_CHUNK_H_
