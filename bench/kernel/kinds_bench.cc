// SPDX-License-Identifier: Apache-2.0
// Times each loss kind's fused op (FusedLoss::Enqueue, the device entry point the CUDA backend
// runs, with the chunk plan CudaBackend::Plan gives the kind) against the GEMM floor of the
// same work, measured in the same rounds: cross-entropy (the anchor), logprob with entropy and
// upstream gradients, policy (dapo) with old and reference log-probs, and distill (jsd_beta
// 0.5) against a teacher head. The floor is the unchunked GEMMs (logits bf16, dX bf16, dW into
// fp32; distill adds the teacher's logits GEMM), with cuBLASLt's first choice ("floor") and
// with the fastest of its candidates ("tuned floor", the autotuning the fused op gets). Also
// reports the chunk plan, the workspace, the peak extra device memory measured (the drop in
// free memory across the timed runs, beyond inputs and outputs, which are allocated before),
// and the mean of a per-row statistic as a sanity value (cross-entropy: the row loss; logprob
// and policy: log p(target); distill: the row's divergence). bf16, random data (logits of
// standard deviation 2), median of --runs CUDA-event timings after --warmup rounds.
// With logprob among the kinds and --two_phase, the two-phase logprob too: its forward (logits
// GEMM and one row pass, no gradient) then its backward (the one-phase logprob with upstream
// gradients on the kept inputs: logits again, dX, dW), timed together in the same rounds as the
// floor and the one-phase logprob, so the 8-against-6 BT H V cost is measured
// (two_phase_row.h states it).
// With policy among the kinds and --policy_verl, the row "policy_verl": policy with verl's
// k2 estimator and an entropy bonus (its e_i per row, the one-read kernel's entropy variant);
// the aggregation modes change only the host's row weights, so they cost nothing here.
// With policy among the kinds and --policy_sequence=S, the row "policy_seq": the policy kind at
// sequence level over sequences of S rows as the CUDA backend runs it (policy_sequence.h), its
// host step timed too, against the same 6 BT H V floor (its GEMMs are 8 BT H V: ~1.33x); and
// the rows "policy_geo_mean", "policy_kl_cov" and "policy_vespo": those loss types over the same
// rows, the same path (kl_cov's group is the whole call, verl's default share 0.0002).
// --chunk_budget_mib plans every kind with that budget instead of the backend's default.
// Reads --shapes, --runs and --warmup (kernel_flags.h; its other flags are bench_kernel's) and
// its own flags below. Exit codes: 0; 1 on a failed call; 2 on a bad flag; 3 when a per-row
// statistic came out non-finite.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/kernel/bench_util.h"
#include "bench/kernel/floor.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/kinds_bench_shape.h"
#include "bench/kernel/kinds_table.h"
#include "bench/kernel/problem.h"
#include "bench/kernel/timing.h"
#include "bench/kernel/two_phase_row.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_io.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/policy_rows.h"

ABSL_FLAG(std::string, kinds, "cross_entropy,logprob,policy,distill",
          "loss kinds to time, in this order (cross_entropy, logprob, policy, distill)");
ABSL_FLAG(double, temperature, 1.0, "temperature T of logprob, policy and distill (> 0)");
ABSL_FLAG(int64_t, teacher_h, 0, "distill's teacher hidden size (0: the student's H)");
ABSL_FLAG(bool, two_phase, true,
          "with logprob in --kinds: also time the two-phase logprob (forward, then backward)");
ABSL_FLAG(int64_t, policy_sequence, 0,
          "with policy in --kinds and S > 0 dividing BT: also time the policy kind at sequence "
          "level over sequences of S rows (the row policy_seq), and the loss types geo_mean, "
          "kl_cov and vespo over the same rows (policy_geo_mean, policy_kl_cov, policy_vespo)");
ABSL_FLAG(int64_t, chunk_budget_mib, 0,
          "the backend's chunk budget in MiB for every kind's plan (0: its default for the "
          "shape and GPU; distill holds two logits chunks in it)");
