// SPDX-License-Identifier: Apache-2.0
#include "client/lossctl_heads.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/lossctl_inputs.h"
#include "client/npy.h"
#include "core/status_macros.h"

// The head commands' own flags (--head, --head_version, --rank and --micro_batch are in
// lossctl.cc: compute --head reads them too).
ABSL_FLAG(uint32_t, world_size, 1,
          "head step: the ranks of the step's barrier; head info: of a group's head, also "
          "show each rank's member");
ABSL_FLAG(std::string, optimizer, "adamw", "head create: adamw|sgd (torch.optim's)");
ABSL_FLAG(std::optional<double>, lr, std::nullopt,
          "head create: the learning rate (default 1e-3); head step: this step's (default the "
          "head's)");
ABSL_FLAG(std::optional<double>, weight_decay, std::nullopt,
          "head create: W's weight decay (default torch's: adamw 0.01, sgd 0)");
ABSL_FLAG(double, bias_weight_decay, 0, "head create: the bias's weight decay");
ABSL_FLAG(double, momentum, 0, "head create: sgd momentum");
ABSL_FLAG(double, dampening, 0, "head create: sgd dampening");
ABSL_FLAG(bool, nesterov, false, "head create: sgd nesterov");
ABSL_FLAG(double, beta1, 0.9, "head create: adamw beta1");
ABSL_FLAG(double, beta2, 0.999, "head create: adamw beta2");
ABSL_FLAG(double, eps, 1e-8, "head create: adamw eps");
ABSL_FLAG(bool, amsgrad, false, "head create: adamw amsgrad");
ABSL_FLAG(std::string, compute_dtype, "bf16", "head create: the compute copy's dtype (X's)");
ABSL_FLAG(std::string, state_dir, "",
          "head create: a folder of the optimizer's state as .npy (exp_avg_w.npy, ... as head "
          "export names them), fp32");
ABSL_FLAG(int64_t, optimizer_step, 0,
          "head create: updates applied so far (torch's AdamW `step`; sgd: > 0 once the "
          "momentum buffer holds a value)");
ABSL_FLAG(std::string, phase, "full", "head step: full|reduce|apply");
ABSL_FLAG(std::optional<double>, clip_coef, std::nullopt,
          "head step: multiply the gradient by this (the trainer's clipping)");
ABSL_FLAG(std::optional<double>, max_norm, std::nullopt,
          "head step: clip by the head's own gradient norm");
ABSL_FLAG(bool, skip, false, "head step: drop the step's gradients, W unchanged");
ABSL_FLAG(int64_t, range_bytes, 256 << 20, "head export: bytes per range stream");
ABSL_FLAG(std::string, in_dir, "", "head import: a folder head export wrote");
ABSL_FLAG(std::vector<std::string>, group_members, {},
          "head create|import: a head group's members, endpoint,endpoint,... (the same list "
          "sent to every member, each with its --group_member; empty: one server)");
ABSL_FLAG(uint32_t, group_member, 0, "head create|import: this server's index in --group_members");
ABSL_FLAG(std::string, group_id, "",
          "head create|import: the head group's id (a new one for every group)");

namespace lossd {
namespace client {
namespace {

constexpr char kHeadFile[] = "head.txt";

std::string PathIn(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).string();
}

absl::StatusOr<std::string> HeadFlag(const char* sub) {
  const std::string head = absl::GetFlag(FLAGS_head);
  if (head.empty()) return absl::InvalidArgumentError(absl::StrCat("head ", sub, " needs --head"));
  return head;
}

absl::StatusOr<OptimizerOptions> OptimizerFromFlags() {
  OptimizerOptions o;
  const std::string kind = absl::GetFlag(FLAGS_optimizer);
  if (kind == "sgd") {
    o.kind = Optimizer::kSgd;
  } else if (kind != "adamw") {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer must be adamw or sgd, got '", kind, "'"));
  }
  if (absl::GetFlag(FLAGS_lr).has_value()) o.lr = *absl::GetFlag(FLAGS_lr);
  o.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  o.bias_weight_decay = absl::GetFlag(FLAGS_bias_weight_decay);
  o.momentum = absl::GetFlag(FLAGS_momentum);
  o.dampening = absl::GetFlag(FLAGS_dampening);
  o.nesterov = absl::GetFlag(FLAGS_nesterov);
  o.beta1 = absl::GetFlag(FLAGS_beta1);
  o.beta2 = absl::GetFlag(FLAGS_beta2);
  o.eps = absl::GetFlag(FLAGS_eps);
  o.amsgrad = absl::GetFlag(FLAGS_amsgrad);
  return o;
}

// --group_members, --group_member, --group_id: empty for one server.
absl::StatusOr<HeadGroup> GroupFromFlags() {
  HeadGroup g;
  g.members = absl::GetFlag(FLAGS_group_members);
  g.member = absl::GetFlag(FLAGS_group_member);
  g.id = absl::GetFlag(FLAGS_group_id);
  if (g.members.empty()) {
    if (g.member != 0 || !g.id.empty()) {
      return absl::InvalidArgumentError(
          "--group_member and --group_id name a head group: give its --group_members too");
    }
    return g;
  }
  if (g.member >= g.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--group_member must be < ", g.size(),
                                                   " (the --group_members given), got ",
                                                   g.member));
  }
  if (g.id.empty() && g.size() > 1) {
    return absl::InvalidArgumentError(
        "--group_members needs --group_id (a new id for every group)");
  }
  return g;
}

