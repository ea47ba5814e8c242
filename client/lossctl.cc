// SPDX-License-Identifier: Apache-2.0
// lossctl: the command-line client of lossd. Inspects a server, runs one Compute from .npy
// files or random data and saves what comes back, benchmarks many Computes, and manages
// weight handles and gradient accumulators. Never changes what the server computes.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/host_tensor.h"
#include "client/lossd_client.h"
#include "client/lossctl_heads.h"
#include "client/lossctl_inputs.h"
#include "client/lossctl_kinds.h"
#include "client/lossctl_output.h"
#include "client/lossctl_replicas.h"
#include "client/npy.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"

// Connection.
ABSL_FLAG(std::string, target, "localhost:50051", "server address host:port");
ABSL_FLAG(double, deadline_seconds, 600, "deadline of each call, seconds (0 = none)");
ABSL_FLAG(int64_t, part_bytes, 4 << 20, "largest data bytes of one sent part");
ABSL_FLAG(int64_t, response_part_bytes, 0,
          "largest part the server should send (0 = its default; else at least 1024)");
ABSL_FLAG(int32_t, connections, 1, "TCP connections (channels); calls round-robin over them");
ABSL_FLAG(int32_t, stripes, 0,
          "connections one put-weights / fetch-gradients is split over (at most --connections; "
          "0 = min(connections, 4) for tensors of 64 MiB and more, else 1; 1 = never)");
ABSL_FLAG(bool, wait_for_ready, false, "wait for the server instead of failing fast");
ABSL_FLAG(bool, overlap, true,
          "compute: overlap transfer with compute (the server computes rows as X arrives and "
          "sends dX back meanwhile)");
ABSL_FLAG(std::string, metadata, "", "call metadata, key=value[,key=value...]");
ABSL_FLAG(bool, tls, false, "connect with TLS");
ABSL_FLAG(std::string, tls_ca, "", "TLS: PEM file of the CAs to trust (empty = defaults)");
ABSL_FLAG(std::string, tls_cert, "", "mutual TLS: PEM file of this client's certificate");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: PEM file of its private key");
ABSL_FLAG(std::string, tls_server_name, "", "TLS: name to check the server certificate for");
ABSL_FLAG(std::string, auth_token, "", "bearer token sent as 'authorization: Bearer <token>'");
ABSL_FLAG(std::string, auth_token_file, "", "file whose first line is the bearer token");

// Inputs: .npy files, or random data of a shape.
ABSL_FLAG(std::string, x, "", ".npy of X (BT, H)");
ABSL_FLAG(std::string, w, "", ".npy of W (V, H)");
ABSL_FLAG(std::string, bias, "", ".npy of the bias (V)");
ABSL_FLAG(std::string, targets, "", ".npy of the targets (BT), int32 or int64");
ABSL_FLAG(std::string, class_weights, "", ".npy of class weights (V), converted to fp32");
ABSL_FLAG(std::string, grad_output, "", ".npy of the upstream per-token gradient (BT), fp32");
ABSL_FLAG(int64_t, bt, 0, "random data: rows (tokens)");
ABSL_FLAG(int64_t, h, 0, "random data: hidden size");
ABSL_FLAG(int64_t, v, 0, "random data: vocabulary size");
ABSL_FLAG(std::string, dtype, "",
          "bf16|fp16|fp32: dtype of X, W, bias (random data default bf16; .npy files are "
          "converted to it when set)");
ABSL_FLAG(std::string, target_dtype, "int64", "random data: int32|int64");
ABSL_FLAG(bool, with_bias, false, "random data: add a random bias");
ABSL_FLAG(double, ignore_fraction, 0.0, "random data: fraction of targets set to ignore_index");
ABSL_FLAG(uint64_t, seed, 1, "random data: seed");