ABSL_FLAG(bool, policy_verl, true,
          "with policy in --kinds: also time the policy kind with verl's options (the row "
          "policy_verl: k2 KL estimator, entropy bonus 0.01)");

namespace lossd {
namespace bench {
namespace {

constexpr const char* kDefaultShapes = "8192x4096x128256,8192x2304x256000";
bool ParseShape(absl::string_view s, int64_t* bt, int64_t* h, int64_t* v) {
  std::vector<std::string> parts = absl::StrSplit(s, 'x');
  return parts.size() == 3 && absl::SimpleAtoi(parts[0], bt) && absl::SimpleAtoi(parts[1], h) &&
         absl::SimpleAtoi(parts[2], v) && *bt > 0 && *h > 0 && *v > 0;
}

bool ParseKind(absl::string_view s, LossKind* k) {
  for (int i = 0; i < kLossKinds; ++i) {
    if (s == LossKindName(static_cast<LossKind>(i))) {
      *k = static_cast<LossKind>(i);
      return true;
    }
  }
  return false;
}

// n floats uploaded to a fresh device buffer.
int Upload(const std::vector<float>& host, float** dst) {
  BENCH_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(dst), host.size() * 4));
  BENCH_CHECK_CUDA(cudaMemcpy(*dst, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  return 0;
}

// Logprob's upstream gradients, as a trainer's mean over the tokens sends them
// (U(-1, 1) / BT), scaled as the backend scales them: the power of two above the largest
// taken out into the GEMMs' alpha (row_loss_io.cc).
int MakeLogprobInputs(ShapeBuffers* b) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> c1(b->bt), c2(b->bt);
  double largest = 0;
  for (int64_t i = 0; i < b->bt; ++i) {
    c1[i] = u(rng) / b->bt;
    c2[i] = u(rng) / b->bt;
    largest = std::fmax(largest, std::fmax(std::fabs(c1[i]), std::fabs(c2[i])));
  }
  const double alpha = PowerOfTwoAbove(largest);
  std::vector<float> f1(b->bt), f2(b->bt);
  for (int64_t i = 0; i < b->bt; ++i) {
    f1[i] = static_cast<float>(c1[i] / alpha);
    f2[i] = static_cast<float>(c2[i] / alpha);
  }
  b->logprob_alpha = static_cast<float>(alpha);
  return Upload(f1, &b->coef_logp) || Upload(f2, &b->coef_entropy);
}

// Policy's inputs: dapo's row weight 1 / BT (every row counts), advantages U(-1, 1), and old
// and reference log-probs near the current ones (`logp`, a forward pass's), so that the
// ratios sit around 1 and some clip, as in training.
int MakePolicyInputs(const std::vector<float>& logp, ShapeBuffers* b) {
  std::mt19937_64 rng(12);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::normal_distribution<float> near(0.0f, 0.15f);
  const double w = 1.0 / static_cast<double>(b->bt);
  const double alpha = PowerOfTwoAbove(w);
  std::vector<float> weight(b->bt, static_cast<float>(w / alpha)), adv(b->bt), old(b->bt),
      ref(b->bt), entropy(b->bt, static_cast<float>(-0.01 * w / alpha));
  for (int64_t i = 0; i < b->bt; ++i) {
    adv[i] = u(rng);
    old[i] = logp[i] + near(rng);
    ref[i] = logp[i] + near(rng);
  }
  b->policy_alpha = static_cast<float>(alpha);
  return Upload(weight, &b->row_weight) || Upload(adv, &b->advantages) ||
         Upload(old, &b->old_logp) || Upload(ref, &b->ref_logp) ||
         Upload(entropy, &b->policy_entropy);
}

// The mean of the per-row statistic in row_ce (see the top of the file); false if any row's
// is not finite.
int RowMean(const ShapeBuffers& b, double* mean, bool* finite) {
  std::vector<float> host(b.bt);
  const float* row_ce = static_cast<const float*>(b.rows) + b.bt;
  BENCH_CHECK_CUDA(cudaMemcpy(host.data(), row_ce, b.bt * 4, cudaMemcpyDeviceToHost));
  double sum = 0;
  *finite = true;
  for (float f : host) {
    *finite = *finite && std::isfinite(f);
    sum += f;
  }
  *mean = sum / static_cast<double>(b.bt);
  return 0;
}

}  // namespace

// The fused op's arguments for `kind` on the shape's buffers (dX bf16, a fresh fp32 dW).
cuda::DeviceLossArgs ArgsOf(LossKind kind, const ShapeBuffers& b, float temperature) {
  cuda::DeviceLossArgs a = BenchProblem(b.bt, b.h, b.v, b.x, b.w, b.tg, b.rows, b.dx, b.dw);
  if (kind == LossKind::kCrossEntropy) return a;
  a.kind = kind;
  a.options.temperature = temperature;
  cuda::RowLossInputs& in = a.row_loss;
  if (kind == LossKind::kLogprob) {
    in.coef_logp = b.coef_logp;
    in.coef_entropy = b.coef_entropy;
    in.alpha = b.logprob_alpha;
  } else if (kind == LossKind::kPolicy) {
    const PolicyParams defaults;
    in.row_weight = b.row_weight;
    in.advantages = b.advantages;
    in.old_logp = b.old_logp;
    in.ref_logp = b.ref_logp;
    in.policy = PolicyRowOptionsOf(defaults);
    in.alpha = b.policy_alpha;
  } else {
    a.targets = b.counted;
    in.teacher_h = b.th;
    in.teacher_x = b.tx;
    in.teacher_w = b.tw;
    in.jsd_beta = DistillParams{}.jsd_beta;
    // grad_scale / n with n = BT, its power of two in alpha (row_loss_io.cc's UploadTeacher).
    const double c = 1.0 / static_cast<double>(b.bt);
    const double alpha = PowerOfTwoAbove(c);
    in.alpha = static_cast<float>(alpha);
    in.distill_coef = static_cast<float>(c / alpha);
  }
  return a;
}

// The shape a trainer with weight handles sends: W (and the teacher's) resident, dX and dW
// wanted; what CudaBackend::Plan takes.
WorkspaceShape ShapeFor(LossKind kind, const ShapeBuffers& b) {
  WorkspaceShape s;
  s.bt = b.bt;
  s.h = b.h;
  s.v = b.v;
  s.w_memory = Memory::kBackend;
  s.want_dx = true;
  s.dw = GradOut::kWritten;
  s.kind = kind;
  if (kind == LossKind::kDistill) {
    s.teacher_h = b.th;
    s.teacher_w_memory = Memory::kBackend;
  }
  s.want_entropy = kind == LossKind::kLogprob;
  return s;
}

// The floor: the GEMMs of the kind's work, unchunked, on `e`'s algorithm cache.
absl::Status Floor(cuda::FusedLoss& e, cudaStream_t stream, const ShapeBuffers& b, bool teacher,
                   bool tune) {
  absl::Status s = ChunkedGemms(e, stream, b.fws, kFloorWsBytes, b.bt, b.h, b.v, b.bt, b.x, b.w,
                                b.fz, b.dx, b.dw, -1, 0, tune);
  if (!s.ok() || !teacher) return s;
  // The teacher's logits Zt = Xt Wt^T (bf16), as the fused op computes them per chunk.
  return tune ? e.TuneGemm(stream, b.fws, kFloorWsBytes, true, false, b.v, b.bt, b.th, 1.0f,
                           b.tw, b.th, b.tx, b.th, CUDA_R_16BF, 0.0f, b.ftz, b.v, CUDA_R_16BF)
              : e.Gemm(stream, b.fws, kFloorWsBytes, true, false, b.v, b.bt, b.th, 1.0f, b.tw,
                       b.th, b.tx, b.th, CUDA_R_16BF, 0.0f, b.ftz, b.v, CUDA_R_16BF);
}

// One kind at one shape: plan, workspace, the floor, tuned floor and fused op in the same
// rounds, the memory measured across them and the sanity statistic.
// With `args`, those arguments instead of the kind's own (ArgsOf).
int RunKind(cuda::CudaBackend& backend, cuda::FusedLoss& engine, cuda::FusedLoss& floor_engine,
            LossKind kind, const ShapeBuffers& b, KindRow* row, bool* finite,
            const cuda::DeviceLossArgs* args) {
  cudaStream_t stream = engine.stream();
  const bool teacher = kind == LossKind::kDistill;
  const cuda::DeviceLossArgs a =
      args != nullptr ? *args : ArgsOf(kind, b, absl::GetFlag(FLAGS_temperature));
  const cuda::ChunkPlan plan = backend.Plan(ShapeFor(kind, b));
  row->bt = b.bt, row->h = b.h, row->v = b.v;
  row->kind = LossKindName(kind);
  row->chunk_rows = plan.chunk_rows;
  row->schedule = static_cast<int>(plan.schedule);
  row->workspace = plan.workspace_bytes;
  row->flop = 2.0 * b.bt * b.v * (3.0 * b.h + (teacher ? b.th : 0));
  // Tune the floor's GEMMs on `engine` and run both floors once before any memory is measured
  // (a kernel's first launch loads its code).
  BENCH_CHECK_OK(Floor(engine, stream, b, teacher, /*tune=*/true));
  BENCH_CHECK_OK(Floor(floor_engine, stream, b, teacher, false));
  BENCH_CHECK_OK(Floor(engine, stream, b, teacher, false));
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  const int64_t free_before = FreeBytes();
  void* ws = nullptr;
  BENCH_CHECK_CUDA(cudaMalloc(&ws, plan.workspace_bytes));
  std::vector<std::function<absl::Status()>> bodies = {
      [&]() { return Floor(floor_engine, stream, b, teacher, false); },
      [&]() { return Floor(engine, stream, b, teacher, false); },
      [&]() { return engine.Enqueue(a, plan, ws); }};
  std::vector<double> ms;
  if (TimeRoundsMs(stream, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_runs), bodies,
                   &ms)) {
    return 1;
  }
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  row->measured_extra = free_before - FreeBytes();
  // A time that implies more than any GPU's tensor cores (5 PFLOP/s) means the events did not
  // enclose the work: a wrong table, not a fast one.
  for (double t : ms) {
    if (row->flop / (t * 1e-3) > 5e15) {
      std::fprintf(stderr, "%s: %.3f ms is faster than any GPU; timing broken\n",
                   row->kind.c_str(), t);
      return 1;
    }
  }
  row->floor_ms = ms[0], row->tuned_floor_ms = ms[1], row->ms = ms[2];
  if (RowMean(b, &row->row_mean, finite)) return 1;
  BENCH_CHECK_CUDA(cudaFree(ws));
  std::fprintf(stderr, "  %lldx%lldx%lld %s: C=%lld %.2f ms (floor %.2f, tuned %.2f)\n",
               static_cast<long long>(b.bt), static_cast<long long>(b.h),
               static_cast<long long>(b.v), row->kind.c_str(),
               static_cast<long long>(plan.chunk_rows), row->ms, row->floor_ms,
               row->tuned_floor_ms);
  return 0;
}

