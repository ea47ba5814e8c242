// SPDX-License-Identifier: Apache-2.0
#include "bench/service/transfers.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/service/striped.h"
#include "client/host_tensor.h"
#include "core/dtype.h"

namespace lossd {
namespace bench {
namespace {

using client::ComputeRequest;
using client::ComputeResult;
using client::HostTensor;
using client::LossClient;

// PutWeights of W on one connection and striped (raw client), then through LossClient. The
// last striped upload's handle is kept in *striped_handle; every other upload is dropped.
void PutTransfers(const Env& env, const Shape& s, const uint8_t* w, LossClient* lc, int runs,
                  std::vector<Transfer>* out, std::string* striped_handle) {
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
        *striped_handle = *h;
      } else {
        (void)lc->DropWeights(*h);
      }
    }
    out->push_back(t);
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
    out->push_back(t);
  }
}

// A small Compute (at most 256 rows of X, held in *x and *targets) by `handle` into the
// accumulator `acc`: it makes an accumulator of the full (V, H).
ComputeRequest AccumulatorRequest(const Shape& s, const std::string& handle,
                                  const std::string& acc, std::vector<uint16_t>* x,
                                  std::vector<int32_t>* targets) {
  const int64_t bt = std::min<int64_t>(s.bt, 256);
  x->resize(static_cast<size_t>(bt) * s.h);
  FillBf16(x->data(), x->size(), 1.0f, 99);
  targets->resize(bt);
  for (int64_t i = 0; i < bt; ++i) (*targets)[i] = static_cast<int32_t>((i * 7919) % s.v);
  ComputeRequest r;
  r.x = HostTensor::View(DType::kBF16, {bt, s.h}, x->data());
  r.weight_handle = handle;
  r.targets = HostTensor::View(DType::kI32, {bt}, targets->data());
  r.want.dx = false;
  r.want.dw = false;
  r.accumulator = acc;
  return r;
}

// The striped upload must hold the same W: the same small Compute gives the same loss bit
// for bit (lossd is deterministic). Drops the striped handle.
void CheckStripedWeights(const ComputeRequest& r, const std::string& striped_handle,
                         LossClient* lc, std::string* error) {
  std::string& err = *error;
  ComputeRequest q = r;
  q.accumulator.clear();
  absl::StatusOr<ComputeResult> a = lc->Compute(q);
  q.weight_handle = striped_handle;
  absl::StatusOr<ComputeResult> b = lc->Compute(q);
  if (!a.ok() || !b.ok()) {
    err = absl::StrCat("check compute: ", (a.ok() ? b : a).status().ToString());
  } else if (std::memcmp(&a->loss, &b->loss, sizeof(float)) != 0) {
    err = absl::StrFormat("striped W differs: loss %.9g vs %.9g with the plain upload",
                          b->loss, a->loss);
  }
  (void)lc->DropWeights(striped_handle);
}

// FetchGradients of the accumulator `acc` (made or not, as `made` says) on one connection and
// striped (raw client), then through LossClient, which also checks the striped bytes.
void FetchTransfers(const Env& env, const Shape& s, const std::string& acc,
                    const absl::StatusOr<ComputeResult>& made, LossClient* lc, int runs,
                    std::vector<Transfer>* out) {
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
    out->push_back(t);
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
      if (i == -1 && g.ok() && out->back().error.empty() &&
          (g->dw.num_bytes() != s.AccBytes() ||
           std::memcmp(g->dw.data(), dst, s.AccBytes()) != 0)) {
        out->back().error = "the striped fetch differs from the whole fetch";
      }
    }
    out->push_back(t);
  }
  Pool().Give(s.AccBytes(), dst);
}

}  // namespace

std::vector<Transfer> RunTransfers(const Env& env, const Shape& s, const uint8_t* w,
                                   const std::string& handle, LossClient* lc, int runs) {
  std::vector<Transfer> out;
  std::string striped_handle;  // kept to check that it computes what the plain handle does
  PutTransfers(env, s, w, lc, runs, &out, &striped_handle);
  // An accumulator of the full (V, H) from one small Compute.
  const std::string acc = "bench-transfer";
  std::vector<uint16_t> x;
  std::vector<int32_t> targets;
  const ComputeRequest r = AccumulatorRequest(s, handle, acc, &x, &targets);
  absl::StatusOr<ComputeResult> made = lc->Compute(r);
  if (!striped_handle.empty()) CheckStripedWeights(r, striped_handle, lc, &out[1].error);
  FetchTransfers(env, s, acc, made, lc, runs, &out);
  (void)lc->DropAccumulator(acc);
  return out;
}

}  // namespace bench
}  // namespace lossd
