// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/cpu_chunk.h"

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "core/loss_problem.h"
#include "kernels/cpu/cpu_convert.h"
#include "kernels/cpu/cpu_task_pool.h"
#include "kernels/cpu/row_pass.h"

namespace lossd {
namespace {

// Task sizes depend on the shape only, never on the thread count. Larger tasks repack less
// (every sgemm call packs its whole shared operand); at least 4 to 8 tasks keep threads busy.
int64_t RoundUp(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
int64_t VBlock(int64_t v) {  // vocabulary columns per logits / dW task
  return std::min<int64_t>(2048, std::max<int64_t>(256, RoundUp(CeilDiv(v, 8), 64)));
}
int64_t RowBlock(int64_t rows) {  // chunk rows per dX task
  return std::min<int64_t>(512, std::max<int64_t>(16, RoundUp(CeilDiv(rows, 4), 16)));
}
constexpr int64_t kPassRows = 8;      // rows per row-pass task

// ---------------------------------------------------------------------------------------------
// GEMM.

// C (m x n) = A (m x k) B^T (trans_b, B is n x k) or A B (B is k x n), row-major, beta 0.
// OpenBLAS computes a one-row product by another path whose rounding differs from the
// many-row kernels; computing it as two identical rows keeps every row's result independent
// of how rows are grouped into calls, so the chunk size never changes z or dX.
void GemmRows(bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
              const float* b, int64_t ldb, float* c, int64_t ldc, float alpha = 1.0f) {
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  std::unique_ptr<float[]> a2, c2;
  if (m == 1) {
    a2.reset(new (std::nothrow) float[2 * k]);
    c2.reset(new (std::nothrow) float[2 * n]);
  }
  if (a2 == nullptr || c2 == nullptr) {  // m > 1, or (out of memory) the one-row path
    cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
    return;
  }
  std::memcpy(a2.get(), a, k * sizeof(float));
  std::memcpy(a2.get() + k, a, k * sizeof(float));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, 2, n, k, alpha, a2.get(), k, b, ldb, 0.0f,
              c2.get(), n);
  std::memcpy(c, c2.get(), n * sizeof(float));
}

}  // namespace

void ChunkLogitsGemm(CpuTaskPool& pool, const float* xc, int64_t rows, int64_t h,
                     const float* wf, int64_t v, float* z) {
  // One task per block of V columns.
  const int64_t v_block = VBlock(v), v_tasks = CeilDiv(v, v_block);
  pool.Run(v_tasks, [&](int64_t task) {
    const int64_t j0 = task * v_block, nj = std::min(v_block, v - j0);
    GemmRows(/*trans_b=*/true, rows, nj, h, xc, h, wf + j0 * h, h, z + j0, v);
  });
}

void WidenRows(CpuTaskPool& pool, const void* src, DType t, int64_t r0, int64_t rows, int64_t h,
               float* dst) {
  pool.Run(CeilDiv(rows * h, kConvertBlock), [&](int64_t task) {
    const int64_t first = task * kConvertBlock;
    const int64_t n = std::min(kConvertBlock, rows * h - first);
    WidenRange(src, t, r0 * h + first, n, dst + first);
  });
}

// Rows [c0, c0 + rows_c): waits for them (overlapped path), z = X_c W^T in ws.z_buf, then the
// row pass, which leaves G over z. *xc is set to X_c in fp32.
absl::Status ChunkForward(const CpuChunkPass& c, int64_t c0, int64_t rows_c, const float** xc_out) {
  const LossProblem& p = c.p;
  const int64_t h = p.h, v = p.v;
  const bool none = p.options.reduction == Reduction::kNone;
  float* z = c.ws.z_buf.data();
  // Overlapped path: this chunk's rows of X may still be on their way.
  if (p.rows != nullptr) {
    absl::Status arrived = p.rows->WaitX(c0 + rows_c);
    if (!arrived.ok()) return arrived;
  }
  // X_c in fp32.
  const float* xc = static_cast<const float*>(p.x) + c0 * h;
  if (c.x_copy) {
    WidenRows(c.pool, p.x, p.dtype, c0, rows_c, h, c.ws.x_copy.data());
    xc = c.ws.x_copy.data();
  }
  *xc_out = xc;
  ChunkLogitsGemm(c.pool, xc, rows_c, h, c.ws.wf, v, z);
  if (c.before_rows) c.before_rows(c0, rows_c);
  if (c.row) {
    c.pool.Run(CeilDiv(rows_c, kPassRows), [&](int64_t task) {
      const int64_t r_end = std::min(rows_c, (task + 1) * kPassRows);
      for (int64_t r = task * kPassRows; r < r_end; ++r) c.row(c0 + r, z + r * v);
    });
    return absl::OkStatus();
  }
  // Row pass: + b and the rounding to the input dtype, then loss, lse, argmax and G over z.
  c.pool.Run(CeilDiv(rows_c, kPassRows), [&](int64_t task) {
    const int64_t r_end = std::min(rows_c, (task + 1) * kPassRows);
    for (int64_t r = task * kPassRows; r < r_end; ++r) {
      const int64_t i = c0 + r;
      double sc = c.ce_scale, sz = c.z_scale;
      if (none) sc = sz = p.grad_output != nullptr ? p.grad_output[i] : 1.0;
      c.rows[i] = RowPass(c.rp, z + r * v, c.targets[i], sc / c.g_alpha, sz / c.g_alpha);
    }
  });
  return absl::OkStatus();
}

// dX_c = G W, dW += G^T X_c and db += colsum G for the chunk at c0, from G in ws.z_buf.
void ChunkBackward(const CpuChunkPass& c, int64_t c0, int64_t rows_c, const float* xc) {
  const LossProblem& p = c.p;
  const LossOutputs& out = c.out;
  const int64_t h = p.h, v = p.v;
  const float alpha = static_cast<float>(c.g_alpha);
  float* z = c.ws.z_buf.data();
  const float* wf = c.ws.wf;
  // dX_c = G W; one task per block of rows.
  if (c.want_dx) {
    float* dxc =
        c.dx_scratch ? c.ws.dx_scratch.data() : static_cast<float*>(out.dx) + c0 * h;
    const int64_t row_block = RowBlock(rows_c);
    c.pool.Run(CeilDiv(rows_c, row_block), [&](int64_t task) {
      const int64_t r0 = task * row_block, nr = std::min(row_block, rows_c - r0);
      GemmRows(/*trans_b=*/false, nr, h, v, z + r0 * v, v, wf, h, dxc + r0 * h, h, alpha);
      if (c.dx_scratch) {
        NarrowRange(dxc + r0 * h, nr * h, out.grad_dtype, out.dx, (c0 + r0) * h);
      }
    });
    if (p.rows != nullptr) p.rows->DxReady(c0 + rows_c);
  }
  // dW += G^T X_c and db += colsum G; one task per block of V rows of dW, rows of the
  // chunk summed in order.
  float* dw_f = c.ws.dw_f;
  float* db_acc = c.ws.db_acc;
  if (dw_f == nullptr && db_acc == nullptr) return;
  const float beta = (c.ws.dw_overwrite && c0 == 0) ? 0.0f : 1.0f;
  const int64_t v_block = VBlock(v), v_tasks = CeilDiv(v, v_block);
  c.pool.Run(v_tasks, [&](int64_t task) {
    const int64_t j0 = task * v_block, nj = std::min(v_block, v - j0);
    if (dw_f != nullptr) {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nj, h, rows_c, alpha, z + j0, v,
                  xc, h, beta, dw_f + j0 * h, h);
    }
    if (db_acc != nullptr) {
      float* db = db_acc + j0;
      for (int64_t r = 0; r < rows_c; ++r) {
        const float* g = z + r * v + j0;
        for (int64_t j = 0; j < nj; ++j) db[j] += alpha * g[j];
      }
    }
  });
}

}  // namespace lossd