// Options; their defaults are the server's (core/loss_problem.h).
ABSL_FLAG(int64_t, ignore_index, lossd::kDefaultIgnoreIndex, "target value to ignore");
ABSL_FLAG(std::string, reduction, "mean", "mean|sum|none");
ABSL_FLAG(double, label_smoothing, lossd::kDefaultLabelSmoothing, "label smoothing in [0, 1]");
ABSL_FLAG(double, lse_square_scale, lossd::kDefaultZLossScale, "z-loss scale");
ABSL_FLAG(double, softcap, lossd::kDefaultSoftcap, "final logit softcap (0 = off)");
ABSL_FLAG(double, grad_scale, lossd::kDefaultGradScale, "upstream gradient of the scalar loss");
ABSL_FLAG(std::string, grad_dtype, "", "gradient dtype: empty = input dtype, or fp32");
ABSL_FLAG(int64_t, chunk_rows, lossd::kDefaultChunkRows, "rows per chunk (0 = server chooses)");
ABSL_FLAG(bool, token_scaling, false,
          "scale each token's loss and gradient by its target's probability (Liger's "
          "use_token_scaling; needs a server listing the token_scaling feature)");
ABSL_FLAG(std::string, weight_handle, "", "use weights uploaded with put-weights");
ABSL_FLAG(std::string, accumulator, "", "add dW/db into this server-side accumulator");
ABSL_FLAG(std::string, want, "dx,dw",
          "outputs: any of dx,dw,db,lse,z_loss,accuracy,predictions (or none)");
ABSL_FLAG(std::string, out_dir, "", "write returned tensors here as <name>.npy");

// bench.
ABSL_FLAG(int64_t, calls, 20, "bench: timed calls");
ABSL_FLAG(int32_t, concurrency, 1, "bench: calls in flight at once");
ABSL_FLAG(int64_t, warmup, 2, "bench: untimed calls first");
ABSL_FLAG(bool, put_weights, false, "bench: upload W once and use the handle");

// Handles and accumulators.
ABSL_FLAG(std::string, handle, "", "drop-weights: the handle");
ABSL_FLAG(bool, reset, false, "fetch-gradients: zero the accumulator after reading");
ABSL_FLAG(std::string, replicas, "",
          "replicas: the pool's targets, host:port,host:port or dns:///name:port");
ABSL_FLAG(std::string, keys, "",
          "replicas: keys to place, e.g. head:lm,acc:run/rank0,weights:w,rank:3");
ABSL_FLAG(bool, json, false,
          "print one JSON object on stdout when the command ends (bench: progress as JSON "
          "lines before it) instead of text; errors also go into it as \"error\"");
ABSL_FLAG(std::string, service, "",
          "health: the service to check (empty = the whole server; lossd.v1.Loss)");

// Hosted heads (lossctl head ...; compute --head).
ABSL_FLAG(std::string, head, "", "head commands: the head's name; compute: on this hosted head");
ABSL_FLAG(uint64_t, head_version, 0,
          "compute, head step: the head's version computed against; head create: its version "
          "(steps done) to start at");
ABSL_FLAG(uint32_t, rank, 0, "compute --head, head step: this trainer's data-parallel rank");
ABSL_FLAG(uint64_t, micro_batch, 0, "compute --head: the micro-batch (with --rank: the retry key)");