void PrintInfo(const HeadInfo& i, CommandOutput& out) {
  auto field = [&](const char* key, JsonValue v, const std::string& text) {
    out.Field(key, std::move(v), absl::StrFormat("%-15s %s", key, text));
  };
  field("name", i.name, i.name);
  field("shape", absl::StrCat(i.v, "x", i.h),
        absl::StrCat("(", i.v, ", ", i.h, ")", i.has_bias ? " with bias" : ""));
  out.Field("has_bias", i.has_bias, "");
  field("compute_dtype", std::string(DTypeName(i.compute_dtype)),
        std::string(DTypeName(i.compute_dtype)));
  const OptimizerOptions& o = i.optimizer;
  field("optimizer", std::string(OptimizerName(o.kind)),
        o.kind == Optimizer::kAdamW
            ? absl::StrFormat("adamw lr %g betas (%g, %g) eps %g weight_decay %g%s "
                              "bias_weight_decay %g",
                              o.lr, o.beta1, o.beta2, o.eps, o.WeightDecay(),
                              o.amsgrad ? " amsgrad" : "", o.bias_weight_decay)
            : absl::StrFormat("sgd lr %g momentum %g dampening %g%s weight_decay %g "
                              "bias_weight_decay %g",
                              o.lr, o.momentum, o.dampening, o.nesterov ? " nesterov" : "",
                              o.WeightDecay(), o.bias_weight_decay));
  out.Field("lr", o.lr, "");
  field("version", uint64_t{i.version}, absl::StrCat(i.version));
  field("optimizer_step", int64_t{i.optimizer_step}, absl::StrCat(i.optimizer_step));
  field("bytes", uint64_t{i.bytes}, absl::StrFormat("%d (%s)", i.bytes, BinarySize(i.bytes)));
  field("contributions", uint64_t{i.contributions},
        absl::StrFormat("%d (%d tokens)", i.contributions, i.tokens));
  out.Field("tokens", int64_t{i.tokens}, "");
  field("ranks_waiting", uint64_t{i.ranks_waiting}, absl::StrCat(i.ranks_waiting));
  field("instance", i.instance, i.instance);
  if (i.group.size() > 1) {
    const size_t S = i.group.size();
    field("group", i.group.members,
          absl::StrFormat("member %d of %d, id %s; rank r's Computes and Steps go to member "
                          "r %% %d:",
                          i.group.member, S, i.group.id, S));
    // With --world_size, each member's line names its ranks too (the rule above, worked out
    // for that job, so an operator sees which trainers a member's loss would stop).
    const uint32_t world = absl::GetFlag(FLAGS_world_size);
    for (size_t m = 0; !out.json() && m < S; ++m) {
      std::vector<uint32_t> ranks;
      for (uint32_t r = 0; world > 1 && r < world; ++r) {
        if (HeadGroupMemberOf(r, S) == m) ranks.push_back(r);
      }
      absl::PrintF("%-15s %d %s%s%s\n", "", m, i.group.members[m],
                   m == i.group.member ? " (this server)" : "",
                   world <= 1 ? ""
                   : ranks.empty()
                       ? ", no rank"
                       : absl::StrCat(ranks.size() == 1 ? ", rank " : ", ranks ",
                                      absl::StrJoin(ranks, ", ")));
    }
    out.Field("group_member", uint64_t{i.group.member}, "");
    out.Field("group_id", i.group.id, "");
    if (world > 1) {
      std::vector<std::string> rank_members;  // rank r's member's endpoint, by rank
      for (uint32_t r = 0; r < world; ++r) {
        rank_members.push_back(i.group.members[HeadGroupMemberOf(r, S)]);
      }
      out.Field("rank_members", std::move(rank_members), "");
    }
  }
}

