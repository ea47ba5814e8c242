// SPDX-License-Identifier: Apache-2.0
#include "service/metrics.h"

#include <cstring>
#include <exception>
#include <utility>

#include "CivetServer.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "civetweb.h"
#include "service/process_metrics.h"

namespace lossd {
namespace {

// A metric family with a single unlabelled series, registered in `r`; the series lives as long
// as the registry.
prometheus::Counter* UnlabelledCounter(prometheus::Registry& r, const char* name,
                                       const char* help) {
  return &prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
}
prometheus::Gauge* UnlabelledGauge(prometheus::Registry& r, const char* name, const char* help) {
  return &prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
}

// Gauges computed from a StateSample at collection time.
class StateCollector : public prometheus::Collectable {
 public:
  explicit StateCollector(std::function<StateSample()> sample) : sample_(std::move(sample)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const StateSample s = sample_();
    std::vector<prometheus::MetricFamily> out;
    auto gauge = [&](const char* name, const char* help, double v) {
      AddUnlabelledFamily(&out, name, help, prometheus::MetricType::Gauge, v);
    };
    auto counter = [&](const char* name, const char* help, double v) {
      AddUnlabelledFamily(&out, name, help, prometheus::MetricType::Counter, v);
    };
    gauge("lossd_memory_in_use_bytes", "Bytes admitted for requests in flight (host buffers "
          "and backend workspace).", s.memory_in_use_bytes);
    gauge("lossd_memory_budget_bytes", "The admission memory budget.", s.memory_budget_bytes);
    gauge("lossd_gpu_memory_used_bytes", "Device memory in use, as the driver reports it.",
          s.gpu_memory_used_bytes);
    gauge("lossd_gpu_memory_total_bytes", "Device memory in all.", s.gpu_memory_total_bytes);
    gauge("lossd_gpu_memory_peak_bytes", "Most device memory the backend held at once.",
          s.gpu_memory_peak_bytes);
    gauge("lossd_gpu_memory_held_bytes",
          "Device memory the backend holds now (freed memory its caching pool keeps, which "
          "the driver still counts as used, aside).",
          s.gpu_memory_held_bytes);
    gauge("lossd_gpu_memory_budget_bytes",
          "Most device memory the backend may hold (--device_memory_budget_bytes; 0: no limit "
          "of its own).",
          s.gpu_memory_budget_bytes);
    gauge("lossd_weight_cache_bytes",
          "Bytes of weight memory held: cached weights, and evicted or dropped ones that "
          "running requests still use (with uploads in progress, at most the budget).",
          s.weight_cache_bytes);
    gauge("lossd_weight_cache_budget_bytes", "Weight cache budget.", s.weight_cache_budget_bytes);
    gauge("lossd_weight_cache_entries", "Weight handles served (evicted or dropped ones aside).",
          s.weight_cache_entries);
    counter("lossd_weight_cache_hits_total", "Computes that found their weight handle.",
            s.weight_cache_hits);
    counter("lossd_weight_cache_misses_total", "Computes whose weight handle was missing.",
            s.weight_cache_misses);
    counter("lossd_weight_cache_evictions_total", "Handles evicted to make room.",
            s.weight_cache_evictions);
    gauge("lossd_accumulators", "Gradient accumulators held.", s.accumulators);
    gauge("lossd_accumulator_bytes", "Bytes of gradient accumulators.", s.accumulator_bytes);
    gauge("lossd_heads", "Hosted heads held.", s.heads);
    gauge("lossd_head_bytes",
          "Bytes of hosted heads: fp32 master, optimizer state, compute copy and gradient sum.",
          s.head_bytes);
    gauge("lossd_head_budget_bytes", "Hosted heads' memory budget (--head_bytes).",
          s.head_budget_bytes);
    gauge("lossd_tickets", "Two-phase log-prob tickets held for their backward.", s.tickets);
    gauge("lossd_ticket_bytes",
          "Bytes the tickets hold: X and targets (host), inline weights copied (backend).",
          s.ticket_bytes);
    gauge("lossd_ticket_budget_bytes", "Two-phase tickets' byte budget (--ticket_bytes).",
          s.ticket_budget_bytes);
    gauge("lossd_max_tickets", "Most two-phase tickets held at once (--max_tickets).",
          s.max_tickets);
    counter("lossd_tickets_expired_total", "Tickets freed at their TTL without a backward.",
            s.tickets_expired);
    gauge("lossd_queued_requests", "Requests waiting for memory admission.", s.queued_requests);
    gauge("lossd_host_buffer_pool_bytes", "Idle request buffers kept for reuse.",
          s.host_buffer_pool_bytes);
    gauge("lossd_healthy", "1 while the backend is healthy, 0 after a sticky device error.",
          s.healthy);
    return out;
  }