namespace {

// A forward-only logprob pass (no gradients) at the shape: the current log-probs, from which
// policy's old and reference log-probs are drawn.
int CurrentLogp(cuda::CudaBackend& backend, cuda::FusedLoss& engine, const ShapeBuffers& b,
                std::vector<float>* logp) {
  cuda::DeviceLossArgs a = ArgsOf(LossKind::kLogprob, b, absl::GetFlag(FLAGS_temperature));
  a.row_loss = cuda::RowLossInputs{};
  a.dx = nullptr;
  a.dw_acc = nullptr;
  WorkspaceShape s = ShapeFor(LossKind::kLogprob, b);
  s.want_dx = false;
  s.dw = GradOut::kNone;
  const cuda::ChunkPlan plan = backend.Plan(s);
  void* ws = nullptr;
  BENCH_CHECK_CUDA(cudaMalloc(&ws, plan.workspace_bytes));
  BENCH_CHECK_OK(engine.Enqueue(a, plan, ws));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(engine.stream()));
  BENCH_CHECK_CUDA(cudaFree(ws));
  logp->resize(b.bt);
  const float* row_ce = static_cast<const float*>(b.rows) + b.bt;
  BENCH_CHECK_CUDA(cudaMemcpy(logp->data(), row_ce, b.bt * 4, cudaMemcpyDeviceToHost));
  return 0;
}

