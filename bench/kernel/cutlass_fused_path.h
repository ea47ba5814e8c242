// SPDX-License-Identifier: Apache-2.0
// The fused path of cutlass_fused_bench (the schedules that file's header describes), on one
// shape's device buffers: the CUTLASS logits kernels bound per chunk and part, the CE pieces of
// cutlass_ce.h and lossd's cuBLASLt dX and dW GEMMs, enqueued on lossd's stream (the timed
// one) and a side stream. Bench only; never linked into the server.
#ifndef LOSSD_BENCH_KERNEL_CUTLASS_FUSED_PATH_H_
#define LOSSD_BENCH_KERNEL_CUTLASS_FUSED_PATH_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/kernel/cutlass_ce.h"
#include "bench/kernel/cutlass_logits.h"
#include "kernels/cuda/fused_loss.h"

ABSL_DECLARE_FLAG(std::string, order);

namespace lossd {
namespace bench {

inline absl::Status FromCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

inline absl::Status FromString(const std::string& err) {
  return err.empty() ? absl::OkStatus() : absl::InternalError(err);
}

// One shape's fused CUTLASS path: its buffers, one bound logits kernel per (chunk, half,
// SM setting), and the schedules as enqueue functions on lossd's stream (the timed one).
class CutlassPath {
 public:
  CutlassPath(cuda::FusedLoss& engine, int64_t bt, int64_t h, int64_t v, int64_t chunk,
              const void* x, const void* w, const int32_t* tg, void* dx, float* dw)
      : e_(engine), bt_(bt), h_(h), v_(v), chunk_(chunk), x_(x), w_(w), tg_(tg), dx_(dx),
        dw_(dw) {}
  ~CutlassPath() {
    for (void* p : {z_, static_cast<void*>(tmax_), static_cast<void*>(tsum_),
                    static_cast<void*>(lse_), static_cast<void*>(loss_), gws_, cws_}) {
      cudaFree(p);
    }
    if (side_ != nullptr) cudaStreamDestroy(side_);
    for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
  }

  // Allocates and binds a kernel for every part (whole chunks; halves at each SM setting).
  absl::Status Init(const std::vector<int>& side_sms) {
    const int64_t tiles = (v_ + 127) / 128, ld = Ld(chunk_);
    n_tiles_ = tiles;
    for (auto [p, bytes] : {std::pair<void**, size_t>{&z_, chunk_ * v_ * 2},
                            {reinterpret_cast<void**>(&tmax_), tiles * ld * 4},
                            {reinterpret_cast<void**>(&tsum_), tiles * ld * 4},
                            {reinterpret_cast<void**>(&lse_), chunk_ * 4},
                            {reinterpret_cast<void**>(&loss_), bt_ * 4},
                            {&gws_, cuda::kGemmWorkspaceBytes},
                            {&cws_, 1 << 20}}) {
      if (absl::Status s = FromCuda(cudaMalloc(p, bytes), "cudaMalloc"); !s.ok()) return s;
    }
    if (absl::Status s = FromCuda(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking),
                                  "stream");
        !s.ok()) {
      return s;
    }
    for (int i = 0; i < 4; ++i) {
      events_.emplace_back();
      if (absl::Status s = FromCuda(
              cudaEventCreateWithFlags(&events_.back(), cudaEventDisableTiming), "event");
          !s.ok()) {
        return s;
      }
    }
    side_sms_ = side_sms;
    return BindAll();
  }

  static constexpr int kSeq = -1;

