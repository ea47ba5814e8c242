// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/cpu_kinds.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_chunk.h"
#include "kernels/cpu/cpu_convert.h"
#include "kernels/cpu/kind_rows.h"
#include "kernels/policy_rows.h"

namespace lossd {
namespace {

// One row's results.
struct KindRow {
  double logp = 0, entropy = 0, lse = 0;
  double loss = 0, kl = 0;  // policy: w_i l_i and kl_i; distill: the row's divergence
  int64_t argmax = 0;
  bool clipped = false;  // policy
};
constexpr uint64_t kKindRowBytes = sizeof(KindRow);

absl::Status Refuse(const LossProblem& p, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("cpu backend: ", what, " (loss kind ", LossKindName(p.kind), ")"));
}

// Outputs this backend does not write for a kind (rather than fill them with values that
// mean nothing for it). The engine never asks for them; a direct caller hears so.
absl::Status CheckKindOutputs(const LossProblem& p, const LossOutputs& out) {
  if (p.kind == LossKind::kPolicy && out.entropy != nullptr) {
    return Refuse(p, "the entropy output is logprob's only");
  }
  if (p.kind == LossKind::kDistill && (out.logp != nullptr || out.entropy != nullptr)) {
    return Refuse(p, "the logp and entropy outputs are not computed for distill");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckKindProblem(const LossProblem& p, const LossOutputs& out) {
  // Inputs and options were validated once (core/loss_problem_check.h); what stays here is
  // what this backend does or does not compute.
  const int32_t kind = static_cast<int32_t>(p.kind);
  if (kind < 0 || kind >= kLossKinds) {
    return absl::InvalidArgumentError(absl::StrCat("cpu backend: loss kind ", kind, " is unknown"));
  }
  if ((kCpuLossKinds & LossKindBit(p.kind)) == 0) {
    return Refuse(p, "this loss kind is not computed by the cpu backend");
  }
  return CheckKindOutputs(p, out);
}

uint64_t KindExtraBytes(const WorkspaceShape& s, int64_t chunk) {
  if (s.kind == LossKind::kCrossEntropy) return 0;
  // Per row: its results (KindRow below) and its target.
  uint64_t bytes = static_cast<uint64_t>(s.bt) * (kKindRowBytes + 9);
  if (s.kind == LossKind::kPolicy) {  // row weights, coefficients and statistics
    // (and at sequence level one log-ratio sum and count, and a coefficient, per sequence)
    bytes += static_cast<uint64_t>(s.bt) * (40 + sizeof(HeadRowStats));
  }
  // A top-k teacher's rows are read in place; each row keeps its state for its G.
  if (s.kind == LossKind::kDistill && s.teacher_topk > 0) {
    bytes += static_cast<uint64_t>(s.bt) * sizeof(TopkRowState);
  }
  if (s.kind == LossKind::kDistill && s.teacher_topk == 0) {
    const uint64_t c = chunk, v = s.v, th = s.teacher_h, f = sizeof(float);
    bytes += c * v * f;                                            // the teacher's logits chunk
    bytes += v * f;                                                // its bias in fp32
    if (s.dtype != DType::kF32) bytes += v * th * f + c * th * f;  // its W and X chunk in fp32
  }
  return bytes;
}

namespace {

// The power of two the GEMMs' alpha carries instead of the stored G (as for cross-entropy):
// the largest per-row scale of G, within 2^[-100, 100].
double AlphaOf(double max_scale) {
  return std::clamp(PowerOfTwoAbove(max_scale), std::ldexp(1.0, -100), std::ldexp(1.0, 100));
}

// The teacher's head for distill: W and bias in fp32, and per chunk its X in fp32 and logits.
struct Teacher {
  FloatBuffer w_copy, bias_f, x_copy, z;
  const float* wf = nullptr;
};

absl::Status SetUpTeacher(const LossProblem& p, const KindPassSetup& k, Teacher* t) {
  const int64_t th = p.teacher_h, v = p.v;
  auto oom = [](const char* what, uint64_t n) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend: out of host memory for ", what, " (", n * 4, " bytes)"));
  };
  t->wf = static_cast<const float*>(p.teacher_w);
  if (p.dtype != DType::kF32) {
    if (!t->w_copy.Allocate(v * th)) return oom("the teacher's W in fp32", v * th);
    ParallelWiden(k.pool, p.teacher_w, p.dtype, v * th, t->w_copy.data());
    t->wf = t->w_copy.data();
    if (!t->x_copy.Allocate(k.chunk * th)) return oom("the teacher's X chunk", k.chunk * th);
  }
  if (p.teacher_bias != nullptr) {
    if (!t->bias_f.Allocate(v)) return oom("the teacher's bias", v);
    WidenRange(p.teacher_bias, p.dtype, 0, v, t->bias_f.data());
  }
  if (!t->z.Allocate(k.chunk * v)) return oom("the teacher's logits chunk", k.chunk * v);
  return absl::OkStatus();
}

// The per-row outputs and the reductions, in row order.
void WriteKindOutputs(const LossProblem& p, const LossOutputs& out,
                      const std::vector<KindRow>& rows, const std::vector<uint8_t>& counted,
                      int64_t tokens) {
  const int64_t bt = p.bt;
  double total = 0, kl = 0;
  int64_t clipped = 0, correct = 0;
  for (int64_t i = 0; i < bt; ++i) {
    const KindRow& r = rows[i];
    if (out.lse != nullptr) out.lse[i] = static_cast<float>(r.lse);
    if (out.predictions != nullptr) out.predictions[i] = r.argmax;
    if (out.logp != nullptr) out.logp[i] = counted[i] ? static_cast<float>(r.logp) : 0.0f;
    if (out.entropy != nullptr) out.entropy[i] = counted[i] ? static_cast<float>(r.entropy) : 0.0f;
    if (!counted[i]) continue;
    if (p.targets != nullptr && LoadAsInt(p.targets, p.target_dtype, i) == r.argmax) ++correct;
    kl += r.kl;
    clipped += r.clipped ? 1 : 0;
    if (p.kind == LossKind::kLogprob) {
      const double dlogp = p.dlogp != nullptr ? p.dlogp[i] : 0.0;
      const double dentropy = p.dentropy != nullptr ? p.dentropy[i] : 0.0;
      total += dlogp * r.logp + dentropy * r.entropy;
    } else {
      total += r.loss;
    }
  }
  const double n = std::max(1.0, static_cast<double>(tokens));
  double loss = total;
  if (p.kind == LossKind::kLogprob) loss = static_cast<double>(p.options.grad_scale) * total;
  if (p.kind == LossKind::kDistill) loss = tokens != 0 ? total / static_cast<double>(tokens) : 0.0;
  if (out.loss != nullptr) out.loss[0] = static_cast<float>(loss);
  if (out.z_loss != nullptr) out.z_loss[0] = 0.0f;
  const bool policy = p.kind == LossKind::kPolicy;
  if (out.kl != nullptr) out.kl[0] = policy && p.policy.beta != 0.0f ? kl / n : 0.0f;
  if (out.clip_fraction != nullptr) out.clip_fraction[0] = policy ? clipped / n : 0.0f;
  if (out.accuracy != nullptr) out.accuracy[0] = tokens != 0 ? correct / n : 0.0f;
  if (out.tokens != nullptr) out.tokens[0] = tokens;
}

// One Compute of a kind: which rows count, the GEMMs' alpha, and the row functions the chunks
// call (from the pool's threads: each writes only its own row's results).
class KindPass {
 public:
  KindPass(const LossProblem& p, const LossOutputs& out, const KindPassSetup& k)
      : p_(p), out_(out), k_(k), v_(p.v) {}

  absl::Status Run() {
    SelectRows();
    const LossOptions& o = p_.options;
    kp_ = KindRowParams{v_, p_.dtype, p_.bias != nullptr ? k_.ws.bias_f.data() : nullptr, o.softcap,
                        o.temperature};
    if (p_.kind == LossKind::kPolicy) weight_ = PolicyWeights(p_, counted_, tokens_);
    const double gs = o.grad_scale;
    const double alpha = AlphaOf(std::abs(gs) * MaxRowScale() / o.temperature);
    g_scale_ = gs / alpha;
    want_entropy_ = out_.entropy != nullptr ||
                    (p_.kind == LossKind::kLogprob && p_.dentropy != nullptr) ||
                    (p_.kind == LossKind::kPolicy && p_.policy.entropy_coeff != 0.0f);
    sequence_ = p_.kind == LossKind::kPolicy && PolicyBySequence(p_.policy);
    rows_.assign(p_.bt, KindRow());
    if (p_.kind == LossKind::kPolicy) {
      stats_.assign(p_.bt, HeadRowStats());
      coef_.assign(p_.bt, 0.0);
    }
    // The cross-entropy fields of the pass are unused with a row function.
    const RowPassParams unused_rp;
    std::vector<RowResult> unused_rows;
    CpuChunkPass pass{p_,  out_,  k_.pool,     k_.ws,     unused_rp,  tg_,          0.0,
                      0.0, alpha, unused_rows, k_.x_copy, k_.want_dx, k_.dx_scratch};
    if (p_.kind == LossKind::kDistill && p_.teacher_topk > 0) {
      topk_state_.assign(p_.bt, TopkRowState());
      pass.row = [this](int64_t i, float* z) { DistillTopkRowAt(i, z); };
    } else if (p_.kind == LossKind::kDistill) {
      LOSSD_RETURN_IF_ERROR(SetUpTeacher(p_, k_, &teacher_));
      teacher_kp_ = kp_;
      teacher_kp_.bias = p_.teacher_bias != nullptr ? teacher_.bias_f.data() : nullptr;
      pass.before_rows = [this](int64_t c0, int64_t rows_c) { TeacherLogits(c0, rows_c); };
      pass.row = [this](int64_t i, float* z) { DistillRowAt(i, z); };
    } else {
      pass.row = [this](int64_t i, float* z) { HeadRow(i, z); };
    }
    if (sequence_) {
      LOSSD_RETURN_IF_ERROR(SequenceLevel(pass));
    } else {
      for (int64_t c0 = 0; c0 < p_.bt; c0 += k_.chunk) {
        const int64_t rows_c = std::min(k_.chunk, p_.bt - c0);
        const float* xc = nullptr;
        LOSSD_RETURN_IF_ERROR(ChunkForward(pass, c0, rows_c, &xc));
        if (k_.want_grad && p_.kind == LossKind::kPolicy) PolicyGradients(c0, rows_c, &pass);
        if (k_.want_grad && !topk_state_.empty()) TopkGradients(c0, rows_c, &pass);
        if (k_.want_grad) ChunkBackward(pass, c0, rows_c, xc);
      }
    }
    WriteKindOutputs(p_, out_, rows_, counted_, tokens_);
    return absl::OkStatus();
  }

  // How many passes over the logits a sequence-level Compute makes: 1 where every chunk
  // holds whole sequences (or no gradient is wanted), else 2.
  int64_t SequencePasses() const {
    const int64_t s = PolicyGroupRows(p_.policy, p_.bt);
    return (!k_.want_grad || k_.chunk % s == 0 || k_.chunk >= p_.bt) ? 1 : 2;
  }

 private:
  // counted_: the rows that count (target != ignore_index; distill without targets: all);
  // tg_: their targets (-1: none), what the head rows read.
  void SelectRows() {
    tg_.assign(p_.bt, -1);
    counted_.assign(p_.bt, 1);
    for (int64_t i = 0; i < p_.bt; ++i) {
      if (p_.targets != nullptr) {
        const int64_t t = LoadAsInt(p_.targets, p_.target_dtype, i);
        counted_[i] = t != p_.options.ignore_index;
        if (counted_[i] && p_.kind != LossKind::kDistill) tg_[i] = t;
      }
      tokens_ += counted_[i];
    }
  }

  // The largest coefficient of a row's gradient before grad_scale and 1/T: |dlogp| +
  // |dentropy|; distill's 1 / tokens times the larger of its terms' weights, the hard one's
  // times T (it has no 1/T); policy's are each chunk's own: PolicyGradients.
  double MaxRowScale() const {
    if (p_.kind == LossKind::kDistill) {
      const DistillParams& d = p_.distill;
      const double w = std::max<double>(d.weight_soft_loss,
                                        double{d.weight_hard_loss} * p_.options.temperature);
      return tokens_ != 0 ? w / tokens_ : 0.0;
    }
    double m = 0;
    for (int64_t i = 0; i < p_.bt; ++i) {
      if (!counted_[i]) continue;
      m = std::max(m, std::abs(p_.dlogp != nullptr ? double{p_.dlogp[i]} : 0.0) +
                          std::abs(p_.dentropy != nullptr ? double{p_.dentropy[i]} : 0.0));
    }
    return m;
  }

  // logprob and policy: the row's statistics, then G from its coefficients.
  void HeadRow(int64_t i, float* z) {
    const int64_t t = tg_[i];
    const HeadRowStats s = HeadRowForward(kp_, z, t, want_entropy_ && t >= 0);
    KindRow& r = rows_[i];
    r.lse = s.lse;
    r.argmax = s.argmax;
    if (t < 0) {
      if (k_.want_grad) std::fill(z, z + v_, 0.0f);
      return;
    }
    r.logp = s.logp;
    r.entropy = s.entropy;
    double dlogp = p_.dlogp != nullptr ? p_.dlogp[i] : 0.0;
    const double dentropy = p_.dentropy != nullptr ? p_.dentropy[i] : 0.0;
    if (p_.kind == LossKind::kPolicy) {
      // G waits for the chunk's alpha (PolicyGradients); at sequence level the terms wait for
      // the sequence's every logp too (SequenceTerms).
      stats_[i] = s;
      if (sequence_) return;
      const double r_i = p_.old_logp != nullptr ? std::exp(s.logp - p_.old_logp[i]) : 1.0;
      const PolicyRowTerms t = PolicyTerms(p_, i, s.logp, s.entropy, r_i, false);
      TakeTerms(t, i);
      coef_[i] = weight_[i] * t.dlogp;
      return;
    }
    if (k_.want_grad) WriteLogprobGradient(kp_, z, t, s, g_scale_ * dlogp, g_scale_ * dentropy);
  }

  // policy, after a chunk's rows: its coefficients depend on r_i, unbounded before the rows
  // are seen (an fp16 G of e^12 A would overflow), so the GEMMs' alpha is the chunk's own,
  // from its largest coefficient; then each counted row's G over its logits.
  void PolicyGradients(int64_t c0, int64_t rows_c, CpuChunkPass* pass) {
    // The entropy bonus's coefficient of row i is -entropy_coeff w_i (dl/dH_i times w_i).
    const double ec = -static_cast<double>(p_.policy.entropy_coeff);
    double m = 0;
    for (int64_t i = c0; i < c0 + rows_c; ++i) {
      m = std::max(m, std::abs(coef_[i]) + std::abs(ec * weight_[i]));
    }
    const double gs = p_.options.grad_scale;
    pass->g_alpha = AlphaOf(std::abs(gs) * m / p_.options.temperature);
    const double g_scale = gs / pass->g_alpha;
    float* z = k_.ws.z_buf.data();
    constexpr int64_t kRows = 8;  // rows per task
    k_.pool.Run(CeilDiv(rows_c, kRows), [&](int64_t task) {
      for (int64_t r = task * kRows; r < std::min(rows_c, (task + 1) * kRows); ++r) {
        const int64_t i = c0 + r;
        if (tg_[i] < 0) continue;  // zeroed by HeadRow
        WriteLogprobGradient(kp_, z + r * v_, tg_[i], stats_[i], g_scale * coef_[i],
                             g_scale * ec * weight_[i]);
      }
    });
  }

  // policy at sequence level (GSPO): a sequence's ratio needs every logp of it before any of
  // its rows' G. Where each chunk holds whole sequences (chunk rows a multiple of S), the
  // chunk's rows are followed by its sequences' terms, then its G and GEMMs: one pass, as at
  // token level. Otherwise a forward pass over every chunk (logits GEMM and rows: logp), the
  // terms of every sequence, then the token level's pass again (logits recomputed, G, dX,
  // dW): 8 BT H V flops against 6.
  absl::Status SequenceLevel(CpuChunkPass& pass) {
    const float* xc = nullptr;
    if (SequencePasses() == 1) {
      const bool whole =
          k_.chunk % PolicyGroupRows(p_.policy, p_.bt) == 0 || k_.chunk >= p_.bt;
      for (int64_t c0 = 0; c0 < p_.bt; c0 += k_.chunk) {
        const int64_t rows_c = std::min(k_.chunk, p_.bt - c0);
        LOSSD_RETURN_IF_ERROR(ChunkForward(pass, c0, rows_c, &xc));
        if (!whole) continue;  // no gradient: the terms once every row is seen
        SequenceTerms(c0, rows_c);
        if (k_.want_grad) {
          PolicyGradients(c0, rows_c, &pass);
          ChunkBackward(pass, c0, rows_c, xc);
        }
      }
      if (!whole) SequenceTerms(0, p_.bt);
      return absl::OkStatus();
    }
    for (int64_t c0 = 0; c0 < p_.bt; c0 += k_.chunk) {
      LOSSD_RETURN_IF_ERROR(ChunkForward(pass, c0, std::min(k_.chunk, p_.bt - c0), &xc));
    }
    SequenceTerms(0, p_.bt);
    for (int64_t c0 = 0; c0 < p_.bt; c0 += k_.chunk) {
      const int64_t rows_c = std::min(k_.chunk, p_.bt - c0);
      LOSSD_RETURN_IF_ERROR(ChunkForward(pass, c0, rows_c, &xc));  // same logp, same stats
      PolicyGradients(c0, rows_c, &pass);
      ChunkBackward(pass, c0, rows_c, xc);
    }
    return absl::OkStatus();
  }

  // The sequences of rows [r0, r0 + rows) (whole ones): each row's terms, loss share and
  // coefficient from its sequence's every logp (policy_rows.h's PolicySequenceRows).
  void SequenceTerms(int64_t r0, int64_t rows) {
    const int64_t s = PolicyGroupRows(p_.policy, p_.bt);
    seq_logp_.resize(p_.bt);
    seq_entropy_.resize(p_.bt);
    for (int64_t i = r0; i < r0 + rows; ++i) {
      seq_logp_[i] = rows_[i].logp;
      seq_entropy_[i] = rows_[i].entropy;
    }
    std::vector<PolicySequenceRow> seq(s);
    for (int64_t b0 = r0; b0 < r0 + rows; b0 += s) {
      PolicySequenceRows(p_, counted_.data(), weight_.data(), seq_logp_.data(),
                         seq_entropy_.data(), b0, seq.data());
      for (int64_t k = 0; k < s; ++k) {
        const int64_t i = b0 + k;
        if (tg_[i] < 0) continue;
        KindRow& r = rows_[i];
        r.loss = seq[k].loss;
        r.kl = seq[k].terms.kl;
        r.clipped = seq[k].terms.clipped;
        coef_[i] = seq[k].coef;
      }
    }
  }

  // policy: row i's results from its terms, its loss weighted.
  void TakeTerms(const PolicyRowTerms& t, int64_t i) {
    KindRow& r = rows_[i];
    r.loss = weight_[i] * t.loss;
    r.kl = t.kl;
    r.clipped = t.clipped;
  }

  // distill, before a chunk's rows: the teacher's logits of rows [c0, c0 + rows_c).
  void TeacherLogits(int64_t c0, int64_t rows_c) {
    const int64_t th = p_.teacher_h;
    const float* xt = static_cast<const float*>(p_.teacher_x) + c0 * th;
    if (p_.dtype != DType::kF32) {
      WidenRows(k_.pool, p_.teacher_x, p_.dtype, c0, rows_c, th, teacher_.x_copy.data());
      xt = teacher_.x_copy.data();
    }
    ChunkLogitsGemm(k_.pool, xt, rows_c, th, teacher_.wf, v_, teacher_.z.data());
    chunk_start_ = c0;
  }

  // distill's terms of row i: the divergence's, and the hard label's where it counts.
  DistillRowTerms DistillTermsOf(int64_t i) const {
    const DistillParams& o = p_.distill;
    DistillRowTerms terms{o.jsd_beta, o.weight_soft_loss, 0.0, -1};
    if (counted_[i] && o.weight_hard_loss != 0.0f) {  // its labels are in [0, V) (validated)
      terms.w_hard = o.weight_hard_loss;
      terms.label = LoadAsInt(p_.targets, p_.target_dtype, i);
    }
    return terms;
  }

  // Row i of a top-k teacher: its k ids and log-probs, read in place.
  TopkTeacherRow TopkRowOf(int64_t i) const {
    const int64_t n = p_.teacher_topk;
    const size_t id_bytes = DTypeSize(p_.teacher_topk_id_dtype);
    return TopkTeacherRow{static_cast<const char*>(p_.teacher_topk_ids) + i * n * id_bytes,
                          p_.teacher_topk_id_dtype, p_.teacher_topk_logp + i * n, n,
                          p_.distill.topk_tail};
  }

  // distill from the teacher's top-k: a counted row's state (validated: an ignored row's ids
  // and log-probs are never read, so it takes only its statistics and a zero gradient); its
  // G waits for the chunk's alpha (TopkGradients).
  void DistillTopkRowAt(int64_t i, float* z) {
    KindRow& r = rows_[i];
    if (!counted_[i]) {
      const HeadRowStats s = HeadRowForward(kp_, z, -1, false);
      r.lse = s.lse;
      r.argmax = s.argmax;
      if (k_.want_grad) std::fill(z, z + v_, 0.0f);
      return;
    }
    const DistillRowTerms terms = DistillTermsOf(i);
    const TopkRowState& st = topk_state_[i] = DistillTopkForward(kp_, z, TopkRowOf(i), terms);
    r.lse = st.stats.lse;
    r.argmax = st.stats.argmax;
    r.loss = terms.w_soft * st.divergence + terms.w_hard * st.hard;
  }

  // distill from the top-k, after a chunk's rows: a row's G can lie far below the a-priori
  // 1 / tokens (a flat student spreads it over V), where an fp16 G would lose its digits; so
  // the GEMMs' alpha is the chunk's own, from its rows' bounds, then each counted row's G.
  void TopkGradients(int64_t c0, int64_t rows_c, CpuChunkPass* pass) {
    double m = 0;
    for (int64_t i = c0; i < c0 + rows_c; ++i) {
      if (counted_[i]) m = std::max(m, topk_state_[i].g_bound);
    }
    const double gs = p_.options.grad_scale;
    const double n = std::max<double>(1.0, static_cast<double>(tokens_));
    pass->g_alpha = AlphaOf(std::abs(gs) * m / n);
    const double k = gs / pass->g_alpha / n;
    float* z = k_.ws.z_buf.data();
    constexpr int64_t kRows = 8;  // rows per task
    k_.pool.Run(CeilDiv(rows_c, kRows), [&](int64_t task) {
      for (int64_t r = task * kRows; r < std::min(rows_c, (task + 1) * kRows); ++r) {
        const int64_t i = c0 + r;
        if (!counted_[i]) continue;  // zeroed by DistillTopkRowAt
        WriteTopkGradient(kp_, z + r * v_, TopkRowOf(i), DistillTermsOf(i), topk_state_[i], k);
      }
    });
  }

  void DistillRowAt(int64_t i, float* z) {
    float* zt = teacher_.z.data() + (i - chunk_start_) * v_;
    const double k = tokens_ != 0 ? g_scale_ / static_cast<double>(tokens_) : 0.0;
    const bool grad = k_.want_grad && counted_[i];
    const DistillRowTerms terms = DistillTermsOf(i);
    const DistillRowResult d = DistillRow(kp_, teacher_kp_, z, zt, terms, k, grad);
    KindRow& r = rows_[i];
    r.lse = d.lse;
    r.argmax = d.argmax;
    r.loss = counted_[i] ? terms.w_soft * d.divergence + terms.w_hard * d.hard : 0.0;
    if (k_.want_grad && !counted_[i]) std::fill(z, z + v_, 0.0f);
  }

  const LossProblem& p_;
  const LossOutputs& out_;
  const KindPassSetup& k_;
  const int64_t v_;
  std::vector<int64_t> tg_;
  std::vector<uint8_t> counted_;
  int64_t tokens_ = 0;
  KindRowParams kp_, teacher_kp_;
  std::vector<double> weight_;       // policy's row weights
  std::vector<HeadRowStats> stats_;  // policy: each row's statistics, for its G
  std::vector<double> coef_;         // policy: each row's w_i dl_i/dlogp_i
  std::vector<double> seq_logp_, seq_entropy_;  // policy by sequence: the rows' logp and H
  std::vector<TopkRowState> topk_state_;  // distill from a top-k teacher: each row's, for its G
  double g_scale_ = 0;               // grad_scale over the GEMMs' alpha
  bool want_entropy_ = false;
  bool sequence_ = false;  // policy with sequence-level importance sampling
  std::vector<KindRow> rows_;
  Teacher teacher_;
  int64_t chunk_start_ = 0;  // the first row of the chunk whose teacher logits are in teacher_.z
};

}  // namespace

absl::Status ComputeKind(const LossProblem& p, const LossOutputs& out, const KindPassSetup& k) {
  return KindPass(p, out, k).Run();
}

}  // namespace lossd