// The two-phase logprob at one shape: its forward (the forward-only logprob: logits and one
// row pass, no gradient) alone, and forward then backward (the one-phase logprob with upstream
// gradients, which is what the server runs on a ticket's kept inputs) together, in the same
// rounds as the floor, the tuned floor and the one-phase logprob.
int RunTwoPhase(cuda::CudaBackend& backend, cuda::FusedLoss& engine,
                cuda::FusedLoss& floor_engine, const ShapeBuffers& b, TwoPhaseTimes* t) {
  cudaStream_t stream = engine.stream();
  const float temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  const cuda::DeviceLossArgs backward = ArgsOf(LossKind::kLogprob, b, temperature);
  cuda::DeviceLossArgs forward = backward;
  forward.row_loss = cuda::RowLossInputs{};
  forward.dx = nullptr;
  forward.dw_acc = nullptr;
  const cuda::ChunkPlan back_plan = backend.Plan(ShapeFor(LossKind::kLogprob, b));
  WorkspaceShape fs = ShapeFor(LossKind::kLogprob, b);
  fs.want_dx = false;
  fs.dw = GradOut::kNone;
  const cuda::ChunkPlan fwd_plan = backend.Plan(fs);
  void* ws = nullptr;
  BENCH_CHECK_CUDA(
      cudaMalloc(&ws, std::max(back_plan.workspace_bytes, fwd_plan.workspace_bytes)));
  BENCH_CHECK_OK(Floor(engine, stream, b, false, /*tune=*/true));
  std::vector<std::function<absl::Status()>> bodies = {
      [&]() { return Floor(floor_engine, stream, b, false, false); },
      [&]() { return Floor(engine, stream, b, false, false); },
      [&]() { return engine.Enqueue(backward, back_plan, ws); },
      [&]() { return engine.Enqueue(forward, fwd_plan, ws); },
      [&]() -> absl::Status {
        absl::Status s = engine.Enqueue(forward, fwd_plan, ws);
        return s.ok() ? engine.Enqueue(backward, back_plan, ws) : s;
      }};
  std::vector<double> ms;
  if (TimeRoundsMs(stream, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_runs), bodies,
                   &ms)) {
    return 1;
  }
  BENCH_CHECK_CUDA(cudaFree(ws));
  t->bt = b.bt, t->h = b.h, t->v = b.v;
  t->floor_ms = ms[0], t->tuned_floor_ms = ms[1], t->one_phase_ms = ms[2];
  t->forward_ms = ms[3], t->two_phase_ms = ms[4];
  // As RunKind: a time beyond any GPU means the events did not enclose the work.
  if (TwoPhaseFlop(b.bt, b.h, b.v) / (t->two_phase_ms * 1e-3) > 5e15) {
    std::fprintf(stderr, "two-phase: %.3f ms is faster than any GPU; timing broken\n",
                 t->two_phase_ms);
    return 1;
  }
  std::fprintf(stderr, "  %s\n", TwoPhaseLine(*t).c_str());
  return 0;
}

