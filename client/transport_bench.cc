// SPDX-License-Identifier: Apache-2.0
// Measures the client library's own transport ceiling, apart from any real server: PutWeights
// into, and FetchGradients out of, a sink service that only counts bytes (typed protobuf on the
// server side). Runs the sink in this process or another (--serve_port / --target). Never
// computes anything.
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/host_tensor.h"
#include "client/lossd_client.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "lossd/v1/lossd.pb.h"

ABSL_FLAG(std::string, target, "", "benchmark this sink (another process); empty = in-process");
ABSL_FLAG(int32_t, serve_port, 0, "only serve the sink on this port");
ABSL_FLAG(int64_t, mib, 1024, "MiB moved per call");
ABSL_FLAG(std::string, connections, "1,2,4", "connection counts to try (calls = connections)");
ABSL_FLAG(int64_t, part_bytes, 4 << 20, "part size both ways");
ABSL_FLAG(int32_t, repeats, 3, "runs per setting; the median is reported");

namespace lossd {
namespace client {
namespace {

// FetchGradients' accumulator name is "V,H": the sink streams an fp32 (V, H) tensor of that
// shape, every part the same bytes.
class Sink final : public v1::Loss::Service {
 public:
  grpc::Status PutWeights(grpc::ServerContext*, grpc::ServerReader<v1::PutWeightsRequest>* r,
                          v1::PutWeightsResponse* resp) override {
    v1::PutWeightsRequest req;
    uint64_t bytes = 0;
    while (r->Read(&req)) bytes += req.part().data().size();
    resp->set_handle("sink");
    resp->set_bytes(bytes);
    return grpc::Status::OK;
  }

  grpc::Status FetchGradients(grpc::ServerContext*, const v1::FetchGradientsRequest* req,
                              grpc::ServerWriter<v1::FetchGradientsResponse>* w) override {
    std::vector<std::string> vh = absl::StrSplit(req->accumulator(), ',');
    int64_t v = 0, h = 0;
    if (vh.size() != 2 || !absl::SimpleAtoi(vh[0], &v) || !absl::SimpleAtoi(vh[1], &h)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "name must be V,H");
    }
    v1::FetchGradientsResponse head;
    head.mutable_header()->mutable_dw()->set_dtype(v1::DTYPE_FP32);
    head.mutable_header()->mutable_dw()->add_shape(v);
    head.mutable_header()->mutable_dw()->add_shape(h);
    w->Write(head);
    const uint64_t total = static_cast<uint64_t>(v) * h * 4;
    const uint64_t part = req->response_part_bytes() ? req->response_part_bytes() : 4 << 20;
    v1::FetchGradientsResponse msg;
    msg.mutable_part()->set_tensor(v1::TENSOR_DW);
    msg.mutable_part()->mutable_data()->assign(part, '\x3c');
    for (uint64_t off = 0; off < total; off += part) {
      msg.mutable_part()->set_offset(off);
      if (total - off < part) msg.mutable_part()->mutable_data()->resize(total - off);
      if (!w->Write(msg)) break;
    }
    return grpc::Status::OK;
  }
};

std::unique_ptr<grpc::Server> StartSink(Sink* sink, int port, int* bound) {
  grpc::ServerBuilder b;
  b.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(), bound);
  b.SetMaxReceiveMessageSize(-1);
  b.SetMaxSendMessageSize(-1);
  b.RegisterService(sink);
  return b.BuildAndStart();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main() {
  TuneMallocForLargeMessages();
  Sink sink;
  std::unique_ptr<grpc::Server> server;
  std::string target = absl::GetFlag(FLAGS_target);
  if (absl::GetFlag(FLAGS_serve_port) != 0 || target.empty()) {
    int bound = 0;
    server = StartSink(&sink, absl::GetFlag(FLAGS_serve_port), &bound);
    if (server == nullptr) return 1;
    target = absl::StrCat("127.0.0.1:", bound);
    if (absl::GetFlag(FLAGS_serve_port) != 0) {
      absl::PrintF("sink serving on %s\n", target);
      server->Wait();
      return 0;
    }
  }
  const int64_t bytes = absl::GetFlag(FLAGS_mib) << 20;
  HostTensor w = HostTensor::Owned(DType::kBF16, {bytes / 2 / 4096, 4096});
  std::memset(w.mutable_data(), 0x3c, w.num_bytes());
  for (absl::string_view cs : absl::StrSplit(absl::GetFlag(FLAGS_connections), ',')) {
    int conns = 0;
    if (!absl::SimpleAtoi(cs, &conns)) return 2;
    ClientOptions o;
    o.target = target;
    o.connections = conns;
    o.part_bytes = absl::GetFlag(FLAGS_part_bytes);
    o.response_part_bytes = static_cast<uint32_t>(absl::GetFlag(FLAGS_part_bytes));
    auto client = LossClient::Create(o);
    if (!client.ok()) return 3;
    (*client)->ServerInfo().IgnoreError();  // connect every channel first
    std::vector<double> up, down;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_repeats); ++rep) {
      for (int dir = 0; dir < 2; ++dir) {
        std::atomic<int> failures{0};
        const absl::Time t0 = absl::Now();
        std::vector<std::thread> threads;
        for (int c = 0; c < conns; ++c) {
          threads.emplace_back([&] {
            absl::Status s =
                dir == 0 ? (*client)->PutWeights(w, nullptr).status()
                         : (*client)
                               ->FetchGradients(absl::StrCat(bytes / 4 / 4096, ",4096"), false)
                               .status();
            if (!s.ok()) {
              std::fprintf(stderr, "%s\n", s.ToString().c_str());
              ++failures;
            }
          });
        }
        for (auto& t : threads) t.join();
        // GiB/s: the one unit lossd and lossctl print sizes and rates in.
        const double gibs =
            conns * bytes / absl::ToDoubleSeconds(absl::Now() - t0) / (1024.0 * 1024 * 1024);
        if (failures > 0) return 4;
        (dir == 0 ? up : down).push_back(gibs);
      }
    }
    absl::PrintF(
        "connections %d (one %d MiB call on each at once): up %.2f GiB/s, down %.2f GiB/s\n",
        conns, absl::GetFlag(FLAGS_mib), Median(up), Median(down));
  }
  return 0;
}

}  // namespace
}  // namespace client
}  // namespace lossd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return lossd::client::Main();
}
