// SPDX-License-Identifier: Apache-2.0
// Writes, as JSON on stdout, the float64 logprob, policy and distill references' outputs on
// small random problems over every option combination, with their inputs: what
// client/python/tests/test_rl_reference_torch.py checks against torch autograd (and against
// Liger-Kernel where it is importable). Test tool; never linked into the server.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/dtype.h"
#include "kernels/cpu/distill_reference.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {
namespace {

// A JSON object written field by field (numbers with 17 significant digits: exact doubles).
class Json {
 public:
  template <typename T>
  void Array(const char* key, const std::vector<T>& v) {
    Key(key);
    s_ += "[";
    for (size_t k = 0; k < v.size(); ++k) absl::StrAppend(&s_, k ? "," : "", Num(v[k]));
    s_ += "]";
  }
  void Number(const char* key, double v) { Key(key), s_ += Num(v); }
  void Str(const char* key, const char* v) { Key(key), absl::StrAppend(&s_, "\"", v, "\""); }
  void Null(const char* key) { Key(key), s_ += "null"; }
  std::string Close() { return s_ + "}"; }

 private:
  static std::string Num(double v) { return absl::StrFormat("%.17g", v); }
  static std::string Num(int64_t v) { return absl::StrCat(v); }
  static std::string Num(uint8_t v) { return absl::StrCat(static_cast<int>(v)); }
  void Key(const char* key) { absl::StrAppend(&s_, s_.size() > 1 ? "," : "", "\"", key, "\":"); }
  std::string s_ = "{";
};

std::vector<float> Uniform(std::mt19937* rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& e : v) e = u(*rng);
  return v;
}

std::vector<int64_t> Ids(std::mt19937* rng, int64_t n, int64_t v) {
  std::uniform_int_distribution<int64_t> u(0, v - 1);
  std::vector<int64_t> ids(n);
  for (int64_t& e : ids) e = u(*rng);
  return ids;
}

void Head(Json* j, const char* prefix, const HeadInputs& h, const std::vector<float>& x,
          const std::vector<float>& w, const std::vector<float>& b) {
  j->Number(absl::StrCat(prefix, "h").c_str(), static_cast<double>(h.h));
  j->Array(absl::StrCat(prefix, "x").c_str(), x);
  j->Array(absl::StrCat(prefix, "w").c_str(), w);
  if (h.bias != nullptr) {
    j->Array(absl::StrCat(prefix, "b").c_str(), b);
  } else {
    j->Null(absl::StrCat(prefix, "b").c_str());
  }
}

void Grad(Json* j, const HeadGradients& g) {
  j->Array("dx", g.dx);
  j->Array("dw", g.dw);
  j->Array("db", g.db);
}

std::vector<std::string> LogprobCases() {
  std::vector<std::string> cases;
  const int64_t bt = 5, h = 4, v = 7;
  uint32_t seed = 100;
  for (float t : {1.0f, 0.7f})
    for (float cap : {0.0f, 2.5f})
      for (bool bias : {false, true})
        for (bool ignore : {false, true}) {
          std::mt19937 rng(seed++);
          std::vector<float> x = Uniform(&rng, bt * h, -1, 1), w = Uniform(&rng, v * h, -1, 1),
                             b = Uniform(&rng, v, -1, 1), dl = Uniform(&rng, bt, -1, 1),
                             de = Uniform(&rng, bt, -1, 1);
          std::vector<int64_t> targets = Ids(&rng, bt, v);
          if (ignore) targets[2] = -100;
          LogprobProblem p;
          p.head = HeadInputs{bt, h, v, DType::kF32, x.data(), w.data(), bias ? b.data() : nullptr};
          p.targets = targets.data();
          p.dlogp = dl.data();
          p.dentropy = de.data();
          p.options.temperature = t;
          p.options.softcap = cap;
          LogprobReferenceOutputs r;
          if (!LogprobReference(p, &r).ok()) std::abort();
          Json j;
          j.Number("bt", bt), j.Number("v", v), j.Number("temperature", t);
          j.Number("softcap", cap), j.Number("ignore_index", -100);
          Head(&j, "", p.head, x, w, b);
          j.Array("targets", targets), j.Array("dlogp", dl), j.Array("dentropy", de);
          j.Array("logp", r.logp), j.Array("entropy", r.entropy);
          Grad(&j, r.grad);
          cases.push_back(j.Close());
        }
  return cases;
}

// The options of the loss types beyond Liger's first four (their defaults: none of them).
struct PolicyExtra {
  float sapo_temperature_pos = 1.0f, sapo_temperature_neg = 1.05f, delta = 0.0f;
  bool use_bias_correction_kl = false;
};