// What create and import print: whether the head is new, then its info.
void PrintCreated(const CreateHeadResult& res, CommandOutput& out) {
  out.Field("created", res.created,
            res.created ? "created         yes"
                        : "created         no: the same head at the same version was there");
  PrintInfo(res.head, out);
}

absl::Status RunCreate(CommandOutput& out) {
  CreateHeadRequest r;
  LOSSD_ASSIGN_OR_RETURN(r.name, HeadFlag("create"));
  // A head's master is fp32: random weights are fp32 unless --dtype says otherwise.
  if (absl::GetFlag(FLAGS_w).empty() && absl::GetFlag(FLAGS_dtype).empty()) {
    absl::SetFlag(&FLAGS_dtype, "fp32");
  }
  std::optional<HostTensor> w;
  LOSSD_RETURN_IF_ERROR(LoadWeights(&w, &r.bias));
  r.w = std::move(*w);
  LOSSD_ASSIGN_OR_RETURN(r.compute_dtype,
                         ParseFloatDType("--compute_dtype", absl::GetFlag(FLAGS_compute_dtype)));
  LOSSD_ASSIGN_OR_RETURN(r.optimizer, OptimizerFromFlags());
  LOSSD_ASSIGN_OR_RETURN(r.group, GroupFromFlags());
  r.version = absl::GetFlag(FLAGS_head_version);
  r.optimizer_step = absl::GetFlag(FLAGS_optimizer_step);
  const std::string state_dir = absl::GetFlag(FLAGS_state_dir);
  if (!state_dir.empty()) {
    // The optimizer's state as torch keeps it, one .npy per tensor, named as an export's.
    for (HeadTensor t : StateTensors(r.optimizer, r.bias.has_value())) {
      LOSSD_ASSIGN_OR_RETURN(HostTensor s,
                             ReadNpy(PathIn(state_dir, absl::StrCat(HeadTensorName(t), ".npy"))));
      r.state.emplace(t, std::move(s));
    }
  }
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_ASSIGN_OR_RETURN(CreateHeadResult res, client->CreateHead(r));
  PrintCreated(res, out);
  return absl::OkStatus();
}

absl::Status RunStep(CommandOutput& out) {
  StepRequest r;
  LOSSD_ASSIGN_OR_RETURN(r.head, HeadFlag("step"));
  r.version = absl::GetFlag(FLAGS_head_version);
  r.rank = absl::GetFlag(FLAGS_rank);
  r.world_size = absl::GetFlag(FLAGS_world_size);
  const std::string phase = absl::GetFlag(FLAGS_phase);
  if (phase == "reduce") {
    r.phase = StepPhase::kReduce;
  } else if (phase == "apply") {
    r.phase = StepPhase::kApply;
  } else if (phase != "full") {
    return absl::InvalidArgumentError(
        absl::StrCat("--phase must be full, reduce or apply, got '", phase, "'"));
  }
  r.lr = absl::GetFlag(FLAGS_lr);
  if (absl::GetFlag(FLAGS_clip_coef).has_value()) {
    r.clip_coef = static_cast<float>(*absl::GetFlag(FLAGS_clip_coef));
  }
  r.max_norm = absl::GetFlag(FLAGS_max_norm);
  r.skip = absl::GetFlag(FLAGS_skip);
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_ASSIGN_OR_RETURN(StepResult s, client->Step(r));
  out.Field("version", uint64_t{s.version}, absl::StrFormat("version         %d", s.version));
  out.Field("applied", s.applied, absl::StrFormat("applied         %s", s.applied ? "yes" : "no"));
  out.Field("grad_norm", s.grad_norm,
            absl::StrFormat("grad_norm       %.9g%s", s.grad_norm,
                            s.finite ? "" : " (not finite)"));
  out.Field("finite", s.finite, "");
  out.Field("clip_coef", double{s.clip_coef}, absl::StrFormat("clip_coef       %.9g", s.clip_coef));
  out.Field("contributions", uint64_t{s.contributions},
            absl::StrFormat("contributions   %d (%d tokens)", s.contributions, s.tokens));
  out.Field("tokens", int64_t{s.tokens}, "");
  out.Field("step_seconds", s.step_seconds,
            absl::StrFormat("step_s          %.6f", s.step_seconds));
  return absl::OkStatus();
}

