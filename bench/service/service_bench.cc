// End-to-end benchmark of a running lossd: weight upload and gradient download on one
// connection and striped, Compute per micro-batch with W inline, W by handle, and a handle
// plus a server-side accumulator (one striped FetchGradients per step), at 1..N concurrent
// clients, against the loopback ceilings that net_ceiling measured (--ceilings). Prints a
// markdown report with pass/fail per target and writes it to --out. Never checks the numbers
// lossd computes (the test suites do); GB = 1e9 bytes.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/service/striped.h"
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
ABSL_FLAG(std::string, modes, "inline,handle,accum", "Which of inline, handle, accum to run.");
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

using client::ComputeRequest;
using client::ComputeResult;
using client::HostTensor;
using client::LossClient;
using client::OutputBuffer;
using client::OutputTensor;

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double GB(double bytes) { return bytes * 1e-9; }

struct Shape {
  int64_t bt = 0, h = 0, v = 0;
  std::string Name() const { return absl::StrCat("(", bt, ", ", h, ", ", v, ")"); }
  uint64_t XBytes() const { return static_cast<uint64_t>(bt) * h * 2; }
  uint64_t WBytes() const { return static_cast<uint64_t>(v) * h * 2; }
  uint64_t AccBytes() const { return static_cast<uint64_t>(v) * h * 4; }
  double Flops() const { return 6.0 * bt * h * v; }
};

// ---- Data ------------------------------------------------------------------------------

// Page-backed, written once (so no first-touch faults show inside a timed call), reused.
class BufferPool {
 public:
  uint8_t* Take(uint64_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      auto& list = free_[bytes];
      if (!list.empty()) {
        uint8_t* b = list.back();
        list.pop_back();
        return b;
      }
    }
    uint8_t* b = new uint8_t[bytes];
    std::memset(b, 0x5A, bytes);
    return b;
  }
  void Give(uint64_t bytes, uint8_t* b) {
    absl::MutexLock lock(&mu_);
    free_[bytes].push_back(b);
  }
  // Frees every idle buffer (between points, so memory follows the current point).
  void Trim() {
    absl::MutexLock lock(&mu_);
    for (auto& [n, list] : free_) {
      for (uint8_t* b : list) delete[] b;
      list.clear();
    }
  }

 private:
  absl::Mutex mu_;
  std::map<uint64_t, std::vector<uint8_t*>> free_ ABSL_GUARDED_BY(mu_);
};

BufferPool& Pool() {
  static BufferPool* p = new BufferPool;
  return *p;
}

// Uniform bf16 values in [-scale, scale), filled on every core.
void FillBf16(uint16_t* p, uint64_t n, float scale, uint64_t seed) {  // (n) bf16
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t) {
    ts.emplace_back([=] {
      const uint64_t b = n * t / threads, e = n * (t + 1) / threads;
      uint64_t x = seed * 0x9E3779B97F4A7C15ull + t + 1;
      for (uint64_t i = b; i < e; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const float f = (static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale;
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        p[i] = static_cast<uint16_t>(bits >> 16);
      }
    });
  }
  for (auto& t : ts) t.join();
}

// Inputs shared (read-only) by every client of one shape.
struct ShapeData {
  Shape s;
  std::unique_ptr<uint16_t[]> x;      // (BT, H) bf16
  std::vector<int32_t> targets;       // (BT)
};

// ---- One measured point ------------------------------------------------------------------

enum class Mode { kInline, kHandle, kAccum, kAccumNoFetch };

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kInline: return "W inline";
    case Mode::kHandle: return "W by handle";
    case Mode::kAccum: return "handle + accumulator";
    case Mode::kAccumNoFetch: return "handle + accumulator, no fetch";
  }
  return "?";
}

struct Point {
  Shape shape;
  Mode mode = Mode::kHandle;
  int clients = 1;
  std::string error;
  std::vector<double> call_seconds;     // each Compute, client wall
  std::vector<double> compute_seconds;  // each Compute, server compute
  std::vector<double> step_seconds;     // accum: micro-batches + fetch + drop
  std::vector<double> fetch_seconds;    // accum: the striped fetch
  double window_seconds = 0;            // barrier to the last client's end
  uint64_t micro_batches = 0;           // in the window
  double compute_sum = 0;               // in the window
  // Bytes one micro-batch Compute moves, each way.
  uint64_t up_bytes = 0, down_bytes = 0;
  // Overlapped runs: the median compute_seconds of the same calls made without overlap by one
  // client in the same run. An overlapped compute_seconds includes the waits for rows of X
  // still on the wire, so it is no measure of the device's work; this is (0: not measured).
  double plain_compute = 0;