 private:
  std::function<StateSample()> sample_;
};

// Outcomes of CountHeadStep, and the codes LossdHighErrorRatio counts as failed on the
// server side (with OK, its denominator's usual series).
constexpr const char* kHeadStepOutcomes[] = {"applied", "skipped", "reduced", "failed"};
constexpr const char* kAlertedCodes[] = {"OK",          "INTERNAL",           "UNKNOWN",
                                         "UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
                                         "DATA_LOSS"};

}  // namespace

const char* const kLossMethods[12] = {
    "Compute",    "PutWeights", "DropWeights", "FetchGradients", "DropAccumulator", "ServerInfo",
    "List",       "CreateHead", "Step",        "ExportHead",     "GetHeadInfo",     "DropHead"};

ServerMetrics::ServerMetrics(std::function<StateSample()> sample)
    : registry_(std::make_shared<prometheus::Registry>()),
      state_(std::make_shared<StateCollector>(std::move(sample))),
      process_(std::make_shared<ProcessCollector>()) {
  requests_ = &prometheus::BuildCounter()
                   .Name("lossd_requests_total")
                   .Help("Finished RPCs by method and gRPC status code.")
                   .Register(*registry_);
  durations_ = &prometheus::BuildHistogram()
                    .Name("lossd_request_duration_seconds")
                    .Help("Time per RPC phase: receive, queue, compute, send, total.")
                    .Register(*registry_);
  tokens_ = UnlabelledCounter(*registry_, "lossd_tokens_total", "Non-ignored tokens computed.");
  bytes_in_ = UnlabelledCounter(*registry_, "lossd_bytes_received_total", "Tensor bytes received.");
  bytes_out_ = UnlabelledCounter(*registry_, "lossd_bytes_sent_total", "Tensor bytes sent.");
  flops_ = UnlabelledCounter(
      *registry_, "lossd_compute_flops_total",
      "Floating-point operations done (6 BT H V per Compute); rate() is FLOP/s.");
  gemm_tunings_ = UnlabelledCounter(
      *registry_, "lossd_gemm_tunings_total",
      "GEMM algorithm choices timed by the CUDA backend's autotuning (new shapes only).");
  tflops_ = UnlabelledGauge(*registry_, "lossd_last_compute_tflops",
                            "Achieved TFLOP/s of the last Compute (6 BT H V / compute time).");
  in_flight_ =
      UnlabelledGauge(*registry_, "lossd_requests_in_flight", "RPCs started and not yet finished.");
  head_steps_ = &prometheus::BuildCounter()
                     .Name("lossd_head_steps_total")
                     .Help("Hosted-head Step barriers that completed, by outcome: applied, "
                           "skipped, reduced (a REDUCE phase) or failed.")
                     .Register(*registry_);
  // From a small head's update (tens of microseconds) to a large one's on a CPU (seconds).
  head_step_seconds_ = &prometheus::BuildHistogram()
                            .Name("lossd_head_step_seconds")
                            .Help("Device time of a hosted head's step phase (the update, or "
                                  "the gradient norm of a REDUCE).")
                            .Register(*registry_)
                            .Add({}, prometheus::Histogram::BucketBoundaries{
                                         0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                         0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10});
  head_contributions_ = UnlabelledCounter(
      *registry_, "lossd_head_step_contributions_total",
      "Computes summed into hosted-head steps that completed; per step: divide by the rate "
      "of lossd_head_steps_total{outcome=~\"applied|skipped\"}.");
  head_tokens_ = UnlabelledCounter(*registry_, "lossd_head_step_tokens_total",
                                   "Non-ignored tokens of those Computes.");
  head_grad_norm_ = UnlabelledGauge(
      *registry_, "lossd_head_last_grad_norm",
      "L2 norm of the summed gradient of the last hosted-head step (any head).");
  head_version_ = UnlabelledGauge(*registry_, "lossd_head_last_version",
                                  "Version of the last hosted head that stepped, after its step.");
  // The series the rules read, at 0 (see the class comment).
  for (const char* outcome : kHeadStepOutcomes) head_steps_->Add({{"outcome", outcome}});
  for (const char* method : kLossMethods) {
    for (const char* code : kAlertedCodes) requests_->Add({{"method", method}, {"code", code}});
  }
  PhaseSeries("Compute", "total");
}

void ServerMetrics::CountHeadStep(const char* outcome) {
  head_steps_->Add({{"outcome", outcome}}).Increment();
}

void ServerMetrics::ObserveHeadStep(double seconds) { head_step_seconds_->Observe(seconds); }

void ServerMetrics::AddHeadStepContributions(double contributions, double tokens) {
  head_contributions_->Increment(contributions);
  head_tokens_->Increment(tokens);
}

void ServerMetrics::SetBuildInfo(const std::string& version, const std::string& commit,
                                 const std::string& backend, const std::string& cuda_plugin) {
  prometheus::BuildGauge()
      .Name("lossd_build_info")
      .Help("Always 1; its labels say what is running: the release, the commit it was built "
            "from, the backend in use and the CUDA plugin's ABI version (or none).")
      .Register(*registry_)
      .Add({{"version", version},
            {"commit", commit},
            {"backend", backend},
            {"cuda_plugin", cuda_plugin}})
      .Set(1);
}

void ServerMetrics::CountRequest(const std::string& method, const char* code) {
  requests_->Add({{"method", method}, {"code", code}}).Increment();
}

void ServerMetrics::ObservePhase(const std::string& method, const char* phase,
                                 double seconds) {
  PhaseSeries(method, phase).Observe(seconds);
}

prometheus::Histogram& ServerMetrics::PhaseSeries(const std::string& method,
                                                  const char* phase) {
  // Up to 600 s, the default deadline of lossctl, the C++ and the Python client, so a call
  // that runs into it still lands in a finite bucket (the p99 reads "at the deadline", not
  // "+Inf"); 1200 s for callers who raise it. Never destroyed: a static vector would be freed
  // at exit, after gRPC threads that are not joined (and that TSan cannot order) have read it.
  static const auto* const kBuckets = new prometheus::Histogram::BucketBoundaries{
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
      1,      2.5,   5,      10,    30,    60,    120,  300, 600,  1200};
  return durations_->Add({{"method", method}, {"phase", phase}}, *kBuckets);
}

namespace {

// The probes of the process's exposer, read by civetweb's request hook on its threads.
absl::Mutex g_probes_mu;
HttpProbes* g_probes ABSL_GUARDED_BY(g_probes_mu) = nullptr;

// `head`: a HEAD request, answered with GET's status and headers and no body (RFC 9110 9.3.2).
void Reply(mg_connection* conn, int code, const char* reason, const char* body,
           bool head = false) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
            "Content-Length: %zu\r\nCache-Control: no-store\r\nConnection: close\r\n%s\r\n%s",
            code, reason, std::strlen(body),
            // RFC 9110 15.5.6: a 405 must say which methods the resource takes.
            code == 405 ? "Allow: GET, HEAD\r\n" : "", head ? "" : body);
}

