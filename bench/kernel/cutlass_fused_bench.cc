// The fused path after issue 26's go: forward + backward of the mean cross-entropy of X W^T
// with the logits GEMM a CUTLASS sm_90a ping-pong kernel that writes each row tile's max and
// sum of exp in its epilogue (cutlass_logits.h), so the CE pass only combines statistics and
// forms G at copy speed (cutlass_ce.h), then lossd's cuBLASLt dX and dW GEMMs. Timed in the same
// rounds as the tuned 3-GEMM floor and lossd's default fused op, each over the same chunks:
//   seq      one stream: per chunk, logits + statistics, combine, G, dX, dW;
//   halves   a chunk's two row halves: the second half's logits GEMM and the first half's dX
//            run beside the other half's combine + G on a second stream; the logits kernel's
//            persistent grid leaves --side_sms SMs to it; one dW over the whole chunk;
//   refexp   no pass over the logits: the GEMM's epilogue writes E = exp(z - z_target) and
//            per-tile sums of E (row_ref_exp_node.cuh); G = diag(s / S) (E - S onehot), so
//            after a combine of C-sized work dX = diag(s / S) (E' W) and
//            dW = E'^T (diag(s / S) X) are plain cuBLASLt GEMMs;
// and each phase alone over every chunk (where the time goes). Checked against the float64
// reference and for bit-identical reruns before it is timed. Needs an sm_90 GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/kernel/bench_util.h"
#include "bench/kernel/cutlass_ce.h"
#include "bench/kernel/cutlass_logits.h"
#include "bench/kernel/floor.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/problem.h"
#include "bench/kernel/reference_fp64.h"
#include "bench/kernel/timing.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/fused_loss.h"

ABSL_FLAG(std::string, side_sms_list, "0,16",
          "SMs the halves schedule's logits GEMM leaves to the CE pass on the other stream, one "
          "timed variant each");
ABSL_FLAG(double, logit_scale, 1.0,
          "W's range times this (the problem's logits have standard deviation 2 times it): how "
          "far the reference-exp schedule's reference (the target's logit) may sit below the "
          "row's largest logit before rows are flagged");
ABSL_FLAG(int, ref_sample, 1024,
          "vocabulary rows (evenly strided) whose logits the reference-exp schedule's reference "
          "also takes the max of, beside the target's (0: the target's logit alone)");
ABSL_FLAG(bool, time, true, "time the schedules after checking them (false: checks only)");
ABSL_FLAG(std::string, order, "1:1",
          "the CUTLASS persistent scheduler's raster:swizzle (raster 0 heuristic, 1 along M, 2 "
          "along N)");

namespace lossd {
namespace bench {
namespace {

absl::Status FromCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

absl::Status FromString(const std::string& err) {
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
                    static_cast<void*>(lse_), static_cast<void*>(loss_), gws_, cws_,
                    static_cast<void*>(ref_), static_cast<void*>(alpha_), xs_, dxf_,
                    static_cast<void*>(bad_), static_cast<void*>(zt_), static_cast<void*>(zs_),
                    wsamp_}) {
      cudaFree(p);
    }
    if (side_ != nullptr) cudaStreamDestroy(side_);
    for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
  }