  double PerMicroBatch() const {  // window-amortised
    return micro_batches ? window_seconds / micro_batches : 0;
  }
  // The device's work per call: measured without overlap where that was run.
  double DeviceCompute() const {
    return plain_compute > 0 ? plain_compute : compute_seconds.empty() ? 0 : Median(compute_seconds);
  }
  // Share of the window the device computed: its work per call times the calls.
  double Busy() const {
    if (window_seconds <= 0) return 0;
    return plain_compute > 0 ? plain_compute * micro_batches / window_seconds
                             : compute_sum / window_seconds;
  }
};

struct Env {
  std::string target;
  size_t part_bytes = 4u << 20;
  absl::Duration deadline;
  int stripes = 4;
  int micro_batches = 4;
  int runs = 5;
  bool overlap = true;
};

absl::StatusOr<std::unique_ptr<LossClient>> NewClient(const Env& env, int connections) {
  client::ClientOptions o;
  o.target = env.target;
  o.part_bytes = env.part_bytes;
  o.deadline = env.deadline;
  o.connections = connections;
  o.wait_for_ready = true;
  o.overlap = env.overlap;
  return LossClient::Create(o);
}

// Runs one point: `clients` threads, each with its own connection(s), one untimed warm-up
// call (or step), then env.runs timed calls (steps) between two barriers.
Point RunPoint(const Env& env, const ShapeData& d, const uint8_t* w, const std::string& handle,
               Mode mode, int clients) {
  Point pt;
  pt.shape = d.s;
  pt.mode = mode;
  pt.clients = clients;
  const Shape& s = d.s;
  const bool accum = mode == Mode::kAccum || mode == Mode::kAccumNoFetch;
  const bool want_dw = !accum;
  pt.up_bytes = s.XBytes() + s.bt * 4 + (mode == Mode::kInline ? s.WBytes() : 0);
  pt.down_bytes = s.XBytes() + (want_dw ? s.WBytes() : 0);

  absl::Mutex mu;
  absl::Barrier* start = new absl::Barrier(clients + 1);
  absl::Barrier* stop = new absl::Barrier(clients + 1);
  std::vector<std::string> errors(clients);
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      std::string& err = errors[c];
      auto lc = NewClient(env, 1);
      std::unique_ptr<StripedTransfer> fetcher;
      if (mode == Mode::kAccum) {
        fetcher = std::make_unique<StripedTransfer>(env.target, env.stripes, env.part_bytes,
                                                    env.deadline);
      }
      uint8_t* dx = Pool().Take(s.XBytes());
      uint8_t* dw = want_dw ? Pool().Take(s.WBytes()) : nullptr;
      uint8_t* acc = mode == Mode::kAccum ? Pool().Take(s.AccBytes()) : nullptr;
      const std::string acc_name = absl::StrCat("bench-", s.bt, "-", c);
      if (!lc.ok()) err = lc.status().ToString();

      ComputeRequest r;
      r.x = HostTensor::View(DType::kBF16, {s.bt, s.h}, d.x.get());
      if (mode == Mode::kInline) {
        r.w = HostTensor::View(DType::kBF16, {s.v, s.h}, w);
      } else {
        r.weight_handle = handle;
      }
      r.targets = HostTensor::View(DType::kI32, {s.bt}, d.targets.data());
      r.want.dx = true;
      r.want.dw = want_dw;
      r.output_into[OutputTensor::kDx] = OutputBuffer{dx, s.XBytes()};
      if (want_dw) r.output_into[OutputTensor::kDw] = OutputBuffer{dw, s.WBytes()};
      if (accum) {
        r.accumulator = acc_name;
        r.options.grad_scale = 1.0f / env.micro_batches;
      }

      std::vector<double> calls, computes, steps, fetches;
      double compute_sum = 0;
      uint64_t mbs = 0;
      // One Compute; records it when `timed`.
      auto one = [&](bool timed) -> bool {
        const auto t0 = Clock::now();
        absl::StatusOr<ComputeResult> res = (*lc)->Compute(r);
        const double wall = Since(t0);
        if (!res.ok()) {
          err = absl::StrCat("Compute: ", res.status().ToString());
          return false;
        }
        if (timed) {
          calls.push_back(wall);
          computes.push_back(res->compute_seconds);
          compute_sum += res->compute_seconds;
          ++mbs;
        }
        return true;
      };
      // One unit of work: a call, or (accum) micro_batches calls + fetch + drop.
      auto unit = [&](bool timed) -> bool {
        if (!accum) return one(timed);
        const auto t0 = Clock::now();
        for (int m = 0; m < env.micro_batches; ++m) {
          if (!one(timed)) return false;
        }
        if (mode == Mode::kAccumNoFetch) return true;
        const auto f0 = Clock::now();
        absl::Status fs = fetcher->FetchGradients(acc_name, s.AccBytes(), acc);
        const double fetch = Since(f0);
        if (fs.ok()) fs = (*lc)->DropAccumulator(acc_name);
        if (!fs.ok()) {
          err = absl::StrCat("fetch/drop: ", fs.ToString());
          return false;
        }
        if (timed) {
          steps.push_back(Since(t0));
          fetches.push_back(fetch);
        }
        return true;
      };
      if (err.empty()) unit(false);
      start->Block();
      if (err.empty()) {
        for (int i = 0; i < env.runs && unit(true); ++i) {
        }
      }
      stop->Block();
      if (mode == Mode::kAccumNoFetch && err.empty()) (void)(*lc)->DropAccumulator(acc_name);
      Pool().Give(s.XBytes(), dx);
      if (dw != nullptr) Pool().Give(s.WBytes(), dw);
      if (acc != nullptr) Pool().Give(s.AccBytes(), acc);
      absl::MutexLock lock(&mu);
      pt.call_seconds.insert(pt.call_seconds.end(), calls.begin(), calls.end());
      pt.compute_seconds.insert(pt.compute_seconds.end(), computes.begin(), computes.end());
      pt.step_seconds.insert(pt.step_seconds.end(), steps.begin(), steps.end());
      pt.fetch_seconds.insert(pt.fetch_seconds.end(), fetches.begin(), fetches.end());
      pt.compute_sum += compute_sum;
      pt.micro_batches += mbs;
    });
  }
  start->Block();
  const auto t0 = Clock::now();
  stop->Block();
  pt.window_seconds = Since(t0);
  for (auto& t : threads) t.join();
  delete start;
  delete stop;
  for (const std::string& e : errors) {
    if (!e.empty()) {
      pt.error = e;
      break;
    }
  }
  return pt;
}