// Writes each tensor of an export to <dir>/<name>.npy as its bytes arrive (they come in
// order within each tensor): the client holds no more than a part at a time.
class NpyFolderSink {
 public:
  explicit NpyFolderSink(std::string dir) : dir_(std::move(dir)) {}

  absl::Status Open(const HeadExport& e) {
    LOSSD_RETURN_IF_ERROR(MakeDir(dir_));
    for (const ExportedTensor& t : e.layout) {
      const std::string path = PathIn(dir_, absl::StrCat(HeadTensorName(t.id), ".npy"));
      auto f = std::make_unique<std::ofstream>(path, std::ios::binary | std::ios::trunc);
      const std::string header = EncodeNpyHeader(t.dtype, t.shape);
      f->write(header.data(), header.size());
      if (!*f) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
      files_[t.id] = {path, std::move(f)};
    }
    return absl::OkStatus();
  }

  absl::Status Write(HeadTensor t, const uint8_t* data, size_t size) {
    auto& [path, f] = files_.at(t);
    f->write(reinterpret_cast<const char*>(data), size);
    if (!*f) return absl::DataLossError(absl::StrCat("cannot write ", path));
    return absl::OkStatus();
  }

  absl::Status Close() {
    for (auto& [t, file] : files_) {
      file.second->close();
      if (!*file.second) return absl::DataLossError(absl::StrCat("cannot write ", file.first));
    }
    return absl::OkStatus();
  }

 private:
  std::string dir_;
  std::map<HeadTensor, std::pair<std::string, std::unique_ptr<std::ofstream>>> files_;
};

absl::Status RunExportCommand(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(std::string head, HeadFlag("export"));
  const std::string dir = absl::GetFlag(FLAGS_out_dir);
  if (dir.empty()) return absl::InvalidArgumentError("head export needs --out_dir");
  ExportHeadOptions o;
  o.range_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_range_bytes));  // > 0: main checks
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  NpyFolderSink files(dir);
  const absl::Time t0 = absl::Now();
  LOSSD_ASSIGN_OR_RETURN(
      HeadExport e,
      client->ExportHeadTo(
          head, [&](const HeadExport& layout) { return files.Open(layout); },
          [&](HeadTensor t, uint64_t, const uint8_t* data, size_t size) {
            return files.Write(t, data, size);
          },
          o));
  LOSSD_RETURN_IF_ERROR(files.Close());
  // Last: a folder without head.txt is an export that did not finish.
  std::ofstream txt(PathIn(dir, kHeadFile), std::ios::trunc);
  txt << HeadSpecText(e.spec, e.instance);
  txt.close();
  if (!txt) return absl::DataLossError(absl::StrCat("cannot write ", PathIn(dir, kHeadFile)));
  const double s = absl::ToDoubleSeconds(absl::Now() - t0);
  out.Field("version", uint64_t{e.spec.version},
            absl::StrFormat("version         %d", e.spec.version));
  for (const ExportedTensor& t : e.layout) {
    out.Row("tensors", {{"name", std::string(HeadTensorName(t.id))},
                        {"tensor", ShapeString(t.dtype, t.shape)}},
            absl::StrFormat("wrote           %s %s", PathIn(dir, absl::StrCat(HeadTensorName(t.id),
                                                                              ".npy")),
                            ShapeString(t.dtype, t.shape)));
  }
  out.Field("bytes", uint64_t{e.bytes},
            absl::StrFormat("bytes           %s in %.3f s over %d range(s)",
                            BinarySize(e.bytes), s, e.ranges));
  out.Field("ranges", int64_t{e.ranges}, "");
  return absl::OkStatus();
}

