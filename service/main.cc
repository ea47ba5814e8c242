// SPDX-License-Identifier: Apache-2.0
// lossd: the loss service. Parses flags, picks a backend (CUDA where a GPU is present, else
// CPU), starts the gRPC server and the metrics exposer, and drains gracefully on SIGTERM or
// SIGINT. The CUDA backend is loaded as a plugin (dlopen) so that cuBLAS never sits in this
// binary's static TLS, which would starve civetweb's small thread stacks.
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/host_memory.h"
#include "kernels/plugin_loader.h"
#include "engine/engine.h"
#include "engine/instance_id.h"
#include "service/auth.h"
#include "service/build_info.h"
#include "service/drain.h"
#include "service/flags.h"
#include "service/head_files.h"
#include "service/idle_state_sweep.h"
#include "service/log.h"
#include "service/head_group_store.h"
#include "service/loss_server.h"
#include "service/metrics.h"
#include "service/part_flags.h"
#include "service/state_sample.h"
#include "service/store_budgets.h"
#include "service/tls.h"

namespace lossd {
namespace {


absl::StatusOr<std::unique_ptr<Backend>> MakeBackend() {
  const std::string which = absl::GetFlag(FLAGS_backend);
  if (which != "auto" && which != "cpu" && which != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be auto, cpu or cuda, got '", which, "'"));
  }
  if (which != "cpu") {
    LossdCudaOptions o{};
    o.device = absl::GetFlag(FLAGS_cuda_device);
    o.memory_budget_bytes = absl::GetFlag(FLAGS_device_memory_budget_bytes);
    o.chunk_budget_bytes = absl::GetFlag(FLAGS_cuda_chunk_budget_bytes);
    o.fixed_gemm_algorithms = absl::GetFlag(FLAGS_cuda_autotune) ? 0 : 1;
    auto cuda = LoadCudaBackend(absl::GetFlag(FLAGS_cuda_plugin), o);
    if (cuda.ok()) return cuda;
    if (which == "cuda") return cuda.status();
    // auto falls back where there is no CUDA to be had (no plugin, a plugin that cannot load
    // here, no GPU), not where a GPU is present but was set up wrong (--cuda_device out of
    // range, a failed start): that would quietly serve on the CPU.
    const absl::StatusCode code = cuda.status().code();
    if (code != absl::StatusCode::kNotFound && code != absl::StatusCode::kUnavailable &&
        code != absl::StatusCode::kFailedPrecondition) {
      return cuda.status();
    }
    Log(LogLevel::kWarning, absl::StrCat("no CUDA backend (", cuda.status().message(),
                                         "); using the CPU backend"));
  }
  return NewCpuBackend(absl::GetFlag(FLAGS_threads));
}

// "--a=1 --b=x": lossd's flags whose value is not their default, for the start-up line.
std::string NonDefaultFlags() {
  std::vector<std::string> set;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::EndsWith(flag->Filename(), "service/flags.cc")) continue;
    if (flag->CurrentValue() == flag->DefaultValue()) continue;
    set.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
  }
  std::sort(set.begin(), set.end());  // GetAllFlags is a hash map
  return absl::StrJoin(set, " ");
}

// (This Abseil keeps "was it on the command line" private: a value equal to the default
// counts as the default, which changes nothing for it.)
bool AtDefault(absl::string_view name) {
  const absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
  return f != nullptr && f->CurrentValue() == f->DefaultValue();
}

// Logs `line` as the error that stops lossd before it serves; Main returns this exit code.
int StartFailed(absl::string_view line) {
  Log(LogLevel::kError, line);
  return 1;
}

// Process-wide settings made before lossd starts a thread: malloc's thresholds, and SIGTERM
// and SIGINT kept for ServeUntilSignalled (TakeStopSignals). Returns their set.
sigset_t TuneProcess() {
  // gRPC allocates and frees multi-MiB buffers per message; keep glibc from handing them back
  // to the kernel each time (every message would page-fault again).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
  return TakeStopSignals();
}