// ---- Transfers ---------------------------------------------------------------------------

struct Transfer {
  std::string name;
  uint64_t bytes = 0;
  int connections = 1;
  bool upload = true;
  std::vector<double> seconds;
  std::vector<double> header_seconds;  // fetches: time to the header (the server's snapshot)
  std::string error;
  double Gbps() const {
    const double m = Median(seconds);
    return m > 0 ? GB(bytes) / m : 0;
  }
};

// PutWeights and FetchGradients of the first shape's W and fp32 dW: on one connection and
// striped (raw client), and through LossClient on one connection.
std::vector<Transfer> RunTransfers(const Env& env, const Shape& s, const uint8_t* w,
                                   const std::string& handle, LossClient* lc, int runs) {
  std::vector<Transfer> out;
  std::string striped_handle;  // kept to check that it computes what the plain handle does
  for (const int n : {1, env.stripes}) {
    Transfer t{absl::StrCat("PutWeights, raw client"), s.WBytes(), n, true};
    StripedTransfer x(env.target, n, env.part_bytes, env.deadline);
    for (int i = -1; i < runs && t.error.empty(); ++i) {
      const auto t0 = Clock::now();
      absl::StatusOr<std::string> h = x.PutWeights(w, s.v, s.h);
      const double sec = Since(t0);
      if (!h.ok()) {
        t.error = h.status().ToString();
        break;
      }
      if (i >= 0) t.seconds.push_back(sec);
      if (n > 1 && i + 1 == runs) {
        striped_handle = *h;
      } else {
        (void)lc->DropWeights(*h);
      }
    }
    out.push_back(t);
  }
  {
    Transfer t{"PutWeights, LossClient", s.WBytes(), 1, true};
    HostTensor wt = HostTensor::View(DType::kBF16, {s.v, s.h}, w);
    for (int i = -1; i < runs && t.error.empty(); ++i) {
      const auto t0 = Clock::now();
      auto h = lc->PutWeights(wt, nullptr);
      const double sec = Since(t0);
      if (!h.ok()) {
        t.error = h.status().ToString();
        break;
      }
      if (i >= 0) t.seconds.push_back(sec);
      (void)lc->DropWeights(h->handle);
    }
    out.push_back(t);
  }
  // An accumulator of the full (V, H) from one small Compute.
  const std::string acc = "bench-transfer";
  const int64_t bt = std::min<int64_t>(s.bt, 256);
  std::vector<uint16_t> x(static_cast<size_t>(bt) * s.h);
  FillBf16(x.data(), x.size(), 1.0f, 99);
  std::vector<int32_t> targets(bt);
  for (int64_t i = 0; i < bt; ++i) targets[i] = static_cast<int32_t>((i * 7919) % s.v);
  ComputeRequest r;
  r.x = HostTensor::View(DType::kBF16, {bt, s.h}, x.data());
  r.weight_handle = handle;
  r.targets = HostTensor::View(DType::kI32, {bt}, targets.data());
  r.want.dx = false;
  r.want.dw = false;
  r.accumulator = acc;
  absl::StatusOr<ComputeResult> made = lc->Compute(r);
  if (!striped_handle.empty()) {
    // The striped upload must hold the same W: the same small Compute gives the same loss
    // bit for bit (lossd is deterministic).
    ComputeRequest q = r;
    q.accumulator.clear();
    absl::StatusOr<ComputeResult> a = lc->Compute(q);
    q.weight_handle = striped_handle;
    absl::StatusOr<ComputeResult> b = lc->Compute(q);
    std::string& err = out[1].error;
    if (!a.ok() || !b.ok()) {
      err = absl::StrCat("check compute: ", (a.ok() ? b : a).status().ToString());
    } else if (std::memcmp(&a->loss, &b->loss, sizeof(float)) != 0) {
      err = absl::StrFormat("striped W differs: loss %.9g vs %.9g with the plain upload",
                            b->loss, a->loss);
    }
    (void)lc->DropWeights(striped_handle);
  }
  uint8_t* dst = Pool().Take(s.AccBytes());
  for (const int n : {1, env.stripes}) {
    Transfer t{"FetchGradients (fp32 dW), raw client", s.AccBytes(), n, false};
    if (!made.ok()) t.error = made.status().ToString();
    StripedTransfer x(env.target, n, env.part_bytes, env.deadline);
    for (int i = -1; i < runs && t.error.empty(); ++i) {
      const auto t0 = Clock::now();
      double header = 0;
      absl::Status st = x.FetchGradients(acc, s.AccBytes(), dst, &header);
      const double sec = Since(t0);
      if (!st.ok()) t.error = st.ToString();
      if (i >= 0 && st.ok()) {
        t.seconds.push_back(sec);
        t.header_seconds.push_back(header);
      }
    }
    out.push_back(t);
  }
  {
    Transfer t{"FetchGradients (fp32 dW), LossClient", s.AccBytes(), 1, false};
    if (!made.ok()) t.error = made.status().ToString();
    for (int i = -1; i < runs && t.error.empty(); ++i) {
      const auto t0 = Clock::now();
      auto g = lc->FetchGradients(acc, false);
      const double sec = Since(t0);
      if (!g.ok()) t.error = g.status().ToString();
      if (i >= 0 && g.ok()) t.seconds.push_back(sec);
      // The striped ranges, reassembled, must equal the whole fetch.
      if (i == -1 && g.ok() && out.back().error.empty() &&
          (g->dw.num_bytes() != s.AccBytes() ||
           std::memcmp(g->dw.data(), dst, s.AccBytes()) != 0)) {
        out.back().error = "the striped fetch differs from the whole fetch";
      }
    }
    out.push_back(t);
  }
  Pool().Give(s.AccBytes(), dst);
  (void)lc->DropAccumulator(acc);
  return out;
}

