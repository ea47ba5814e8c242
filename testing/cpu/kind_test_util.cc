// SPDX-License-Identifier: Apache-2.0
#include "testing/cpu/kind_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_head.h"
#include "testing/test_util.h"

namespace lossd {

KindOutputs::KindOutputs(const LossProblem& p, DType grad_dtype_in, bool accumulate_in)
    : grad_dtype(grad_dtype_in), accumulate(accumulate_in) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const size_t gs = DTypeSize(grad_dtype);
  loss.assign(1, nan);
  lse.assign(p.bt, nan);
  logp.assign(p.bt, nan);
  entropy.assign(p.bt, nan);
  predictions.assign(p.bt, -7);
  accuracy = kl = clip_fraction = nan;
  tokens = -7;
  dx.assign(p.bt * p.h * gs, 0xFF);
  if (accumulate) {
    dw_start = RandomFloats(p.v * p.h, -1e-2f, 1e-2f, 77 + p.v);
    dw_accum = dw_start;
    if (p.bias != nullptr) {
      db_start = RandomFloats(p.v, -1e-2f, 1e-2f, 78 + p.v);
      db_accum = db_start;
    }
  } else {
    dw.assign(p.v * p.h * gs, 0xFF);
    if (p.bias != nullptr) db.assign(p.v * gs, 0xFF);
  }
}

LossOutputs KindOutputs::outputs() {
  LossOutputs o;
  o.grad_dtype = grad_dtype;
  o.loss = loss.data();
  o.lse = lse.data();
  o.predictions = predictions.data();
  o.accuracy = &accuracy;
  o.tokens = &tokens;
  o.logp = want_logp ? logp.data() : nullptr;
  o.entropy = want_entropy ? entropy.data() : nullptr;
  o.kl = &kl;
  o.clip_fraction = &clip_fraction;
  o.dx = dx.data();
  if (accumulate) {
    o.dw_accum = dw_accum.data();
    o.db_accum = db_accum.empty() ? nullptr : db_accum.data();
  } else {
    o.dw = dw.data();
    o.db = db.empty() ? nullptr : db.data();
  }
  return o;
}

std::vector<float> RandomFloats(int64_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& e : v) e = u(rng);
  return v;
}

std::vector<uint8_t> RandomStored(int64_t n, double std, DType t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(std));
  std::vector<uint8_t> out(n * DTypeSize(t));
  for (int64_t k = 0; k < n; ++k) StoreFromFloat(out.data(), t, k, normal(rng));
  return out;
}

RawLogits ComputeRawLogits(const HeadInputs& head) {
  const std::vector<double> x = Widen(head.x, head.dtype, head.bt * head.h);
  const std::vector<double> w = Widen(head.w, head.dtype, head.v * head.h);
  std::vector<double> b(head.v, 0.0);
  if (head.bias != nullptr) b = Widen(head.bias, head.dtype, head.v);
  RawLogits l;
  l.u.assign(head.bt * head.v, 0.0);
  l.abs_max.assign(head.bt, 0.0);
  l.argmax.assign(head.bt, 0);
  l.rms.assign(head.bt, 0.0);
  for (int64_t i = 0; i < head.bt; ++i) {
    for (int64_t j = 0; j < head.v; ++j) {
      double u = b[j];
      for (int64_t k = 0; k < head.h; ++k) u += x[i * head.h + k] * w[j * head.h + k];
      l.u[i * head.v + j] = u;
      l.abs_max[i] = std::max(l.abs_max[i], std::abs(u));
      l.rms[i] += u * u / static_cast<double>(head.v);
      if (u > l.u[i * head.v + l.argmax[i]]) l.argmax[i] = j;
    }
    l.rms[i] = std::sqrt(l.rms[i]);
  }
  return l;
}

bool ArgmaxAcceptable(const RawLogits& l, int64_t v, int64_t i, int64_t got, double u) {
  if (got < 0 || got >= v) return false;
  const double best = l.u[i * v + l.argmax[i]], mine = l.u[i * v + got];
  return best - mine <= 2 * u * l.abs_max[i] + 1e-5 * (1 + l.abs_max[i]);
}

double Rms(const std::vector<double>& v) {
  double s = 0;
  for (double e : v) s += e * e;
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}