// Starts logging in --log_format (text where that is bad, so the refusal itself is logged).
bool InitLoggingFromFlags() {
  auto format = ParseLogFormat(absl::GetFlag(FLAGS_log_format));
  LogOptions lo;
  lo.format = format.ok() ? *format : LogFormat::kText;
  lo.access_log = absl::GetFlag(FLAGS_access_log);
  InitLogging(lo);
  RouteGrpcLogLimitingTlsFailures(absl::GetFlag(FLAGS_tls_failure_log_interval));
  if (!format.ok()) {
    Log(LogLevel::kError, format.status().ToString());
    return false;
  }
  return true;
}

// What the transport flags give once checked: the response part size, the credentials and
// the token check.
struct TransportSettings {
  uint32_t response_part_bytes = 0;
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::shared_ptr<const TokenAuthenticator> auth;  // null: no token needed
  bool tls = false;
};

// Flags checked before anything starts: a bad one is named, not found out later. Logs the
// refusal and returns false on the first bad flag.
bool CheckTransportFlags(TransportSettings* t) {
  const int port = absl::GetFlag(FLAGS_port);
  if (port < 0 || port > 65535) {
    // getaddrinfo would keep the low 16 bits and bind another port.
    StartFailed(absl::StrCat("INVALID_ARGUMENT: --port must be in [0, 65535], got ", port));
    return false;
  }
  const std::pair<const char*, absl::Duration> durations[] = {
      {"shutdown_grace", absl::GetFlag(FLAGS_shutdown_grace)},
      {"tls_failure_log_interval", absl::GetFlag(FLAGS_tls_failure_log_interval)}};
  for (const auto& [name, d] : durations) {
    if (d < absl::ZeroDuration()) {
      StartFailed(absl::StrCat("INVALID_ARGUMENT: --", name, " must be >= 0; got ",
                               absl::FormatDuration(d)));
      return false;
    }
  }
  auto response_part_bytes =
      CheckPartFlags(absl::GetFlag(FLAGS_max_part_bytes), absl::GetFlag(FLAGS_response_part_bytes),
                     !AtDefault("response_part_bytes"));
  if (!response_part_bytes.ok()) {
    StartFailed(response_part_bytes.status().ToString());
    return false;
  }
  t->response_part_bytes = *response_part_bytes;

  auto credentials = MakeServerCredentials(absl::GetFlag(FLAGS_tls_cert),
                                           absl::GetFlag(FLAGS_tls_key),
                                           absl::GetFlag(FLAGS_tls_client_ca));
  if (!credentials.ok()) {
    StartFailed(credentials.status().ToString());
    return false;
  }
  t->credentials = *credentials;
  t->tls = !absl::GetFlag(FLAGS_tls_cert).empty();
  if (!absl::GetFlag(FLAGS_auth_tokens_file).empty()) {
    auto a = TokenAuthenticator::FromFile(absl::GetFlag(FLAGS_auth_tokens_file));
    if (!a.ok()) {
      StartFailed(a.status().ToString());
      return false;
    }
    t->auth = std::make_shared<const TokenAuthenticator>(std::move(*a));
  }
  return true;
}

// The budgets lossd runs with, after the defaults have been fitted to the machine.
struct Budgets {
  uint64_t memory_budget_bytes = 0;
  uint64_t host_buffer_pool_bytes = 0;
  uint64_t weight_cache_bytes = 0;
  uint64_t accumulator_bytes = 0;
  uint64_t head_bytes = 0;
  uint64_t ticket_bytes = 0;
};