absl::Status RunImport(CommandOutput& out) {
  const std::string dir = absl::GetFlag(FLAGS_in_dir);
  if (dir.empty()) return absl::InvalidArgumentError("head import needs --in_dir");
  std::ifstream txt(PathIn(dir, kHeadFile));
  if (!txt) {
    return absl::NotFoundError(absl::StrCat("cannot read ", PathIn(dir, kHeadFile),
                                            " (written last by head export: is it complete?)"));
  }
  std::stringstream text;
  text << txt.rdbuf();
  HeadExport e;
  LOSSD_ASSIGN_OR_RETURN(e.spec, ParseHeadSpecText(text.str()));
  if (!absl::GetFlag(FLAGS_head).empty()) e.spec.name = absl::GetFlag(FLAGS_head);
  std::vector<HeadTensor> needed = {HeadTensor::kMasterW};
  if (e.spec.has_bias) needed.push_back(HeadTensor::kMasterBias);
  if (e.spec.with_state) {
    for (HeadTensor t : StateTensors(e.spec.optimizer, e.spec.has_bias)) needed.push_back(t);
  }
  for (HeadTensor t : needed) {
    LOSSD_ASSIGN_OR_RETURN(HostTensor tensor,
                           ReadNpy(PathIn(dir, absl::StrCat(HeadTensorName(t), ".npy"))));
    e.tensors.emplace(t, std::move(tensor));
  }
  LOSSD_ASSIGN_OR_RETURN(HeadGroup group, GroupFromFlags());
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_ASSIGN_OR_RETURN(CreateHeadResult res, client->ImportHead(e, group));
  PrintCreated(res, out);
  return absl::OkStatus();
}

absl::Status RunInfo(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(std::string head, HeadFlag("info"));
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_ASSIGN_OR_RETURN(HeadInfo info, client->GetHeadInfo(head));
  PrintInfo(info, out);
  return absl::OkStatus();
}

absl::Status RunList(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_ASSIGN_OR_RETURN(auto entries, client->List());
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  out.Table("heads");
  if (!out.json()) {
    absl::PrintF("%-40s %10s %14s %10s %13s %s\n", "head", "version", "bytes", "idle_s",
                 "contributions", "group");
  }
  for (const StateEntry& e : entries) {
    if (e.kind != StateEntry::Kind::kHead) continue;
    const double idle_s = (now_ms - e.last_used_unix_ms) / 1e3;
    JsonFields row = {{"name", e.name}, {"version", uint64_t{e.version}},
                      {"bytes", uint64_t{e.bytes}}, {"idle_seconds", idle_s},
                      {"contributions", uint64_t{e.micro_batches}}};
    std::string text = absl::StrFormat("%-40s %10d %14d %10.1f %13d", e.name, e.version,
                                       e.bytes, idle_s, e.micro_batches);
    // The listing names no group: a head's own info does (one call per head; a head dropped
    // in between is listed without one).
    absl::StatusOr<HeadInfo> info = client->GetHeadInfo(e.name);
    if (!info.ok() && info.status().code() != absl::StatusCode::kNotFound) {
      return info.status();
    }
    if (info.ok() && info->group.size() > 1) {
      const HeadGroup& g = info->group;
      row.push_back({"group", g.members});
      row.push_back({"group_member", uint64_t{g.member}});
      row.push_back({"group_id", g.id});
      absl::StrAppendFormat(&text, " member %d of %d, id %s", g.member, g.size(), g.id);
    } else {
      absl::StrAppend(&text, " -");
    }
    out.Row("heads", std::move(row), text);
  }
  return absl::OkStatus();
}

absl::Status RunDrop(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(std::string head, HeadFlag("drop"));
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_RETURN_IF_ERROR(client->DropHead(head));
  out.Field("dropped", head, absl::StrFormat("dropped         %s", head));
  return absl::OkStatus();
}

}  // namespace

absl::Status RunHead(const std::string& sub, CommandOutput& out) {
  const std::map<std::string, absl::Status (*)(CommandOutput&)> subs = {
      {"create", &RunCreate}, {"step", &RunStep}, {"export", &RunExportCommand},
      {"import", &RunImport}, {"info", &RunInfo}, {"list", &RunList},
      {"drop", &RunDrop}};
  auto it = subs.find(sub);
  if (it == subs.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown head command '", sub, "': create, step, export, import, info, list or drop"));
  }
  return it->second(out);
}

