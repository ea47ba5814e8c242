#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <utility>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "kernels/backend.h"
#include "kernels/cpu/nonfinite_scan.h"
#include "core/dtype.h"
#include "kernels/host_memory.h"
#include "core/loss_problem.h"
#include "core/loss_problem_check.h"

// Functions built for several instruction sets, picked at load time. Not under TSan: gcc
// instruments the load-time resolvers, which run before TSan is ready.
#if defined(__SANITIZE_THREAD__)
#define LOSSD_CPU_TARGET_CLONES
#else
#define LOSSD_CPU_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

namespace lossd {

// Bytes held (buffers from Allocate plus running workspaces) and their peak.
struct CpuMemoryCounter {
  std::atomic<int64_t> held{0};
  std::atomic<int64_t> peak{0};
  void Add(int64_t bytes) {
    const int64_t now = held.fetch_add(bytes) + bytes;
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }
};

namespace {

// ---------------------------------------------------------------------------------------------
// Memory and threads.

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

class HostBuffer : public BackendBuffer {
 public:
  HostBuffer(void* data, size_t size, std::shared_ptr<CpuMemoryCounter> counter)
      : data_(data), size_(size), counter_(std::move(counter)) {}
  ~HostBuffer() override {
    std::free(data_);
    counter_->Add(-static_cast<int64_t>(size_));
  }
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  void* data_;
  size_t size_;
  std::shared_ptr<CpuMemoryCounter> counter_;  // may outlive the backend
};

}  // namespace

// A fixed set of worker threads, started once: a server calls Compute often, and OpenBLAS
// keeps per-thread state, so short-lived threads would cost both time and memory.
class CpuTaskPool {
 public:
  explicit CpuTaskPool(int threads) {
    for (int k = 1; k < threads; ++k) {
      try {
        workers_.emplace_back([this] { WorkerLoop(); });
      } catch (...) {
        break;  // fewer threads give the same results, only later
      }
    }
  }