  // Enqueues the whole forward + backward: kSeq the one-stream schedule, else the row halves
  // with side_sms_[schedule] SMs left to the CE pass.
  absl::Status Run(int schedule) {
    for (int64_t c0 = 0; c0 < bt_; c0 += chunk_) {
      const int64_t r = std::min(chunk_, bt_ - c0);
      absl::Status s = schedule == kSeq ? Seq(c0, r) : Halves(c0, r, schedule);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // One phase over every chunk, where the time goes: 0 logits + statistics, 1 combine + G.
  absl::Status Phase(int phase) {
    cudaStream_t st = e_.stream();
    for (int64_t c0 = 0; c0 < bt_; c0 += chunk_) {
      const int64_t r = std::min(chunk_, bt_ - c0);
      absl::Status s = phase == 0 ? RunKernel(c0, 0, r, 0, st) : CombineAndForm(c0, 0, r, st);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // The mean loss of the last run (every row's term, summed on the host in double).
  absl::StatusOr<double> MeanLoss() {
    std::vector<float> l(bt_);
    absl::Status s = FromCuda(cudaMemcpy(l.data(), loss_, bt_ * 4, cudaMemcpyDeviceToHost), "copy");
    if (!s.ok()) return s;
    return std::accumulate(l.begin(), l.end(), 0.0) / static_cast<double>(bt_);
  }

 private:
  struct Bound {
    int64_t c0, row0, rows;
    int sms;
    std::unique_ptr<CutlassLogits> k;
  };

  // The statistics kernel of the ping-pong set, bound to rows [c0 + row0, +rows): it writes z
  // rows [row0, +rows) and the part's own statistics block (Stats).
  absl::Status Bind(int64_t c0, int64_t row0, int64_t rows, int sms) {
    for (auto& k : MakePingpongKernels()) {
      if (!k->Stats()) continue;
      CutlassLogitsArgs a;
      a.x = static_cast<const char*>(x_) + (c0 + row0) * h_ * 2;
      a.w = w_;
      a.z = static_cast<char*>(z_) + row0 * v_ * 2;
      a.tile_max = tmax_ + n_tiles_ * row0;
      a.tile_sum = tsum_ + n_tiles_ * row0;
      a.c = rows;
      a.h = h_;
      a.v = v_;
      a.ld = Ld(rows);
      a.sms = sms;
      std::vector<std::string> o = absl::StrSplit(absl::GetFlag(FLAGS_order), ':');
      if (o.size() != 2 || !absl::SimpleAtoi(o[0], &a.raster) ||
          !absl::SimpleAtoi(o[1], &a.swizzle)) {
        return absl::InvalidArgumentError("--order: want raster:swizzle");
      }
      if (absl::Status s = FromString(k->Init(a, cws_)); !s.ok()) return s;
      bound_.push_back(Bound{c0, row0, rows, sms, std::move(k)});
      return absl::OkStatus();
    }
    return absl::InternalError("no statistics kernel compiled");
  }

  absl::Status BindAll() {
    for (int64_t c0 = 0; c0 < bt_; c0 += chunk_) {
      const int64_t r = std::min(chunk_, bt_ - c0);
      if (absl::Status s = Bind(c0, 0, r, 0); !s.ok()) return s;
      const int64_t half = Half(r);
      for (int sms : side_sms_) {
        const int grid = sms > 0 ? Sms() - sms : 0;
        if (absl::Status s = Bind(c0, 0, half, grid); !s.ok()) return s;
        if (absl::Status s = Bind(c0, half, r - half, grid); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

  static int Sms() {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n;
  }

  // The first half: a multiple of 128 rows (the CTA tile), so each half's statistics start at
  // a tile boundary of the chunk's layout.
  static int64_t Half(int64_t rows) {
    return std::min(rows, std::max<int64_t>(128, rows / 256 * 128));
  }

  // The statistics' leading dimension for a part of `rows` rows: the node's, rows rounded up
  // to the CTA tile. A part starting at row0 (0 or a multiple of 128) keeps its statistics in
  // the block [n_tiles row0, n_tiles (row0 + Ld(rows))), so the two halves of a chunk never
  // overlap and together fit the chunk's n_tiles Ld(chunk) floats.
  static int64_t Ld(int64_t rows) { return (rows + 127) / 128 * 128; }

  // The kernel bound to the part (every part the schedules run is bound by BindAll).
  absl::Status RunKernel(int64_t c0, int64_t row0, int64_t rows, int sms, cudaStream_t st) {
    for (const Bound& b : bound_) {
      if (b.c0 == c0 && b.row0 == row0 && b.rows == rows && b.sms == sms) {
        return FromString(b.k->Run(st));
      }
    }
    return absl::InternalError("logits kernel not bound for this part");
  }

  // Combine + G of z rows [row0, +rows) of the chunk at c0, on `st`.
  absl::Status CombineAndForm(int64_t c0, int64_t row0, int64_t rows, cudaStream_t st) {
    const void* zr = static_cast<const char*>(z_) + row0 * v_ * 2;
    absl::Status s = FromCuda(CombineRowLoss(tmax_ + n_tiles_ * row0, tsum_ + n_tiles_ * row0,
                                             rows, n_tiles_, Ld(rows), zr, v_, tg_ + c0 + row0,
                                             lse_ + row0, loss_ + c0 + row0, st),
                              "combine");
    if (!s.ok()) return s;
    return FromCuda(FormGradient(static_cast<char*>(z_) + row0 * v_ * 2, rows, v_, lse_ + row0,
                                 tg_ + c0 + row0, 1.0f / static_cast<float>(bt_), st),
                    "form G");
  }

  // dX rows [c0 + row0, +rows) = G W.
  absl::Status Dx(int64_t c0, int64_t row0, int64_t rows) {
    return e_.Gemm(e_.stream(), gws_, cuda::kGemmWorkspaceBytes, false, false, h_, rows, v_, 1.0f,
                   w_, h_, static_cast<const char*>(z_) + row0 * v_ * 2, v_, CUDA_R_16BF, 0.0f,
                   static_cast<char*>(dx_) + (c0 + row0) * h_ * 2, h_, CUDA_R_16BF);
  }

  // dW (+)= G^T X over the chunk's rows (fp32; the first chunk writes, the rest add).
  absl::Status Dw(int64_t c0, int64_t rows) {
    return e_.Gemm(e_.stream(), gws_, cuda::kGemmWorkspaceBytes, false, true, h_, v_, rows, 1.0f,
                   static_cast<const char*>(x_) + c0 * h_ * 2, h_, z_, v_, CUDA_R_16BF,
                   c0 > 0 ? 1.0f : 0.0f, dw_, h_, CUDA_R_32F);
  }

  absl::Status Seq(int64_t c0, int64_t r) {
    cudaStream_t st = e_.stream();
    if (absl::Status s = RunKernel(c0, 0, r, 0, st); !s.ok()) return s;
    if (absl::Status s = CombineAndForm(c0, 0, r, st); !s.ok()) return s;
    if (absl::Status s = Dx(c0, 0, r); !s.ok()) return s;
    return Dw(c0, r);
  }

  // Main stream: logits A, logits B, dX A, dX B, dW; side stream: CE A once logits A is done
  // (under logits B), CE B once logits B is done (under dX A). The next chunk's logits follow
  // dW on the main stream, which has waited for CE B: z and the statistics are free again.
  absl::Status Halves(int64_t c0, int64_t r, int which) {
    cudaStream_t st = e_.stream();
    const int sms = side_sms_[which] > 0 ? Sms() - side_sms_[which] : 0;
    const int64_t a = Half(r), b = r - a;
    auto record = [](cudaEvent_t e, cudaStream_t s) { return FromCuda(cudaEventRecord(e, s), "record"); };
    auto wait = [](cudaStream_t s, cudaEvent_t e) { return FromCuda(cudaStreamWaitEvent(s, e, 0), "wait"); };
    absl::Status s = RunKernel(c0, 0, a, sms, st);
    if (s.ok()) s = record(events_[0], st);
    if (s.ok()) s = wait(side_, events_[0]);
    if (s.ok()) s = CombineAndForm(c0, 0, a, side_);
    if (s.ok()) s = record(events_[1], side_);
    if (s.ok() && b > 0) s = RunKernel(c0, a, b, sms, st);
    if (s.ok() && b > 0) s = record(events_[2], st);
    if (s.ok() && b > 0) s = wait(side_, events_[2]);
    if (s.ok() && b > 0) s = CombineAndForm(c0, a, b, side_);
    if (s.ok() && b > 0) s = record(events_[3], side_);
    if (s.ok()) s = wait(st, events_[1]);
    if (s.ok()) s = Dx(c0, 0, a);
    if (s.ok() && b > 0) s = wait(st, events_[3]);
    if (s.ok() && b > 0) s = Dx(c0, a, b);
    if (s.ok()) s = Dw(c0, r);
    return s;
  }

  cuda::FusedLoss& e_;
  const int64_t bt_, h_, v_, chunk_;
  const void* x_;
  const void* w_;
  const int32_t* tg_;
  void* dx_;
  float* dw_;
  void* z_ = nullptr;
  float *tmax_ = nullptr, *tsum_ = nullptr, *lse_ = nullptr, *loss_ = nullptr;
  void* gws_ = nullptr;
  void* cws_ = nullptr;
  int64_t n_tiles_ = 0;
  cudaStream_t side_ = nullptr;
  std::vector<cudaEvent_t> events_;
  std::vector<int> side_sms_;
  std::vector<Bound> bound_;
};

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_CUTLASS_FUSED_PATH_H_