// Host-memory defaults follow the container's limit where it is below the machine's; logs
// the budgets and sizes the host buffer pool.
void FitHostBudgets(Budgets* b) {
  const HostMemoryLimit host = ReadHostMemoryLimit();
  b->memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes);
  b->host_buffer_pool_bytes = absl::GetFlag(FLAGS_host_buffer_pool_bytes);
  FitDefaultHostBudgets(host.limit_bytes(), !AtDefault("memory_budget_bytes"),
                        !AtDefault("host_buffer_pool_bytes"), &b->memory_budget_bytes,
                        &b->host_buffer_pool_bytes);
  Log(LogLevel::kInfo,
      absl::StrCat("host memory ", host.Describe(), "; --memory_budget_bytes=",
                   b->memory_budget_bytes,
                   AtDefault("memory_budget_bytes") ? " (default, at most 1/4 of it)" : "",
                   ", --host_buffer_pool_bytes=", b->host_buffer_pool_bytes,
                   AtDefault("host_buffer_pool_bytes") ? " (default, at most 1/8 of it)" : ""));
  SetHostBufferPoolBytes(b->host_buffer_pool_bytes);
}

// Weights, accumulators and heads live in backend memory between requests: budgets the
// backend cannot hold would surface later as out-of-memory failures of requests already
// accepted. The defaults (4 + 8 + 16 GiB) suit a GPU host; on a smaller machine those left at
// their defaults shrink to fit rather than keep lossd from starting. Values given on the
// command line are checked as they are. Logs the refusal and returns false where they do not
// fit.
bool FitStoreBudgets(const BackendInfo& info, Budgets* b) {
  StoreBudgets stores;
  stores.weight_cache_bytes = absl::GetFlag(FLAGS_weight_cache_bytes);
  stores.accumulator_bytes = absl::GetFlag(FLAGS_accumulator_bytes);
  stores.head_bytes = absl::GetFlag(FLAGS_head_bytes);
  stores.ticket_bytes = absl::GetFlag(FLAGS_ticket_bytes);
  StoreBudgetsGiven given;
  given.weight_cache = !AtDefault("weight_cache_bytes");
  given.accumulator = !AtDefault("accumulator_bytes");
  given.head = !AtDefault("head_bytes");
  given.ticket = !AtDefault("ticket_bytes");
  // Shrinking defaults is the designed path on a small machine (as the host budgets above),
  // so it is logged as information, not as something for an operator to fix.
  if (FitDefaultStoreBudgets(&stores, given, info)) {
    Log(LogLevel::kInfo,
        absl::StrCat("the default store budgets do not fit the ", info.name,
                     " backend's memory; using --weight_cache_bytes=", stores.weight_cache_bytes,
                     " --accumulator_bytes=", stores.accumulator_bytes,
                     " --head_bytes=", stores.head_bytes,
                     " --ticket_bytes=", stores.ticket_bytes,
                     " (the defaulted ones scaled into half of it)"));
  }
  if (absl::Status s = CheckStoreBudgets(stores, info); !s.ok()) {
    StartFailed(s.ToString());
    return false;
  }
  b->weight_cache_bytes = stores.weight_cache_bytes;
  b->accumulator_bytes = stores.accumulator_bytes;
  b->head_bytes = stores.head_bytes;
  b->ticket_bytes = stores.ticket_bytes;
  return true;
}

