// SPDX-License-Identifier: Apache-2.0
// lossd's Prometheus metrics (prometheus-cpp), recorded at the edge by the transport: base
// units, `lossd_` prefix. Counters and histograms are updated per request; gauges of server
// state (memory, cache, accumulators, health) are read at scrape time through a callback, so
// they are never stale. The exposer (HTTP /metrics) is started separately on its own port.
#ifndef LOSSD_SERVICE_METRICS_H_
#define LOSSD_SERVICE_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace lossd {

// Server state sampled at scrape time.
struct StateSample {
  double memory_in_use_bytes = 0;
  double memory_budget_bytes = 0;
  double gpu_memory_used_bytes = 0;
  double gpu_memory_total_bytes = 0;
  double gpu_memory_peak_bytes = 0;
  double gpu_memory_held_bytes = 0;    // by the backend now (its caching pool aside)
  double gpu_memory_budget_bytes = 0;  // --device_memory_budget_bytes (0: none)
  double weight_cache_bytes = 0;  // held: cached, and evicted or dropped but still in use
  double weight_cache_budget_bytes = 0;
  double weight_cache_entries = 0;
  double weight_cache_hits = 0;
  double weight_cache_misses = 0;
  double weight_cache_evictions = 0;
  double accumulators = 0;
  double accumulator_bytes = 0;
  double heads = 0;             // hosted heads held
  double head_bytes = 0;        // their memory (master, state, copy, gradient sum)
  double head_budget_bytes = 0; // --head_bytes
  double tickets = 0;           // two-phase log-prob tickets held
  double ticket_bytes = 0;      // what they hold (X, targets, own weight copies)
  double ticket_budget_bytes = 0;  // --ticket_bytes
  double max_tickets = 0;          // --max_tickets
  double tickets_expired = 0;   // tickets freed unconsumed at their TTL, since start
  double queued_requests = 0;
  double host_buffer_pool_bytes = 0;
  double healthy = 1;
};

// The Loss service's methods, as lossd_requests_total{method} names them (the proto's rpc
// names; metrics_test checks the list against lossd.v1.Loss).
extern const char* const kLossMethods[12];

// Every labelled series an alert or recording rule reads (deploy/prometheus/rules) exists from
// the start, at 0: a series that first appears at 1 gives increase() and rate() nothing to
// compare with, so the first failure after a start would never fire its alert. Those are
// lossd_requests_total for every method with OK and each code LossdHighErrorRatio counts,
// lossd_head_steps_total for every outcome, and the Compute total-latency histogram.
class ServerMetrics {
 public:
  explicit ServerMetrics(std::function<StateSample()> sample);

  void CountRequest(const std::string& method, const char* code);
  // phase: receive | queue | compute | send | total
  void ObservePhase(const std::string& method, const char* phase, double seconds);
  void AddTokens(double n) { tokens_->Increment(n); }
  void AddBytesIn(double n) { bytes_in_->Increment(n); }
  void AddBytesOut(double n) { bytes_out_->Increment(n); }
  void AddFlops(double n) { flops_->Increment(n); }
  void AddGemmTunings(double n) { gemm_tunings_->Increment(n); }
  void SetLastTflops(double t) { tflops_->Set(t); }
  void InFlight(int delta) { in_flight_->Increment(delta); }
  // Hosted heads' steps, counted once per barrier (not per rank). outcome: applied | skipped
  // (GradScaler's skip, or a non-finite gradient) | reduced (a REDUCE phase) | failed.
  void CountHeadStep(const char* outcome);
  // The phase's run on the device (StepResult::step_seconds).
  void ObserveHeadStep(double seconds);
  // A completed step's Computes and their non-ignored tokens.
  void AddHeadStepContributions(double contributions, double tokens);
  // The last step's, of whichever head stepped last (no per-head series: heads are many and
  // short-lived, and their names are the clients').
  void SetHeadLastGradNorm(double norm) { head_grad_norm_->Set(norm); }
  void SetHeadLastVersion(double version) { head_version_->Set(version); }
  // lossd_build_info{version,commit,backend,cuda_plugin} = 1, set once at start; the values
  // are those `lossd --version` prints (service/build_info.h).
  void SetBuildInfo(const std::string& version, const std::string& commit,
                    const std::string& backend, const std::string& cuda_plugin);

  std::shared_ptr<prometheus::Registry> registry() { return registry_; }
  std::shared_ptr<prometheus::Collectable> state_collector() { return state_; }
  std::shared_ptr<prometheus::Collectable> process_collector() { return process_; }

 private:
  // The series of `method` and `phase`, created (empty) where it is not yet.
  prometheus::Histogram& PhaseSeries(const std::string& method, const char* phase);

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Histogram>* durations_;
  prometheus::Counter* tokens_;
  prometheus::Counter* bytes_in_;
  prometheus::Counter* bytes_out_;
  prometheus::Counter* flops_;
  prometheus::Counter* gemm_tunings_;
  prometheus::Gauge* tflops_;
  prometheus::Gauge* in_flight_;
  prometheus::Family<prometheus::Counter>* head_steps_;
  prometheus::Histogram* head_step_seconds_;
  prometheus::Counter* head_contributions_;
  prometheus::Counter* head_tokens_;
  prometheus::Gauge* head_grad_norm_;
  prometheus::Gauge* head_version_;
  std::shared_ptr<prometheus::Collectable> state_;
  std::shared_ptr<prometheus::Collectable> process_;  // process_* from /proc
};

// HTTP probes beside /metrics, for orchestrators and load balancers that probe over HTTP:
// GET /healthz answers 200 "ok" while `live()` (the process can do its work: the backend is
// healthy), else 503; GET /readyz answers 200 while `ready()` (it takes new calls: serving,
// not draining), else 503. Unset functions leave their path unanswered (404).
struct HttpProbes {
  std::function<bool()> live;
  std::function<bool()> ready;
};

// Serves /metrics for `metrics` on `address` ("0.0.0.0:9464"; port 0 picks a free one), and
// `probes`. One exposer with probes per process (civetweb's request hook has no user data):
// a later one's probes replace an earlier one's. Returns the exposer (keep it alive) or
// UNAVAILABLE when it cannot listen.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetricsExposer(
    const std::string& address, ServerMetrics& metrics, HttpProbes probes = {});

}  // namespace lossd

#endif  // LOSSD_SERVICE_METRICS_H_
