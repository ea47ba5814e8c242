// SPDX-License-Identifier: Apache-2.0
#include "service/metrics.h"

#include <cmath>
#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "proto/lossd/v1/lossd.pb.h"
#include "prometheus/text_serializer.h"

namespace lossd {
namespace {

// Cumulative count per upper bound of lossd_request_duration_seconds{method, phase}.
std::map<double, uint64_t> Buckets(ServerMetrics& m, const std::string& method,
                                   const std::string& phase) {
  std::map<double, uint64_t> out;
  for (const prometheus::MetricFamily& f : m.registry()->Collect()) {
    if (f.name != "lossd_request_duration_seconds") continue;
    for (const prometheus::ClientMetric& c : f.metric) {
      std::map<std::string, std::string> labels;
      for (const auto& l : c.label) labels[l.name] = l.value;
      if (labels["method"] != method || labels["phase"] != phase) continue;
      for (const auto& b : c.histogram.bucket) out[b.upper_bound] = b.cumulative_count;
    }
  }
  return out;
}

// lossctl's --deadline_seconds, ClientOptions::deadline and the Python Client's timeout all
// default to 600 s: a call cut off there must land in a finite bucket, and a longer one
// (a raised deadline) in a later finite bucket, so the quantiles can tell them apart.
TEST(ServerMetricsTest, PhaseBucketsCoverTheClientsDefaultDeadline) {
  ServerMetrics m([] { return StateSample{}; });
  m.ObservePhase("Compute", "total", 0.003);
  m.ObservePhase("Compute", "total", 590.0);
  m.ObservePhase("Compute", "total", 900.0);
  const std::map<double, uint64_t> b = Buckets(m, "Compute", "total");
  for (double bound : {0.005, 300.0, 600.0, 1200.0}) {
    ASSERT_EQ(b.count(bound), 1u) << "no bucket at " << bound << " s";
  }
  EXPECT_EQ(b.at(0.005), 1u);
  EXPECT_EQ(b.at(300), 1u);
  EXPECT_EQ(b.at(600), 2u);
  EXPECT_EQ(b.at(1200), 3u);
  // The last finite bound is above 600 s, and +Inf counts everything.
  auto inf = b.rbegin();
  EXPECT_TRUE(std::isinf(inf->first));
  EXPECT_EQ(inf->second, 3u);
  EXPECT_GE(std::next(inf)->first, 600.0);
}

// Each method and phase is its own series with the same bounds.
TEST(ServerMetricsTest, PhasesAreSeparateSeries) {
  ServerMetrics m([] { return StateSample{}; });
  m.ObservePhase("Compute", "queue", 0.2);
  m.ObservePhase("PutWeights", "total", 45.0);
  const std::map<double, uint64_t> queue = Buckets(m, "Compute", "queue");
  const std::map<double, uint64_t> put = Buckets(m, "PutWeights", "total");
  EXPECT_EQ(queue.size(), put.size());
  EXPECT_EQ(queue.at(0.25), 1u);
  EXPECT_EQ(queue.at(0.1), 0u);
  EXPECT_EQ(put.at(30), 0u);
  EXPECT_EQ(put.at(60), 1u);
  EXPECT_TRUE(Buckets(m, "PutWeights", "queue").empty());
}

// The /metrics text of a fresh registry, as the first scrape after a start reads it.
std::string FirstScrape(ServerMetrics& m) {
  return prometheus::TextSerializer().Serialize(m.registry()->Collect());
}

// LossdHeadStepsFailing is increase(lossd_head_steps_total{outcome="failed"}[15m]) > 0: the
// series must be scraped at 0 before the first failure, or that failure never shows in
// increase() (the series would first appear at 1).
TEST(ServerMetricsTest, EveryAlertedSeriesIsScrapedAtZeroFromTheStart) {
  ServerMetrics m([] { return StateSample{}; });
  const std::string text = FirstScrape(m);
  for (const char* outcome : {"applied", "skipped", "reduced", "failed"}) {
    EXPECT_NE(text.find(std::string("lossd_head_steps_total{outcome=\"") + outcome + "\"} 0\n"),
              std::string::npos)
        << outcome << " missing from:\n" << text;
  }
  // LossdHighErrorRatio's codes, for every method.
  for (const char* method : kLossMethods) {
    for (const char* code : {"OK", "INTERNAL", "UNKNOWN", "UNAVAILABLE", "RESOURCE_EXHAUSTED",
                             "DEADLINE_EXCEEDED", "DATA_LOSS"}) {
      // (prometheus-cpp writes the labels sorted by name.)
      const std::string series = std::string("lossd_requests_total{code=\"") + code +
                                 "\",method=\"" + method + "\"} 0\n";
      EXPECT_NE(text.find(series), std::string::npos) << series;
    }
  }
  // LossdComputeLatencyP99High's buckets.
  EXPECT_NE(text.find("lossd_request_duration_seconds_count{method=\"Compute\",phase=\"total\"} 0"),
            std::string::npos);

  // The first failure moves the series the alert reads from 0 to 1.
  m.CountHeadStep("failed");
  EXPECT_NE(FirstScrape(m).find("lossd_head_steps_total{outcome=\"failed\"} 1\n"),
            std::string::npos);
}

// kLossMethods names every rpc of lossd.v1.Loss, so a new method's series start at 0 too.
TEST(ServerMetricsTest, LossMethodsAreTheServicesRpcs) {
  const google::protobuf::ServiceDescriptor* loss =
      lossd::v1::ComputeRequest::descriptor()->file()->FindServiceByName("Loss");
  ASSERT_NE(loss, nullptr);
  std::set<std::string> rpcs, listed;
  for (int i = 0; i < loss->method_count(); ++i) rpcs.insert(loss->method(i)->name());
  for (const char* method : kLossMethods) listed.insert(method);
  EXPECT_EQ(rpcs, listed);
}

}  // namespace
}  // namespace lossd
