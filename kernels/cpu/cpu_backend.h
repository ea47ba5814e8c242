// SPDX-License-Identifier: Apache-2.0
// The CPU backend: chunked linear + cross-entropy on OpenBLAS sgemm plus a multithreaded
// row pass, for bf16/fp16/fp32 inputs and every LossOptions. It never materialises BT x V
// logits (one C x V fp32 chunk at a time), and its results never depend on the thread count.
#ifndef LOSSD_KERNELS_CPU_CPU_BACKEND_H_
#define LOSSD_KERNELS_CPU_CPU_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/host_memory.h"
#include "core/loss_problem.h"

namespace lossd {

class CpuTaskPool;
struct CpuMemoryCounter;

// Numerics (what the GPU backend does too, so the two agree): per chunk of C rows,
//   z = X_c W^T + b   sgemm on the stored inputs widened to fp32, fp32 accumulate, then
//                     rounded to the input dtype (as the GPU stores logits), kept in fp32;
//   row pass          softcap, lse (max then sum of exp, fp32), loss, z-loss, argmax, and
//                     G = dL/dz written over z, rounded to the input dtype;
//   dX_c = G W, dW += G^T X_c, db += colsum G   sgemm, fp32 accumulate, fixed order.
// Memory: besides the C x V chunk, a per-call fp32 copy of W (V x H, bf16/fp16 inputs only)
// and, unless an accumulator or an fp32 dw is given, an fp32 dW; all freed on return and all
// counted by WorkspaceBytes (OpenBLAS's own packing buffers, kept per thread for the life of
// the process, are not). Memory::kBackend is host memory here: Allocate returns host buffers.
// Threads: threads - 1 workers started with the backend plus the calling thread; concurrent
// Compute calls share them (one parallel step at a time).
// Determinism: OpenBLAS runs single-threaded inside fixed tasks (blocks of V or of rows whose
// bounds depend on the shape only), and the threads take tasks in any order; so the same
// request gives bit-identical outputs at any thread count. The chunk size changes results by
// fp32 rounding only: OpenBLAS picks kernels by shape, and dW/db sum over chunks.
class CpuBackend : public Backend {
 public:
  // threads >= 1: the most threads one Compute uses.
  explicit CpuBackend(int threads);
  ~CpuBackend() override;

  BackendInfo Info() override;
  absl::StatusOr<std::unique_ptr<BackendBuffer>> Allocate(size_t bytes) override;
  absl::Status CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                             size_t bytes) override;
  absl::Status CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                               size_t bytes) override;
  absl::Status Zero(BackendBuffer& buf) override;
  uint64_t WorkspaceBytes(const WorkspaceShape& shape) override;
  absl::Status Compute(const LossProblem& p, const LossOutputs& out, LossStats* stats) override;
  // Over the task pool (kernels/cpu/optimizer_step.h); one at a time with Compute's steps.
  absl::Status OptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) override;
  absl::StatusOr<double> SumOfSquares(const float* data, int64_t n) override;

  int threads() const { return threads_; }

  // Rows per chunk for p: options.chunk_rows when set (clamped to BT), else as many rows as
  // keep the C x V fp32 chunk within kDefaultChunkBytes (distill: its two chunks, the
  // student's and the teacher's logits).
  static int64_t ChunkRows(const LossProblem& p);
  static int64_t ChunkRows(int64_t bt, int64_t v, int64_t chunk_rows);
  static constexpr uint64_t kDefaultChunkBytes = uint64_t{256} << 20;

 private:
  const int threads_;
  std::string device_;
  // The host memory this process may use, read once (the limit does not change; Info reads
  // only the usage again).
  const HostMemoryLimit host_memory_;
  // Buffers from Allocate plus running workspaces; shared with the buffers, which may
  // outlive the backend.
  std::shared_ptr<CpuMemoryCounter> memory_;
  std::unique_ptr<CpuTaskPool> pool_;  // threads_ - 1 workers, started once
};

// threads = 0: the hardware concurrency.
std::unique_ptr<Backend> NewCpuBackend(int threads);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_CPU_BACKEND_H_