// The engine's options from the flags and the fitted budgets; logs the refusal and returns
// false where --overlap_stall is not positive.
bool EngineOptionsFromFlags(const Budgets& b, EngineOptions* eo) {
  eo->instance = NewInstanceId();
  eo->memory_budget_bytes = b.memory_budget_bytes;
  eo->max_queue = absl::GetFlag(FLAGS_max_queue);
  eo->executor_threads = absl::GetFlag(FLAGS_executor_threads);
  eo->weight_cache_bytes = b.weight_cache_bytes;
  eo->max_weight_handles = absl::GetFlag(FLAGS_max_weight_handles);
  eo->accumulator_bytes = b.accumulator_bytes;
  eo->max_accumulators = absl::GetFlag(FLAGS_max_accumulators);
  eo->head_bytes = b.head_bytes;
  eo->max_heads = absl::GetFlag(FLAGS_max_heads);
  eo->head_step_timeout = absl::GetFlag(FLAGS_head_step_timeout);
  if (eo->head_step_timeout <= absl::ZeroDuration()) {
    StartFailed(absl::StrCat("--head_step_timeout must be positive; got ",
                             absl::FormatDuration(eo->head_step_timeout)));
    return false;
  }
  eo->ticket_bytes = b.ticket_bytes;
  eo->max_tickets = absl::GetFlag(FLAGS_max_tickets);
  eo->ticket_max_ms = absl::GetFlag(FLAGS_ticket_max_ms);
  if (eo->ticket_max_ms <= 0) {
    StartFailed(absl::StrCat("--ticket_max_ms must be positive; got ", eo->ticket_max_ms));
    return false;
  }
  eo->max_bt = absl::GetFlag(FLAGS_max_bt);
  eo->max_h = absl::GetFlag(FLAGS_max_h);
  eo->max_v = absl::GetFlag(FLAGS_max_v);
  eo->max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  eo->check_finite = absl::GetFlag(FLAGS_check_finite);
  eo->overlap_stall = absl::GetFlag(FLAGS_overlap_stall);
  if (eo->overlap_stall <= absl::ZeroDuration()) {
    StartFailed(absl::StrCat("--overlap_stall must be positive; got ",
                             absl::FormatDuration(eo->overlap_stall)));
    return false;
  }
  return true;
}

// /readyz: the gRPC server is up and not draining (ServeUntilSignalled sets it), and the
// backend healthy.
std::atomic<bool> accepting{false};

// Starts /metrics, /healthz and /readyz where --metrics_port is not 0 (else leaves *exposer
// null); logs the refusal and returns false where it cannot listen.
bool StartHttpEndpoints(Engine& engine, ServerMetrics& metrics,
                        std::unique_ptr<prometheus::Exposer>* exposer) {
  // /healthz: the backend healthy (a sticky device error needs a restart).
  HttpProbes probes;
  probes.live = [&engine] { return engine.backend_info().healthy; };
  probes.ready = [&engine] { return accepting.load() && engine.backend_info().healthy; };
  if (absl::GetFlag(FLAGS_metrics_port) != 0) {
    auto e = StartMetricsExposer(absl::StrCat(absl::GetFlag(FLAGS_metrics_address), ":",
                                              absl::GetFlag(FLAGS_metrics_port)),
                                 metrics, probes);
    if (!e.ok()) {
      StartFailed(e.status().ToString());
      return false;
    }
    *exposer = std::move(*e);
  }
  return true;
}

// Head groups (--head_group_address, service/head_group_store.h). Logs the refusal and
// returns false on a bad flag.
bool HeadGroupsFromFlags(const TransportSettings& t, EngineOptions* eo,
                         std::unique_ptr<GroupStoreService>* service) {
  absl::Status s = ConfigureHeadGroups(
      {absl::GetFlag(FLAGS_head_group_address), absl::GetFlag(FLAGS_head_group_timeout),
       absl::GetFlag(FLAGS_head_group_token_file), absl::GetFlag(FLAGS_head_group_tls_ca),
       absl::GetFlag(FLAGS_head_group_tls_cert), absl::GetFlag(FLAGS_head_group_tls_key)},
      t.auth, eo, service);
  if (!s.ok()) StartFailed(s.ToString());
  return s.ok();
}

