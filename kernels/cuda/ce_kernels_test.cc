// SPDX-License-Identifier: Apache-2.0
// GPU tests of the cross-entropy kernel alone: bf16 logits and the same values given as fp32
// must give bit-identical statistics and identically rounded gradients (the fp32-compute
// path), and both must match a float64 computation of the same formulas.
#include "kernels/cuda/ce_kernels.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/softcap_tanh.h"
#include "core/dtype.h"
#include "testing/cuda/gpu_test_util.h"

namespace lossd {
namespace cuda {
namespace {

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

struct Case {
  int64_t rows, v;
  bool bias, weights, row_scale;
  float eps, zs, cap;
};

std::string Name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "r" + std::to_string(c.rows) + "_v" + std::to_string(c.v) + (c.bias ? "_bias" : "") +
         (c.weights ? "_cw" : "") + (c.row_scale ? "_rs" : "") + (c.eps > 0 ? "_eps" : "") +
         (c.zs > 0 ? "_z" : "") + (c.cap > 0 ? "_cap" : "");
}

// Host inputs with bf16-representable values, and device copies in both dtypes.
struct Inputs {
  std::vector<float> z, bias, cw, rs;  // fp32 values that are exact in bf16 (z, bias)
  std::vector<int32_t> targets;
};

Inputs MakeInputs(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 3.0f);
  std::uniform_real_distribution<float> u(0.25f, 2.0f);
  Inputs in;
  in.z.resize(c.rows * c.v);
  for (float& x : in.z) x = Bf16ToFloat(FloatToBf16(n(rng)));
  if (c.bias) {
    in.bias.resize(c.v);
    for (float& x : in.bias) x = Bf16ToFloat(FloatToBf16(0.5f * n(rng)));
  }
  if (c.weights) {
    in.cw.resize(c.v);
    for (float& x : in.cw) x = u(rng);
  }
  if (c.row_scale) {
    in.rs.resize(c.rows);
    for (float& x : in.rs) x = u(rng) - 1.0f;
  }
  in.targets.resize(c.rows);
  std::uniform_int_distribution<int64_t> t(0, c.v - 1);
  for (int64_t i = 0; i < c.rows; ++i) in.targets[i] = (i % 7 == 3) ? -1 : static_cast<int32_t>(t(rng));
  return in;
}

struct Outputs {
  std::vector<float> lse, ce, z;
  std::vector<int32_t> pred;
  std::vector<float> grad;  // widened
  std::vector<uint16_t> grad16;  // raw bf16 (bf16 run only)
};

template <typename T>
T* ToDevice(const std::vector<T>& h) {
  if (h.empty()) return nullptr;
  T* d = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&d), h.size() * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

// The blocked layout's column blocks (as chunk_plan.cc's PlanWhole makes them): block 0 takes
// the rest, the others a multiple of 64 columns each.
void Blocks(int64_t v, int segments, std::vector<int64_t>* col0, std::vector<int64_t>* cols) {
  const int64_t nb = ((v + segments - 1) / segments + 63) / 64 * 64;
  const int64_t n = (v + nb - 1) / nb, first = v - (n - 1) * nb;
  for (int64_t b = 0; b < n; ++b) {
    col0->push_back(b == 0 ? 0 : first + (b - 1) * nb);
    cols->push_back(b == 0 ? first : nb);
  }
}

// Runs the kernel on `in` stored as elem (kElemBF16 or kElemF32); segments > 0: with the rows
// split into that many column blocks, each in its own allocation.
void RunKernel(const Case& c, const Inputs& in, int32_t elem, Outputs* out, int segments = 0,
               bool two_pass = false) {
  const int64_t n = c.rows * c.v;
  std::vector<uint16_t> z16(n), b16(in.bias.size());
  for (int64_t i = 0; i < n; ++i) z16[i] = FloatToBf16(in.z[i]);
  for (size_t i = 0; i < in.bias.size(); ++i) b16[i] = FloatToBf16(in.bias[i]);
  std::vector<int64_t> col0, cols;
  std::vector<void*> blocks;
  if (segments > 0) {
    Blocks(c.v, segments, &col0, &cols);
    for (size_t b = 0; b < cols.size(); ++b) {
      std::vector<float> zb(c.rows * cols[b]);
      std::vector<uint16_t> zb16(zb.size());
      for (int64_t i = 0; i < c.rows; ++i) {
        for (int64_t j = 0; j < cols[b]; ++j) {
          zb[i * cols[b] + j] = in.z[i * c.v + col0[b] + j];
          zb16[i * cols[b] + j] = z16[i * c.v + col0[b] + j];
        }
      }
      blocks.push_back(elem == kElemBF16 ? static_cast<void*>(ToDevice(zb16)) : ToDevice(zb));
      ASSERT_NE(blocks.back(), nullptr);
    }
  }
  void* z = segments > 0 ? nullptr
                         : (elem == kElemBF16 ? static_cast<void*>(ToDevice(z16)) : ToDevice(in.z));
  void* bias = nullptr;
  if (c.bias) bias = elem == kElemBF16 ? static_cast<void*>(ToDevice(b16)) : ToDevice(in.bias);
  int32_t* t = ToDevice(in.targets);
  float* cw = ToDevice(in.cw);
  float* rs = ToDevice(in.rs);
  float* rows = nullptr;
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&rows), 4 * c.rows * sizeof(float)));
  ASSERT_CUDA(cudaMemset(rows, 0xFF, 4 * c.rows * sizeof(float)));  // poison
  ASSERT_TRUE(z != nullptr || segments > 0);
  CrossEntropyParams p{};
  p.logits = z;
  p.segments = static_cast<int32_t>(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    p.seg_base[b] = blocks[b];
    p.seg_col0[b] = col0[b];
    p.seg_cols[b] = cols[b];
  }
  p.two_pass = two_pass ? 1 : 0;
  p.elem = elem;
  p.rows = c.rows;
  p.v = c.v;
  p.bias = bias;
  p.targets = t;
  p.class_weights = cw;
  p.row_scale = rs;
  p.ce_scale = 0.75f;
  p.z_scale = 1.25f;
  p.label_smoothing = c.eps;
  p.z_loss_scale = c.zs;
  p.softcap = c.cap;
  double s = 0;
  for (float w : in.cw) s += w;
  p.class_weight_sum = c.weights ? static_cast<float>(s) : static_cast<float>(c.v);
  p.write_grad = 1;
  p.row_lse = rows;
  p.row_ce = rows + c.rows;
  p.row_z = rows + 2 * c.rows;
  p.row_pred = reinterpret_cast<int32_t*>(rows + 3 * c.rows);
  ASSERT_CUDA(LaunchCrossEntropy(p, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> r(4 * c.rows);
  ASSERT_CUDA(cudaMemcpy(r.data(), rows, r.size() * 4, cudaMemcpyDeviceToHost));
  out->lse.assign(r.begin(), r.begin() + c.rows);
  out->ce.assign(r.begin() + c.rows, r.begin() + 2 * c.rows);
  out->z.assign(r.begin() + 2 * c.rows, r.begin() + 3 * c.rows);
  out->pred.resize(c.rows);
  std::memcpy(out->pred.data(), r.data() + 3 * c.rows, c.rows * 4);
  out->grad.resize(n);
  if (segments > 0) {
    // Gathered back into (rows, v) row-major.
    const size_t es = elem == kElemBF16 ? 2 : 4;
    if (elem == kElemBF16) out->grad16.resize(n);
    for (size_t b = 0; b < blocks.size(); ++b) {
      std::vector<uint8_t> raw(c.rows * cols[b] * es);
      ASSERT_CUDA(cudaMemcpy(raw.data(), blocks[b], raw.size(), cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < c.rows; ++i) {
        for (int64_t j = 0; j < cols[b]; ++j) {
          const int64_t k = i * c.v + col0[b] + j;
          if (elem == kElemBF16) {
            std::memcpy(&out->grad16[k], raw.data() + (i * cols[b] + j) * 2, 2);
            out->grad[k] = Bf16ToFloat(out->grad16[k]);
          } else {
            std::memcpy(&out->grad[k], raw.data() + (i * cols[b] + j) * 4, 4);
          }
        }
      }
      cudaFree(blocks[b]);
    }
  } else if (elem == kElemBF16) {
    out->grad16.resize(n);
    ASSERT_CUDA(cudaMemcpy(out->grad16.data(), z, n * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; ++i) out->grad[i] = Bf16ToFloat(out->grad16[i]);
  } else {
    ASSERT_CUDA(cudaMemcpy(out->grad.data(), z, n * 4, cudaMemcpyDeviceToHost));
  }
  for (void* ptr : {static_cast<void*>(z), bias, static_cast<void*>(t), static_cast<void*>(cw),
                    static_cast<void*>(rs), static_cast<void*>(rows)}) {
    if (ptr != nullptr) cudaFree(ptr);
  }
}

class CrossEntropyKernelTest : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  }
};

// bf16 and fp32 storage of the same values give bit-identical statistics and identically
// rounded gradients, and both match float64 of the same formulas; with `segments` > 0 the
// rows come in that many column blocks; `two_pass` forces the two-pass kernel.
void CheckBothDtypes(const Case& c, int segments, bool two_pass = false) {
  const Inputs in = MakeInputs(c, 1234 + c.v);
  Outputs b, f;
  ASSERT_NO_FATAL_FAILURE(RunKernel(c, in, kElemBF16, &b, segments, two_pass));
  ASSERT_NO_FATAL_FAILURE(RunKernel(c, in, kElemF32, &f, segments, two_pass));
  int64_t stat_diff = 0, grad_diff = 0;
  for (int64_t i = 0; i < c.rows; ++i) {
    stat_diff += std::memcmp(&b.lse[i], &f.lse[i], 4) != 0;
    stat_diff += std::memcmp(&b.ce[i], &f.ce[i], 4) != 0;
    stat_diff += std::memcmp(&b.z[i], &f.z[i], 4) != 0;
    stat_diff += b.pred[i] != f.pred[i];
  }
  for (size_t k = 0; k < b.grad16.size(); ++k) grad_diff += b.grad16[k] != FloatToBf16(f.grad[k]);
  EXPECT_EQ(stat_diff, 0) << "row statistics differ between bf16 and fp32 storage";
  EXPECT_EQ(grad_diff, 0) << "gradients differ after rounding the fp32 one to bf16";

  // Float64 of the same formulas from the same values.
  double worst_lse = 0, worst_ce = 0, worst_z = 0, worst_g = 0, g_scale = 0;
  int64_t pred_bad = 0;
  for (int64_t i = 0; i < c.rows; ++i) {
    const int t = in.targets[i];
    // An unwritten prediction is the poison (-1): out of range, and no index to read.
    ASSERT_GE(f.pred[i], 0) << "row " << i;
    ASSERT_LT(f.pred[i], c.v) << "row " << i;
    std::vector<double> zz(c.v), th(c.v, 0.0);
    double m = -INFINITY;
    int64_t arg = 0;
    for (int64_t j = 0; j < c.v; ++j) {
      double u = in.z[i * c.v + j] + (c.bias ? in.bias[j] : 0.0);
      if (c.cap > 0) {
        th[j] = std::tanh(u / c.cap);
        u = c.cap * th[j];
      }
      zz[j] = u;
      if (u > m) {
        m = u;
        arg = j;
      }
    }
    double s = 0, wz = 0, cws = 0;
    for (int64_t j = 0; j < c.v; ++j) {
      s += std::exp(zz[j] - m);
      const double w = c.weights ? in.cw[j] : 1.0;
      wz += w * zz[j];
      cws += w;
    }
    const double lse = m + std::log(s);
    worst_lse = std::max(worst_lse, std::fabs(lse - f.lse[i]) / (1 + std::fabs(lse)));
    if (f.pred[i] != arg && zz[f.pred[i]] < m - 1e-5 * (1 + std::fabs(m))) ++pred_bad;
    if (t < 0) {
      EXPECT_EQ(f.ce[i], 0.0f);
      EXPECT_EQ(f.z[i], 0.0f) << "an ignored row's z-loss, row " << i;
      for (int64_t j = 0; j < c.v; ++j) ASSERT_EQ(f.grad[i * c.v + j], 0.0f) << i << "," << j;
      continue;
    }
    // The z-loss zs lse^2, relative to its size as lse is (the same 2e-6 below).
    const double zl = c.zs * lse * lse;
    worst_z = std::max(worst_z, std::fabs(zl - f.z[i]) / (c.zs * (1 + lse * lse) + 1e-30));
    const double cwt = c.weights ? in.cw[t] : 1.0;
    const double ce = (1 - c.eps) * cwt * (lse - zz[t]) + c.eps / c.v * (cws * lse - wz);
    worst_ce = std::max(worst_ce, std::fabs(ce - f.ce[i]) / (1 + std::fabs(ce)));
    const double rs = c.row_scale ? in.rs[i] : 1.0;
    const double ce_s = 0.75 * rs, z_s = 1.25 * rs;
    for (int64_t j = 0; j < c.v; ++j) {
      const double pj = std::exp(zz[j] - lse);
      const double w = c.weights ? in.cw[j] : 1.0;
      double g = ce_s * ((1 - c.eps) * cwt * (pj - (j == t)) + c.eps / c.v * (cws * pj - w)) +
                 z_s * 2 * c.zs * lse * pj;
      if (c.cap > 0) g *= 1 - th[j] * th[j];
      worst_g = std::max(worst_g, std::fabs(g - f.grad[i * c.v + j]));
      g_scale = std::max(g_scale, std::fabs(g));
    }
  }
  EXPECT_LT(worst_lse, 2e-6) << "lse";
  // lse^2 doubles lse's relative error.
  EXPECT_LT(worst_z, 4e-6) << "z-loss";
  EXPECT_LT(worst_ce, 2e-5) << "ce";
  EXPECT_LT(worst_g, 2e-6 * (1 + g_scale)) << "gradient";
  EXPECT_EQ(pred_bad, 0) << "argmax";
}

TEST_P(CrossEntropyKernelTest, Bf16AndFp32AreBitIdenticalAndMatchFloat64) {
  CheckBothDtypes(GetParam(), 0);
}

// The same promises from the two-pass kernel where the one-read kernel would run.
TEST_P(CrossEntropyKernelTest, TwoPassKernelMatchesFloat64) { CheckBothDtypes(GetParam(), 0, true); }

// The whole-batch layout's rows: the same promises over column blocks (3 and 5 of them).
TEST_P(CrossEntropyKernelTest, BlockedRowsMatchFloat64) {
  for (int segments : {3, 5}) {
    SCOPED_TRACE(segments);
    CheckBothDtypes(GetParam(), segments);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CrossEntropyKernelTest,
    testing::Values(Case{3, 123, false, false, false, 0, 0, 0},
                    Case{9, 123, true, true, true, 0.1f, 1e-3f, 0},
                    Case{5, 1000, true, false, false, 0, 0, 5.0f},
                    Case{16, 4096, false, false, false, 0, 0, 0},
                    Case{16, 4096, true, true, true, 0.2f, 1e-2f, 8.0f},
                    Case{4, 32000, false, true, false, 0.1f, 1e-4f, 0},
                    Case{3, 32001, true, false, true, 0, 0, 30.0f},
                    // The one-read kernel's cluster sizes (blocks per row): 1 at its widest
                    // segment, 2 with a short last segment, 4, 8, 8 at the portable limit, 9,
                    // 16 (Hopper), then the two-pass kernel (OneReadClusterSizes pins these).
                    Case{5, 32768, true, false, false, 0.1f, 0, 0},
                    Case{5, 32776, false, true, true, 0, 1e-3f, 0},
                    Case{6, 128256, true, true, false, 0.1f, 1e-4f, 15.0f},
                    Case{5, 256000, false, false, false, 0, 0, 0},
                    Case{5, 256000, true, true, true, 0.1f, 1e-4f, 30.0f},
                    Case{4, 262144, false, false, true, 0, 1e-4f, 0},
                    Case{4, 262152, true, false, false, 0, 0, 0},
                    Case{3, 524288, false, true, false, 0, 1e-4f, 0},
                    Case{3, 524296, false, false, false, 0, 0, 0}),
    Name);

// The softcap's tanh as this GPU computes it, against long double tanhl: the polynomial must
// give the host's bits (softcap_tanh_test bounds those), the exponential form must stay within
// its bound with the GPU's approximate 2^x and reciprocal. The bound: the host's 1.5 ulp plus
// what those two instructions add through the 2 / (e + 1) term (at most 0.24 of the result):
// about 2 ulp of relative error each (ex2.approx, rcp.approx), times 0.48.
TEST(SoftcapTanhGpuTest, MatchesTheHostAndTanh) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  constexpr double kFarGpuUlps = 3.5;
  std::vector<float> x;
  auto bits = [](float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
  };
  auto from = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
  };
  for (uint32_t b = bits(0x1p-30f); b < bits(48.0f); b += 13) x.push_back(from(b));
  for (uint32_t b = bits(kTanhNear - 0x1p-10f); b <= bits(kTanhNear + 0x1p-10f); ++b) {
    x.push_back(from(b));
  }
  const size_t half = x.size();
  for (size_t i = 0; i < half; ++i) x.push_back(-x[i]);
  x.push_back(INFINITY);
  x.push_back(-INFINITY);
  x.push_back(NAN);
  float *dx = nullptr, *dy = nullptr;
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&dx), x.size() * sizeof(float)));
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&dy), x.size() * sizeof(float)));
  ASSERT_CUDA(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemset(dy, 0xFF, x.size() * sizeof(float)));  // poison: NaN
  ASSERT_CUDA(LaunchSoftcapTanh(dx, dy, static_cast<int64_t>(x.size()), nullptr));
  std::vector<float> y(x.size());
  ASSERT_CUDA(cudaMemcpy(y.data(), dy, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(dx);
  cudaFree(dy);
  int64_t near_differs = 0, far_n = 0;
  double far_worst = 0;
  float far_at = 0;
  for (size_t i = 0; i + 3 < x.size(); ++i) {
    if (std::fabs(x[i]) < kTanhNear) {
      near_differs += bits(y[i]) != bits(SoftcapTanh(x[i]));
      continue;
    }
    const long double want = tanhl(static_cast<long double>(x[i]));
    const float w = std::fabs(static_cast<float>(want));
    const double ulps =
        static_cast<double>(std::fabs(static_cast<long double>(y[i]) - want)) /
        (std::nextafter(w, INFINITY) - w);
    if (!(ulps <= far_worst)) far_worst = ulps, far_at = x[i];
    ++far_n;
  }
  EXPECT_EQ(near_differs, 0) << "polynomial: GPU and host bits differ";
  EXPECT_GT(far_n, 100000);
  EXPECT_LE(far_worst, kFarGpuUlps) << "exponential form, at y = " << far_at;
  std::printf("softcap tanh on the GPU: exponential form at most %.3f ulp (y = %.9g), %lld "
              "values\n", far_worst, far_at, static_cast<long long>(far_n));
  const size_t n = x.size();
  EXPECT_EQ(y[n - 3], 1.0f);
  EXPECT_EQ(y[n - 2], -1.0f);
  EXPECT_TRUE(std::isnan(y[n - 1]));
}

// Which kernel runs which shape: the cases above cover every branch only if these hold.
TEST(CrossEntropyDispatchTest, OneReadClusterSizes) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  int major = 0;
  ASSERT_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  void* buf = nullptr;
  ASSERT_CUDA(cudaMalloc(&buf, 256));
  auto cluster = [&](int64_t v, void* logits, void* bias, int segments, int two_pass) {
    CrossEntropyParams p{};
    p.logits = logits;
    p.bias = bias;
    p.rows = 5;
    p.v = v;
    p.segments = segments;
    p.two_pass = two_pass;
    return CrossEntropyCluster(p);
  };
  const int on = major >= 9 ? 1 : 0;  // clusters exist from compute capability 9.0
  EXPECT_EQ(cluster(8, buf, nullptr, 0, 0), 1 * on);
  EXPECT_EQ(cluster(4096, buf, buf, 0, 0), 1 * on);
  EXPECT_EQ(cluster(32768, buf, nullptr, 0, 0), 1 * on);
  EXPECT_EQ(cluster(32776, buf, nullptr, 0, 0), 2 * on);
  EXPECT_EQ(cluster(128256, buf, nullptr, 0, 0), 4 * on);
  EXPECT_EQ(cluster(256000, buf, nullptr, 0, 0), 8 * on);
  EXPECT_EQ(cluster(262144, buf, nullptr, 0, 0), 8 * on);
  // Wider rows take 9 to 16 blocks where the GPU places clusters of 16 (Hopper does).
  const int wide = CrossEntropyMaxCluster() >= 16 ? 1 : 0;
  if (major == 9) {
    EXPECT_EQ(wide, 1) << "a Hopper GPU places clusters of 16";
  }
  EXPECT_EQ(cluster(262152, buf, nullptr, 0, 0), 9 * wide);
  EXPECT_EQ(cluster(524288, buf, nullptr, 0, 0), 16 * wide);
  EXPECT_EQ(cluster(524296, buf, nullptr, 0, 0), 0);  // more than 16 blocks a row
  // Narrower segments on request: more blocks per row.
  {
    CrossEntropyParams p{};
    p.logits = buf;
    p.rows = 5;
    p.v = 256000;
    p.one_read_cols = 16384;
    EXPECT_EQ(CrossEntropyCluster(p), 16 * wide);
    p.one_read_cols = 12;  // not a multiple of 8
    EXPECT_EQ(CrossEntropyCluster(p), 0);
  }
  EXPECT_EQ(cluster(4095, buf, nullptr, 0, 0), 0);    // V % 8 != 0
  EXPECT_EQ(cluster(4096, static_cast<char*>(buf) + 2, nullptr, 0, 0), 0);  // misaligned
  EXPECT_EQ(cluster(4096, buf, static_cast<char*>(buf) + 8, 0, 0), 0);      // misaligned bias
  EXPECT_EQ(cluster(4096, nullptr, nullptr, 3, 0), 0);  // the blocked layout
  EXPECT_EQ(cluster(4096, buf, nullptr, 0, 1), 0);      // forced two-pass
  cudaFree(buf);
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
