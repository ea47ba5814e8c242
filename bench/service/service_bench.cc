// SPDX-License-Identifier: Apache-2.0
// End-to-end benchmark of a running lossd: weight upload and gradient download on one
// connection and striped, Compute per micro-batch with W inline, W by handle, and a handle
// plus a server-side accumulator (one striped FetchGradients per step), at 1..N concurrent
// clients, against the loopback ceilings that net_ceiling measured (--ceilings). Prints a
// markdown report with pass/fail per target and writes it to --out. Never checks the numbers
// lossd computes (the test suites do); GB = 1e9 bytes.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/service/bench_common.h"
#include "bench/service/report.h"
#include "bench/service/run_point.h"
#include "bench/service/transfers.h"
#include "client/host_tensor.h"
#include "client/lossd_client.h"
#include "core/dtype.h"

ABSL_FLAG(std::string, target, "localhost:50051", "lossd address.");
ABSL_FLAG(std::string, ceilings, "", "key=value file written by net_ceiling --client.");
ABSL_FLAG(std::string, out, "", "Markdown report file (also printed to stdout).");
ABSL_FLAG(std::string, shapes, "8192x4096x128256,2048x4096x128256",
          "BTxHxV shapes (bf16); the last one is where GPU busy is measured.");
ABSL_FLAG(std::string, clients, "1,4|1,4,16",
          "Concurrent clients per shape, '|' between shapes (the last list repeats).");
ABSL_FLAG(std::string, modes, "inline,handle,accum,head",
          "Which of inline, handle, accum, head (a hosted head) to run.");
ABSL_FLAG(int, runs, 5, "Timed calls per client per point (steps in accum mode); medians.");
ABSL_FLAG(int, transfer_runs, 3, "Timed PutWeights / FetchGradients per variant; medians.");
ABSL_FLAG(int, micro_batches, 4, "Micro-batches per optimizer step (accum mode).");
ABSL_FLAG(int, stripes, 4, "Connections of a striped PutWeights / FetchGradients.");
ABSL_FLAG(int, busy_clients, 4, "Clients of the GPU-busy point (last shape, accum, no fetch).");
ABSL_FLAG(uint64_t, part_bytes, 4u << 20, "Bytes per sent part.");
ABSL_FLAG(bool, overlap, true,
          "Computes overlap transfer with compute (ClientOptions::overlap); false: X up, "
          "compute, dX down one after the other, for comparison.");
ABSL_FLAG(int, deadline_s, 600, "Deadline of every call.");
ABSL_FLAG(int, budget_s, 0,
          "Start no new point after this many seconds (0 = no limit); skipped points are listed.");