  // Allocates and binds a kernel for every part (whole chunks; halves at each SM setting).
  absl::Status Init(const std::vector<int>& side_sms) {
    const int64_t tiles = (v_ + 127) / 128, ld = Ld(chunk_);
    n_tiles_ = tiles;
    n_sample_ = std::min<int64_t>(absl::GetFlag(FLAGS_ref_sample), v_);
    for (auto [p, bytes] : {std::pair<void**, size_t>{&z_, chunk_ * v_ * 2},
                            {reinterpret_cast<void**>(&tmax_), tiles * ld * 4},
                            {reinterpret_cast<void**>(&tsum_), tiles * ld * 4},
                            {reinterpret_cast<void**>(&lse_), chunk_ * 4},
                            {reinterpret_cast<void**>(&loss_), bt_ * 4},
                            {&gws_, cuda::kGemmWorkspaceBytes},
                            {&cws_, 1 << 20},
                            {reinterpret_cast<void**>(&ref_), ld * 4},
                            {reinterpret_cast<void**>(&alpha_), chunk_ * 4},
                            {&xs_, chunk_ * h_ * 2},
                            {&dxf_, chunk_ * h_ * 4},
                            {reinterpret_cast<void**>(&bad_), 4},
                            {reinterpret_cast<void**>(&zt_), chunk_ * 4},
                            {reinterpret_cast<void**>(&zs_), chunk_ * std::max(n_sample_, int64_t{1}) * 4},
                            {&wsamp_, std::max(n_sample_, int64_t{1}) * h_ * 2}}) {
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
    if (n_sample_ > 0) {  // rows 0, v / n, 2 v / n, ... of W: the sample's weights
      const int64_t step = v_ / n_sample_;
      absl::Status s = FromCuda(cudaMemcpy2D(wsamp_, h_ * 2, w_, step * h_ * 2, h_ * 2,
                                             n_sample_, cudaMemcpyDeviceToDevice),
                                "sample W");
      if (!s.ok()) return s;
    }
    return BindAll();
  }

  static constexpr int kSeq = -1, kRefExp = -2;

  // Enqueues the whole forward + backward: kSeq the one-stream schedule, kRefExp the
  // reference-exp one, else the row halves with side_sms_[schedule] SMs left to the CE pass.
  absl::Status Run(int schedule) {
    for (int64_t c0 = 0; c0 < bt_; c0 += chunk_) {
      const int64_t r = std::min(chunk_, bt_ - c0);
      absl::Status s = schedule == kSeq      ? Seq(c0, r)
                       : schedule == kRefExp ? RefExp(c0, r)
                                             : Halves(c0, r, schedule);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // One phase over every chunk, where the time goes: 0 logits + statistics, 1 combine + G;
  // 2 the target logits + reference-exp GEMM, 3 its combine and row scalings, 4 its dX GEMM
  // (fp32 out).
  absl::Status Phase(int phase) {
    cudaStream_t st = e_.stream();
    for (int64_t c0 = 0; c0 < bt_; c0 += chunk_) {
      const int64_t r = std::min(chunk_, bt_ - c0);
      absl::Status s;
      switch (phase) {
        case 0: s = RunKernel(c0, 0, r, 0, st, 1); break;
        case 1: s = CombineAndForm(c0, 0, r, st); break;
        case 2: s = RefLogits(c0, r); break;
        case 3: s = RefCombine(c0, r); break;
        default: s = RefDx(c0, r, false); break;
      }
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Picks cuBLASLt's fastest algorithm for the reference-exp dX GEMM (fp32 out: a key of its
  // own; the dW GEMM's is the chunks' dW, tuned with them).
  absl::Status TuneRefExp() {
    for (int64_t c0 = 0; c0 < bt_; c0 += chunk_) {
      const int64_t r = std::min(chunk_, bt_ - c0);
      if (absl::Status s = RefDx(c0, r, true); !s.ok()) return s;
      if (absl::Status s = SampleLogits(c0, r, true); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Rows the reference-exp schedule flagged since the last call (S not finite, log S > 80).
  absl::StatusOr<unsigned int> TakeBad() {
    unsigned int n = 0;
    absl::Status s = FromCuda(cudaMemcpy(&n, bad_, 4, cudaMemcpyDeviceToHost), "copy");
    if (s.ok()) s = FromCuda(cudaMemset(bad_, 0, 4), "memset");
    if (!s.ok()) return s;
    return n;
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
    int mode;  // 1 statistics, 2 reference-exp
    std::unique_ptr<CutlassLogits> k;
  };

  // The statistics kernel of the ping-pong set, bound to rows [c0 + row0, +rows): it writes z
  // rows [row0, +rows) and the part's own statistics block (Stats).
  absl::Status Bind(int64_t c0, int64_t row0, int64_t rows, int sms, int mode = 1) {
    for (auto& k : mode == 1 ? MakePingpongKernels() : MakeRefExpKernels()) {
      if (mode == 1 ? !k->Stats() : !k->RefExp()) continue;
      CutlassLogitsArgs a;
      a.x = static_cast<const char*>(x_) + (c0 + row0) * h_ * 2;
      a.w = w_;
      a.z = static_cast<char*>(z_) + row0 * v_ * 2;
      a.tile_max = tmax_ + n_tiles_ * row0;
      a.tile_sum = tsum_ + n_tiles_ * row0;
      a.row_ref = ref_;
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
      bound_.push_back(Bound{c0, row0, rows, sms, mode, std::move(k)});
      return absl::OkStatus();
    }
    return absl::InternalError("no statistics kernel compiled");
  }

  absl::Status BindAll() {
    for (int64_t c0 = 0; c0 < bt_; c0 += chunk_) {
      const int64_t r = std::min(chunk_, bt_ - c0);
      if (absl::Status s = Bind(c0, 0, r, 0); !s.ok()) return s;
      if (absl::Status s = Bind(c0, 0, r, 0, 2); !s.ok()) return s;
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
  absl::Status RunKernel(int64_t c0, int64_t row0, int64_t rows, int sms, cudaStream_t st,
                         int mode = 1) {
    for (const Bound& b : bound_) {
      if (b.c0 == c0 && b.row0 == row0 && b.rows == rows && b.sms == sms && b.mode == mode) {
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

  // The reference-exp schedule's parts (one stream).
  // zs = the chunk's logits at the sampled vocabulary rows (fp32).
  absl::Status SampleLogits(int64_t c0, int64_t r, bool tune) {
    const char* xc = static_cast<const char*>(x_) + c0 * h_ * 2;
    cudaStream_t st = e_.stream();
    return tune ? e_.TuneGemm(st, gws_, cuda::kGemmWorkspaceBytes, true, false, n_sample_, r, h_,
                              1.0f, wsamp_, h_, xc, h_, CUDA_R_16BF, 0.0f, zs_, n_sample_,
                              CUDA_R_32F)
                : e_.Gemm(st, gws_, cuda::kGemmWorkspaceBytes, true, false, n_sample_, r, h_,
                          1.0f, wsamp_, h_, xc, h_, CUDA_R_16BF, 0.0f, zs_, n_sample_,
                          CUDA_R_32F);
  }
  absl::Status RefLogits(int64_t c0, int64_t r) {
    cudaStream_t st = e_.stream();
    absl::Status s = FromCuda(TargetLogits(static_cast<const char*>(x_) + c0 * h_ * 2, w_,
                                           tg_ + c0, r, h_, zt_, st),
                              "target logits");
    if (s.ok() && n_sample_ > 0) s = SampleLogits(c0, r, false);
    if (s.ok()) {
      s = FromCuda(RowReference(zt_, zs_, r, n_sample_, Ld(r), ref_, st), "reference");
    }
    return s.ok() ? RunKernel(c0, 0, r, 0, st, 2) : s;
  }
  absl::Status RefCombine(int64_t c0, int64_t r) {
    cudaStream_t st = e_.stream();
    absl::Status s = FromCuda(CombineRefExp(tsum_, r, n_tiles_, Ld(r), tg_ + c0, zt_, ref_,
                                            1.0f / static_cast<float>(bt_), z_, v_, loss_ + c0,
                                            alpha_, bad_, st),
                              "combine");
    if (!s.ok()) return s;
    return FromCuda(ScaleRows(static_cast<const char*>(x_) + c0 * h_ * 2, false, alpha_, r, h_,
                              xs_, st),
                    "scale X");
  }
  // dX rows [c0, +r) = diag(alpha) (E' W): the GEMM into fp32, then one rounding to bf16.
  absl::Status RefDx(int64_t c0, int64_t r, bool tune) {
    cudaStream_t st = e_.stream();
    absl::Status s =
        tune ? e_.TuneGemm(st, gws_, cuda::kGemmWorkspaceBytes, false, false, h_, r, v_, 1.0f, w_,
                           h_, z_, v_, CUDA_R_16BF, 0.0f, dxf_, h_, CUDA_R_32F)
             : e_.Gemm(st, gws_, cuda::kGemmWorkspaceBytes, false, false, h_, r, v_, 1.0f, w_, h_,
                       z_, v_, CUDA_R_16BF, 0.0f, dxf_, h_, CUDA_R_32F);
    if (!s.ok() || tune) return s;
    return FromCuda(ScaleRows(dxf_, true, alpha_, r, h_, static_cast<char*>(dx_) + c0 * h_ * 2,
                              st),
                    "scale dX");
  }
  absl::Status RefExp(int64_t c0, int64_t r) {
    absl::Status s = RefLogits(c0, r);
    if (s.ok()) s = RefCombine(c0, r);
    if (s.ok()) s = RefDx(c0, r, false);
    if (!s.ok()) return s;
    return e_.Gemm(e_.stream(), gws_, cuda::kGemmWorkspaceBytes, false, true, h_, v_, r, 1.0f,
                   xs_, h_, z_, v_, CUDA_R_16BF, c0 > 0 ? 1.0f : 0.0f, dw_, h_, CUDA_R_32F);
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
  float* ref_ = nullptr;    // (Ld(chunk)) the reference-exp schedule's z_target
  float* alpha_ = nullptr;  // (chunk) s / S
  void* xs_ = nullptr;      // (chunk, h) bf16: diag(alpha) X_c
  void* dxf_ = nullptr;     // (chunk, h) fp32: E' W
  unsigned int* bad_ = nullptr;
  int64_t n_sample_ = 0;
  float* zt_ = nullptr;    // (chunk) target logits
  float* zs_ = nullptr;    // (chunk, n_sample) the sample's logits
  void* wsamp_ = nullptr;  // (n_sample, h) bf16: the sampled rows of W
};

// The accuracy bench_kernel asks of the fused op (report.cc): bf16-level gradients, the loss
// within 1e-5 relative of the float64 reference.
constexpr double kGradRelNorm = 3e-3, kLossRel = 1e-5;

struct Problem {
  int64_t bt, h, v;
  void *x = nullptr, *w = nullptr, *dx = nullptr, *dw = nullptr, *rows = nullptr, *tg = nullptr;
  void *z = nullptr, *ws = nullptr, *fws = nullptr, *ref_dx = nullptr, *ref_dw = nullptr;
  unsigned long long* diff = nullptr;
  ~Problem() {
    for (void* p : {x, w, dx, dw, rows, tg, z, ws, fws, ref_dx, ref_dw,
                    static_cast<void*>(diff)}) {
      cudaFree(p);
    }
  }
};

// Runs a schedule of the path twice (outputs poisoned before each), checks the second run's
// outputs against the first word for word and against float64. 0, or 2 on a failed check.
int CheckSchedule(CutlassPath& path, int halves, const char* name, Problem& p,
                  cudaStream_t st) {
  const size_t dx_bytes = p.bt * p.h * 2, dw_bytes = p.v * p.h * 4;
  unsigned long long mism[2] = {0, 0};
  for (int run = 0; run < 2; ++run) {
    BENCH_CHECK_CUDA(cudaMemsetAsync(p.dx, 0xFF, dx_bytes, st));
    BENCH_CHECK_CUDA(cudaMemsetAsync(p.dw, 0xFF, dw_bytes, st));
    BENCH_CHECK_OK(path.Run(halves));
    if (run == 0) {
      BENCH_CHECK_CUDA(cudaMemcpyAsync(p.ref_dx, p.dx, dx_bytes, cudaMemcpyDeviceToDevice, st));
      BENCH_CHECK_CUDA(cudaMemcpyAsync(p.ref_dw, p.dw, dw_bytes, cudaMemcpyDeviceToDevice, st));
    }
  }
  BENCH_CHECK_CUDA(CountMismatches(p.dx, p.ref_dx, dx_bytes / 4, p.diff, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(&mism[0], p.diff, 8, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(st));
  BENCH_CHECK_CUDA(CountMismatches(p.dw, p.ref_dw, dw_bytes / 4, p.diff, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(&mism[1], p.diff, 8, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(st));
  absl::StatusOr<double> loss = path.MeanLoss();
  BENCH_CHECK_OK(loss.status());
  absl::StatusOr<unsigned int> bad = path.TakeBad();  // two runs' worth
  BENCH_CHECK_OK(bad.status());
  Fp64Errors e;
  std::string error;
  if (!CompareWithFp64(p.bt, p.h, p.v, p.x, p.w, static_cast<const int32_t*>(p.tg), *loss, p.dx,
                       static_cast<const float*>(p.dw), 2048, &e, &error)) {
    std::fprintf(stderr, "float64 reference: %s\n", error.c_str());
    return 1;
  }
  const bool ok = *bad == 0 && mism[0] == 0 && mism[1] == 0 && e.loss_rel <= kLossRel &&
                  e.dx_rel_norm <= kGradRelNorm && e.dw_rel_norm <= kGradRelNorm;
  std::printf("  check %-14s loss %.6f (float64 %.6f, rel %.2e), dX rel norm %.2e, dW %.2e, "
              "rerun words differing dX %llu dW %llu, rows flagged %u: %s\n",
              name, *loss, e.ref_loss, e.loss_rel, e.dx_rel_norm, e.dw_rel_norm, mism[0],
              mism[1], *bad, ok ? "ok" : "FAILED");
  return ok ? 0 : 2;
}

// lossd's default fused op against float64 on the same inputs, printed beside the schedules'
// checks (the comparison the bar is for: the paths that read bf16 logits share its error).
int CheckLossd(cuda::FusedLoss& engine, const cuda::DeviceLossArgs& a,
               const cuda::ChunkPlan& plan, Problem& p) {
  BENCH_CHECK_OK(engine.Enqueue(a, plan, p.ws));
  std::vector<float> ce(p.bt);
  BENCH_CHECK_CUDA(cudaStreamSynchronize(engine.stream()));
  BENCH_CHECK_CUDA(cudaMemcpy(ce.data(), a.row_ce, p.bt * 4, cudaMemcpyDeviceToHost));
  const double loss = std::accumulate(ce.begin(), ce.end(), 0.0) / static_cast<double>(p.bt);
  Fp64Errors e;
  std::string error;
  if (!CompareWithFp64(p.bt, p.h, p.v, p.x, p.w, static_cast<const int32_t*>(p.tg), loss, p.dx,
                       static_cast<const float*>(p.dw), 2048, &e, &error)) {
    std::fprintf(stderr, "float64 reference: %s\n", error.c_str());
    return 1;
  }
  const bool ok = e.loss_rel <= kLossRel && e.dx_rel_norm <= kGradRelNorm &&
                  e.dw_rel_norm <= kGradRelNorm;
  std::printf("  check %-14s loss %.6f (float64 %.6f, rel %.2e), dX rel norm %.2e, dW %.2e: "
              "%s\n",
              "lossd default", loss, e.ref_loss, e.loss_rel, e.dx_rel_norm, e.dw_rel_norm,
              ok ? "within the bar" : "OUTSIDE the bar");
  return 0;
}

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view item : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int n = 0;
    if (absl::SimpleAtoi(item, &n) && n >= 0) out.push_back(n);
  }
  return out;
}

int AllocateShape(Problem& p, cudaStream_t st) {
  if (AllocateProblem(p.bt, p.h, p.v, st, &p.x, &p.w, &p.dx, &p.dw, &p.rows, &p.tg)) return 1;
  BENCH_CHECK_CUDA(cudaMalloc(&p.z, p.bt * p.v * 2));  // the floor's whole logits
  BENCH_CHECK_CUDA(cudaMalloc(&p.fws, cuda::kGemmWorkspaceBytes));
  BENCH_CHECK_CUDA(cudaMalloc(&p.ref_dx, p.bt * p.h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&p.ref_dw, p.v * p.h * 4));
  BENCH_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&p.diff), 8));
  return 0;
}

// One shape: tune, check every schedule of the path, then time everything in the same rounds.
int RunShape(cuda::FusedLoss& engine, int64_t bt, int64_t h, int64_t v) {
  cudaStream_t st = engine.stream();
  Problem p{bt, h, v};
  const cuda::ChunkPlan plan =
      cuda::PlanChunks(bt, v, DType::kBF16, cuda::DefaultChunkBudget(bt, v, DType::kBF16), 0);
  const int64_t chunk = plan.chunk_rows;
  if (AllocateShape(p, st)) return 1;
  if (const double k = absl::GetFlag(FLAGS_logit_scale); k != 1.0) {
    // As AllocateProblem fills W (seed 2 there too), times k.
    BENCH_CHECK_CUDA(FillUniformBf16(p.w, v * h, 2, static_cast<float>(6.0 * k / std::sqrt(double(h))), st));
  }
  BENCH_CHECK_CUDA(cudaMalloc(&p.ws, plan.workspace_bytes));
  const cuda::DeviceLossArgs args = BenchProblem(bt, h, v, p.x, p.w, p.tg, p.rows, p.dx, p.dw);
  const uint64_t gws = cuda::kGemmWorkspaceBytes;
  BENCH_CHECK_OK(ChunkedGemms(engine, st, p.fws, gws, bt, h, v, bt, p.x, p.w, p.z, p.dx, p.dw,
                              -1, 0, true));
  BENCH_CHECK_OK(ChunkedGemms(engine, st, p.fws, gws, bt, h, v, chunk, p.x, p.w, p.z, p.dx,
                              p.dw, -1, 0, true));
  BENCH_CHECK_OK(engine.Enqueue(args, plan, p.ws));  // tunes lossd's own GEMMs
  const std::vector<int> side = ParseInts(absl::GetFlag(FLAGS_side_sms_list));
  CutlassPath path(engine, bt, h, v, chunk, p.x, p.w, static_cast<const int32_t*>(p.tg), p.dx,
                   static_cast<float*>(p.dw));
  BENCH_CHECK_OK(path.Init(side));
  BENCH_CHECK_OK(path.TuneRefExp());
  BENCH_CHECK_OK(path.TakeBad().status());  // zeroes the counter
  std::printf("shape BT=%lld H=%lld V=%lld, chunks of %lld rows, logits' standard deviation "
              "%.3g\n", static_cast<long long>(bt), static_cast<long long>(h),
              static_cast<long long>(v), static_cast<long long>(chunk),
              2.0 * absl::GetFlag(FLAGS_logit_scale));
  std::vector<std::string> names = {"tuned 3-GEMM floor", "lossd default", "cutlass seq"};
  std::vector<std::function<absl::Status()>> bodies = {
      [&] { return ChunkedGemms(engine, st, p.fws, gws, bt, h, v, bt, p.x, p.w, p.z, p.dx, p.dw); },
      [&] { return engine.Enqueue(args, plan, p.ws); },
      [&] { return path.Run(CutlassPath::kSeq); }};
  int rc = CheckLossd(engine, args, plan, p);
  rc = std::max(rc, CheckSchedule(path, CutlassPath::kSeq, "cutlass seq", p, st));
  names.push_back("cutlass refexp");
  bodies.push_back([&] { return path.Run(CutlassPath::kRefExp); });
  rc = std::max(rc, CheckSchedule(path, CutlassPath::kRefExp, "cutlass refexp", p, st));
  for (size_t i = 0; i < side.size(); ++i) {
    const std::string n = "cutlass halves " + std::to_string(side[i]);
    names.push_back(n);
    bodies.push_back([&path, i] { return path.Run(static_cast<int>(i)); });
    rc = std::max(rc, CheckSchedule(path, static_cast<int>(i), n.c_str(), p, st));
  }
  if (!absl::GetFlag(FLAGS_time)) return rc;
  const size_t n_schedules = names.size();
  names.insert(names.end(), {"  seq: logits + statistics alone", "  seq: combine + G alone",
                             "  refexp: target logits + GEMM alone",
                             "  refexp: combine + row scalings alone",
                             "  refexp: dX GEMM (fp32 out) + scale alone",
                             "  chunk dX GEMMs alone", "  chunk dW GEMMs alone"});
  for (int phase = 0; phase < 5; ++phase) {
    bodies.push_back([&path, phase] { return path.Phase(phase); });
  }
  for (int role : {1, 2}) {
    bodies.push_back([&, role] {
      return ChunkedGemms(engine, st, p.fws, gws, bt, h, v, chunk, p.x, p.w, p.z, p.dx, p.dw,
                          role);
    });
  }
  std::vector<double> ms;
  if (TimeRoundsMs(st, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_runs), bodies, &ms)) {
    return 1;
  }
  for (size_t i = 0; i < ms.size(); ++i) {
    std::printf("  %-34s %9.3f ms", names[i].c_str(), ms[i]);
    if (i < n_schedules) std::printf("  %.3fx the tuned floor", ms[i] / ms[0]);
    std::printf("\n");
  }
  return rc;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::fprintf(stderr, "needs an sm_90 GPU; device 0 is %s (sm_%d%d)\n", prop.name, prop.major,
                 prop.minor);
    return 1;
  }
  std::printf("device: %s, %d SMs; median of %d runs in rounds\n", prop.name,
              prop.multiProcessorCount, absl::GetFlag(FLAGS_runs));
  auto engine = cuda::FusedLoss::Create(0);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  (*engine)->set_autotune(true);
  int rc = 0;
  for (absl::string_view item :
       absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(item, 'x');
    int64_t bt = 0, h = 0, v = 0;
    if (f.size() != 3 || !absl::SimpleAtoi(f[0], &bt) || !absl::SimpleAtoi(f[1], &h) ||
        !absl::SimpleAtoi(f[2], &v) || bt <= 0 || h % 8 != 0 || v % 8 != 0 || h <= 0 || v <= 0) {
      std::fprintf(stderr, "--shapes: bad item '%s' (want BTxHxV, H and V multiples of 8)\n",
                   std::string(item).c_str());
      return 1;
    }
    rc = std::max(rc, RunShape(**engine, bt, h, v));
    std::fflush(stdout);
  }
  std::printf("checks: %s\n", rc == 0 ? "all passed" : "FAILED");
  return rc;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) { return lossd::bench::Main(argc, argv); }