// civetweb's http_error: every error reply it would write itself (a malformed request, say)
// is written here instead, for the same reason as the 404s below.
int AnswerError(mg_connection* conn, int status, const char*) {
  Reply(conn, status, status == 400 ? "Bad Request" : "Error", "request refused\n");
  return 0;  // handled
}

// civetweb's begin_request: answers /healthz and /readyz itself, and every path but /metrics
// with 404, returning the status code; /metrics (0) goes to the exposer's handler. The 404s
// are ours because Debian's civetweb 1.15 crashes writing its own error page for a path no
// handler serves (a GET of /favicon.ico took the process down).
int AnswerRequest(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  const absl::string_view uri =
      info != nullptr && info->local_uri != nullptr ? info->local_uri : "";
  const absl::string_view method =
      info != nullptr && info->request_method != nullptr ? info->request_method : "";
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    Reply(conn, 405, "Method Not Allowed", "method not allowed: GET or HEAD only\n");
    return 405;
  }
  if (uri == "/metrics") {
    if (!head) return 0;
    // prometheus-cpp's handler answers GET alone. A HEAD says the scrape would answer,
    // without collecting (the length is unknown until it has: the header is left out).
    mg_printf(conn,
              "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
              "Cache-Control: no-store\r\nConnection: close\r\n\r\n");
    return 200;
  }
  std::function<bool()> check;
  {
    absl::MutexLock lock(&g_probes_mu);
    if (g_probes != nullptr && uri == "/healthz") check = g_probes->live;
    if (g_probes != nullptr && uri == "/readyz") check = g_probes->ready;
  }
  if (!check) {
    Reply(conn, 404, "Not Found", "not found: lossd serves /metrics, /healthz and /readyz here\n",
          head);
    return 404;
  }
  if (check()) {
    Reply(conn, 200, "OK", "ok\n", head);
    return 200;
  }
  Reply(conn, 503, "Service Unavailable", uri == "/healthz" ? "unhealthy\n" : "not ready\n",
        head);
  return 503;
}

}  // namespace

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetricsExposer(
    const std::string& address, ServerMetrics& metrics, HttpProbes probes) {
  {
    absl::MutexLock lock(&g_probes_mu);
    // Never freed: civetweb's threads may read it until the process ends.
    g_probes = new HttpProbes(std::move(probes));
  }
  // Read by the exposer's server for its life; the same hook for every exposer.
  static const CivetCallbacks* const kCallbacks = [] {
    auto* c = new CivetCallbacks();
    c->begin_request = &AnswerRequest;
    c->http_error = &AnswerError;
    return c;
  }();
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(address, 2, kCallbacks);
  } catch (const std::exception& e) {
    // civetweb reports bind failures (and too-small thread stacks) by throwing.
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  exposer->RegisterCollectable(metrics.registry());
  exposer->RegisterCollectable(metrics.state_collector());
  exposer->RegisterCollectable(metrics.process_collector());
  return exposer;
}

}  // namespace lossd