namespace lossd {
namespace bench {
namespace {

using client::HostTensor;
using client::LossClient;

std::vector<int> Ints(absl::string_view s) {
  std::vector<int> v;
  for (absl::string_view x : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int n = 0;
    if (absl::SimpleAtoi(x, &n) && n > 0) v.push_back(n);
  }
  return v;
}

void Log(const std::string& s) {
  std::fprintf(stderr, "[%s] %s\n", absl::FormatTime("%H:%M:%S", absl::Now(), absl::UTCTimeZone()).c_str(),
               s.c_str());
  std::fflush(stderr);
}

Env EnvFromFlags() {
  Env env;
  env.target = absl::GetFlag(FLAGS_target);
  env.part_bytes = absl::GetFlag(FLAGS_part_bytes);
  env.deadline = absl::Seconds(absl::GetFlag(FLAGS_deadline_s));
  env.stripes = std::max(1, absl::GetFlag(FLAGS_stripes));
  env.micro_batches = std::max(1, absl::GetFlag(FLAGS_micro_batches));
  env.runs = std::max(1, absl::GetFlag(FLAGS_runs));
  env.overlap = absl::GetFlag(FLAGS_overlap);
  return env;
}

// --shapes, --clients and --modes; false (having said why) when one does not parse.
bool PlanFlags(std::vector<Shape>* shapes, std::vector<std::vector<int>>* clients,
               std::vector<Mode>* modes) {
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',', absl::SkipEmpty())) {
    std::vector<std::string> d = absl::StrSplit(t, 'x');
    Shape s;
    if (d.size() != 3 || !absl::SimpleAtoi(d[0], &s.bt) || !absl::SimpleAtoi(d[1], &s.h) ||
        !absl::SimpleAtoi(d[2], &s.v) || s.bt < 1 || s.h < 1 || s.v < 1) {
      std::fprintf(stderr, "bad shape '%s' (want BTxHxV)\n", std::string(t).c_str());
      return false;
    }
    shapes->push_back(s);
  }
  if (shapes->empty()) return false;
  for (absl::string_view l : absl::StrSplit(absl::GetFlag(FLAGS_clients), '|')) {
    clients->push_back(Ints(l));
  }
  for (absl::string_view m : absl::StrSplit(absl::GetFlag(FLAGS_modes), ',', absl::SkipEmpty())) {
    if (m == "inline") modes->push_back(Mode::kInline);
    else if (m == "handle") modes->push_back(Mode::kHandle);
    else if (m == "accum") modes->push_back(Mode::kAccum);
    else if (m == "head") modes->push_back(Mode::kHead);
    else {
      std::fprintf(stderr, "unknown mode '%s'\n", std::string(m).c_str());
      return false;
    }
  }
  return true;
}

std::string ReportHeader(const Env& env, const client::ServerInfoResult& info) {
  return absl::StrCat(
      "# lossd service benchmark\n\nserver: lossd ", info.version, ", backend ", info.backend,
      ", device ", info.device, "; client: ", std::thread::hardware_concurrency(),
      " cores, loopback; ", absl::FormatTime("%Y-%m-%d %H:%M UTC", absl::Now(), absl::UTCTimeZone()),
      "; parts of ", env.part_bytes, " bytes; ", env.runs, " timed calls (steps) per client per "
      "point, ", absl::GetFlag(FLAGS_transfer_runs), " per transfer; ", env.micro_batches,
      " micro-batches per step; striping over ", env.stripes, " connections; Computes ",
      env.overlap ? "overlapped (ComputeHeader.overlap)" : "not overlapped");
}

std::vector<ShapeData> MakeShapeData(const std::vector<Shape>& shapes) {
  std::vector<ShapeData> data(shapes.size());
  for (size_t si = 0; si < shapes.size(); ++si) {
    const Shape& s = shapes[si];
    ShapeData& d = data[si];
    d.s = s;
    d.x.reset(new uint16_t[static_cast<size_t>(s.bt) * s.h]);
    FillBf16(d.x.get(), static_cast<uint64_t>(s.bt) * s.h, 1.0f, 11 + si);
    d.targets.resize(s.bt);
    for (int64_t i = 0; i < s.bt; ++i) {
      d.targets[i] = static_cast<int32_t>((static_cast<uint64_t>(i) * 2654435761u + si) % s.v);
    }
  }
  return data;
}

struct Planned {
  size_t shape;
  Mode mode;
  int clients;
  int priority;
};

// The plan, most important first (what the targets need), so a time budget cuts the least
// important points: accumulator points at <= 4 clients, the GPU-busy point, handle and
// inline at <= 4 clients, then above 4 clients in the same order.
std::vector<Planned> MakePlan(const std::vector<Shape>& shapes,
                              const std::vector<std::vector<int>>& clients,
                              const std::vector<Mode>& modes, int busy_n) {
  std::vector<Planned> plan;
  for (size_t si = 0; si < shapes.size(); ++si) {
    for (Mode m : modes) {
      for (int n : clients[std::min(si, clients.size() - 1)]) {
        const int base = m == Mode::kAccum || m == Mode::kHead ? 0 : m == Mode::kHandle ? 2 : 3;
        plan.push_back({si, m, n, (n > 4 ? 4 : 0) + base});
      }
    }
  }
  plan.push_back({shapes.size() - 1, Mode::kAccumNoFetch, busy_n, 1});
  std::stable_sort(plan.begin(), plan.end(),
                   [](const Planned& x, const Planned& y) { return x.priority < y.priority; });
  return plan;
}

// Points in display order: by shape, then mode, then clients.
std::vector<Point> DisplayOrder(const std::vector<Point>& points,
                                const std::vector<Shape>& shapes) {
  std::vector<Point> v = points;
  auto index = [&](const Point& p) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (shapes[i].bt == p.shape.bt && shapes[i].h == p.shape.h && shapes[i].v == p.shape.v) {
        return i;
      }
    }
    return shapes.size();
  };
  std::stable_sort(v.begin(), v.end(), [&](const Point& x, const Point& y) {
    if (index(x) != index(y)) return index(x) < index(y);
    if (x.mode != y.mode) return static_cast<int>(x.mode) < static_cast<int>(y.mode);
    return x.clients < y.clients;
  });
  return v;
}

