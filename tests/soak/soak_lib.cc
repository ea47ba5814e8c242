// SPDX-License-Identifier: Apache-2.0
#include "tests/soak/soak_lib.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "testing/test_util.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "testing/server_harness.h"
#include "tests/soak/soak_problems.h"

namespace lossd {
namespace soak {
namespace {

using testing_harness::ComputeReply;
using testing_harness::HeaderFor;
using testing_harness::PartsFor;
using testing_harness::RunCompute;
using Clock = std::chrono::steady_clock;

class Soak {
 public:
  explicit Soak(const SoakOptions& o) : o_(o) {}

  SoakReport Run() {
    std::unique_ptr<testing_harness::Harness> harness;
    std::string address = o_.target;
    if (address.empty()) {
      harness = std::make_unique<testing_harness::Harness>();
      address = absl::StrCat("127.0.0.1:", harness->port());
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    for (int i = 0; i < std::max(1, o_.clients); ++i) {
      // One channel (connection) per client, as separate trainer ranks would have.
      args.SetInt("lossd_soak_client", i);
      channels_.push_back(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    }
    auto stub = v1::Loss::NewStub(channels_[0]);
    if (!Prepare(*stub)) return std::move(report_);

    v1::ServerInfoResponse info = Info(*stub);
    report_.rss_start = RssBytes();
    report_.admitted_start = info.memory_in_use_bytes();
    report_.weight_cache_start = info.weight_cache_bytes();
    max_bt_ = info.max_bt();

    const auto start = Clock::now();
    const auto end = start + std::chrono::milliseconds(
                                 static_cast<int64_t>(o_.duration_seconds * 1000));
    std::thread monitor([&] {
      const auto baseline_at =
          start + std::chrono::milliseconds(static_cast<int64_t>(
                      std::min(o_.warmup_seconds, o_.duration_seconds / 2) * 1000));
      while (Clock::now() < baseline_at) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::lock_guard<std::mutex> lock(mu_);
      report_.rss_baseline = RssBytes();
    });
    std::vector<std::thread> clients;
    for (int i = 0; i < std::max(1, o_.clients); ++i) {
      clients.emplace_back([this, i, end] { Client(i, end); });
    }
    for (auto& t : clients) t.join();
    monitor.join();
    report_.seconds = std::chrono::duration<double>(Clock::now() - start).count();

    CheckLeftovers(*stub);
    LatencyPercentiles();
    if (report_.served_ok == 0) Fail("no call was served");
    stub.reset();
    channels_.clear();
    if (harness) harness.reset();
    return std::move(report_);
  }

 private:
  // Quiesce and check nothing was left behind: admitted memory, the weight cache, the
  // accumulators and this process's RSS against the baseline.
  void CheckLeftovers(v1::Loss::Stub& stub) {
    v1::ServerInfoResponse info;
    for (int i = 0; i < std::max(1, o_.clients); ++i) {
      grpc::ClientContext ctx;
      v1::DropAccumulatorRequest d;
      d.set_accumulator(absl::StrCat("soak-c", i));
      v1::DropAccumulatorResponse r;
      (void)stub.DropAccumulator(&ctx, d, &r);  // NOT_FOUND when it was just fetched
    }
    const auto until = Clock::now() + std::chrono::seconds(10);
    do {
      info = Info(stub);
      if (info.memory_in_use_bytes() == report_.admitted_start) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } while (Clock::now() < until);
    report_.admitted_end = info.memory_in_use_bytes();
    report_.weight_cache_end = info.weight_cache_bytes();
    report_.rss_end = RssBytes();
    if (report_.admitted_end != report_.admitted_start) {
      Fail(absl::StrCat("admitted memory ", report_.admitted_end, " at the end, ",
                        report_.admitted_start, " at the start"));
    }
    if (report_.weight_cache_end != report_.weight_cache_start) {
      Fail(absl::StrCat("weight cache holds ", report_.weight_cache_end, " bytes at the end, ",
                        report_.weight_cache_start, " at the start"));
    }
    if (info.accumulators() != 0) {
      Fail(absl::StrCat(info.accumulators(), " accumulators left at the end"));
    }
    if (report_.rss_baseline > 0 &&
        report_.rss_end > report_.rss_baseline + o_.rss_growth_bound_bytes) {
      Fail(absl::StrCat("RSS grew from ", report_.rss_baseline, " to ", report_.rss_end,
                        " bytes, more than the bound of ", o_.rss_growth_bound_bytes));
    }
  }

  // p50, p99 and the maximum of the valid computes' latencies.
  void LatencyPercentiles() {
    std::sort(latencies_ms_.begin(), latencies_ms_.end());
    if (!latencies_ms_.empty()) {
      auto at = [&](double q) {
        return latencies_ms_[std::min(latencies_ms_.size() - 1,
                                      static_cast<size_t>(q * latencies_ms_.size()))];
      };
      report_.compute_p50_ms = at(0.50);
      report_.compute_p99_ms = at(0.99);
      report_.compute_max_ms = latencies_ms_.back();
    }
  }

  v1::ServerInfoResponse Info(v1::Loss::Stub& stub) {
    grpc::ClientContext ctx;
    v1::ServerInfoResponse info;
    grpc::Status s = stub.ServerInfo(&ctx, v1::ServerInfoRequest(), &info);
    if (!s.ok()) Fail(absl::StrCat("ServerInfo: ", s.error_message()));
    return info;
  }

  void Fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    ++report_.failure_count;
    if (report_.failures.size() < 50) report_.failures.push_back(what);
  }

  void Count(const std::string& kind, grpc::StatusCode code) {
    std::lock_guard<std::mutex> lock(mu_);
    ++report_.calls;
    if (code == grpc::StatusCode::OK) ++report_.served_ok;
    ++report_.by_kind_and_code[absl::StrCat(kind, ":", CodeName(code))];
  }

  // Golden answers: each problem once against the float64 reference; the handle and the
  // accumulator against the inline answers.
  bool Prepare(v1::Loss::Stub& stub) {
    for (const RandomProblemSpec& spec : ProblemSpecs()) {
      Problem p;
      p.rp = std::make_unique<RandomProblem>(RandomProblem::Make(spec));
      p.header = HeaderFor(*p.rp);
      p.parts = PartsFor(*p.rp, 16 << 10);
      p.overlap_header = p.header;
      p.overlap_header.set_overlap(true);
      p.overlap_parts = testing_harness::XLast(p.parts);
      p.golden = RunCompute(stub, p.header, p.parts, o_.call_deadline_seconds);
      if (!p.golden.status.ok()) {
        Fail(absl::StrCat("preparing: ", p.golden.status.error_message()));
        return false;
      }
      ::testing::AssertionResult m =
          testing_harness::ReplyMatchesReference(*p.rp, p.golden, spec.dtype);
      if (!m) {
        Fail(absl::StrCat("problem ", problems_.size(), " does not match the reference: ",
                          m.message()));
        return false;
      }
      problems_.push_back(std::move(p));
    }
    const Problem& a = problems_[0];
    grpc::Status put = testing_harness::PutWeights(stub, *a.rp, 64 << 10, &handle_);
    if (!put.ok()) {
      Fail(absl::StrCat("preparing: PutWeights: ", put.error_message()));
      return false;
    }
    handle_header_ = HeaderFor(*a.rp, handle_);
    handle_parts_ = PartsFor(*a.rp, 16 << 10, /*include_weights=*/false);
    ComputeReply by_handle = RunCompute(stub, handle_header_, handle_parts_);
    if (!by_handle.status.ok() || !SameReply(by_handle, a.golden)) {
      Fail("preparing: the compute by handle differs from the inline one");
      return false;
    }
    // The accumulator: kAccumulateEvery micro-batches of problem 0 must give (within fp32
    // rounding of the sum) kAccumulateEvery times its own fp32 dW.
    v1::ComputeHeader fp32 = a.header;
    fp32.mutable_options()->set_grad_dtype(v1::DTYPE_FP32);
    ComputeReply own = RunCompute(stub, fp32, a.parts);
    v1::ComputeHeader acc = handle_header_;
    acc.set_accumulator("soak-golden");
    for (int k = 0; k < kAccumulateEvery; ++k) {
      ComputeReply r = RunCompute(stub, acc, handle_parts_);
      if (!r.status.ok()) {
        Fail(absl::StrCat("preparing: accumulate: ", r.status.error_message()));
        return false;
      }
    }
    Fetched f = Fetch(stub, "soak-golden", /*reset=*/true, o_.call_deadline_seconds);
    grpc::ClientContext ctx;
    v1::DropAccumulatorRequest d;
    d.set_accumulator("soak-golden");
    v1::DropAccumulatorResponse dr;
    (void)stub.DropAccumulator(&ctx, d, &dr);
    if (!own.status.ok() || !f.status.ok() ||
        f.header.micro_batches() != static_cast<uint64_t>(kAccumulateEvery)) {
      Fail("preparing: the golden accumulation failed");
      return false;
    }
    const size_t n = a.rp->spec().v * a.rp->spec().h;
    std::vector<double> want = Widen(own.tensors[v1::TENSOR_DW].data(), DType::kF32, n);
    for (double& x : want) x *= kAccumulateEvery;
    CompareResult c = CompareRelNorm("accumulated dw", want, Widen(f.dw.data(), DType::kF32, n),
                                     1e-6);
    if (!c.ok()) {
      Fail(absl::StrCat("preparing: ", c.ToString()));
      return false;
    }
    golden_acc_dw_ = f.dw;
    return true;
  }

  void Client(int id, Clock::time_point end) {
    std::mt19937_64 rng(o_.seed * 1000003 + id);
    auto stub = v1::Loss::NewStub(channels_[id % channels_.size()]);
    const std::string acc_name = absl::StrCat("soak-c", id);
    int acc_count = 0;
    std::vector<double> latencies;
    while (Clock::now() < end) {
      const int dice = static_cast<int>(rng() % 100);
      if (dice < 40) {
        ValidInline(*stub, rng, &latencies);
      } else if (dice < 50) {
        ValidByHandle(*stub, &latencies);
      } else if (dice < 60) {
        Accumulate(*stub, acc_name, &acc_count);
      } else if (dice < 80) {
        Invalid(*stub, rng);
      } else if (dice < 95) {
        Cancel(*stub, rng);
      } else {
        PutUseDrop(*stub, rng);
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    latencies_ms_.insert(latencies_ms_.end(), latencies.begin(), latencies.end());
  }

  ComputeReply Timed(v1::Loss::Stub& stub, const v1::ComputeHeader& h,
                     const std::vector<v1::ComputeRequest>& parts, std::vector<double>* lat) {
    const auto t0 = Clock::now();
    ComputeReply r = RunCompute(stub, h, parts, o_.call_deadline_seconds);
    if (lat != nullptr && r.status.ok()) {
      lat->push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    return r;
  }

  void ValidInline(v1::Loss::Stub& stub, std::mt19937_64& rng, std::vector<double>* lat) {
    const Problem& p = problems_[rng() % problems_.size()];
    const bool overlap = rng() % 2 == 0;
    const char* kind = overlap ? "valid_overlap" : "valid_inline";
    ComputeReply r = overlap ? Timed(stub, p.overlap_header, p.overlap_parts, lat)
                             : Timed(stub, p.header, p.parts, lat);
    Count(kind, r.status.error_code());
    if (!r.status.ok()) {
      Fail(absl::StrCat(kind, ": ", CodeName(r.status.error_code()), " ",
                        r.status.error_message()));
    } else if (!SameReply(r, p.golden)) {
      Fail(absl::StrCat(kind, ": a result differs from the checked answer"));
    }
  }

  void ValidByHandle(v1::Loss::Stub& stub, std::vector<double>* lat) {
    ComputeReply r = Timed(stub, handle_header_, handle_parts_, lat);
    Count("valid_handle", r.status.error_code());
    if (!r.status.ok()) {
      Fail(absl::StrCat("valid_handle: ", CodeName(r.status.error_code()), " ",
                        r.status.error_message()));
    } else if (!SameReply(r, problems_[0].golden)) {
      Fail("valid_handle: a result differs from the checked answer");
    }
  }

  void Accumulate(v1::Loss::Stub& stub, const std::string& name, int* count) {
    v1::ComputeHeader h = handle_header_;
    h.set_accumulator(name);
    ComputeReply r = RunCompute(stub, h, handle_parts_, o_.call_deadline_seconds);
    Count("accumulate", r.status.error_code());
    if (!r.status.ok()) {
      Fail(absl::StrCat("accumulate: ", CodeName(r.status.error_code()), " ",
                        r.status.error_message()));
      return;
    }
    ++*count;
    if (r.summary.accumulated_micro_batches() != static_cast<uint64_t>(*count)) {
      Fail(absl::StrCat("accumulate: the server counts ", r.summary.accumulated_micro_batches(),
                        " micro-batches, the client sent ", *count));
    }
    if (*count < kAccumulateEvery) return;
    Fetched f = Fetch(stub, name, /*reset=*/true, o_.call_deadline_seconds);
    Count("fetch_reset", f.status.error_code());
    *count = 0;
    if (!f.status.ok()) {
      Fail(absl::StrCat("fetch: ", f.status.error_message()));
    } else if (f.header.micro_batches() != static_cast<uint64_t>(kAccumulateEvery) ||
               f.dw != golden_acc_dw_) {
      Fail("fetch: the accumulated dW differs from the checked one");
    }
  }

  void ExpectRefusal(const char* kind, const ComputeReply& r, grpc::StatusCode code,
                     const std::string& substring) {
    Count(kind, r.status.error_code());
    if (r.status.error_code() != code ||
        r.status.error_message().find(substring) == std::string::npos) {
      Fail(absl::StrCat(kind, ": wanted ", CodeName(code), " '", substring, "', got ",
                        CodeName(r.status.error_code()), " '", r.status.error_message(), "'"));
    }
  }

  void Invalid(v1::Loss::Stub& stub, std::mt19937_64& rng) {
    const Problem& p = problems_[0];
    switch (rng() % 7) {
      case 0: {  // a target outside the vocabulary
        std::vector<v1::ComputeRequest> parts = p.parts;
        for (auto& m : parts) {
          if (m.part().tensor() == v1::TENSOR_TARGETS && m.part().offset() == 0) {
            int64_t bad = 1000;
            std::memcpy(&(*m.mutable_part()->mutable_data())[8], &bad, 8);
          }
        }
        ExpectRefusal("invalid_target", RunCompute(stub, p.header, parts),
                      grpc::StatusCode::INVALID_ARGUMENT, "targets[1] = 1000 is outside");
        break;
      }
      case 1: {
        v1::ComputeHeader h = p.header;
        h.mutable_w()->set_shape(1, 63);
        ExpectRefusal("invalid_hidden", RunCompute(stub, h, {}),
                      grpc::StatusCode::INVALID_ARGUMENT, "must be (V, H) with H");
        break;
      }
      case 2: {  // NaN in x
        std::vector<v1::ComputeRequest> parts = p.parts;
        (*parts[0].mutable_part()->mutable_data())[7] = static_cast<char>(0x7F);
        (*parts[0].mutable_part()->mutable_data())[6] = static_cast<char>(0xC1);
        ExpectRefusal("invalid_nan", RunCompute(stub, p.header, parts),
                      grpc::StatusCode::INVALID_ARGUMENT, "x contains a non-finite value (nan)");
        break;
      }
      case 3: {
        std::vector<v1::ComputeRequest> parts = p.parts;
        std::swap(parts[1], parts[2]);  // W's first two parts (parts of different tensors
                                        // may interleave; parts of one may not)
        ExpectRefusal("invalid_order", RunCompute(stub, p.header, parts),
                      grpc::StatusCode::INVALID_ARGUMENT, "parts must arrive in order");
        break;
      }
      case 4: {
        v1::ComputeHeader h = handle_header_;
        h.set_weight_handle("w-e15e0e5e-1");  // another instance's, as lossd writes them
        ExpectRefusal("invalid_handle", RunCompute(stub, h, handle_parts_),
                      grpc::StatusCode::NOT_FOUND, "another server instance");
        break;
      }
      case 5: {
        std::vector<v1::ComputeRequest> parts = p.parts;
        parts.pop_back();
        ExpectRefusal("invalid_short", RunCompute(stub, p.header, parts),
                      grpc::StatusCode::INVALID_ARGUMENT, "closed early");
        break;
      }
      default: {
        v1::ComputeHeader h = p.header;
        h.mutable_x()->set_shape(0, max_bt_ + 1);
        h.mutable_targets()->set_shape(0, max_bt_ + 1);
        ExpectRefusal("invalid_limits", RunCompute(stub, h, {}),
                      grpc::StatusCode::INVALID_ARGUMENT, "exceeds the limits");
        break;
      }
    }
  }

  void Cancel(v1::Loss::Stub& stub, std::mt19937_64& rng) {
    const Problem& p = problems_[3];  // the largest: many parts each way
    // Half of them overlapped: the cancel or the deadline then lands while the compute runs
    // (or waits for rows of X).
    const bool overlap = rng() % 2 == 0;
    const v1::ComputeHeader& header = overlap ? p.overlap_header : p.header;
    const std::vector<v1::ComputeRequest>& parts = overlap ? p.overlap_parts : p.parts;
    switch (rng() % 3) {
      case 0: {  // the client dies half way through its upload
        grpc::ClientContext ctx;
        auto stream = stub.Compute(&ctx);
        v1::ComputeRequest first;
        *first.mutable_header() = header;
        stream->Write(first);
        for (size_t i = 0; i < parts.size() / 2; ++i) stream->Write(parts[i]);
        ctx.TryCancel();
        grpc::Status s = stream->Finish();
        Count("cancel_upload", s.error_code());
        if (s.error_code() != grpc::StatusCode::CANCELLED) {
          Fail(absl::StrCat("cancel_upload: ", CodeName(s.error_code()), " ", s.error_message()));
        }
        break;
      }
      case 1: {  // the client dies while results arrive
        grpc::ClientContext ctx;
        auto stream = stub.Compute(&ctx);
        v1::ComputeRequest first;
        *first.mutable_header() = header;
        first.mutable_header()->set_response_part_bytes(4096);
        stream->Write(first);
        for (const auto& m : parts) stream->Write(m);
        stream->WritesDone();
        v1::ComputeResponse r;
        stream->Read(&r);
        ctx.TryCancel();
        grpc::Status s = stream->Finish();
        Count("cancel_download", s.error_code());
        if (s.error_code() != grpc::StatusCode::CANCELLED) {
          Fail(absl::StrCat("cancel_download: ", CodeName(s.error_code()), " ",
                            s.error_message()));
        }
        break;
      }
      default: {  // a deadline that passes during the call
        ComputeReply r = RunCompute(stub, header, parts, 0.002);
        Count("deadline", r.status.error_code());
        if (r.status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
            !(r.status.ok() && SameReply(r, p.golden))) {
          Fail(absl::StrCat("deadline: ", CodeName(r.status.error_code()), " ",
                            r.status.error_message()));
        }
        break;
      }
    }
  }

  void PutUseDrop(v1::Loss::Stub& stub, std::mt19937_64& rng) {
    RandomProblemSpec s;
    s.bt = 8;
    s.h = 16;
    s.v = 50;
    s.bias = (rng() % 2) == 0;
    s.seed = rng();
    RandomProblem rp = RandomProblem::Make(s);
    std::string handle;
    // Parts of 334 bytes: not a power of two, whole bf16 elements (parts that split an element
    // are covered by //tests/faults:put_weights_boundary_test).
    grpc::Status put = testing_harness::PutWeights(stub, rp, 334, &handle);
    Count("put_weights", put.error_code());
    if (!put.ok()) {
      Fail(absl::StrCat("put_weights: ", put.error_message()));
      return;
    }
    ComputeReply used = RunCompute(stub, HeaderFor(rp, handle), PartsFor(rp, 1 << 16, false));
    ComputeReply inline_w = RunCompute(stub, HeaderFor(rp), PartsFor(rp, 1 << 16));
    Count("valid_new_handle", used.status.error_code());
    Count("valid_inline_small", inline_w.status.error_code());
    if (!used.status.ok() || !inline_w.status.ok() || !SameReply(used, inline_w)) {
      Fail(absl::StrCat("put_weights: the compute by the new handle (",
                        used.status.error_message(), ") differs from inline (",
                        inline_w.status.error_message(), ")"));
    }
    grpc::ClientContext ctx;
    v1::DropWeightsRequest d;
    d.set_handle(handle);
    v1::DropWeightsResponse dr;
    grpc::Status drop = stub.DropWeights(&ctx, d, &dr);
    Count("drop_weights", drop.error_code());
    if (!drop.ok()) Fail(absl::StrCat("drop_weights: ", drop.error_message()));
    ExpectRefusal("dropped_handle",
                  RunCompute(stub, HeaderFor(rp, handle), PartsFor(rp, 1 << 16, false)),
                  grpc::StatusCode::NOT_FOUND, "was dropped");
  }

  static constexpr int kAccumulateEvery = 4;

  const SoakOptions o_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<Problem> problems_;
  std::string handle_;
  v1::ComputeHeader handle_header_;
  std::vector<v1::ComputeRequest> handle_parts_;
  std::vector<uint8_t> golden_acc_dw_;
  int64_t max_bt_ = 0;

  std::mutex mu_;
  SoakReport report_;
  std::vector<double> latencies_ms_;
};

}  // namespace

std::string SoakReport::ToString() const {
  std::string s = absl::StrFormat(
      "soak: %.1f s, %llu calls, %llu OK (%.1f calls/s); valid compute latency p50 %.1f ms, "
      "p99 %.1f ms, max %.1f ms\n",
      seconds, static_cast<unsigned long long>(calls),
      static_cast<unsigned long long>(served_ok), seconds > 0 ? calls / seconds : 0.0,
      compute_p50_ms, compute_p99_ms, compute_max_ms);
  absl::StrAppendFormat(&s,
                        "soak: RSS start %.1f MiB, after warm-up %.1f MiB, end %.1f MiB; "
                        "admitted memory start %llu, end %llu bytes; weight cache start %llu, "
                        "end %llu bytes\n",
                        rss_start / 1048576.0, rss_baseline / 1048576.0, rss_end / 1048576.0,
                        static_cast<unsigned long long>(admitted_start),
                        static_cast<unsigned long long>(admitted_end),
                        static_cast<unsigned long long>(weight_cache_start),
                        static_cast<unsigned long long>(weight_cache_end));
  for (const auto& [k, n] : by_kind_and_code) {
    absl::StrAppendFormat(&s, "soak:   %-40s %llu\n", k, static_cast<unsigned long long>(n));
  }
  for (const std::string& f : failures) absl::StrAppend(&s, "soak: FAILURE ", f, "\n");
  absl::StrAppendFormat(&s, "soak: %s (%llu unexpected outcomes)\n", ok() ? "PASS" : "FAIL",
                        static_cast<unsigned long long>(failure_count));
  return s;
}

SoakReport RunSoak(const SoakOptions& options) { return Soak(options).Run(); }

}  // namespace soak
}  // namespace lossd