  ~CpuTaskPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  // Runs fn(task) for every task in [0, n) on the workers and the caller; returns when all
  // are done. What a task computes never depends on which thread runs it, so neither do the
  // results. One Run at a time: concurrent callers queue.
  void Run(int64_t n, const std::function<void(int64_t)>& fn) {
    if (n <= 0) return;
    std::lock_guard<std::mutex> run_lock(run_mu_);
    if (n == 1 || workers_.empty()) {
      for (int64_t t = 0; t < n; ++t) fn(t);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    Drain(fn, n);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  void Drain(const std::function<void(int64_t)>& fn, int64_t n) {
    for (int64_t t = next_.fetch_add(1); t < n; t = next_.fetch_add(1)) fn(t);
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t)>* fn;
      int64_t n;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        fn = fn_;
        n = n_;
      }
      Drain(*fn, n);
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mu_;  // serialises Run
  std::mutex mu_;      // guards everything below but next_
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int busy_ = 0;  // workers still in the current generation
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
constexpr int64_t kConvertBlock = 1 << 16;  // elements per conversion task

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

// ---------------------------------------------------------------------------------------------
// Element conversion.

// x rounded to bf16 and widened back (round to nearest even; NaN stays NaN).
inline float RoundBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  uint32_t r = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  r = nan ? (bits | 0x00400000u) & 0xffff0000u : r;
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

inline float RoundF16(float x) { return F16ToFloat(FloatToF16(x)); }

// Rounds n fp32 values in place to dtype t (no-op for fp32).
LOSSD_CPU_TARGET_CLONES
void RoundInPlace(float* v, int64_t n, DType t) {
  if (t == DType::kBF16) {
    for (int64_t k = 0; k < n; ++k) v[k] = RoundBf16(v[k]);
  } else if (t == DType::kF16) {
    for (int64_t k = 0; k < n; ++k) v[k] = RoundF16(v[k]);
  }
}

// Widens n elements of src (dtype t) starting at element `first` into dst.
void WidenRange(const void* src, DType t, int64_t first, int64_t n, float* dst) {
  if (t == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + first;
    for (int64_t k = 0; k < n; ++k) dst[k] = Bf16ToFloat(s[k]);
  } else if (t == DType::kF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + first;
    for (int64_t k = 0; k < n; ++k) dst[k] = F16ToFloat(s[k]);
  } else {
    std::memcpy(dst, static_cast<const float*>(src) + first, n * sizeof(float));
  }
}

// Stores n fp32 values as elements [first, first + n) of dst (dtype t), rounding to nearest even.
void NarrowRange(const float* src, int64_t n, DType t, void* dst, int64_t first) {
  if (t == DType::kBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst) + first;
    for (int64_t k = 0; k < n; ++k) d[k] = FloatToBf16(src[k]);
  } else if (t == DType::kF16) {
    uint16_t* d = static_cast<uint16_t*>(dst) + first;
    for (int64_t k = 0; k < n; ++k) d[k] = FloatToF16(src[k]);
  } else {
    std::memcpy(static_cast<float*>(dst) + first, src, n * sizeof(float));
  }
}

void ParallelWiden(CpuTaskPool& pool, const void* src, DType t, int64_t n, float* dst) {
  pool.Run(CeilDiv(n, kConvertBlock), [&](int64_t task) {
    const int64_t first = task * kConvertBlock;
    WidenRange(src, t, first, std::min(kConvertBlock, n - first), dst + first);
  });
}

// NaN or Inf among `data`'s n elements, scanned in parallel blocks.
bool ParallelAnyNonFinite(CpuTaskPool& pool, const void* data, DType t, int64_t n) {
  if (data == nullptr) return false;
  std::atomic<bool> any{false};
  pool.Run(CeilDiv(n, kConvertBlock), [&](int64_t task) {
    const int64_t first = task * kConvertBlock;
    if (AnyNonFinite(data, t, first, std::min(kConvertBlock, n - first))) any.store(true);
  });
  return any.load();
}

void ParallelNarrow(CpuTaskPool& pool, const float* src, int64_t n, DType t, void* dst) {
  pool.Run(CeilDiv(n, kConvertBlock), [&](int64_t task) {
    const int64_t first = task * kConvertBlock;
    NarrowRange(src + first, std::min(kConvertBlock, n - first), t, dst, first);
  });
}

// ---------------------------------------------------------------------------------------------
// The row pass.

// exp(x) for x <= 0 (every argument here is z - max or z - lse), to about 1 ulp, in a form
// the compiler vectorises: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial
// (Cephes' coefficients), 2^n put into the exponent bits. Below -87 (where exp underflows to
// a denormal) it returns about 1e-38 instead of 0; a NaN stays NaN.
inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  // Round to nearest by adding and subtracting 1.5 * 2^23 (vectorises, unlike nearbyint).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // n is NaN when x is; converting a NaN to int is undefined, so feed 0 (p stays NaN).
  const int32_t e = (static_cast<int32_t>(n == n ? n : 0.0f) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

// Per-problem constants of the row pass.
struct RowPassParams {
  int64_t v = 0;
  DType dtype = DType::kBF16;
  const float* cw = nullptr;    // (V) class weights, null = ones
  const float* bias = nullptr;  // (V) fp32, null = none
  double cw_sum = 0;            // S = sum_j cw[j]
  double eps = 0, zs = 0, cap = 0;
  bool token_scaling = false;  // LossOptions::token_scaling
  bool want_grad = false;
};

// What the row pass reports for one row.
struct RowResult {
  double ce = 0, zl = 0;
  float lse = 0;
  int64_t argmax = 0;
};

constexpr int kLanes = 16;  // independent fp32 partial sums: vectorisable, and more accurate

// One row: z (V) holds x W^T in fp32; the bias is added and the sum rounded to the input
// dtype here (the stored logits, done while the row is in cache), and z is overwritten with
// G = dL/dz (rounded to the input dtype) when want_grad. t < 0 marks an ignored row, whose G is
// zero. sc and sz scale the cross-entropy and z-loss gradients.
// Compiled for AVX-512, AVX2 and baseline x86-64, picked at load time. Without FMA
// contraction (ISO C++ mode) every variant rounds alike, so results do not depend on it.
LOSSD_CPU_TARGET_CLONES
RowResult RowPass(const RowPassParams& rp, float* z, int64_t t, double sc, double sz) {
  const int64_t v = rp.v;
  RowResult res;
  if (rp.bias != nullptr) {
    for (int64_t j = 0; j < v; ++j) z[j] += rp.bias[j];
  }
  RoundInPlace(z, v, rp.dtype);
  if (rp.cap > 0) {
    const float cap = static_cast<float>(rp.cap), inv = static_cast<float>(1.0 / rp.cap);
    for (int64_t j = 0; j < v; ++j) z[j] = cap * std::tanh(z[j] * inv);
  }
  // Max and the first index reaching it. Two passes (max, then the sum of exp) rather than an
  // online max/sum: the row is in cache, and the exact max needs no rescaling.
  float m = z[0];
  int64_t arg = 0;
  for (int64_t j = 1; j < v; ++j) {
    if (z[j] > m) {
      m = z[j];
      arg = j;
    }
  }
  res.argmax = arg;
  // sum_j exp(z_j - m), and sum_j cw_j z_j for label smoothing.
  float acc[kLanes] = {0}, wz[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += ExpNonPositive(z[j + l] - m);
  }
  for (int l = 0; j < v; ++j, ++l) acc[l] += ExpNonPositive(z[j] - m);
  double sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  const double lse = m + std::log(sum);
  res.lse = static_cast<float>(lse);
  if (t < 0) {
    if (rp.want_grad) std::fill(z, z + v, 0.0f);
    return res;
  }
  double smooth = 0;
  if (rp.eps > 0) {
    j = 0;
    if (rp.cw != nullptr) {
      for (; j + kLanes <= v; j += kLanes) {
        for (int l = 0; l < kLanes; ++l) wz[l] += rp.cw[j + l] * z[j + l];
      }
      for (int l = 0; j < v; ++j, ++l) wz[l] += rp.cw[j] * z[j];
    } else {
      for (; j + kLanes <= v; j += kLanes) {
        for (int l = 0; l < kLanes; ++l) wz[l] += z[j + l];
      }
      for (int l = 0; j < v; ++j, ++l) wz[l] += z[j];
    }
    double s = 0;
    for (int l = 0; l < kLanes; ++l) s += wz[l];
    smooth = (rp.cw_sum * lse - s) / static_cast<double>(v);  // -(1/V) sum_j cw_j (z_j - lse)
  }
  const double cwt = rp.cw != nullptr ? rp.cw[t] : 1.0;
  res.ce = (1 - rp.eps) * cwt * (lse - z[t]) + rp.eps * smooth;
  res.zl = rp.zs * lse * lse;
  if (rp.token_scaling) {
    // s = p_t from the stored (softcapped) logits, rounded to the input dtype as
    // torch.softmax rounds its output; a constant to the gradient, so it scales G's row.
    float s = static_cast<float>(std::exp(static_cast<double>(z[t]) - lse));
    RoundInPlace(&s, 1, rp.dtype);
    res.ce *= s;
    res.zl *= s;
    sc *= s;
    sz *= s;
  }
  if (!rp.want_grad) return res;

  // g_j = A p_j - B cw_j - [j == t] C, p_j = exp(z_j - lse), then times the softcap's
  // 1 - tanh^2 = 1 - (z_j / cap)^2.
  const float a = static_cast<float>(
      sc * ((1 - rp.eps) * cwt + rp.eps * rp.cw_sum / static_cast<double>(v)) +
      2 * sz * rp.zs * lse);
  const float b = static_cast<float>(sc * rp.eps / static_cast<double>(v));
  const float c = static_cast<float>(sc * (1 - rp.eps) * cwt);
  const float lse_f = static_cast<float>(lse);
  const float zt = z[t];
  if (rp.cap > 0) {
    const float inv = static_cast<float>(1.0 / rp.cap);
    for (j = 0; j < v; ++j) {
      const float th = z[j] * inv;
      const float cwj = rp.cw != nullptr ? rp.cw[j] : 1.0f;
      z[j] = (a * ExpNonPositive(z[j] - lse_f) - b * cwj) * (1.0f - th * th);
    }
    const float th = zt * inv;
    z[t] = (a * ExpNonPositive(zt - lse_f) - b * (rp.cw != nullptr ? rp.cw[t] : 1.0f) - c) *
           (1.0f - th * th);
  } else if (rp.cw != nullptr) {
    for (j = 0; j < v; ++j) z[j] = a * ExpNonPositive(z[j] - lse_f) - b * rp.cw[j];
    z[t] -= c;
  } else {
    for (j = 0; j < v; ++j) z[j] = a * ExpNonPositive(z[j] - lse_f) - b;
    z[t] -= c;
  }
  // G is stored in the input dtype, as the GPU stores it over its logits.
  RoundInPlace(z, v, rp.dtype);
  return res;
}

// ---------------------------------------------------------------------------------------------
// Info helpers.

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
    }
  }
  return "unknown CPU";
}