// The gRPC server's options from the flags; logs the refusal and returns false on a bad
// --stream_idle_timeout or --health_port.
bool ServerOptionsFromFlags(const TransportSettings& t, const std::string& instance,
                            LossServerOptions* so) {
  so->address = absl::StrCat(absl::GetFlag(FLAGS_address), ":", absl::GetFlag(FLAGS_port));
  so->service.version = kLossdVersion;
  so->service.instance = instance;
  so->service.max_part_bytes = absl::GetFlag(FLAGS_max_part_bytes);
  so->service.default_response_part_bytes = t.response_part_bytes;
  so->service.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  so->service.max_in_flight_per_client = absl::GetFlag(FLAGS_max_in_flight_per_client);
  so->service.max_parts_per_request = absl::GetFlag(FLAGS_max_parts_per_request);
  so->service.overlap_start_when_busy = absl::GetFlag(FLAGS_overlap_start_when_busy);
  so->service.stream_idle_timeout = absl::GetFlag(FLAGS_stream_idle_timeout);
  if (so->service.stream_idle_timeout < absl::ZeroDuration()) {
    StartFailed(absl::StrCat("--stream_idle_timeout must be >= 0 (0 = off); got ",
                             absl::FormatDuration(so->service.stream_idle_timeout)));
    return false;
  }
  so->service.auth = t.auth;
  if (const int health_port = absl::GetFlag(FLAGS_health_port); health_port != 0) {
    if (health_port < 0 || health_port > 65535 || health_port == absl::GetFlag(FLAGS_port)) {
      StartFailed(absl::StrCat("INVALID_ARGUMENT: --health_port must be in [1, 65535] "
                               "and not --port, got ",
                               health_port));
      return false;
    }
    so->health_address = absl::StrCat(absl::GetFlag(FLAGS_address), ":", health_port);
  }
  so->reflection = absl::GetFlag(FLAGS_reflection);
  so->credentials = t.credentials;
  return true;
}

// The start-up line on stdout (scripts and tests read it) and the "started" log line.
void AnnounceStarted(const LossServer& server, const prometheus::Exposer* exposer,
                     const BackendInfo& info, const std::string& instance, const Budgets& b) {
  const int metrics_port =
      exposer && !exposer->GetListeningPorts().empty() ? exposer->GetListeningPorts()[0] : 0;
  // Scripts and tests read this line from stdout: its words stay as they are.
  const std::string started = absl::StrCat(
      "lossd ", kLossdVersion, " listening on port ", server.port(), " (backend ", info.name,
      ", device ", info.device, ", instance ", instance, ")",
      exposer ? absl::StrCat(", metrics on port ", metrics_port) : "",
      server.health_port() != 0
          ? absl::StrCat(", health on port ", server.health_port(), " (plaintext)")
          : "");
  std::printf("%s\n", started.c_str());
  std::fflush(stdout);
  Log(LogLevel::kInfo, "started",
      {{"version", kLossdVersion},
       {"commit", GetBuildInfo().commit},
       {"backend", info.name},
       {"device", info.device},
       {"instance", instance},
       {"port", server.port()},
       {"metrics_port", metrics_port},
       {"health_port", server.health_port()},
       {"memory_budget_bytes", b.memory_budget_bytes},
       {"host_buffer_pool_bytes", b.host_buffer_pool_bytes},
       {"weight_cache_bytes", b.weight_cache_bytes},
       {"accumulator_bytes", b.accumulator_bytes},
       {"head_bytes", b.head_bytes},
       {"ticket_bytes", b.ticket_bytes},
       {"flags", NonDefaultFlags()}});
}