// The shape's buffers for the kinds asked for.
int AllocateShape(cuda::CudaBackend& backend, cuda::FusedLoss& engine,
                  const std::vector<LossKind>& kinds, ShapeBuffers* b) {
  cudaStream_t stream = engine.stream();
  if (AllocateProblem(b->bt, b->h, b->v, stream, &b->x, &b->w, &b->dx, &b->dw, &b->rows,
                      &b->tg)) {
    return 1;
  }
  BENCH_CHECK_CUDA(cudaMalloc(&b->fz, b->bt * b->v * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&b->fws, kFloorWsBytes));
  bool distill = false, logprob = false, policy = false;
  for (LossKind k : kinds) {
    distill = distill || k == LossKind::kDistill;
    logprob = logprob || k == LossKind::kLogprob;
    policy = policy || k == LossKind::kPolicy;
  }
  if (distill) {
    BENCH_CHECK_CUDA(cudaMalloc(&b->tx, b->bt * b->th * 2));
    BENCH_CHECK_CUDA(cudaMalloc(&b->tw, b->v * b->th * 2));
    BENCH_CHECK_CUDA(cudaMalloc(&b->ftz, b->bt * b->v * 2));
    BENCH_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&b->counted), b->bt * 4));
    BENCH_CHECK_CUDA(cudaMemsetAsync(b->counted, 0, b->bt * 4, stream));
    // The teacher's logits have the student's spread (standard deviation 2).
    BENCH_CHECK_CUDA(FillUniformBf16(b->tx, b->bt * b->th, 21, 1.0f, stream));
    BENCH_CHECK_CUDA(FillUniformBf16(b->tw, b->v * b->th, 22,
                                     6.0f / std::sqrt(static_cast<float>(b->th)), stream));
  }
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  if (logprob && MakeLogprobInputs(b)) return 1;
  if (policy) {
    std::vector<float> logp;
    if (CurrentLogp(backend, engine, *b, &logp) || MakePolicyInputs(logp, b)) return 1;
  }
  return 0;
}

