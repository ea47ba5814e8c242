#include "bench/service/run_point.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "bench/service/striped.h"
#include "client/host_tensor.h"
#include "core/dtype.h"

namespace lossd {
namespace bench {
namespace {

using client::ComputeRequest;
using client::ComputeResult;
using client::HostTensor;
using client::OutputBuffer;
using client::OutputTensor;

// What one client of a point timed.
struct ClientTimes {
  std::vector<double> calls, computes, steps, fetches;
  double compute_sum = 0;
  uint64_t mbs = 0;
};

// The Compute one client repeats: the shape's X and targets, W inline or by handle, dX (and
// dW unless it accumulates) into the client's own buffers.
ComputeRequest PointRequest(const Env& env, const ShapeData& d, const uint8_t* w,
                            const std::string& handle, Mode mode, const std::string& acc_name,
                            uint8_t* dx, uint8_t* dw) {
  const Shape& s = d.s;
  const bool accum = mode == Mode::kAccum || mode == Mode::kAccumNoFetch;
  const bool want_dw = !accum;
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
  return r;
}

void AddTo(const ClientTimes& t, Point* pt) {
  pt->call_seconds.insert(pt->call_seconds.end(), t.calls.begin(), t.calls.end());
  pt->compute_seconds.insert(pt->compute_seconds.end(), t.computes.begin(), t.computes.end());
  pt->step_seconds.insert(pt->step_seconds.end(), t.steps.begin(), t.steps.end());
  pt->fetch_seconds.insert(pt->fetch_seconds.end(), t.fetches.begin(), t.fetches.end());
  pt->compute_sum += t.compute_sum;
  pt->micro_batches += t.mbs;
}

// One client of a point, on its own thread: a warm-up unit, `start`, env.runs timed units,
// `stop`; then its times go into *pt under `mu`, and its first error into *error.
void RunClient(const Env& env, const ShapeData& d, const uint8_t* w, const std::string& handle,
               Mode mode, int c, absl::Barrier* start, absl::Barrier* stop, absl::Mutex* mu,
               Point* pt, std::string* error) {
  std::string& err = *error;
  const Shape& s = d.s;
  const bool accum = mode == Mode::kAccum || mode == Mode::kAccumNoFetch;
  const bool want_dw = !accum;
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

  const ComputeRequest r = PointRequest(env, d, w, handle, mode, acc_name, dx, dw);
  ClientTimes times;
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
      times.calls.push_back(wall);
      times.computes.push_back(res->compute_seconds);
      times.compute_sum += res->compute_seconds;
      ++times.mbs;
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
      times.steps.push_back(Since(t0));
      times.fetches.push_back(fetch);
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
  absl::MutexLock lock(mu);
  AddTo(times, pt);
}

}  // namespace

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
      RunClient(env, d, w, handle, mode, c, start, stop, &mu, &pt, &errors[c]);
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

}  // namespace bench
}  // namespace lossd
