// SPDX-License-Identifier: Apache-2.0
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
  const bool want_dw = !accum && mode != Mode::kHead;
  ComputeRequest r;
  r.x = HostTensor::View(DType::kBF16, {s.bt, s.h}, d.x.get());
  if (mode == Mode::kInline) {
    r.w = HostTensor::View(DType::kBF16, {s.v, s.h}, w);
  } else if (mode == Mode::kHead) {
    r.head = acc_name;  // the point's head; version, rank and micro-batch per call
    r.options.grad_scale = 1.0f / env.micro_batches;
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

// Head mode: the point's head, one for all its clients (ranks).
std::string HeadName(const Shape& s, int clients) {
  return absl::StrCat("bench-head-", s.bt, "-", s.v, "-", clients);
}

// Creates the point's head from the shape's bf16 W (the master is its upcast), AdamW with
// torch's defaults; "" or the error.
std::string CreatePointHead(const Env& env, const Shape& s, const uint8_t* w, int clients) {
  auto lc = NewClient(env, 1);
  if (!lc.ok()) return lc.status().ToString();
  client::CreateHeadRequest req;
  req.name = HeadName(s, clients);
  req.w = HostTensor::View(DType::kBF16, {s.v, s.h}, w);
  req.compute_dtype = DType::kBF16;
  (void)(*lc)->DropHead(req.name);  // a run cut short may have left it
  auto created = (*lc)->CreateHead(req);
  return created.ok() ? "" : absl::StrCat("CreateHead: ", created.status().ToString());
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
               Mode mode, int c, int clients, absl::Barrier* start, absl::Barrier* stop,
               absl::Mutex* mu, Point* pt, std::string* error) {
  std::string& err = *error;
  const Shape& s = d.s;
  const bool head = mode == Mode::kHead;
  const bool accum = mode == Mode::kAccum || mode == Mode::kAccumNoFetch || head;
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
  const std::string acc_name =
      head ? HeadName(s, clients) : absl::StrCat("bench-", s.bt, "-", c);
  if (!lc.ok()) err = lc.status().ToString();

  ComputeRequest r = PointRequest(env, d, w, handle, mode, acc_name, dx, dw);
  if (head) r.rank = c;  // the head's key fields are refused on a Compute that names no head
  uint64_t version = 0, micro_batch = 0;  // head mode: where this rank's step stands
  ClientTimes times;
  // One Compute; records it when `timed`.
  auto one = [&](bool timed) -> bool {
    const auto t0 = Clock::now();
    if (head) {
      r.head_version = version;
      r.micro_batch = micro_batch++;
    }
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
    if (head) {
      const auto f0 = Clock::now();
      client::StepRequest step;
      step.head = acc_name;
      step.version = version;
      step.rank = c;
      step.world_size = clients;
      absl::StatusOr<client::StepResult> sr = (*lc)->Step(step);
      if (!sr.ok()) {
        err = absl::StrCat("Step: ", sr.status().ToString());
        return false;
      }
      version = sr->version;
      if (timed) {
        times.fetches.push_back(Since(f0));
        times.steps.push_back(Since(t0));
      }
      return true;
    }
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
  const bool accum = mode == Mode::kAccum || mode == Mode::kAccumNoFetch || mode == Mode::kHead;
  const bool want_dw = !accum;
  if (mode == Mode::kHead) {
    pt.error = CreatePointHead(env, s, w, clients);
    if (!pt.error.empty()) return pt;
  }
  pt.up_bytes = s.XBytes() + s.bt * 4 + (mode == Mode::kInline ? s.WBytes() : 0);
  pt.down_bytes = s.XBytes() + (want_dw ? s.WBytes() : 0);

  absl::Mutex mu;
  absl::Barrier* start = new absl::Barrier(clients + 1);
  absl::Barrier* stop = new absl::Barrier(clients + 1);
  std::vector<std::string> errors(clients);
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      RunClient(env, d, w, handle, mode, c, clients, start, stop, &mu, &pt, &errors[c]);
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
  if (mode == Mode::kHead) {
    auto lc = NewClient(env, 1);
    if (lc.ok()) (void)(*lc)->DropHead(HeadName(s, clients));
  }
  return pt;
}

}  // namespace bench
}  // namespace lossd