// One run of the benchmark: the weights and handles it made, what it measured, what it skipped.
class BenchRun {
 public:
  BenchRun(const Env& env, std::vector<Shape> shapes, LossClient* lc)
      : env_(env), shapes_(std::move(shapes)), lc_(lc) {}

  // W: one bf16 (V, H) per distinct (V, H), alive for the process (borrowed slices); then a
  // handle per (V, H), made through LossClient. False (having said why) when one fails.
  bool MakeWeights() {
    for (const Shape& s : shapes_) {
      auto key = std::make_pair(s.v, s.h);
      if (weights_.count(key)) continue;
      uint16_t* w = new uint16_t[static_cast<size_t>(s.v) * s.h];
      FillBf16(w, static_cast<uint64_t>(s.v) * s.h, 0.02f, 7);
      weights_[key] = w;
    }
    for (const Shape& s : shapes_) {
      auto key = std::make_pair(s.v, s.h);
      if (handles_.count(key)) continue;
      auto h = lc_->PutWeights(HostTensor::View(DType::kBF16, {s.v, s.h}, W(s)), nullptr);
      if (!h.ok()) {
        std::fprintf(stderr, "PutWeights: %s\n", h.status().ToString().c_str());
        return false;
      }
      handles_[key] = h->handle;
    }
    return true;
  }

  void RunTransferPart() {
    Log("transfers");
    transfers_ = RunTransfers(env_, shapes_[0], W(shapes_[0]), Handle(shapes_[0]), lc_,
                              std::max(1, absl::GetFlag(FLAGS_transfer_runs)));
    for (const Transfer& t : transfers_) {
      Log(absl::StrCat(t.name, " x", t.connections, ": ", Num(t.Gbps()), " GB/s ", t.error));
    }
    Pool().Trim();
  }

  // Runs the plan's points in order, skipping what the time budget (from `started`) leaves no
  // room for, and rewrites the report after each point.
  void RunPoints(const std::vector<Planned>& plan, const std::vector<ShapeData>& data,
                 const std::string& header, Clock::time_point started, int busy_n) {
    header_ = header;
    busy_n_ = busy_n;
    ceilings_ = ReadCeilings(absl::GetFlag(FLAGS_ceilings));
    budget_s_ = absl::GetFlag(FLAGS_budget_s);
    for (const Planned& q : plan) {
      const Shape& s = shapes_[q.shape];
      const std::string name = absl::StrCat(s.Name(), " ", ModeName(q.mode), " x", q.clients);
      if (budget_s_ > 0 && Since(started) > budget_s_) {
        skipped_.push_back(name);
        Log(absl::StrCat("skipped: ", name));
        continue;
      }
      Log(name);
      const double plain = PlainCompute(q, data);
      points_.push_back(RunPoint(env_, data[q.shape], W(s), Handle(s), q.mode, q.clients));
      points_.back().plain_compute = plain;
      const Point& p = points_.back();
      Log(absl::StrCat("  latency ", Ms(Median(p.call_seconds)), " ms, amortised ",
                       Ms(p.PerMicroBatch()), " ms, compute ", Ms(Median(p.compute_seconds)),
                       " ms, busy ", Pct(p.Busy()), " ", p.error));
      Pool().Trim();
      WriteReport();
    }
    for (auto& [key, h] : handles_) (void)lc_->DropWeights(h);
  }

  // The report, also written to --out.
  std::string WriteReport() const {
    std::string md =
        Report(header_, ceilings_, transfers_, DisplayOrder(points_, shapes_), env_, busy_n_);
    if (!skipped_.empty()) {
      absl::StrAppend(&md, "\nskipped (time budget of ", budget_s_, " s): ",
                      absl::StrJoin(skipped_, "; "), "\n");
    }
    if (!absl::GetFlag(FLAGS_out).empty()) {
      std::ofstream f(absl::GetFlag(FLAGS_out));
      f << md;
    }
    return md;
  }