double UnitRoundoff(DType t) {
  return t == DType::kBF16  ? std::ldexp(1.0, -8)
         : t == DType::kF16 ? std::ldexp(1.0, -11)
                            : std::ldexp(1.0, -24);
}

double GradientTolerance(const LossProblem& p, DType grad_dtype, double g_rel) {
  const double gemm =
      4 * std::sqrt(static_cast<double>(std::max(p.v, p.bt))) * std::ldexp(1.0, -24);
  const double tol = 2 * g_rel + 2 * UnitRoundoff(p.dtype) + UnitRoundoff(grad_dtype) + 1e-5 + gemm;
  return std::min(tol, kMaxGradientTolerance);
}

namespace {

std::vector<double> Scaled(const std::vector<double>& v, double s) {
  std::vector<double> out(v);
  for (double& e : out) e *= s;
  return out;
}

std::vector<double> Added(const std::vector<float>& got, const std::vector<float>& start) {
  std::vector<double> out(got.size());
  for (size_t k = 0; k < got.size(); ++k) {
    out[k] = static_cast<double>(got[k]) - static_cast<double>(start[k]);
  }
  return out;
}

}  // namespace

::testing::AssertionResult GradientsMatch(const LossProblem& p, const KindOutputs& got,
                                          const HeadGradients& ref, double scale, double tol) {
  std::vector<CompareResult> rs;
  rs.push_back(CompareRelNorm("dx", Scaled(ref.dx, scale),
                              Widen(got.dx.data(), got.grad_dtype, p.bt * p.h), tol));
  if (got.accumulate) {
    // Each chunk's add into the fp32 accumulator rounds at about 2^-24 |start|: the sum's
    // error is up to (chunks) 2^-24 ||start||, relative to ||ref||.
    const int64_t chunks =
        p.options.chunk_rows > 0 ? (p.bt + p.options.chunk_rows - 1) / p.options.chunk_rows : 1;
    auto accum_tol = [&](const std::vector<float>& start, const std::vector<double>& r) {
      double s2 = 0, r2 = 0;
      for (float e : start) s2 += double{e} * e;
      for (double e : r) r2 += e * e * scale * scale;
      return tol + (r2 > 0 ? chunks * std::ldexp(1.0, -24) * std::sqrt(s2 / r2) : 0.0);
    };
    rs.push_back(CompareRelNorm("dw_accum", Scaled(ref.dw, scale),
                                Added(got.dw_accum, got.dw_start),
                                accum_tol(got.dw_start, ref.dw)));
    if (p.bias != nullptr) {
      rs.push_back(CompareRelNorm("db_accum", Scaled(ref.db, scale),
                                  Added(got.db_accum, got.db_start),
                                  accum_tol(got.db_start, ref.db)));
    }
  } else {
    rs.push_back(CompareRelNorm("dw", Scaled(ref.dw, scale),
                                Widen(got.dw.data(), got.grad_dtype, p.v * p.h), tol));
    if (p.bias != nullptr) {
      rs.push_back(CompareRelNorm("db", Scaled(ref.db, scale),
                                  Widen(got.db.data(), got.grad_dtype, p.v), tol));
    }
  }
  bool ok = true;
  std::string msg;
  for (const CompareResult& r : rs) {
    ok = ok && r.ok();
    absl::StrAppend(&msg, r.ToString(), "\n");
  }
  return ok ? ::testing::AssertionSuccess() << msg : ::testing::AssertionFailure() << msg;
}