namespace lossd {
namespace client {
namespace {

constexpr char kUsage[] = R"(lossctl <command> [flags]

Commands:
  info              print the server's backend, device, memory and limits
  compute           one Compute: inputs from --x --w --targets [--bias --class_weights
                    --grad_output] (.npy) or random (--bt --h --v [--dtype]); prints the loss,
                    writes outputs (--want) to --out_dir as <name>.npy; --kind=logprob|
                    policy|distill computes that loss (docs/rl_clients.md has its flags);
                    --kind=logprob --keep_ms keeps the forward and prints its ticket, and
                    --ticket --dlogp/--dentropy runs that ticket's backward
  bench             --calls Computes at --concurrency on random data; a progress line each
                    second, then latency p50/p90/p99, calls/s, tokens/s, GiB/s;
                    --put_weights uploads W once; --accumulator adds every call there, then
                    fetches it with reset (a striped reset drops it): name one of its own
  put-weights       upload W [and bias] (--w/--bias or random --v --h); prints the handle
  drop-weights      --handle
  fetch-gradients   --accumulator [--reset] [--out_dir]: the accumulated fp32 dW (and db)
  drop-accumulator  --accumulator
  list              the caller's own weight handles, accumulators, hosted heads and
                    tickets: kind, name, bytes, seconds since last use, micro-batches
  health            [--service]: the gRPC health check; exit 0 only when SERVING
  replicas          --replicas [--keys]: the replica pool's view: every replica the targets
                    resolve to and its instance; each key's replica and failover order
  head create       --head: a hosted head from --w [--bias] (.npy) or random (--v --h
                    [--with_bias]), --compute_dtype, --optimizer=adamw|sgd and its flags
                    (--lr ...), [--state_dir --optimizer_step --head_version]
                    [--group_members --group_member --group_id: one member of a head group]
  head step         --head --head_version [--rank --world_size --phase --lr --clip_coef |
                    --max_norm --skip]: one rank's step; returns when every rank has called
  head export       --head --out_dir [--range_bytes]: <tensor>.npy each, then head.txt
  head import       --in_dir [--head: another name] [--group_members ...: into a group]:
                    create the head again as exported
  head info|drop    --head [--world_size: a group's head shows each rank's member]
  head list         the caller's heads: version, bytes, idle seconds, contributions, group
  compute --head    --head_version [--rank --micro_batch]: a Compute on a hosted head (V, H
                    and the dtype from its info when not given)

Global flags: --target --deadline_seconds --part_bytes --connections --stripes --metadata
              --tls --tls_ca --tls_cert --tls_key --tls_server_name --auth_token[_file].
bf16 .npy files hold the raw bits as '<u2'; float64 ones are read as fp32.
Below, every flag; --helpfull adds the libraries' own.)";

absl::Status RunInfo(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_ASSIGN_OR_RETURN(auto info, client->ServerInfo());
  auto field = [&](const char* key, JsonValue v, std::string text) {
    out.Field(key, std::move(v), absl::StrFormat("%-19s %s", key, text));
  };
  field("target", client->options().target, client->options().target);
  field("version", info.version, info.version);
  field("instance", info.instance, info.instance);
  field("backend", info.backend, info.backend);
  field("device", info.device, info.device);
  // An older server sends none: "(not reported)" in text, "" in JSON.
  field("compute_path", info.compute_path,
        info.compute_path.empty() ? "(not reported)" : info.compute_path);
  field("memory_total", info.memory_total_bytes,
        absl::StrFormat("%d bytes (%s)", info.memory_total_bytes,
                        BinarySize(info.memory_total_bytes)));
  field("memory_budget", info.memory_budget_bytes,
        absl::StrFormat("%d bytes (%s)", info.memory_budget_bytes,
                        BinarySize(info.memory_budget_bytes)));
  field("memory_in_use", info.memory_in_use_bytes,
        absl::StrFormat("%d bytes", info.memory_in_use_bytes));
  out.Field("weight_cache_bytes", info.weight_cache_bytes,
            absl::StrFormat("weight_cache        %d of %d bytes", info.weight_cache_bytes,
                            info.weight_cache_budget_bytes));
  out.Field("weight_cache_budget_bytes", info.weight_cache_budget_bytes, "");
  field("max_part_bytes", uint64_t{info.max_part_bytes}, absl::StrCat(info.max_part_bytes));
  out.Field("max_bt", info.max_bt,
            absl::StrFormat("max_bt max_h max_v  %d %d %d", info.max_bt, info.max_h, info.max_v));
  out.Field("max_h", info.max_h, "");
  out.Field("max_v", info.max_v, "");
  field("max_in_flight", uint64_t{info.max_in_flight}, absl::StrCat(info.max_in_flight));
  field("accumulators", uint64_t{info.accumulators}, absl::StrCat(info.accumulators));
  field("features", info.features, absl::StrJoin(info.features, " "));
  return absl::OkStatus();
}

void PrintResult(const ComputeResult& res, CommandOutput& out) {
  out.Field("loss", double{res.loss}, absl::StrFormat("loss        %.9g", res.loss));
  out.Field("z_loss", double{res.z_loss}, absl::StrFormat("z_loss      %.9g", res.z_loss));
  out.Field("accuracy", double{res.accuracy}, absl::StrFormat("accuracy    %.6g", res.accuracy));
  out.Field("tokens", int64_t{res.tokens}, absl::StrFormat("tokens      %d", res.tokens));
  out.Field("backend", res.backend, absl::StrFormat("backend     %s", res.backend));
  out.Field("compute_seconds", res.compute_seconds,
            absl::StrFormat("compute_s   %.6f", res.compute_seconds));
  out.Field("wall_seconds", res.wall_seconds, absl::StrFormat("wall_s      %.6f", res.wall_seconds));
  out.Field("bytes_sent", uint64_t{res.bytes_sent},
            absl::StrFormat("sent        %s, received %s", BinarySize(res.bytes_sent),
                            BinarySize(res.bytes_received)));
  out.Field("bytes_received", uint64_t{res.bytes_received}, "");
  if (!absl::GetFlag(FLAGS_head).empty()) {
    out.Field("head_version", uint64_t{res.head_version},
              absl::StrFormat("head        version %d, %s", res.head_version,
                              res.head_added ? "added to its step"
                                             : "not added: its (rank, micro_batch) was there"));
    out.Field("head_added", res.head_added, "");
  }
  if (res.accumulated_micro_batches > 0) {
    out.Field("micro_batches", uint64_t{res.accumulated_micro_batches},
              absl::StrFormat("micro_batches %d", res.accumulated_micro_batches));
  }
  if (!res.nonfinite.empty()) {
    std::vector<std::string> names;
    for (OutputTensor t : res.nonfinite) names.push_back(OutputTensorName(t));
    out.Field("nonfinite", names,
              absl::StrCat("nonfinite   ", absl::StrJoin(names, " "),
                           " (NaN or Inf; an accumulator's sum now refuses use until reset)"));
  }
  out.Table("outputs");
  for (const auto& [id, t] : res.outputs) {
    out.Row("outputs",
            {{"name", std::string(OutputTensorName(id))}, {"tensor", t.DebugString()}},
            absl::StrFormat("output      %s %s", OutputTensorName(id), t.DebugString()));
  }
}

absl::Status RunCompute(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  if (!absl::GetFlag(FLAGS_head).empty()) LOSSD_RETURN_IF_ERROR(HeadShapeFlagsForCompute(*client));
  int64_t v = 0;
  LOSSD_ASSIGN_OR_RETURN(auto req, RequestFromFlags(&v));
  LOSSD_ASSIGN_OR_RETURN(auto res, client->Compute(req));
  PrintResult(res, out);
  PrintKindResult(req, res, out);
  const std::string dir = absl::GetFlag(FLAGS_out_dir);
  if (dir.empty()) return absl::OkStatus();
  LOSSD_RETURN_IF_ERROR(MakeDir(dir));
  for (const auto& [id, t] : res.outputs) {
    LOSSD_RETURN_IF_ERROR(WriteOutput(dir, OutputTensorName(id), t, out));
  }
  // The scalars too, so a script can compare them without parsing stdout.
  HostTensor scalars = HostTensor::Owned(DType::kF32, {3});
  scalars.mutable_data_as<float>()[0] = res.loss;
  scalars.mutable_data_as<float>()[1] = res.z_loss;
  scalars.mutable_data_as<float>()[2] = res.accuracy;
  return WriteOutput(dir, "scalars_loss_zloss_accuracy", scalars, out);
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(std::ceil(p * v.size())) - 1);
  return v[p <= 0 ? 0 : i];
}

// What the timed calls of a bench gave.
struct BenchRun {
  std::vector<double> latency, compute;  // seconds, of the calls that succeeded
  uint64_t sent = 0, received = 0;
  int64_t errors = 0;
  absl::Status first_error;
  double wall = 0;
};

// `calls` Computes of `req` at `concurrency`, with a progress line at most once a second and
// after the last call, so a long run shows it is moving.
BenchRun TimedCalls(LossClient& client, const ComputeRequest& req, int64_t calls,
                    int concurrency, CommandOutput& out) {
  BenchRun run;
  absl::Mutex mu;
  std::atomic<int64_t> next{0};
  const absl::Time start = absl::Now();
  absl::Time last_progress = start;
  std::vector<std::thread> threads;
  for (int t = 0; t < concurrency; ++t) {
    threads.emplace_back([&] {
      while (next.fetch_add(1) < calls) {
        absl::StatusOr<ComputeResult> res = client.Compute(req);
        absl::MutexLock lock(&mu);
        if (res.ok()) {
          run.latency.push_back(res->wall_seconds);
          run.compute.push_back(res->compute_seconds);
          run.sent += res->bytes_sent;
          run.received += res->bytes_received;
        } else if (run.errors++ == 0) {
          run.first_error = res.status();
        }
        const int64_t done = static_cast<int64_t>(run.latency.size()) + run.errors;
        if (absl::Now() - last_progress >= absl::Seconds(1) || done == calls) {
          last_progress = absl::Now();
          const double last_ms = res.ok() ? 1e3 * res->wall_seconds : 0.0;
          out.Progress({{"done", done}, {"calls", calls}, {"failed", run.errors},
                        {"last_ms", last_ms}},
                       absl::StrFormat("progress    %d/%d calls, %d failed, last %.2f ms", done,
                                       calls, run.errors, last_ms));
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  run.wall = absl::ToDoubleSeconds(absl::Now() - start);
  return run;
}

void PrintBench(const BenchRun& run, int64_t rows, CommandOutput& out) {
  const double ok = static_cast<double>(run.latency.size());
  const double wall = run.wall;
  double compute_sum = 0;
  for (double c : run.compute) compute_sum += c;
  const double p50 = 1e3 * Percentile(run.latency, 0.5), p90 = 1e3 * Percentile(run.latency, 0.9),
               p99 = 1e3 * Percentile(run.latency, 0.99), max = 1e3 * Percentile(run.latency, 1.0);
  out.Field("calls_ok", static_cast<int64_t>(ok),
            absl::StrFormat("calls       %d ok, %d failed in %.3f s", run.latency.size(),
                            run.errors, wall));
  out.Field("calls_failed", run.errors, "");
  out.Field("seconds", wall, "");
  out.Field("latency_ms_p50", p50,
            absl::StrFormat("latency_ms  p50 %.2f  p90 %.2f  p99 %.2f  max %.2f", p50, p90, p99,
                            max));
  out.Field("latency_ms_p90", p90, "");
  out.Field("latency_ms_p99", p99, "");
  out.Field("latency_ms_max", max, "");
  const double compute_ms = ok > 0 ? 1e3 * compute_sum / ok : 0.0;
  out.Field("compute_ms_mean", compute_ms,
            absl::StrFormat("compute_ms  mean %.2f (server-side)", compute_ms));
  out.Field("calls_per_second", ok / wall, absl::StrFormat("calls/s     %.2f", ok / wall));
  const double tokens = ok * static_cast<double>(rows) / wall;
  out.Field("tokens_per_second", tokens, absl::StrFormat("tokens/s    %.0f", tokens));
  const double up = GibPerSecond(run.sent, wall), down = GibPerSecond(run.received, wall);
  out.Field("gib_per_second_up", up,
            absl::StrFormat("GiB/s       %.3f (up %.3f, down %.3f)", up + down, up, down));
  out.Field("gib_per_second_down", down, "");
}

absl::Status RunBench(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  int64_t v = 0;
  LOSSD_ASSIGN_OR_RETURN(auto req, RequestFromFlags(&v));
  const int64_t calls = absl::GetFlag(FLAGS_calls);
  const int concurrency = absl::GetFlag(FLAGS_concurrency);  // >= 1: CheckFlagRanges
  std::string dropped_handle;
  if (absl::GetFlag(FLAGS_put_weights)) {
    if (!req.w.has_value()) return absl::InvalidArgumentError("--put_weights needs weights");
    const absl::Time t0 = absl::Now();
    LOSSD_ASSIGN_OR_RETURN(
        auto put, client->PutWeights(*req.w, req.bias.has_value() ? &*req.bias : nullptr));
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    const double bytes = req.w->num_bytes() + (req.bias.has_value() ? req.bias->num_bytes() : 0);
    out.Field("put_weights_seconds", s,
              absl::StrFormat("put_weights %s in %.3f s (%.3f GiB/s) over %d stripe(s), handle %s",
                              BinarySize(bytes), s, GibPerSecond(bytes, s), put.stripes,
                              put.handle));
    req.weight_handle = put.handle;
    dropped_handle = put.handle;
    req.w.reset();
    req.bias.reset();
  }
  out.Field("concurrency", int64_t{concurrency},
            absl::StrFormat(
                "request     x %s, %s, targets %s, %d calls at concurrency %d over %d connections",
                req.x.DebugString(),
                req.w.has_value() ? absl::StrCat("w ", req.w->DebugString())
                                  : absl::StrCat("handle ", req.weight_handle),
                req.targets.DebugString(), calls, concurrency, client->options().connections));
  for (int64_t i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
    LOSSD_ASSIGN_OR_RETURN(auto res, client->Compute(req));
    if (i == 0) {
      out.Field("first_loss", double{res.loss},
                absl::StrFormat("first call  loss %.6g, %.3f s", res.loss, res.wall_seconds));
    }
  }
  const BenchRun run = TimedCalls(*client, req, calls, concurrency, out);
  PrintBench(run, req.x.dim(0), out);
  if (!absl::GetFlag(FLAGS_accumulator).empty()) {
    const absl::Time t0 = absl::Now();
    LOSSD_ASSIGN_OR_RETURN(auto g, client->FetchGradients(absl::GetFlag(FLAGS_accumulator), true));
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    out.Field("fetch_seconds", s,
              absl::StrFormat("fetch       dw %s over %d micro-batches in %.3f s over %d stripe(s)",
                              g.dw.DebugString(), g.micro_batches, s, g.stripes));
  }
  if (!dropped_handle.empty()) LOSSD_RETURN_IF_ERROR(client->DropWeights(dropped_handle));
  if (run.errors > 0) {
    return absl::Status(run.first_error.code(),
                        absl::StrCat(run.errors, " of ", calls,
                                     " calls failed; first: ", run.first_error.message()));
  }
  return absl::OkStatus();
}

absl::Status RunPutWeights(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  std::optional<HostTensor> w, bias;
  LOSSD_RETURN_IF_ERROR(LoadWeights(&w, &bias));
  const absl::Time t0 = absl::Now();
  LOSSD_ASSIGN_OR_RETURN(auto put, client->PutWeights(*w, bias.has_value() ? &*bias : nullptr));
  const double s = absl::ToDoubleSeconds(absl::Now() - t0);
  const double bytes = w->num_bytes() + (bias.has_value() ? bias->num_bytes() : 0);
  out.Field("handle", put.handle, absl::StrFormat("handle      %s", put.handle));
  out.Field("bytes", uint64_t{put.bytes}, absl::StrFormat("bytes       %d (server-side)", put.bytes));
  out.Field("seconds", s,
            absl::StrFormat("upload      %s in %.3f s (%.3f GiB/s)", BinarySize(bytes), s,
                            GibPerSecond(bytes, s)));
  out.Field("stripes", int64_t{put.stripes}, absl::StrFormat("stripes     %d", put.stripes));
  return absl::OkStatus();
}

absl::Status RunDropWeights(CommandOutput& out) {
  const std::string handle = absl::GetFlag(FLAGS_handle);
  if (handle.empty()) return absl::InvalidArgumentError("drop-weights needs --handle");
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_RETURN_IF_ERROR(client->DropWeights(handle));
  out.Field("dropped", handle, absl::StrFormat("dropped     %s", handle));
  return absl::OkStatus();
}

absl::Status RunFetchGradients(CommandOutput& out) {
  const std::string name = absl::GetFlag(FLAGS_accumulator);
  if (name.empty()) return absl::InvalidArgumentError("fetch-gradients needs --accumulator");
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  const absl::Time t0 = absl::Now();
  LOSSD_ASSIGN_OR_RETURN(auto g, client->FetchGradients(name, absl::GetFlag(FLAGS_reset)));
  out.Field("micro_batches", uint64_t{g.micro_batches},
            absl::StrFormat("micro_batches %d", g.micro_batches));
  out.Field("tokens", int64_t{g.tokens}, absl::StrFormat("tokens        %d", g.tokens));
  out.Field("dw", g.dw.DebugString(), absl::StrFormat("dw            %s", g.dw.DebugString()));
  if (g.db.has_value()) {
    out.Field("db", g.db->DebugString(), absl::StrFormat("db            %s", g.db->DebugString()));
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  const double bytes = g.dw.num_bytes() + (g.db.has_value() ? g.db->num_bytes() : 0);
  out.Field("seconds", seconds,
            absl::StrFormat("seconds       %.3f (%.3f GiB/s)", seconds,
                            GibPerSecond(bytes, seconds)));
  out.Field("stripes", int64_t{g.stripes}, absl::StrFormat("stripes       %d", g.stripes));
  out.Field("ranges", int64_t{g.ranges}, absl::StrFormat("ranges        %d", g.ranges));
  const std::string dir = absl::GetFlag(FLAGS_out_dir);
  if (dir.empty()) return absl::OkStatus();
  LOSSD_RETURN_IF_ERROR(MakeDir(dir));
  LOSSD_RETURN_IF_ERROR(WriteOutput(dir, "dw", g.dw, out));
  if (g.db.has_value()) LOSSD_RETURN_IF_ERROR(WriteOutput(dir, "db", *g.db, out));
  return absl::OkStatus();
}

// The gRPC health check; exits non-zero unless the server answers SERVING (a probe, a script
// waiting for a server).
absl::Status RunHealth(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  const std::string service = absl::GetFlag(FLAGS_service);
  LOSSD_ASSIGN_OR_RETURN(auto status, client->Health(service));
  out.Field("status", status, absl::StrFormat("status      %s", status));
  if (status != "SERVING") {
    return absl::UnavailableError(absl::StrCat(
        service.empty() ? "the server" : absl::StrCat("service '", service, "'"), " is ",
        status));
  }
  return absl::OkStatus();
}

absl::Status RunList(CommandOutput& out) {
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_ASSIGN_OR_RETURN(auto entries, client->List());
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  out.Table("state");
  if (!out.json()) {
    absl::PrintF("%-11s %-40s %14s %10s %s\n", "kind", "name", "bytes", "idle_s",
                 "micro_batches");
  }
  for (const StateEntry& e : entries) {
    // Heads count the Computes in their current step, as accumulators their micro-batches.
    const bool counts =
        e.kind == StateEntry::Kind::kAccumulator || e.kind == StateEntry::Kind::kHead;
    const std::string kind = e.kind == StateEntry::Kind::kAccumulator ? "accumulator"
                             : e.kind == StateEntry::Kind::kHead      ? "head"
                             : e.kind == StateEntry::Kind::kTicket    ? "ticket"
                                                                      : "weights";
    const double idle_s = (now_ms - e.last_used_unix_ms) / 1e3;
    JsonFields row = {{"kind", kind},
                      {"name", e.name},
                      {"bytes", uint64_t{e.bytes}},
                      {"idle_seconds", idle_s}};
    if (counts) row.emplace_back("micro_batches", uint64_t{e.micro_batches});
    if (e.kind == StateEntry::Kind::kHead) row.emplace_back("version", uint64_t{e.version});
    out.Row("state", std::move(row),
            absl::StrFormat("%-11s %-40s %14d %10.1f %s%s", kind, e.name, e.bytes, idle_s,
                            counts ? absl::StrCat(e.micro_batches) : std::string("-"),
                            e.kind == StateEntry::Kind::kHead
                                ? absl::StrCat(" (version ", e.version, ")")
                                : std::string()));
  }
  return absl::OkStatus();
}

absl::Status RunDropAccumulator(CommandOutput& out) {
  const std::string name = absl::GetFlag(FLAGS_accumulator);
  if (name.empty()) return absl::InvalidArgumentError("drop-accumulator needs --accumulator");
  LOSSD_ASSIGN_OR_RETURN(auto client, ClientFromFlags());
  LOSSD_RETURN_IF_ERROR(client->DropAccumulator(name));
  out.Field("dropped", name, absl::StrFormat("dropped     %s", name));
  return absl::OkStatus();
}

}  // namespace
}  // namespace client
}  // namespace lossd

int main(int argc, char** argv) {
  using namespace lossd::client;  // NOLINT(build/namespaces): main only
  absl::SetProgramUsageMessage(kUsage);
  // --help lists the flags of every lossctl source (the loss kinds' are in lossctl_kinds.cc),
  // not only those of the file named after the program.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return file.find("client/lossctl") != absl::string_view::npos;
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  // Parsed with the usage flags handled here: absl exits 1 after --help, and printing the help
  // that was asked for is a success.
  std::vector<char*> args = absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  if (absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) != -1) {
    return 0;
  }
  const bool head = args.size() >= 2 && std::string(args[1]) == "head";
  if (args.size() != (head ? 3u : 2u)) {
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  TuneMallocForLargeMessages();
  // Each line as it is printed, also into a pipe (bench's progress, a script reading along).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string command = head ? absl::StrCat("head ", args[2]) : std::string(args[1]);
  const std::map<std::string, absl::Status (*)(CommandOutput&)> commands = {
      {"info", &RunInfo},
      {"compute", &RunCompute},
      {"bench", &RunBench},
      {"put-weights", &RunPutWeights},
      {"drop-weights", &RunDropWeights},
      {"fetch-gradients", &RunFetchGradients},
      {"drop-accumulator", &RunDropAccumulator},
      {"list", &RunList},
      {"health", &RunHealth},
      {"replicas", &RunReplicas},
  };
  auto it = commands.find(command);
  if (it == commands.end() && !head) {
    std::fprintf(stderr, "lossctl: unknown command '%s'\n\n%s\n", command.c_str(), kUsage);
    return 2;
  }
  CommandOutput out(command, absl::GetFlag(FLAGS_json));
  absl::Status status = CheckFlagRanges();
  if (status.ok()) status = head ? RunHead(args[2], out) : it->second(out);
  out.Finish(status);
  if (!status.ok()) {
    std::fprintf(stderr, "lossctl %s: %s: %s\n", command.c_str(),
                 absl::StatusCodeToString(status.code()).c_str(),
                 std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
