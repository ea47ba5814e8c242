// SPDX-License-Identifier: Apache-2.0
#include "bench/service/report.h"

#include <algorithm>
#include <fstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace lossd {
namespace bench {
namespace {

struct Target {
  std::string what, measured, needed;
  bool pass = false;
  bool known = true;  // false: an input was missing
  bool info = false;  // printed for comparison, not counted
};

// The GPU-busy target of one point: device compute x calls over the wall, at least 85%.
Target BusyTarget(const Point& p, std::string what, bool info = false) {
  Target x;
  x.what = std::move(what);
  x.info = info;
  x.known = p.error.empty() && p.window_seconds > 0;
  x.needed = ">= 85%";
  x.measured = x.known ? Pct(p.Busy()) : "missing";
  x.pass = x.known && p.Busy() >= 0.85;
  return x;
}

// The transfers by name, as the report and the targets look them up.
constexpr char kPutRaw[] = "PutWeights, raw client";
constexpr char kFetchRaw[] = "FetchGradients (fp32 dW), raw client";
constexpr char kPutClient[] = "PutWeights, LossClient";
constexpr char kFetchClient[] = "FetchGradients (fp32 dW), LossClient";

// Writes the report section by section into one string.
class ReportWriter {
 public:
  ReportWriter(const std::map<std::string, double>& ceil, const std::vector<Transfer>& transfers,
               const std::vector<Point>& points, const Env& env, int busy_clients)
      : ceil_(ceil), transfers_(transfers), points_(points), env_(env),
        busy_clients_(busy_clients), n_(std::to_string(env.stripes)) {}

  std::string Write(const std::string& header) {
    Line(header);
    Line("");
    CeilingTable();
    TransferTable();
    ComputeTable();
    EndToEndTable();
    std::vector<Target> targets = TransferTargets();
    PointTargets(&targets);
    BusyTargets(&targets);
    TargetTable(targets);
    return md_;
  }

 private:
  void Line(const std::string& l) { absl::StrAppend(&md_, l, "\n"); }
  // A ceiling by key, 0 when net_ceiling did not write it.
  double C(const std::string& k) const {
    auto it = ceil_.find(k);
    return it == ceil_.end() ? 0.0 : it->second;
  }
  const Transfer* Find(const std::string& prefix, int conns) const {
    for (const Transfer& t : transfers_) {
      if (t.name == prefix && t.connections == conns) return &t;
    }
    return nullptr;
  }
  // max(device compute, the call's bytes at the plain-TCP one-connection rate, up then down).
  double Bound(const Point& p) const {
    const double up1 = C("tcp_up_1") * 1e9, down1 = C("tcp_down_1") * 1e9;
    const double wire = (up1 > 0 && down1 > 0) ? p.up_bytes / up1 + p.down_bytes / down1 : 0;
    return std::max(p.DeviceCompute(), wire);
  }

  void CeilingTable();
  void TransferTable();
  void ComputeTable();
  void EndToEndTable();
  Target RatioTarget(const std::string& what, const Transfer* t, double ceiling,
                     double need) const;
  std::vector<Target> TransferTargets() const;
  void PointTargets(std::vector<Target>* targets) const;
  void BusyTargets(std::vector<Target>* targets) const;
  void HeadTarget(const Point& p, std::vector<Target>* targets) const;
  void TargetTable(const std::vector<Target>& targets);