::testing::AssertionResult KindOutputsIdentical(const KindOutputs& a, const KindOutputs& b) {
  std::string bad;
  auto cmp = [&](const char* name, const void* x, const void* y, size_t bytes) {
    if (bytes > 0 && std::memcmp(x, y, bytes) != 0) absl::StrAppend(&bad, name, " ");
  };
  auto vec = [&](const char* name, const auto& x, const auto& y) {
    if (x.size() != y.size()) {
      absl::StrAppend(&bad, name, "(size) ");
      return;
    }
    cmp(name, x.data(), y.data(), x.size() * sizeof(x[0]));
  };
  vec("loss", a.loss, b.loss);
  vec("lse", a.lse, b.lse);
  vec("logp", a.logp, b.logp);
  vec("entropy", a.entropy, b.entropy);
  vec("predictions", a.predictions, b.predictions);
  cmp("accuracy", &a.accuracy, &b.accuracy, 4);
  cmp("kl", &a.kl, &b.kl, 4);
  cmp("clip_fraction", &a.clip_fraction, &b.clip_fraction, 4);
  cmp("tokens", &a.tokens, &b.tokens, 8);
  vec("dx", a.dx, b.dx);
  vec("dw", a.dw, b.dw);
  vec("db", a.db, b.db);
  vec("dw_accum", a.dw_accum, b.dw_accum);
  vec("db_accum", a.db_accum, b.db_accum);
  if (bad.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "outputs differ: " << bad;
}

::testing::AssertionResult KindVerdict(std::string errors, const ::testing::AssertionResult& grads,
                                       const std::string& summary) {
  if (!grads) absl::StrAppend(&errors, grads.message());
  if (!errors.empty()) return ::testing::AssertionFailure() << errors;
  return ::testing::AssertionSuccess() << summary << grads.message();
}

RandomProblemSpec HeadSpec(int64_t bt, int64_t h, int64_t v, DType dtype, uint64_t seed) {
  RandomProblemSpec spec;
  spec.bt = bt;
  spec.h = h;
  spec.v = v;
  spec.dtype = dtype;
  spec.seed = seed;
  return spec;
}

void ExpectComputeMatches(
    const LossProblem& p, KindOutputs& got,
    const std::function<::testing::AssertionResult(const KindOutputs&)>& matches,
    LossStats* stats) {
  std::unique_ptr<Backend> backend = NewCpuBackend(2);
  LossStats own;
  if (stats == nullptr) stats = &own;
  const absl::Status st = backend->Compute(p, got.outputs(), stats);
  ASSERT_TRUE(st.ok()) << st;
  const ::testing::AssertionResult match = matches(got);
  EXPECT_TRUE(match);
  if (match) std::cout << match.message();
  EXPECT_EQ(stats->peak_extra_bytes, backend->WorkspaceBytes(ShapeOf(p, got.outputs())));
}

void ExpectBitIdenticalAcrossThreads(const LossProblem& p, const MakeKindOutputs& make) {
  KindOutputs first = make(p);
  ASSERT_TRUE(NewCpuBackend(1)->Compute(p, first.outputs(), nullptr).ok());
  std::unique_ptr<Backend> three = NewCpuBackend(3);
  for (int run = 0; run < 2; ++run) {
    KindOutputs again = make(p);
    ASSERT_TRUE(three->Compute(p, again.outputs(), nullptr).ok());
    EXPECT_TRUE(KindOutputsIdentical(first, again)) << "run " << run;
  }
}

void ExpectStreamedRowsIdentical(const LossProblem& p, const MakeKindOutputs& make,
                                 size_t dx_calls) {
  std::unique_ptr<Backend> backend = NewCpuBackend(2);
  KindOutputs whole = make(p);
  ASSERT_TRUE(backend->Compute(p, whole.outputs(), nullptr).ok());
  TrickleRows rows(p, TrickleRows::Spec());
  KindOutputs streamed = make(p);
  ASSERT_TRUE(backend->Compute(rows.Streamed(p), streamed.outputs(), nullptr).ok());
  EXPECT_TRUE(KindOutputsIdentical(whole, streamed));
  EXPECT_TRUE(rows.CallsAreValid(p.bt, dx_calls));
}

void ExpectRefusals(const LossProblem& p, const std::vector<Refusal>& refusals,
                    const MakeKindOutputs& make) {
  std::unique_ptr<Backend> backend = NewCpuBackend(1);
  for (const Refusal& r : refusals) {
    LossProblem bad = p;
    r.edit(bad);
    KindOutputs got = make(bad);
    if (r.edit_outputs) r.edit_outputs(got);
    const absl::Status st = ValidateThenCompute(*backend, bad, got.outputs(), nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << r.field << ": " << st;
    EXPECT_NE(std::string(st.message()).find(r.field), std::string::npos) << r.field << ": " << st;
  }
}

}  // namespace lossd