// A "Name:   123 kB" field of /proc/meminfo in bytes; 0 when absent.
// Workspace plan shared by WorkspaceBytes and Compute.
struct Plan {
  int64_t chunk = 0;
  bool want_dx = false, want_dw = false, want_db = false, want_grad = false;
  bool w_copy = false, x_copy = false, dx_scratch = false, dw_scratch = false;
  bool db_scratch = false;
  uint64_t bytes = 0;
};

Plan MakePlan(const WorkspaceShape& s) {
  Plan pl;
  pl.chunk = CpuBackend::ChunkRows(s.bt, s.v, s.chunk_rows);
  pl.want_dx = s.want_dx;
  pl.want_dw = s.dw != GradOut::kNone;
  pl.want_db = s.has_bias && s.db != GradOut::kNone;
  pl.want_grad = pl.want_dx || pl.want_dw || pl.want_db;
  pl.w_copy = s.dtype != DType::kF32;
  pl.x_copy = s.dtype != DType::kF32;
  pl.dx_scratch = pl.want_dx && s.grad_dtype != DType::kF32;
  pl.dw_scratch = s.dw == GradOut::kWritten && s.grad_dtype != DType::kF32;
  pl.db_scratch = pl.want_db && s.db != GradOut::kAccumulated;
  const uint64_t c = pl.chunk, h = s.h, v = s.v, f = sizeof(float);
  pl.bytes = c * v * f;                     // the logits / G chunk
  if (pl.w_copy) pl.bytes += v * h * f;     // W in fp32
  if (pl.x_copy) pl.bytes += c * h * f;     // X_c in fp32
  if (pl.dx_scratch) pl.bytes += c * h * f;
  if (pl.dw_scratch) pl.bytes += v * h * f;
  pl.bytes += 3 * v * f;                    // bias, class weights, db in fp32
  pl.bytes += static_cast<uint64_t>(s.bt) * (sizeof(RowResult) + 2 * sizeof(double) + 8);
  return pl;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CpuBackend.

CpuBackend::CpuBackend(int threads)
    : threads_(std::max(1, threads)),
      device_(CpuModel()),
      // The container's memory limit where it is below the machine's: the store budgets
      // (service/store_budgets.h) are checked against this, so they hold inside a cgroup.
      host_memory_(ReadHostMemoryLimit()),
      memory_(std::make_shared<CpuMemoryCounter>()),
      pool_(std::make_unique<CpuTaskPool>(threads_)) {
  // Every sgemm runs single-threaded inside one of this backend's tasks (see the header).
  openblas_set_num_threads(1);
}

CpuBackend::~CpuBackend() = default;

int64_t CpuBackend::ChunkRows(const LossProblem& p) {
  return ChunkRows(p.bt, p.v, p.options.chunk_rows);
}

int64_t CpuBackend::ChunkRows(int64_t bt, int64_t v, int64_t chunk_rows) {
  int64_t c = chunk_rows;
  if (c <= 0) {
    c = static_cast<int64_t>(kDefaultChunkBytes / (static_cast<uint64_t>(std::max<int64_t>(v, 1)) *
                                                  sizeof(float)));
  }
  return std::max<int64_t>(1, std::min<int64_t>(c, std::max<int64_t>(bt, 1)));
}

BackendInfo CpuBackend::Info() {
  BackendInfo info;
  info.name = "cpu";
  info.device = device_;
  info.memory_total_bytes = host_memory_.limit_bytes();
  info.memory_used_bytes = host_memory_.ReadUsedBytes();
  info.memory_peak_bytes = static_cast<uint64_t>(std::max<int64_t>(0, memory_->peak.load()));
  info.memory_held_bytes = static_cast<uint64_t>(std::max<int64_t>(0, memory_->held.load()));
  info.healthy = true;
  return info;
}

absl::StatusOr<std::unique_ptr<BackendBuffer>> CpuBackend::Allocate(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  if (rounded < bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu backend: cannot allocate ", bytes,
                                                     " bytes"));
  }
  void* data = std::aligned_alloc(64, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend: out of host memory allocating ", bytes, " bytes"));
  }
  memory_->Add(static_cast<int64_t>(bytes));
  return std::unique_ptr<BackendBuffer>(new HostBuffer(data, bytes, memory_));
}