  const std::map<std::string, double>& ceil_;
  const std::vector<Transfer>& transfers_;
  const std::vector<Point>& points_;
  const Env& env_;
  const int busy_clients_;
  const std::string n_;  // env.stripes, as the ceilings' keys and the headers spell it
  std::string md_;
};

void ReportWriter::CeilingTable() {
  const std::string& n = n_;
  Line(absl::StrCat("## Loopback ceilings and lossd transfers (GB/s, median; ceilings move ",
                    Num(GB(C("ceiling_bytes")), "%.2f"), " GB per run)"));
  Line("");
  Line("| path | 1 conn up | 1 conn down | " + n + " conn up | " + n + " conn down |");
  Line("|---|---|---|---|---|");
  Line(absl::StrCat("| plain TCP | ", Num(C("tcp_up_1")), " | ", Num(C("tcp_down_1")), " | ",
                    Num(C("tcp_up_" + n)), " | ", Num(C("tcp_down_" + n)), " |"));
  Line(absl::StrCat("| bare gRPC byte stream (no protobuf) | ", Num(C("grpc_up_1")), " | ",
                    Num(C("grpc_down_1")), " | ", Num(C("grpc_up_" + n)), " | ",
                    Num(C("grpc_down_" + n)), " |"));
  auto cell = [&](const Transfer* t) -> std::string {
    if (t == nullptr) return "-";
    if (!t->error.empty()) return "error";
    return Num(t->Gbps());
  };
  const Transfer* put1 = Find(kPutRaw, 1);
  const Transfer* putn = Find(kPutRaw, env_.stripes);
  const Transfer* fet1 = Find(kFetchRaw, 1);
  const Transfer* fetn = Find(kFetchRaw, env_.stripes);
  Line(absl::StrCat("| lossd PutWeights (bf16 W) / FetchGradients (fp32 dW), raw client | ",
                    cell(put1), " | ", cell(fet1), " | ", cell(putn), " | ", cell(fetn), " |"));
  Line(absl::StrCat("| same through LossClient | ", cell(Find(kPutClient, 1)), " | ",
                    cell(Find(kFetchClient, 1)), " | - | - |"));
  auto pct_row = [&](const std::string& what, const std::string& prefix) {
    auto pct = [&](const Transfer* t, double ceiling) -> std::string {
      if (t == nullptr || !t->error.empty() || ceiling <= 0) return "-";
      return Pct(t->Gbps() / ceiling);
    };
    Line(absl::StrCat("| lossd raw client as % of ", what, " | ", pct(put1, C(prefix + "up_1")),
                      " | ", pct(fet1, C(prefix + "down_1")), " | ",
                      pct(putn, C(prefix + "up_" + n)), " | ", pct(fetn, C(prefix + "down_" + n)),
                      " |"));
  };
  pct_row("plain TCP", "tcp_");
  pct_row("bare gRPC", "grpc_");
  Line("");
}

void ReportWriter::TransferTable() {
  Line("Fetch times include the server's device-to-host snapshot, taken before the first byte "
       "is sent (`to header`); upload times include the server's host-to-device copies, made "
       "part by part as they arrive.");
  Line("");
  Line("| transfer | bytes | connections | median s | runs (s) | to header, median s | GB/s | error |");
  Line("|---|---|---|---|---|---|---|---|");
  for (const Transfer& t : transfers_) {
    std::vector<std::string> runs;
    for (double s : t.seconds) runs.push_back(Num(s, "%.3f"));
    Line(absl::StrCat("| ", t.name, " | ", t.bytes, " | ", t.connections, " | ",
                      Num(Median(t.seconds), "%.3f"), " | ", absl::StrJoin(runs, ", "), " | ",
                      t.header_seconds.empty() ? "-" : Num(Median(t.header_seconds), "%.3f"),
                      " | ", Num(t.Gbps()), " | ", t.error, " |"));
  }
  Line("");
}

// Compute per shape, from the accum points at 1 client (X in, dX out only).
void ReportWriter::ComputeTable() {
  Line("## Server compute time per Compute (ComputeSummary.compute_seconds, median, ms; of calls without overlap where the run overlaps)");
  Line("");
  Line("| shape (BT, H, V) | handle + accumulator | W by handle (+ dW to host) | W inline (+ W to device) | TFLOP/s (accumulator) |");
  Line("|---|---|---|---|---|");
  std::vector<Shape> shapes;
  for (const Point& p : points_) {
    bool seen = false;
    for (const Shape& s : shapes) seen |= s.bt == p.shape.bt && s.h == p.shape.h && s.v == p.shape.v;
    if (!seen) shapes.push_back(p.shape);
  }
  auto compute_of = [&](const Shape& s, Mode m) -> double {
    for (const Point& p : points_) {
      if (p.shape.bt == s.bt && p.shape.h == s.h && p.shape.v == s.v && p.mode == m &&
          p.clients == 1 && p.error.empty()) {
        return p.DeviceCompute();
      }
    }
    return 0;
  };
  for (const Shape& s : shapes) {
    const double a = compute_of(s, Mode::kAccum), h = compute_of(s, Mode::kHandle),
                 i = compute_of(s, Mode::kInline);
    Line(absl::StrCat("| ", s.Name(), " | ", a > 0 ? Ms(a) : "-", " | ", h > 0 ? Ms(h) : "-",
                      " | ", i > 0 ? Ms(i) : "-", " | ",
                      a > 0 ? Num(s.Flops() / a * 1e-12, "%.3g") : "-", " |"));
  }
  Line("");
}

void ReportWriter::EndToEndTable() {
  Line("## End to end per micro-batch (ms; bf16; one connection per client)");
  Line("");
  Line("`latency`: median wall time of one Compute call at the client. `amortised`: timed window / "
       "micro-batches done by all clients (accumulator: the step's fetch and drop included). "
       "`compute`: median compute_seconds of the point's calls (overlapped, this includes the "
       "waits for rows of X); `no overlap`: the same calls without overlap, one client, same "
       "run. `bound`: max(device compute (`no overlap` where measured), the call's bytes at the "
       "plain-TCP one-connection rate, up then down). `GPU busy`: device compute x calls / "
       "window.");
  Line("");
  Line("| shape | mode | clients | latency | amortised | step (fetch) | compute | no overlap | MB up / down per call | bound | amortised / bound | GPU busy | error |");
  Line("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
  for (const Point& p : points_) {
    const double b = Bound(p);
    Line(absl::StrCat(
        "| ", p.shape.Name(), " | ", ModeName(p.mode), " | ", p.clients, " | ",
        Ms(Median(p.call_seconds)), " | ", Ms(p.PerMicroBatch()), " | ",
        p.step_seconds.empty() ? "-"
                               : absl::StrCat(Ms(Median(p.step_seconds)), " (",
                                              Ms(Median(p.fetch_seconds)), ")"),
        " | ", Ms(Median(p.compute_seconds)), " | ",
        p.plain_compute > 0 ? Ms(p.plain_compute) : "-", " | ", Num(p.up_bytes * 1e-6, "%.4g"), " / ",
        Num(p.down_bytes * 1e-6, "%.4g"), " | ", Ms(b), " | ",
        b > 0 ? Num(p.PerMicroBatch() / b) : "-", " | ", Pct(p.Busy()), " | ", p.error, " |"));
  }
  Line("");
}

Target ReportWriter::RatioTarget(const std::string& what, const Transfer* t, double ceiling,
                                 double need) const {
  Target x;
  x.what = what;
  x.needed = absl::StrCat(">= ", Pct(need), " of ", Num(ceiling), " GB/s");
  x.known = t != nullptr && t->error.empty() && ceiling > 0 && !t->seconds.empty();
  const double r = x.known ? t->Gbps() / ceiling : 0;
  x.measured = x.known ? absl::StrCat(Num(t->Gbps()), " GB/s = ", Pct(r)) : "missing";
  x.pass = x.known && r >= need;
  return x;
}

std::vector<Target> ReportWriter::TransferTargets() const {
  const std::string& n = n_;
  std::vector<Target> targets;
  targets.push_back(RatioTarget("1 conn upload (PutWeights, raw client) vs plain TCP 1 conn",
                                Find(kPutRaw, 1), C("tcp_up_1"), 0.85));
  targets.push_back(RatioTarget("1 conn download (FetchGradients, raw client) vs plain TCP 1 conn",
                                Find(kFetchRaw, 1), C("tcp_down_1"), 0.85));
  targets.push_back(RatioTarget("1 conn upload through LossClient vs plain TCP 1 conn",
                                Find(kPutClient, 1), C("tcp_up_1"), 0.85));
  targets.push_back(RatioTarget("1 conn download through LossClient vs plain TCP 1 conn",
                                Find(kFetchClient, 1), C("tcp_down_1"), 0.85));
  targets.push_back(
      RatioTarget(absl::StrCat("striped ", n, " conn upload of W vs plain TCP ", n, " conn"),
                  Find(kPutRaw, env_.stripes), C("tcp_up_" + n), 0.75));
  targets.push_back(RatioTarget(
      absl::StrCat("striped ", n, " conn download of fp32 dW vs plain TCP ", n, " conn"),
      Find(kFetchRaw, env_.stripes), C("tcp_down_" + n), 0.75));
  return targets;
}

// Per micro-batch with a weight handle: the bound counts the call's own bytes (X up, dX
// down) and its compute, so the counted figure is one call's time: the latency of a single
// client, and, with several clients sharing the GPU, the window per micro-batch without the
// per-step fetch (whose 2 GiB are not in the bound). The step with its fetch amortised over
// the micro-batches is printed beside them, for information.
void ReportWriter::PointTargets(std::vector<Target>* targets) const {
  const char* overlap_words = env_.overlap
                                  ? "overlapped: dX of the first rows comes back while X goes up"
                                  : "not overlapped: X up, compute, dX down";
  for (const Point& p : points_) {
    if (p.mode == Mode::kHead) {
      HeadTarget(p, targets);
      continue;
    }
    if (p.mode != Mode::kAccum && p.mode != Mode::kAccumNoFetch) continue;
    const double b = Bound(p);
    const bool known = p.error.empty() && b > 0 && p.micro_batches > 0;
    const std::string needed = absl::StrCat("<= 1.25 x ", Ms(b), " ms");
    // One target: time `t` per micro-batch against 1.25 x the bound.
    auto add = [&](std::string what, double t, bool info) {
      Target x;
      x.info = info;
      x.what = absl::StrCat("handle + accumulator ", p.shape.Name(), ", ", what, " vs bound");
      x.known = known;
      x.needed = needed;
      x.measured =
          known ? absl::StrCat(Ms(t), " ms = ", Num(t / b), " x") : std::string("missing");
      x.pass = known && t <= 1.25 * b;
      targets->push_back(x);
    };
    if (p.mode == Mode::kAccum && p.clients == 1) {
      add(absl::StrCat("1 client: Compute latency per micro-batch (", overlap_words, ")"),
          Median(p.call_seconds), /*info=*/false);
    }
    if (p.mode == Mode::kAccumNoFetch) {
      add(absl::StrCat(p.clients, " clients: per micro-batch (window / micro-batches, no fetch)"),
          p.PerMicroBatch(), /*info=*/false);
      continue;
    }
    add(absl::StrCat(p.clients,
                     " client(s): amortised per micro-batch (step incl. its fp32 dW fetch)"),
        p.PerMicroBatch(), /*info=*/true);
  }
}

// A hosted head: every client a rank of one head, micro_batches Computes and the Step barrier
// per step, nothing fetched: the step's whole time amortised over its micro-batches against
// 1.25 x the per-call bound; with busy_clients ranks at the last shape, the GPU's share too.
void ReportWriter::HeadTarget(const Point& p, std::vector<Target>* targets) const {
  const double b = Bound(p);
  Target x;
  x.what = absl::StrCat("hosted head ", p.shape.Name(), ", ", p.clients,
                        " rank(s): amortised per micro-batch (incl. the Step) vs bound");
  x.known = p.error.empty() && b > 0 && p.micro_batches > 0;
  x.needed = absl::StrCat("<= 1.25 x ", Ms(b), " ms");
  const double t = p.PerMicroBatch();
  x.measured = x.known ? absl::StrCat(Ms(t), " ms = ", Num(t / b), " x (Step median ",
                                      Ms(Median(p.fetch_seconds)), " ms)")
                       : std::string("missing");
  x.pass = x.known && t <= 1.25 * b;
  targets->push_back(x);
  if (p.clients != busy_clients_ || points_.empty() || p.shape.bt != points_.back().shape.bt ||
      p.shape.v != points_.back().shape.v) {
    return;
  }
  targets->push_back(BusyTarget(p, absl::StrCat("GPU busy, ", p.clients, " ranks, ",
                                                p.shape.Name(),
                                                ", hosted head (device compute x calls / wall)")));
}

void ReportWriter::BusyTargets(std::vector<Target>* targets) const {
  for (const Point& p : points_) {
    if (p.mode != Mode::kAccumNoFetch) continue;
    targets->push_back(
        BusyTarget(p, absl::StrCat("GPU busy, ", p.clients, " clients, ", p.shape.Name(),
                                   ", handle + accumulator (device compute x calls / wall)")));
  }
  for (const Point& p : points_) {
    if (p.mode != Mode::kAccum || p.clients != busy_clients_ || points_.empty() ||
        p.shape.bt != points_.back().shape.bt || p.shape.v != points_.back().shape.v) {
      continue;
    }
    targets->push_back(BusyTarget(p,
                                  absl::StrCat("GPU busy, ", p.clients, " clients, ",
                                               p.shape.Name(),
                                               ", handle + accumulator with the per-step fetch"),
                                  /*info=*/true));
  }
}

void ReportWriter::TargetTable(const std::vector<Target>& targets) {
  Line("## Targets");
  Line("");
  Line("| target | measured | needed | result |");
  Line("|---|---|---|---|");
  int passed = 0, failed = 0;
  for (const Target& t : targets) {
    std::string res = !t.known ? "MISSING" : t.pass ? "PASS" : "FAIL";
    if (t.info) {
      res = absl::StrCat("(", res == "PASS" ? "met" : res == "FAIL" ? "not met" : res,
                         ", for information)");
    } else {
      (t.known && t.pass ? passed : failed)++;
    }
    Line(absl::StrCat("| ", t.what, " | ", t.measured, " | ", t.needed, " | ", res, " |"));
  }
  Line("");
  Line(absl::StrCat("targets: ", passed, " passed, ", failed, " failed or missing"));
}

}  // namespace

std::map<std::string, double> ReadCeilings(const std::string& path) {
  std::map<std::string, double> m;
  if (path.empty()) return m;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    std::vector<std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
    double v = 0;
    if (kv.size() == 2 && absl::SimpleAtod(kv[1], &v)) m[kv[0]] = v;
  }
  return m;
}

std::string Report(const std::string& header, const std::map<std::string, double>& ceil,
                   const std::vector<Transfer>& transfers, const std::vector<Point>& points,
                   const Env& env, int busy_clients) {
  return ReportWriter(ceil, transfers, points, env, busy_clients).Write(header);
}

}  // namespace bench
}  // namespace lossd