int FreeShape(const ShapeBuffers& b) {
  for (void* p : {b.x, b.w, b.dx, b.dw, b.rows, b.tg, b.fz, b.fws, b.tx, b.tw, b.ftz,
                  static_cast<void*>(b.counted), static_cast<void*>(b.coef_logp),
                  static_cast<void*>(b.coef_entropy), static_cast<void*>(b.row_weight),
                  static_cast<void*>(b.advantages), static_cast<void*>(b.old_logp),
                  static_cast<void*>(b.ref_logp), static_cast<void*>(b.policy_entropy)}) {
    if (p != nullptr) BENCH_CHECK_CUDA(cudaFree(p));
  }
  return 0;
}

void PrintTable(const cudaDeviceProp& prop, const std::vector<KindRow>& rows,
                const std::vector<TwoPhaseTimes>& two_phase) {
  std::printf("\nLoss kinds on %s: bf16, median of %d after %d warm-up rounds, temperature %g "
              "(logprob: entropy and upstream gradients; policy: dapo, old and reference "
              "log-probs; distill: jsd_beta 0.5, teacher H %s)\n\n",
              prop.name, absl::GetFlag(FLAGS_runs), absl::GetFlag(FLAGS_warmup),
              absl::GetFlag(FLAGS_temperature),
              absl::GetFlag(FLAGS_teacher_h) > 0 ? "as given" : "= H");
  PrintKindRows(rows);
  for (const TwoPhaseTimes& t : two_phase) std::printf("%s\n", TwoPhaseLine(t).c_str());
}