namespace {
absl::Status CheckRange(const char* what, size_t size, size_t offset, size_t bytes) {
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("cpu backend: ", what, " of ", bytes,
                                                   " bytes at offset ", offset,
                                                   " overruns a buffer of ", size, " bytes"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status CpuBackend::CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                                       size_t bytes) {
  absl::Status st = CheckRange("CopyToBackend", dst.size(), offset, bytes);
  if (!st.ok()) return st;
  if (bytes > 0) std::memcpy(static_cast<char*>(dst.data()) + offset, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                                         size_t bytes) {
  absl::Status st = CheckRange("CopyFromBackend", src.size(), offset, bytes);
  if (!st.ok()) return st;
  // data() is not const in the interface; reading through it does not modify the buffer.
  const char* from = static_cast<const char*>(const_cast<BackendBuffer&>(src).data());
  if (bytes > 0) std::memcpy(dst, from + offset, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Zero(BackendBuffer& buf) {
  if (buf.size() > 0) std::memset(buf.data(), 0, buf.size());
  return absl::OkStatus();
}

uint64_t CpuBackend::WorkspaceBytes(const WorkspaceShape& shape) {
  return MakePlan(shape).bytes;
}

absl::Status CpuBackend::Compute(const LossProblem& p, const LossOutputs& out,
                                 LossStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  // The engine validated the problem (core/loss_problem_check.h); debug builds check again.
  LOSSD_DCHECK_VALID_PROBLEM(p, &out, "cpu backend");
  const Plan plan = MakePlan(ShapeOf(p, out));
  const int64_t bt = p.bt, h = p.h, v = p.v, chunk = plan.chunk;
  const LossOptions& o = p.options;
  const bool none = o.reduction == Reduction::kNone;
  CpuTaskPool& pool = *pool_;

  // Targets (each in [0, V) or ignored: validated): the non-ignored count and the
  // class-weight sum (mean's denominators are needed before any gradient). -1 marks an
  // ignored row below.
  std::vector<int64_t> targets(bt);
  int64_t tokens = 0;
  double weight_sum = 0;
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    if (t == o.ignore_index) {
      targets[i] = -1;
      continue;
    }
    targets[i] = t;
    ++tokens;
    weight_sum += p.class_weights != nullptr ? p.class_weights[t] : 1.0;
  }
  double ce_scale = o.grad_scale, z_scale = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    ce_scale = weight_sum != 0 ? o.grad_scale / weight_sum : 0.0;
    z_scale = tokens != 0 ? o.grad_scale / static_cast<double>(tokens) : 0.0;
  }
  memory_->Add(static_cast<int64_t>(plan.bytes));
  struct Release {
    CpuMemoryCounter* counter;
    int64_t bytes;
    ~Release() { counter->Add(-bytes); }
  } release{memory_.get(), static_cast<int64_t>(plan.bytes)};
  auto oom = [&](const char* what, uint64_t bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu backend: out of host memory for ",
                                                     what, " (", bytes, " bytes)"));
  };

  // Inputs in fp32.
  FloatBuffer w_copy, bias_f, z_buf, x_copy, dx_scratch, dw_scratch, db_f;
  const float* wf = static_cast<const float*>(p.w);
  if (plan.w_copy) {
    if (!w_copy.Allocate(v * h)) return oom("W in fp32", static_cast<uint64_t>(v) * h * 4);
    ParallelWiden(pool, p.w, p.dtype, v * h, w_copy.data());
    wf = w_copy.data();
  }
  if (p.bias != nullptr) {
    if (!bias_f.Allocate(v)) return oom("bias", static_cast<uint64_t>(v) * 4);
    WidenRange(p.bias, p.dtype, 0, v, bias_f.data());
  }
  if (!z_buf.Allocate(chunk * v)) return oom("the logits chunk", static_cast<uint64_t>(chunk) * v * 4);
  if (plan.x_copy && !x_copy.Allocate(chunk * h)) {
    return oom("X chunk in fp32", static_cast<uint64_t>(chunk) * h * 4);
  }
  if (plan.dx_scratch && !dx_scratch.Allocate(chunk * h)) {
    return oom("dX chunk in fp32", static_cast<uint64_t>(chunk) * h * 4);
  }
  float* dw_f = out.dw_accum;  // accumulate straight into the caller's fp32 buffer
  if (dw_f == nullptr && out.dw != nullptr) {
    if (plan.dw_scratch) {
      if (!dw_scratch.Allocate(v * h)) return oom("dW in fp32", static_cast<uint64_t>(v) * h * 4);
      dw_f = dw_scratch.data();
    } else {
      dw_f = static_cast<float*>(out.dw);
    }
  }
  const bool dw_overwrite = out.dw_accum == nullptr;  // first chunk writes, later ones add
  float* db_acc = out.db_accum;
  if (plan.db_scratch) {
    if (!db_f.Allocate(v)) return oom("db in fp32", static_cast<uint64_t>(v) * 4);
    std::fill(db_f.data(), db_f.data() + v, 0.0f);
    db_acc = db_f.data();
  }

  RowPassParams rp;
  rp.v = v;
  rp.dtype = p.dtype;
  rp.cw = p.class_weights;
  rp.bias = p.bias != nullptr ? bias_f.data() : nullptr;
  double max_cw = 0;  // the weights' largest magnitude, for the gradient's scale below
  for (int64_t j = 0; j < v && p.class_weights != nullptr; ++j) {
    rp.cw_sum += p.class_weights[j];
    max_cw = std::max(max_cw, std::abs(double{p.class_weights[j]}));
  }
  if (p.class_weights == nullptr) rp.cw_sum = static_cast<double>(v);
  rp.eps = o.label_smoothing;
  rp.zs = o.z_loss_scale;
  rp.cap = o.softcap;
  rp.token_scaling = o.token_scaling;
  rp.want_grad = plan.want_grad;

  // The stored G would carry the whole scale (1/N for a mean over N tokens, the upstream
  // gradient, the class weights' size), and in fp16 a mean over a few thousand tokens puts
  // it among the subnormals, where it keeps a few bits. A power of two near that scale
  // leaves the stored G for the GEMMs' alpha instead: exact, so bf16 and fp32 results keep
  // their bits, and fp16 keeps its precision (as the CUDA backend does).
  double max_scale = std::abs(ce_scale);
  if (o.reduction == Reduction::kNone) {
    max_scale = p.grad_output != nullptr ? 0.0 : 1.0;
    for (int64_t i = 0; i < bt && p.grad_output != nullptr; ++i) {
      if (targets[i] >= 0) max_scale = std::max(max_scale, std::abs(double{p.grad_output[i]}));
    }
  }
  // Within 2^[-100, 100], so it is a normal float.
  const double g_alpha =
      std::clamp(PowerOfTwoAbove(max_scale) * ClassWeightScale(max_cw, o.z_loss_scale),
                 std::ldexp(1.0, -100), std::ldexp(1.0, 100));
  const float alpha = static_cast<float>(g_alpha);

  std::vector<RowResult> rows(bt);
  const int64_t v_block = VBlock(v), v_tasks = CeilDiv(v, v_block);
  for (int64_t c0 = 0; c0 < bt; c0 += chunk) {
    const int64_t rows_c = std::min(chunk, bt - c0);
    float* z = z_buf.data();
    // Overlapped path: this chunk's rows of X may still be on their way.
    if (p.rows != nullptr) {
      absl::Status arrived = p.rows->WaitX(c0 + rows_c);
      if (!arrived.ok()) return arrived;
    }
    // X_c in fp32.
    const float* xc = static_cast<const float*>(p.x) + c0 * h;
    if (plan.x_copy) {
      pool.Run(CeilDiv(rows_c * h, kConvertBlock), [&](int64_t task) {
        const int64_t first = task * kConvertBlock;
        const int64_t n = std::min(kConvertBlock, rows_c * h - first);
        WidenRange(p.x, p.dtype, c0 * h + first, n, x_copy.data() + first);
      });
      xc = x_copy.data();
    }
    // z = X_c W^T; one task per block of V columns.
    pool.Run(v_tasks, [&](int64_t task) {
      const int64_t j0 = task * v_block, nj = std::min(v_block, v - j0);
      GemmRows(/*trans_b=*/true, rows_c, nj, h, xc, h, wf + j0 * h, h, z + j0, v);
    });
    // Row pass: + b and the rounding to the input dtype, then loss, lse, argmax and G over z.
    pool.Run(CeilDiv(rows_c, kPassRows), [&](int64_t task) {
      const int64_t r_end = std::min(rows_c, (task + 1) * kPassRows);
      for (int64_t r = task * kPassRows; r < r_end; ++r) {
        const int64_t i = c0 + r;
        double sc = ce_scale, sz = z_scale;
        if (none) sc = sz = p.grad_output != nullptr ? p.grad_output[i] : 1.0;
        rows[i] = RowPass(rp, z + r * v, targets[i], sc / g_alpha, sz / g_alpha);
      }
    });
    if (!plan.want_grad) continue;
    // dX_c = G W; one task per block of rows.
    if (plan.want_dx) {
      float* dxc = plan.dx_scratch ? dx_scratch.data() : static_cast<float*>(out.dx) + c0 * h;
      const int64_t row_block = RowBlock(rows_c);
      pool.Run(CeilDiv(rows_c, row_block), [&](int64_t task) {
        const int64_t r0 = task * row_block, nr = std::min(row_block, rows_c - r0);
        GemmRows(/*trans_b=*/false, nr, h, v, z + r0 * v, v, wf, h, dxc + r0 * h, h, alpha);
        if (plan.dx_scratch) NarrowRange(dxc + r0 * h, nr * h, out.grad_dtype, out.dx, (c0 + r0) * h);
      });
      if (p.rows != nullptr) p.rows->DxReady(c0 + rows_c);
    }
    // dW += G^T X_c and db += colsum G; one task per block of V rows of dW, rows of the
    // chunk summed in order.
    if (dw_f != nullptr || db_acc != nullptr) {
      const float beta = (dw_overwrite && c0 == 0) ? 0.0f : 1.0f;
      pool.Run(v_tasks, [&](int64_t task) {
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
  }

  // Outputs of the row pass, reduced in row order.
  double ce_total = 0, z_total = 0;
  int64_t correct = 0;
  for (int64_t i = 0; i < bt; ++i) {
    const RowResult& r = rows[i];
    if (out.lse != nullptr) out.lse[i] = r.lse;
    if (out.predictions != nullptr) out.predictions[i] = r.argmax;
    if (targets[i] >= 0) {
      ce_total += r.ce;
      z_total += r.zl;
      if (r.argmax == targets[i]) ++correct;
    }
    if (none) {
      if (out.loss != nullptr) out.loss[i] = static_cast<float>(r.ce + r.zl);
      if (out.z_loss != nullptr) out.z_loss[i] = static_cast<float>(r.zl);
    }
  }
  if (!none) {
    double ce_loss = ce_total, z_loss = z_total;
    if (o.reduction == Reduction::kMean) {
      ce_loss = weight_sum != 0 ? ce_total / weight_sum : 0.0;
      z_loss = tokens != 0 ? z_total / static_cast<double>(tokens) : 0.0;
    }
    if (out.loss != nullptr) out.loss[0] = static_cast<float>(ce_loss + z_loss);
    if (out.z_loss != nullptr) out.z_loss[0] = static_cast<float>(z_loss);
  }
  if (out.accuracy != nullptr) {
    out.accuracy[0] =
        tokens != 0 ? static_cast<float>(static_cast<double>(correct) / tokens) : 0.0f;
  }
  if (out.tokens != nullptr) out.tokens[0] = tokens;

  // Gradients in the gradient dtype. An empty batch never ran a chunk: write zeros.
  if (bt == 0) {
    if (dw_f != nullptr && dw_overwrite) std::fill(dw_f, dw_f + v * h, 0.0f);
  }
  if (plan.dw_scratch) ParallelNarrow(pool, dw_f, v * h, out.grad_dtype, out.dw);
  if (plan.db_scratch && out.db != nullptr) {
    NarrowRange(db_f.data(), v, out.grad_dtype, out.db, 0);
  }

  if (stats != nullptr) {
    // After the fact: dW is added into an accumulator block by block, so a check before the
    // add would need a scratch dW; reading the written outputs once costs less.
    const bool dx_bad = ParallelAnyNonFinite(pool, out.dx, out.grad_dtype, bt * h);
    const bool dw_bad = out.dw_accum != nullptr
                            ? ParallelAnyNonFinite(pool, out.dw_accum, DType::kF32, v * h)
                            : ParallelAnyNonFinite(pool, out.dw, out.grad_dtype, v * h);
    const bool db_bad = out.db_accum != nullptr
                            ? AnyNonFinite(out.db_accum, DType::kF32, 0, v)
                            : out.db != nullptr && AnyNonFinite(out.db, out.grad_dtype, 0, v);
    stats->nonfinite = (dx_bad ? kNonFiniteDx : 0u) | (dw_bad ? kNonFiniteDw : 0u) |
                       (db_bad ? kNonFiniteDb : 0u);
    stats->compute_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stats->peak_extra_bytes = plan.bytes;
    stats->chunk_rows = chunk;
  }
  return absl::OkStatus();
}

std::unique_ptr<Backend> NewCpuBackend(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  return std::make_unique<CpuBackend>(std::max(1, threads));
}

}  // namespace lossd