// One policy case; eps_low < 0 means the usual 0.2 / 0.28, else eps_low and eps_high as given.
std::string PolicyCase(PolicyLossType type, double normalizer, bool old, int kl, float t,
                       bool masked, bool head_options, uint32_t seed, float eps_low = -1,
                       float eps_high = -1, const PolicyExtra& extra = PolicyExtra()) {
  const int64_t batch = 2, seq = 4, bt = batch * seq, h = 3, v = 6;
  std::mt19937 rng(seed);
  std::vector<float> x = Uniform(&rng, bt * h, -1, 1), w = Uniform(&rng, v * h, -1, 1),
                     b = Uniform(&rng, v, -1, 1), seq_adv = Uniform(&rng, batch, -1.5, 1.5),
                     old_shift = Uniform(&rng, bt, -0.6f, 0.5f), ref_shift = Uniform(&rng, bt, -0.5, 0.5);
  std::vector<float> adv(bt);  // per sequence, as Liger takes them
  for (int64_t i = 0; i < bt; ++i) adv[i] = seq_adv[i / seq];
  std::vector<int64_t> targets = Ids(&rng, bt, v);
  std::vector<uint8_t> mask(bt, 1);
  if (masked) mask[2] = mask[5] = mask[6] = 0;
  PolicyProblem p;
  p.head = HeadInputs{bt, h, v, DType::kF32, x.data(), w.data(), head_options ? b.data() : nullptr};
  p.batch = batch;
  p.targets = targets.data();
  p.mask = mask.data();
  p.advantages = adv.data();
  PolicyOptions& o = p.options;
  o.loss_type = type;
  o.dapo_normalizer = normalizer;
  o.max_completion_length = 7;
  o.epsilon_low = eps_low < 0 ? 0.2f : eps_low;
  o.epsilon_high = eps_low < 0 ? 0.28f : eps_high;
  o.beta = kl == 0 ? 0.0f : 0.3f;
  o.temperature = t;
  o.softcap = head_options ? 2.5f : 0.0f;
  o.sapo_temperature_pos = extra.sapo_temperature_pos;
  o.sapo_temperature_neg = extra.sapo_temperature_neg;
  o.delta = extra.delta;
  o.use_bias_correction_kl = extra.use_bias_correction_kl;
  // Old and reference log-probs near the current ones (ratios in about [0.6, 1.8]).
  PolicyReferenceOutputs current;
  if (!PolicyReference(p, &current).ok()) std::abort();
  std::vector<float> old_logp(bt), ref_logp(bt);
  for (int64_t i = 0; i < bt; ++i) {
    old_logp[i] = static_cast<float>(current.logp[i]) + old_shift[i];
    ref_logp[i] = static_cast<float>(current.logp[i]) + ref_shift[i];
  }
  if (old) p.old_logp = old_logp.data();
  if (kl == 1) p.ref_logp = ref_logp.data();
  PolicyReferenceOutputs r;
  if (!PolicyReference(p, &r).ok()) std::abort();
  Json j;
  j.Str("loss_type", PolicyLossTypeName(type));
  j.Number("dapo_normalizer", normalizer), j.Number("batch", batch), j.Number("v", v);
  j.Number("max_completion_length", 7), j.Number("epsilon_low", o.epsilon_low);
  j.Number("epsilon_high", o.epsilon_high), j.Number("beta", o.beta);
  j.Number("temperature", t), j.Number("softcap", o.softcap);
  j.Number("sapo_temperature_pos", o.sapo_temperature_pos);
  j.Number("sapo_temperature_neg", o.sapo_temperature_neg);
  j.Number("delta", o.delta), j.Number("use_bias_correction_kl", o.use_bias_correction_kl);
  Head(&j, "", p.head, x, w, b);
  j.Array("targets", targets), j.Array("mask", mask), j.Array("advantages", adv);
  if (old) j.Array("old_logp", old_logp); else j.Null("old_logp");
  if (kl == 1) j.Array("ref_logp", ref_logp); else j.Null("ref_logp");
  j.Number("loss", r.loss), j.Number("kl", r.kl), j.Number("has_kl", r.has_kl);
  j.Number("clip_fraction", r.clip_fraction);
  Grad(&j, r.grad);
  return j.Close();
}

std::vector<std::string> PolicyCases() {
  std::vector<std::string> cases;
  const struct {
    PolicyLossType type;
    double normalizer;
  } types[] = {{PolicyLossType::kDapo, 0},
               {PolicyLossType::kDapo, 11.5},
               {PolicyLossType::kGrpo, 0},
               {PolicyLossType::kBnpo, 0},
               {PolicyLossType::kDrGrpo, 0}};
  uint32_t seed = 200;
  for (const auto& k : types)
    for (bool old : {false, true})
      for (int kl : {0, 1, 2})  // beta 0; beta with reference log-probs; beta without
        for (float t : {1.0f, 0.8f})
          for (bool masked : {false, true})
            for (bool head_options : {false, true})
              cases.push_back(
                  PolicyCase(k.type, k.normalizer, old, kl, t, masked, head_options, seed++));
  return cases;
}