int Main() {
  std::vector<LossKind> kinds;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_kinds), ',', absl::SkipEmpty())) {
    LossKind k;
    if (!ParseKind(s, &k)) {
      std::fprintf(stderr, "bad --kinds entry '%s' (cross_entropy, logprob, policy, distill)\n",
                   std::string(s).c_str());
      return 2;
    }
    kinds.push_back(k);
  }
  const double temperature = absl::GetFlag(FLAGS_temperature);
  if (kinds.empty() || !(temperature > 0) || !std::isfinite(temperature) ||
      absl::GetFlag(FLAGS_teacher_h) < 0 || absl::GetFlag(FLAGS_runs) < 1 ||
      absl::GetFlag(FLAGS_warmup) < 1) {
    std::fprintf(stderr, "bad flags: --kinds non-empty, --temperature finite > 0, "
                         "--teacher_h >= 0, --runs >= 1, --warmup >= 1 (the first autotunes)\n");
    return 2;
  }
  cuda::CudaBackendOptions backend_options;  // for its Plan
  if (absl::GetFlag(FLAGS_chunk_budget_mib) < 0) {
    std::fprintf(stderr, "bad flags: --chunk_budget_mib >= 0\n");
    return 2;
  }
  backend_options.chunk_budget_bytes =
      static_cast<uint64_t>(absl::GetFlag(FLAGS_chunk_budget_mib)) << 20;
  auto backend = cuda::CudaBackend::Create(backend_options);
  auto engine = cuda::FusedLoss::Create(0);
  // The floor with cuBLASLt's first choices: an engine whose algorithm cache is never tuned.
  auto floor_engine = cuda::FusedLoss::Create(0);
  if (!backend.ok() || !engine.ok() || !floor_engine.ok()) {
    const absl::Status s = !backend.ok() ? backend.status()
                           : !engine.ok() ? engine.status()
                                          : floor_engine.status();
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  (*engine)->set_autotune(true);  // the backend's default
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::vector<KindRow> rows;
  std::vector<TwoPhaseTimes> two_phase;
  bool all_finite = true;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',', absl::SkipEmpty())) {
    ShapeBuffers b;
    if (!ParseShape(s, &b.bt, &b.h, &b.v)) {
      std::fprintf(stderr, "bad shape '%s' (want BTxHxV, each > 0)\n", std::string(s).c_str());
      return 2;
    }
    b.th = absl::GetFlag(FLAGS_teacher_h) > 0 ? absl::GetFlag(FLAGS_teacher_h) : b.h;
    if (AllocateShape(**backend, **engine, kinds, &b)) return 1;
    for (LossKind k : kinds) {
      KindRow row;
      bool finite = true;
      if (RunKind(**backend, **engine, **floor_engine, k, b, &row, &finite)) return 1;
      if (!finite) {
        std::fprintf(stderr, "%s at %s: a non-finite per-row statistic\n", row.kind.c_str(),
                     std::string(s).c_str());
      }
      all_finite = all_finite && finite;
      rows.push_back(row);
      if (k == LossKind::kLogprob && absl::GetFlag(FLAGS_two_phase)) {
        TwoPhaseTimes t;
        if (RunTwoPhase(**backend, **engine, **floor_engine, b, &t)) return 1;
        two_phase.push_back(t);
      }
      if (k == LossKind::kPolicy && absl::GetFlag(FLAGS_policy_verl)) {
        KindRow verl_row;
        if (RunPolicyVerl(**backend, **engine, **floor_engine, b, &verl_row, &finite)) return 1;
        all_finite = all_finite && finite;
        rows.push_back(verl_row);
      }
      const int64_t seq = absl::GetFlag(FLAGS_policy_sequence);
      if (k == LossKind::kPolicy && seq > 0 && b.bt % seq == 0) {
        for (PolicyLossType type :
             {PolicyLossType::kDapo, PolicyLossType::kGeoMean, PolicyLossType::kKlCov,
              PolicyLossType::kVespo}) {
          KindRow seq_row;
          if (RunPolicySequence(**backend, **engine, **floor_engine, b, seq, type, &seq_row)) {
            return 1;
          }
          rows.push_back(seq_row);
        }
      }
    }
    if (FreeShape(b)) return 1;
  }
  PrintTable(prop, rows, two_phase);
  return all_finite ? 0 : 3;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) {
  // This binary's own default shapes (the flag is shared with bench_kernel).
  absl::SetFlag(&FLAGS_shapes, lossd::bench::kDefaultShapes);
  absl::ParseCommandLine(argc, argv);
  return lossd::bench::Main();
}