absl::Status HeadShapeFlagsForCompute(LossClient& client) {
  LOSSD_RETURN_IF_ERROR(CheckHeadComputeFlags());
  const bool need_h = absl::GetFlag(FLAGS_x).empty() && absl::GetFlag(FLAGS_h) <= 0;
  const bool need_v = absl::GetFlag(FLAGS_targets).empty() && absl::GetFlag(FLAGS_v) <= 0;
  const bool need_dtype = absl::GetFlag(FLAGS_x).empty() && absl::GetFlag(FLAGS_dtype).empty();
  if (!need_h && !need_v && !need_dtype) return absl::OkStatus();
  LOSSD_ASSIGN_OR_RETURN(HeadInfo info, client.GetHeadInfo(absl::GetFlag(FLAGS_head)));
  if (need_h) absl::SetFlag(&FLAGS_h, info.h);
  if (need_v) absl::SetFlag(&FLAGS_v, info.v);
  if (need_dtype) absl::SetFlag(&FLAGS_dtype, std::string(DTypeName(info.compute_dtype)));
  return absl::OkStatus();
}

std::string HeadSpecText(const HeadSpec& s, const std::string& instance) {
  const OptimizerOptions& o = s.optimizer;
  return absl::StrFormat(
      "name %s\nv %d\nh %d\nhas_bias %d\nmaster_dtype %s\ncompute_dtype %s\noptimizer %s\n"
      "lr %.17g\nweight_decay %.17g\nbias_weight_decay %.17g\nmomentum %.17g\n"
      "dampening %.17g\nnesterov %d\nbeta1 %.17g\nbeta2 %.17g\neps %.17g\namsgrad %d\n"
      "version %d\noptimizer_step %d\nwith_state %d\ninstance %s\n",
      s.name, s.v, s.h, s.has_bias, DTypeName(s.master_dtype), DTypeName(s.compute_dtype),
      OptimizerName(o.kind), o.lr, o.WeightDecay(), o.bias_weight_decay, o.momentum, o.dampening,
      o.nesterov, o.beta1, o.beta2, o.eps, o.amsgrad, s.version, s.optimizer_step, s.with_state,
      instance);
}

absl::StatusOr<HeadSpec> ParseHeadSpecText(const std::string& text) {
  std::map<std::string, std::string> kv;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(line, absl::MaxSplits(' ', 1));
    kv[p.first] = p.second;
  }
  absl::Status bad;
  auto get = [&](const char* key) -> std::string {
    auto it = kv.find(key);
    if (it == kv.end() && bad.ok()) {
      bad = absl::InvalidArgumentError(absl::StrCat(kHeadFile, " has no '", key, "'"));
    }
    return it == kv.end() ? "" : it->second;
  };
  auto number = [&](const char* key, auto* out) {
    const std::string v = get(key);
    if (bad.ok() && !absl::SimpleAtoi(v, out)) {
      bad = absl::InvalidArgumentError(absl::StrCat(kHeadFile, ": '", key, "' is '", v, "'"));
    }
  };
  auto real = [&](const char* key) {
    double d = 0;
    const std::string v = get(key);
    if (bad.ok() && !absl::SimpleAtod(v, &d)) {
      bad = absl::InvalidArgumentError(absl::StrCat(kHeadFile, ": '", key, "' is '", v, "'"));
    }
    return d;
  };
  auto flag = [&](const char* key) {
    int64_t b = 0;
    number(key, &b);
    return b != 0;
  };
  HeadSpec s;
  s.name = get("name");
  number("v", &s.v);
  number("h", &s.h);
  s.has_bias = flag("has_bias");
  OptimizerOptions& o = s.optimizer;
  o.kind = get("optimizer") == "sgd" ? Optimizer::kSgd : Optimizer::kAdamW;
  o.lr = real("lr");
  o.weight_decay = real("weight_decay");
  o.bias_weight_decay = real("bias_weight_decay");
  o.momentum = real("momentum");
  o.dampening = real("dampening");
  o.nesterov = flag("nesterov");
  o.beta1 = real("beta1");
  o.beta2 = real("beta2");
  o.eps = real("eps");
  o.amsgrad = flag("amsgrad");
  number("version", &s.version);
  number("optimizer_step", &s.optimizer_step);
  s.with_state = flag("with_state");
  const std::string master = get("master_dtype"), compute = get("compute_dtype");
  LOSSD_RETURN_IF_ERROR(bad);
  LOSSD_ASSIGN_OR_RETURN(s.master_dtype, ParseFloatDType("master_dtype", master));
  LOSSD_ASSIGN_OR_RETURN(s.compute_dtype, ParseFloatDType("compute_dtype", compute));
  return s;
}

}  // namespace client
}  // namespace lossd