// ---- Report ------------------------------------------------------------------------------

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

std::string Ms(double s) { return absl::StrFormat("%.1f", s * 1e3); }
std::string Num(double v, const char* fmt = "%.2f") { return absl::StrFormat(fmt, v); }
std::string Pct(double v) { return absl::StrFormat("%.0f%%", v * 100); }

struct Target {
  std::string what, measured, needed;
  bool pass = false;
  bool known = true;  // false: an input was missing
  bool info = false;  // printed for comparison, not counted
};

std::string Report(const std::string& header, const std::map<std::string, double>& ceil,
                   const std::vector<Transfer>& transfers, const std::vector<Point>& points,
                   const Env& env, int busy_clients) {
  std::string md;
  auto line = [&](const std::string& l) { absl::StrAppend(&md, l, "\n"); };
  const char* overlap_words = env.overlap
                                  ? "overlapped: dX of the first rows comes back while X goes up"
                                  : "not overlapped: X up, compute, dX down";
  auto c = [&](const std::string& k) {
    auto it = ceil.find(k);
    return it == ceil.end() ? 0.0 : it->second;
  };
  line(header);
  line("");
  line(absl::StrCat("## Loopback ceilings and lossd transfers (GB/s, median; ceilings move ",
                    Num(GB(c("ceiling_bytes")), "%.2f"), " GB per run)"));
  line("");
  line("| path | 1 conn up | 1 conn down | " + std::to_string(env.stripes) + " conn up | " +
       std::to_string(env.stripes) + " conn down |");
  line("|---|---|---|---|---|");
  const std::string n = std::to_string(env.stripes);
  line(absl::StrCat("| plain TCP | ", Num(c("tcp_up_1")), " | ", Num(c("tcp_down_1")), " | ",
                    Num(c("tcp_up_" + n)), " | ", Num(c("tcp_down_" + n)), " |"));
  line(absl::StrCat("| bare gRPC byte stream (no protobuf) | ", Num(c("grpc_up_1")), " | ",
                    Num(c("grpc_down_1")), " | ", Num(c("grpc_up_" + n)), " | ",
                    Num(c("grpc_down_" + n)), " |"));
  auto find = [&](const std::string& prefix, int conns) -> const Transfer* {
    for (const Transfer& t : transfers) {
      if (t.name == prefix && t.connections == conns) return &t;
    }
    return nullptr;
  };
  auto cell = [&](const Transfer* t) -> std::string {
    if (t == nullptr) return "-";
    if (!t->error.empty()) return "error";
    return Num(t->Gbps());
  };
  const Transfer* put1 = find("PutWeights, raw client", 1);
  const Transfer* putn = find("PutWeights, raw client", env.stripes);
  const Transfer* fet1 = find("FetchGradients (fp32 dW), raw client", 1);
  const Transfer* fetn = find("FetchGradients (fp32 dW), raw client", env.stripes);
  const Transfer* putl = find("PutWeights, LossClient", 1);
  const Transfer* fetl = find("FetchGradients (fp32 dW), LossClient", 1);
  line(absl::StrCat("| lossd PutWeights (bf16 W) / FetchGradients (fp32 dW), raw client | ",
                    cell(put1), " | ", cell(fet1), " | ", cell(putn), " | ", cell(fetn), " |"));
  line(absl::StrCat("| same through LossClient | ", cell(putl), " | ", cell(fetl), " | - | - |"));
  auto pct_row = [&](const std::string& what, const std::string& prefix) {
    auto pct = [&](const Transfer* t, double ceiling) -> std::string {
      if (t == nullptr || !t->error.empty() || ceiling <= 0) return "-";
      return Pct(t->Gbps() / ceiling);
    };
    line(absl::StrCat("| lossd raw client as % of ", what, " | ", pct(put1, c(prefix + "up_1")),
                      " | ", pct(fet1, c(prefix + "down_1")), " | ",
                      pct(putn, c(prefix + "up_" + n)), " | ", pct(fetn, c(prefix + "down_" + n)),
                      " |"));
  };
  pct_row("plain TCP", "tcp_");
  pct_row("bare gRPC", "grpc_");
  line("");
  line("Fetch times include the server's device-to-host snapshot, taken before the first byte "
       "is sent (`to header`); upload times include the server's host-to-device copies, made "
       "part by part as they arrive.");
  line("");
  line("| transfer | bytes | connections | median s | runs (s) | to header, median s | GB/s | error |");
  line("|---|---|---|---|---|---|---|---|");
  for (const Transfer& t : transfers) {
    std::vector<std::string> runs;
    for (double s : t.seconds) runs.push_back(Num(s, "%.3f"));
    line(absl::StrCat("| ", t.name, " | ", t.bytes, " | ", t.connections, " | ",
                      Num(Median(t.seconds), "%.3f"), " | ", absl::StrJoin(runs, ", "), " | ",
                      t.header_seconds.empty() ? "-" : Num(Median(t.header_seconds), "%.3f"),
                      " | ", Num(t.Gbps()), " | ", t.error, " |"));
  }
  line("");

  // Compute per shape, from the accum points at 1 client (X in, dX out only).
  line("## Server compute time per Compute (ComputeSummary.compute_seconds, median, ms; of calls without overlap where the run overlaps)");
  line("");
  line("| shape (BT, H, V) | handle + accumulator | W by handle (+ dW to host) | W inline (+ W to device) | TFLOP/s (accumulator) |");
  line("|---|---|---|---|---|");
  std::vector<Shape> shapes;
  for (const Point& p : points) {
    bool seen = false;
    for (const Shape& s : shapes) seen |= s.bt == p.shape.bt && s.h == p.shape.h && s.v == p.shape.v;
    if (!seen) shapes.push_back(p.shape);
  }
  auto compute_of = [&](const Shape& s, Mode m) -> double {
    for (const Point& p : points) {
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
    line(absl::StrCat("| ", s.Name(), " | ", a > 0 ? Ms(a) : "-", " | ", h > 0 ? Ms(h) : "-",
                      " | ", i > 0 ? Ms(i) : "-", " | ",
                      a > 0 ? Num(s.Flops() / a * 1e-12, "%.3g") : "-", " |"));
  }
  line("");

  // End to end.
  const double up1 = c("tcp_up_1") * 1e9, down1 = c("tcp_down_1") * 1e9;
  auto bound = [&](const Point& p) {
    const double wire = (up1 > 0 && down1 > 0) ? p.up_bytes / up1 + p.down_bytes / down1 : 0;
    return std::max(p.DeviceCompute(), wire);
  };
  line("## End to end per micro-batch (ms; bf16; one connection per client)");
  line("");
  line("`latency`: median wall time of one Compute call at the client. `amortised`: timed window / "
       "micro-batches done by all clients (accumulator: the step's fetch and drop included). "
       "`compute`: median compute_seconds of the point's calls (overlapped, this includes the "
       "waits for rows of X); `no overlap`: the same calls without overlap, one client, same "
       "run. `bound`: max(device compute (`no overlap` where measured), the call's bytes at the "
       "plain-TCP one-connection rate, up then down). `GPU busy`: device compute x calls / "
       "window.");
  line("");
  line("| shape | mode | clients | latency | amortised | step (fetch) | compute | no overlap | MB up / down per call | bound | amortised / bound | GPU busy | error |");
  line("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
  for (const Point& p : points) {
    const double b = bound(p);
    line(absl::StrCat(
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
  line("");

  // Targets.
  std::vector<Target> targets;
  auto ratio_target = [&](const std::string& what, const Transfer* t, double ceiling,
                          double need) {
    Target x;
    x.what = what;
    x.needed = absl::StrCat(">= ", Pct(need), " of ", Num(ceiling), " GB/s");
    x.known = t != nullptr && t->error.empty() && ceiling > 0 && !t->seconds.empty();
    const double r = x.known ? t->Gbps() / ceiling : 0;
    x.measured = x.known ? absl::StrCat(Num(t->Gbps()), " GB/s = ", Pct(r)) : "missing";
    x.pass = x.known && r >= need;
    targets.push_back(x);
  };
  ratio_target("1 conn upload (PutWeights, raw client) vs plain TCP 1 conn", put1, c("tcp_up_1"),
               0.85);
  ratio_target("1 conn download (FetchGradients, raw client) vs plain TCP 1 conn", fet1,
               c("tcp_down_1"), 0.85);
  ratio_target("1 conn upload through LossClient vs plain TCP 1 conn", putl, c("tcp_up_1"), 0.85);
  ratio_target("1 conn download through LossClient vs plain TCP 1 conn", fetl, c("tcp_down_1"),
               0.85);
  ratio_target(absl::StrCat("striped ", n, " conn upload of W vs plain TCP ", n, " conn"), putn,
               c("tcp_up_" + n), 0.75);
  ratio_target(absl::StrCat("striped ", n, " conn download of fp32 dW vs plain TCP ", n, " conn"),
               fetn, c("tcp_down_" + n), 0.75);
  // Per micro-batch with a weight handle: the bound counts the call's own bytes (X up, dX
  // down) and its compute, so the counted figure is one call's time: the latency of a single
  // client, and, with several clients sharing the GPU, the window per micro-batch without the
  // per-step fetch (whose 2 GiB are not in the bound). The step with its fetch amortised over
  // the micro-batches is printed beside them, for information.
  for (const Point& p : points) {
    if (p.mode != Mode::kAccum && p.mode != Mode::kAccumNoFetch) continue;
    const double b = bound(p);
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
      targets.push_back(x);
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
  for (const Point& p : points) {
    if (p.mode != Mode::kAccumNoFetch) continue;
    Target x;
    x.what = absl::StrCat("GPU busy, ", p.clients, " clients, ", p.shape.Name(),
                          ", handle + accumulator (device compute x calls / wall)");
    x.known = p.error.empty() && p.window_seconds > 0;
    x.needed = ">= 85%";
    x.measured = x.known ? Pct(p.Busy()) : "missing";
    x.pass = x.known && p.Busy() >= 0.85;
    targets.push_back(x);
  }
  for (const Point& p : points) {
    if (p.mode != Mode::kAccum || p.clients != busy_clients || points.empty() ||
        p.shape.bt != points.back().shape.bt || p.shape.v != points.back().shape.v) {
      continue;
    }
    Target x;
    x.what = absl::StrCat("GPU busy, ", p.clients, " clients, ", p.shape.Name(),
                          ", handle + accumulator with the per-step fetch");
    x.info = true;
    x.known = p.error.empty() && p.window_seconds > 0;
    x.needed = ">= 85%";
    x.measured = x.known ? Pct(p.Busy()) : "missing";
    x.pass = x.known && p.Busy() >= 0.85;
    targets.push_back(x);
  }
  line("## Targets");
  line("");
  line("| target | measured | needed | result |");
  line("|---|---|---|---|");
  int passed = 0, failed = 0;
  for (const Target& t : targets) {
    std::string res = !t.known ? "MISSING" : t.pass ? "PASS" : "FAIL";
    if (t.info) {
      res = absl::StrCat("(", res == "PASS" ? "met" : res == "FAIL" ? "not met" : res,
                         ", for information)");
    } else {
      (t.known && t.pass ? passed : failed)++;
    }
    line(absl::StrCat("| ", t.what, " | ", t.measured, " | ", t.needed, " | ", res, " |"));
  }
  line("");
  line(absl::StrCat("targets: ", passed, " passed, ", failed, " failed or missing"));
  return md;
}

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

int Main() {
  const auto started = Clock::now();
  client::TuneMallocForLargeMessages();
  Env env;
  env.target = absl::GetFlag(FLAGS_target);
  env.part_bytes = absl::GetFlag(FLAGS_part_bytes);
  env.deadline = absl::Seconds(absl::GetFlag(FLAGS_deadline_s));
  env.stripes = std::max(1, absl::GetFlag(FLAGS_stripes));
  env.micro_batches = std::max(1, absl::GetFlag(FLAGS_micro_batches));
  env.runs = std::max(1, absl::GetFlag(FLAGS_runs));
  env.overlap = absl::GetFlag(FLAGS_overlap);

  std::vector<Shape> shapes;
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',', absl::SkipEmpty())) {
    std::vector<std::string> d = absl::StrSplit(t, 'x');
    Shape s;
    if (d.size() != 3 || !absl::SimpleAtoi(d[0], &s.bt) || !absl::SimpleAtoi(d[1], &s.h) ||
        !absl::SimpleAtoi(d[2], &s.v) || s.bt < 1 || s.h < 1 || s.v < 1) {
      std::fprintf(stderr, "bad shape '%s' (want BTxHxV)\n", std::string(t).c_str());
      return 2;
    }
    shapes.push_back(s);
  }
  if (shapes.empty()) return 2;
  std::vector<std::vector<int>> clients;
  for (absl::string_view l : absl::StrSplit(absl::GetFlag(FLAGS_clients), '|')) {
    clients.push_back(Ints(l));
  }
  std::vector<Mode> modes;
  for (absl::string_view m : absl::StrSplit(absl::GetFlag(FLAGS_modes), ',', absl::SkipEmpty())) {
    if (m == "inline") modes.push_back(Mode::kInline);
    else if (m == "handle") modes.push_back(Mode::kHandle);
    else if (m == "accum") modes.push_back(Mode::kAccum);
    else {
      std::fprintf(stderr, "unknown mode '%s'\n", std::string(m).c_str());
      return 2;
    }
  }

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
  const std::string header = absl::StrCat(
      "# lossd service benchmark\n\nserver: lossd ", info->version, ", backend ", info->backend,
      ", device ", info->device, "; client: ", std::thread::hardware_concurrency(),
      " cores, loopback; ", absl::FormatTime("%Y-%m-%d %H:%M UTC", absl::Now(), absl::UTCTimeZone()),
      "; parts of ", env.part_bytes, " bytes; ", env.runs, " timed calls (steps) per client per "
      "point, ", absl::GetFlag(FLAGS_transfer_runs), " per transfer; ", env.micro_batches,
      " micro-batches per step; striping over ", env.stripes, " connections; Computes ",
      env.overlap ? "overlapped (ComputeHeader.overlap)" : "not overlapped");
  Log(absl::StrCat("server: ", info->backend, " ", info->device));

  // W: one bf16 (V, H) per distinct (V, H), alive for the process (borrowed slices).
  std::map<std::pair<int64_t, int64_t>, uint16_t*> weights;
  for (const Shape& s : shapes) {
    auto key = std::make_pair(s.v, s.h);
    if (weights.count(key)) continue;
    uint16_t* w = new uint16_t[static_cast<size_t>(s.v) * s.h];
    FillBf16(w, static_cast<uint64_t>(s.v) * s.h, 0.02f, 7);
    weights[key] = w;
  }
  auto wptr = [&](const Shape& s) {
    return reinterpret_cast<const uint8_t*>(weights[std::make_pair(s.v, s.h)]);
  };

  std::vector<Transfer> transfers;
  std::vector<Point> points;
  // Handles, one per (V, H), made through LossClient.
  std::map<std::pair<int64_t, int64_t>, std::string> handles;
  for (const Shape& s : shapes) {
    auto key = std::make_pair(s.v, s.h);
    if (handles.count(key)) continue;
    auto h = (*lc)->PutWeights(HostTensor::View(DType::kBF16, {s.v, s.h}, wptr(s)), nullptr);
    if (!h.ok()) {
      std::fprintf(stderr, "PutWeights: %s\n", h.status().ToString().c_str());
      return 1;
    }
    handles[key] = h->handle;
  }

  Log("transfers");
  transfers = RunTransfers(env, shapes[0], wptr(shapes[0]),
                           handles[std::make_pair(shapes[0].v, shapes[0].h)], lc->get(),
                           std::max(1, absl::GetFlag(FLAGS_transfer_runs)));
  for (const Transfer& t : transfers) {
    Log(absl::StrCat(t.name, " x", t.connections, ": ", Num(t.Gbps()), " GB/s ", t.error));
  }
  Pool().Trim();

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

  // The plan, most important first (what the targets need), so a time budget cuts the least
  // important points: accumulator points at <= 4 clients, the GPU-busy point, handle and
  // inline at <= 4 clients, then above 4 clients in the same order.
  struct Planned {
    size_t shape;
    Mode mode;
    int clients;
    int priority;
  };
  std::vector<Planned> plan;
  const int busy_n = std::max(1, absl::GetFlag(FLAGS_busy_clients));
  for (size_t si = 0; si < shapes.size(); ++si) {
    for (Mode m : modes) {
      for (int n : clients[std::min(si, clients.size() - 1)]) {
        const int base = m == Mode::kAccum ? 0 : m == Mode::kHandle ? 2 : 3;
        plan.push_back({si, m, n, (n > 4 ? 4 : 0) + base});
      }
    }
  }
  plan.push_back({shapes.size() - 1, Mode::kAccumNoFetch, busy_n, 1});
  std::stable_sort(plan.begin(), plan.end(),
                   [](const Planned& x, const Planned& y) { return x.priority < y.priority; });

  const std::map<std::string, double> ceilings = ReadCeilings(absl::GetFlag(FLAGS_ceilings));
  const int budget_s = absl::GetFlag(FLAGS_budget_s);
  std::vector<std::string> skipped;
  // Points in display order: by shape, then mode, then clients.
  auto sorted = [&] {
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
  };
  auto write_report = [&]() -> std::string {
    std::string md = Report(header, ceilings, transfers, sorted(), env, busy_n);
    if (!skipped.empty()) {
      absl::StrAppend(&md, "\nskipped (time budget of ", budget_s, " s): ",
                      absl::StrJoin(skipped, "; "), "\n");
    }
    if (!absl::GetFlag(FLAGS_out).empty()) {
      std::ofstream f(absl::GetFlag(FLAGS_out));
      f << md;
    }
    return md;
  };
  std::map<std::pair<size_t, int>, double> plain_compute;  // (shape, mode) -> seconds
  for (const Planned& q : plan) {
    const Shape& s = shapes[q.shape];
    const std::string name = absl::StrCat(s.Name(), " ", ModeName(q.mode), " x", q.clients);
    if (budget_s > 0 && Since(started) > budget_s) {
      skipped.push_back(name);
      Log(absl::StrCat("skipped: ", name));
      continue;
    }
    Log(name);
    const std::string& handle = handles[std::make_pair(s.v, s.h)];
    // Overlapped: the device's work per call, from the same calls without overlap (once per
    // shape and kind of call; accumulating calls are timed without the fetch).
    double plain = 0;
    if (env.overlap) {
      const Mode cm = q.mode == Mode::kAccum ? Mode::kAccumNoFetch : q.mode;
      const auto key = std::make_pair(q.shape, static_cast<int>(cm));
      auto it = plain_compute.find(key);
      if (it == plain_compute.end()) {
        Env plain_env = env;
        plain_env.overlap = false;
        const Point c = RunPoint(plain_env, data[q.shape], wptr(s), handle, cm, 1);
        const double m = c.error.empty() ? Median(c.compute_seconds) : 0;
        Log(absl::StrCat("  without overlap: compute ", Ms(m), " ms ", c.error));
        it = plain_compute.emplace(key, m).first;
      }
      plain = it->second;
    }
    points.push_back(RunPoint(env, data[q.shape], wptr(s), handle, q.mode, q.clients));
    points.back().plain_compute = plain;
    const Point& p = points.back();
    Log(absl::StrCat("  latency ", Ms(Median(p.call_seconds)), " ms, amortised ",
                     Ms(p.PerMicroBatch()), " ms, compute ", Ms(Median(p.compute_seconds)),
                     " ms, busy ", Pct(p.Busy()), " ", p.error));
    Pool().Trim();
    write_report();
  }
  for (auto& [key, h] : handles) (void)(*lc)->DropWeights(h);

  const std::string md = write_report();
  std::fputs(md.c_str(), stdout);
  std::fflush(stdout);
  // Missed targets are results; a failed call is not: exit non-zero so a script notices.
  int errors = 0;
  for (const Transfer& t : transfers) errors += !t.error.empty();
  for (const Point& p : points) errors += !p.error.empty();
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