  // Transfers and points that failed.
  int Errors() const {
    int errors = 0;
    for (const Transfer& t : transfers_) errors += !t.error.empty();
    for (const Point& p : points_) errors += !p.error.empty();
    return errors;
  }

 private:
  const uint8_t* W(const Shape& s) {
    return reinterpret_cast<const uint8_t*>(weights_[std::make_pair(s.v, s.h)]);
  }
  const std::string& Handle(const Shape& s) { return handles_[std::make_pair(s.v, s.h)]; }

  // Overlapped: the device's work per call, from the same calls without overlap (once per
  // shape and kind of call; accumulating calls are timed without the fetch). 0 otherwise.
  double PlainCompute(const Planned& q, const std::vector<ShapeData>& data) {
    if (!env_.overlap) return 0;
    const Shape& s = shapes_[q.shape];
    // A head's Compute is an accumulating one on the device (its copy, its step's sum).
    const Mode cm =
        q.mode == Mode::kAccum || q.mode == Mode::kHead ? Mode::kAccumNoFetch : q.mode;
    const auto key = std::make_pair(q.shape, static_cast<int>(cm));
    auto it = plain_compute_.find(key);
    if (it == plain_compute_.end()) {
      Env plain_env = env_;
      plain_env.overlap = false;
      const Point c = RunPoint(plain_env, data[q.shape], W(s), Handle(s), cm, 1);
      const double m = c.error.empty() ? Median(c.compute_seconds) : 0;
      Log(absl::StrCat("  without overlap: compute ", Ms(m), " ms ", c.error));
      it = plain_compute_.emplace(key, m).first;
    }
    return it->second;
  }

  const Env env_;
  const std::vector<Shape> shapes_;
  LossClient* const lc_;
  std::map<std::pair<int64_t, int64_t>, uint16_t*> weights_;
  std::map<std::pair<int64_t, int64_t>, std::string> handles_;
  std::map<std::pair<size_t, int>, double> plain_compute_;  // (shape, mode) -> seconds
  std::vector<Transfer> transfers_;
  std::vector<Point> points_;
  std::vector<std::string> skipped_;
  std::string header_;
  std::map<std::string, double> ceilings_;
  int budget_s_ = 0;
  int busy_n_ = 1;
};

int Main() {
  const auto started = Clock::now();
  client::TuneMallocForLargeMessages();
  const Env env = EnvFromFlags();
  std::vector<Shape> shapes;
  std::vector<std::vector<int>> clients;
  std::vector<Mode> modes;
  if (!PlanFlags(&shapes, &clients, &modes)) return 2;

  auto lc = NewClient(env, 1);
  if (!lc.ok()) {
    std::fprintf(stderr, "%s\n", lc.status().ToString().c_str());
    return 1;
  }
  auto info = (*lc)->ServerInfo();
  if (!info.ok()) {
    std::fprintf(stderr, "ServerInfo: %s\n", info.status().ToString().c_str());
    return 1;
  }
  const std::string header = ReportHeader(env, *info);
  Log(absl::StrCat("server: ", info->backend, " ", info->device));

  BenchRun run(env, shapes, lc->get());
  if (!run.MakeWeights()) return 1;
  run.RunTransferPart();
  const std::vector<ShapeData> data = MakeShapeData(shapes);
  const int busy_n = std::max(1, absl::GetFlag(FLAGS_busy_clients));
  run.RunPoints(MakePlan(shapes, clients, modes, busy_n), data, header, started, busy_n);

  const std::string md = run.WriteReport();
  std::fputs(md.c_str(), stdout);
  std::fflush(stdout);
  // Missed targets are results; a failed call is not: exit non-zero so a script notices.
  const int errors = run.Errors();
  if (errors > 0) {
    std::fprintf(stderr, "service_bench: %d transfer(s) or point(s) failed; see the error column\n",
                 errors);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("service_bench --target=HOST:PORT --ceilings=FILE --out=FILE");
  absl::ParseCommandLine(argc, argv);
  return lossd::bench::Main();
}
