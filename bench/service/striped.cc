// SPDX-License-Identifier: Apache-2.0
#include "bench/service/striped.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "bench/service/raw_wire.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace bench {
namespace {

constexpr char kPutWeightsMethod[] = "/lossd.v1.Loss/PutWeights";
constexpr char kFetchGradientsMethod[] = "/lossd.v1.Loss/FetchGradients";

// [begin, end) of stripe i of n over `total` bytes, cut at multiples of `align`.
std::pair<uint64_t, uint64_t> Range(uint64_t total, int i, int n, uint64_t align) {
  const uint64_t units = total / align;
  const uint64_t b = units * i / n * align;
  const uint64_t e = i + 1 == n ? total : units * (i + 1) / n * align;
  return {b, e};
}

// Runs f(i) for i in [0, n) on n threads and returns the first error.
absl::Status ParallelFor(int n, const std::function<absl::Status(int)>& f) {
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { status[i] = f(i); });
  for (auto& t : threads) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

StripedTransfer::StripedTransfer(const std::string& target, int connections, size_t part_bytes,
                                 absl::Duration deadline)
    : channels_(MakeChannels(target, std::max(1, connections))),
      part_bytes_(part_bytes),
      deadline_(deadline) {
  for (auto& c : channels_) stubs_.push_back(std::make_unique<grpc::GenericStub>(c));
}

absl::StatusOr<std::string> StripedTransfer::PutWeights(const uint8_t* w, int64_t v, int64_t h) {
  static std::atomic<uint64_t> uploads{0};
  const int n = connections();
  const uint64_t total = static_cast<uint64_t>(v) * h * 2;
  v1::PutWeightsRequest head;
  v1::WeightsHeader* hd = head.mutable_header();
  hd->mutable_w()->set_dtype(v1::DTYPE_BF16);
  hd->mutable_w()->add_shape(v);
  hd->mutable_w()->add_shape(h);
  if (n > 1) {
    hd->set_upload_id(absl::StrCat("bench-", getpid(), "-", uploads.fetch_add(1)));
    hd->set_stripes(n);
  }
  std::vector<std::string> handles(n);
  absl::Status s = ParallelFor(n, [&](int i) -> absl::Status {
    const auto [begin, end] = Range(total, i, n, 2);
    v1::PutWeightsRequest mine = head;
    if (n > 1) {
      mine.mutable_header()->set_w_begin(begin);
      mine.mutable_header()->set_w_end(end);
    }
    std::vector<grpc::ByteBuffer> out;
    out.push_back(EncodeSmallMessage(mine));
    for (uint64_t off = begin; off < end; off += part_bytes_) {
      const uint64_t k = std::min<uint64_t>(part_bytes_, end - off);
      out.push_back(EncodeBorrowedPart(v1::TENSOR_W, off, w + off, k));
    }
    auto on = [&](const grpc::ByteBuffer& m) -> absl::Status {
      std::vector<grpc::Slice> slices;
      if (!m.Dump(&slices).ok()) return absl::InternalError("unreadable PutWeights reply");
      std::string bytes;
      for (const auto& x : slices) bytes.append(reinterpret_cast<const char*>(x.begin()), x.size());
      v1::PutWeightsResponse r;
      if (!r.ParseFromString(bytes)) return absl::InternalError("unparsable PutWeights reply");
      handles[i] = r.handle();
      return absl::OkStatus();
    };
    return RunStream(stubs_[i].get(), kPutWeightsMethod, std::move(out), on, deadline_);
  });
  if (!s.ok()) return s;
  for (const std::string& x : handles) {
    if (x.empty() || x != handles[0]) {
      return absl::InternalError(absl::StrCat("stripes answered different handles: '", handles[0],
                                              "' and '", x, "'"));
    }
  }
  return handles[0];
}

absl::Status StripedTransfer::FetchGradients(const std::string& accumulator, uint64_t total_bytes,
                                             uint8_t* dst, double* header_seconds) {
  const int n = connections();
  const auto start = std::chrono::steady_clock::now();
  std::vector<double> header_at(n, 0.0);
  absl::Status status = ParallelFor(n, [&](int i) -> absl::Status {
    const auto [begin, end] = Range(total_bytes, i, n, 4);
    v1::FetchGradientsRequest req;
    req.set_accumulator(accumulator);
    if (n > 1) {
      req.set_range_begin(begin);
      req.set_range_end(end);
    }
    std::vector<grpc::ByteBuffer> out;
    out.push_back(EncodeSmallMessage(req));
    uint64_t dw_bytes = 0, got = 0;
    bool have_header = false;
    ReceivedFrame f;
    auto on = [&](const grpc::ByteBuffer& m) -> absl::Status {
      absl::Status p = f.Parse(m);
      if (!p.ok()) return p;
      if (f.kind() == ReceivedFrame::Kind::kHeader) {
        v1::GradientsHeader g;
        if (!g.ParseFromString(f.header_bytes()) || g.dw().shape_size() != 2) {
          return absl::InternalError("bad GradientsHeader");
        }
        dw_bytes = static_cast<uint64_t>(g.dw().shape(0)) * g.dw().shape(1) * 4;
        have_header = true;
        header_at[i] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        return absl::OkStatus();
      }
      if (f.kind() != ReceivedFrame::Kind::kPart || !have_header) {
        return absl::InternalError("a part before the header, or an empty message");
      }
      const uint64_t pos = (f.tensor() == v1::TENSOR_DB ? dw_bytes : 0) + f.offset();
      if (pos < begin || pos + f.data_size() > end) {
        return absl::InternalError(absl::StrCat("part [", pos, ", ", pos + f.data_size(),
                                                ") outside the range [", begin, ", ", end, ")"));
      }
      f.CopyDataTo(dst + pos);
      got += f.data_size();
      return absl::OkStatus();
    };
    absl::Status s = RunStream(stubs_[i].get(), kFetchGradientsMethod, std::move(out), on, deadline_);
    if (s.ok() && got != end - begin) {
      s = absl::DataLossError(absl::StrCat("range [", begin, ", ", end, ") got ", got, " bytes"));
    }
    return s;
  });
  if (header_seconds != nullptr) *header_seconds = *std::max_element(header_at.begin(), header_at.end());
  return status;
}

}  // namespace bench
}  // namespace lossd