int Main() {
  const sigset_t signals = TuneProcess();
  if (!InitLoggingFromFlags()) return 1;
  TransportSettings transport;
  if (!CheckTransportFlags(&transport)) return 1;
  Budgets budgets;
  FitHostBudgets(&budgets);

  auto backend = MakeBackend();
  if (!backend.ok()) return StartFailed(backend.status().ToString());
  const BackendInfo info = (*backend)->Info();
  if (!FitStoreBudgets(info, &budgets)) return 1;
  EngineOptions eo;
  if (!EngineOptionsFromFlags(budgets, &eo)) return 1;
  std::unique_ptr<GroupStoreService> group_store;  // outlives the server
  if (!HeadGroupsFromFlags(transport, &eo, &group_store)) return 1;
  const absl::Duration state_ttl = absl::GetFlag(FLAGS_state_idle_ttl);
  if (state_ttl < absl::ZeroDuration()) {
    return StartFailed(absl::StrCat("--state_idle_ttl must be >= 0 (0 = off); got ",
                                    absl::FormatDuration(state_ttl)));
  }
  Engine engine(std::move(*backend), eo);
  // Declared after the engine, so it stops before the engine goes.
  std::unique_ptr<IdleStateSweep> state_sweep;
  if (state_ttl > absl::ZeroDuration()) {
    state_sweep = std::make_unique<IdleStateSweep>(
        &engine, state_ttl, [](const std::string& l) { Log(LogLevel::kInfo, l); });
  }

  // Heads exported by the previous process (a rolling restart), before any call can come.
  if (const std::string dir = absl::GetFlag(FLAGS_head_export_dir); !dir.empty()) {
    const HeadFilesReport r = ImportHeadsFromDir(engine, dir);
    Log(r.failed == 0 ? LogLevel::kInfo : LogLevel::kError, "heads imported",
        {{"dir", dir},
         {"imported", r.done},
         {"failed", r.failed},
         {"unfinished_removed", r.removed}});
  }

  ServerMetrics metrics([&engine] { return SampleState(engine); });
  {
    const BuildInfo build = GetBuildInfo();
    absl::StatusOr<CudaPluginProbe> plugin = ProbeCudaPlugin(absl::GetFlag(FLAGS_cuda_plugin));
    const std::string abi =
        plugin.ok() ? absl::StrCat("abi", PluginAbiVersionText(plugin->abi_version)) : "none";
    metrics.SetBuildInfo(build.version, build.commit, info.name, abi);
  }
  std::unique_ptr<prometheus::Exposer> exposer;
  if (!StartHttpEndpoints(engine, metrics, &exposer)) return 1;

  LossServerOptions so;
  if (!ServerOptionsFromFlags(transport, eo.instance, &so)) return 1;
  so.head_group_service = group_store.get();
  // Health follows the backend (so.health_poll, every second): a sticky device error turns it
  // NOT_SERVING.
  auto server = LossServer::Start(&engine, &metrics, so);
  if (!server.ok()) return StartFailed(server.status().ToString());
  AnnounceStarted(**server, exposer.get(), info, eo.instance, budgets);
  if (const std::string open = OpenListenerWarning(absl::GetFlag(FLAGS_address), (*server)->port(),
                                                   transport.tls, transport.auth != nullptr);
      !open.empty()) {
    Log(LogLevel::kWarning, open);
  }
  DrainOptions drain;
  drain.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  drain.drain = absl::Seconds(absl::GetFlag(FLAGS_drain_seconds));
  drain.head_export_dir = absl::GetFlag(FLAGS_head_export_dir);
  ServeUntilSignalled(signals, **server, engine, accepting, drain);
  return 0;
}

}  // namespace
}  // namespace lossd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("fused linear + cross-entropy as a gRPC service");
  // --help lists the flags of the files named after the program (lossd.cc, lossd_main.cc);
  // lossd's flags are all in service/flags.cc, so it counts as the program's.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "service/flags.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  // --version: Abseil calls this after parsing every flag, so --cuda_plugin names the plugin
  // probed; the probe dlopens it and reads its ABI version without starting a GPU.
  usage.version_string = [] {
    return lossd::VersionText(lossd::GetBuildInfo(),
                              lossd::ProbeCudaPlugin(absl::GetFlag(FLAGS_cuda_plugin)));
  };
  absl::SetFlagsUsageConfig(usage);
  // absl::ParseCommandLine exits 1 after --help (as after a bad flag), which tells a script
  // that asked for help that something failed. Parsed here with the usage flags left to us:
  // help and version printed as Abseil prints them, exit 0; a bad flag still exits 1 (the
  // parser itself, naming the flag).
  absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  if (absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) != -1) {
    return 0;
  }
  return lossd::Main();
}