// Ratios exactly on a clip bound: no old log-probs (r = 1) with eps_low 0, or both 0.
std::vector<std::string> PolicyTieCases() {
  std::vector<std::string> cases;
  uint32_t seed = 400;
  for (PolicyLossType type : {PolicyLossType::kDapo, PolicyLossType::kGrpo,
                              PolicyLossType::kBnpo, PolicyLossType::kDrGrpo})
    for (int kl : {0, 1})
      for (float eps_high : {0.0f, 0.28f})
        cases.push_back(PolicyCase(type, 0, /*old=*/false, kl, 1.0f, /*masked=*/true,
                                   /*head_options=*/false, seed++, 0.0f, eps_high));
  return cases;
}

// The loss types cispo, sapo, luspo and the options delta and use_bias_correction_kl: each
// with and without old log-probs, x KL term x bias correction x mask x bias and softcap.
// cispo's bound is eps_high itself: 1.3 puts it among the ratios (about [0.6, 1.8]).
std::vector<std::string> PolicyTypeCases() {
  std::vector<std::string> cases;
  const struct {
    PolicyLossType type;
    float eps_high, delta;
  } types[] = {{PolicyLossType::kCispo, 1.3f, 0.0f}, {PolicyLossType::kSapo, 0.28f, 0.0f},
               {PolicyLossType::kLuspo, 0.28f, 0.0f}, {PolicyLossType::kLuspo, 0.28f, 1.35f},
               {PolicyLossType::kDapo, 0.28f, 1.35f}, {PolicyLossType::kGrpo, 0.28f, 1.35f}};
  uint32_t seed = 500;
  for (const auto& k : types)
    for (bool old : {false, true})
      for (int kl : {0, 1, 2})
        for (bool correction : {false, true})
          for (bool masked : {false, true})
            for (bool head_options : {false, true}) {
              PolicyExtra extra;
              extra.sapo_temperature_pos = 1.7f;
              extra.sapo_temperature_neg = 0.6f;
              extra.delta = k.delta;
              extra.use_bias_correction_kl = correction;
              cases.push_back(PolicyCase(k.type, 0, old, kl, 0.9f, masked, head_options, seed++,
                                         0.2f, k.eps_high, extra));
            }
  return cases;
}

std::vector<std::string> DistillCases() {
  std::vector<std::string> cases;
  const int64_t bt = 5, h = 3, ht = 4, v = 7;
  uint32_t seed = 300;
  for (float beta : {0.0f, 0.25f, 0.5f, 1.0f})
    for (float t : {1.0f, 1.7f})
      for (bool labels : {false, true})
        for (int biases : {0, 1, 2}) {
          std::mt19937 rng(seed++);
          std::vector<float> x = Uniform(&rng, bt * h, -1, 1), w = Uniform(&rng, v * h, -1, 1),
                             b = Uniform(&rng, v, -1, 1), xt = Uniform(&rng, bt * ht, -1, 1),
                             wt = Uniform(&rng, v * ht, -2, 2), btb = Uniform(&rng, v, -1, 1);
          std::vector<int64_t> ids = Ids(&rng, bt, v);
          ids[1] = ids[3] = -100;
          DistillProblem p;
          p.student = HeadInputs{bt, h, v, DType::kF32, x.data(), w.data(),
                                 biases >= 1 ? b.data() : nullptr};
          p.teacher = HeadInputs{bt, ht, v, DType::kF32, xt.data(), wt.data(),
                                 biases == 2 ? btb.data() : nullptr};
          p.labels = labels ? ids.data() : nullptr;
          p.options.jsd_beta = beta;
          p.options.temperature = t;
          DistillReferenceOutputs r;
          if (!DistillReference(p, &r).ok()) std::abort();
          Json j;
          j.Number("bt", bt), j.Number("v", v), j.Number("jsd_beta", beta);
          j.Number("temperature", t), j.Number("ignore_index", -100);
          Head(&j, "", p.student, x, w, b);
          Head(&j, "t", p.teacher, xt, wt, btb);
          if (labels) j.Array("labels", ids); else j.Null("labels");
          j.Number("loss", r.loss);
          Grad(&j, r.grad);
          cases.push_back(j.Close());
        }
  return cases;
}

std::string List(const std::vector<std::string>& items) {
  std::string s = "[";
  for (size_t k = 0; k < items.size(); ++k) absl::StrAppend(&s, k ? ",\n" : "", items[k]);
  return s + "]";
}

}  // namespace
}  // namespace lossd

int main() {
  using lossd::List;
  const std::string out =
      absl::StrCat("{\"logprob\":", List(lossd::LogprobCases()),
                   ",\n\"policy\":", List(lossd::PolicyCases()),
                   ",\n\"policy_ties\":", List(lossd::PolicyTieCases()),
                   ",\n\"policy_types\":", List(lossd::PolicyTypeCases()),
                   ",\n\"distill\":", List(lossd::DistillCases()), "}\n");
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}
