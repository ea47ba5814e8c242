// SPDX-License-Identifier: Apache-2.0
// Transport ceilings over loopback for the service benchmark: plain TCP (send/recv of a byte
// count on N connections) and a bare gRPC byte stream (generic ByteBuffer messages, no
// protobuf: the sender references its memory, the receiver copies each message once into a
// reused destination), upload and download. Two processes: `--serve` is the far end,
// `--client` measures and writes medians (GB/s, GB = 1e9 bytes) to --out as key=value lines.
// Moves bytes only; never checks their content and never talks to lossd.
#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
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
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bench/service/raw_wire.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "grpcpp/support/server_callback.h"

ABSL_FLAG(bool, serve, false, "Run the far end (TCP sink/source and gRPC sink/source).");
ABSL_FLAG(bool, client, false, "Measure against a --serve process.");
ABSL_FLAG(int, tcp_port, 0, "--serve: TCP port (0 picks one); --client: the server's.");
ABSL_FLAG(int, grpc_port, 0, "--serve: gRPC port (0 picks one); --client: the server's.");
ABSL_FLAG(std::string, host, "127.0.0.1", "--client: server address.");
ABSL_FLAG(uint64_t, bytes, 2ull << 30, "Bytes moved per measurement (split over the connections).");
ABSL_FLAG(uint64_t, part_bytes, 4u << 20, "gRPC message size (lossd's clients send 4 MiB parts).");
ABSL_FLAG(std::string, connections, "1,4", "Connection counts to measure.");
ABSL_FLAG(int, runs, 3, "Measurements per point; the median is reported.");
ABSL_FLAG(std::string, out, "", "--client: key=value results file.");

namespace lossd {
namespace bench {
namespace {

constexpr uint64_t kBufferBytes = 64ull << 20;  // every send source and receive destination
constexpr char kUploadMethod[] = "/lossd.v1.Loss/PutWeights";
constexpr char kDownloadMethod[] = "/lossd.v1.Loss/FetchGradients";

double Gbps(uint64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds * 1e-9 : 0; }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A pre-touched buffer, so page faults never show in a measurement.
std::unique_ptr<uint8_t[]> TouchedBuffer(uint64_t n) {
  std::unique_ptr<uint8_t[]> b(new uint8_t[n]);
  for (uint64_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 131 + 7);
  return b;
}

// The shared read-only send source (static slices point into it for the process's life).
const uint8_t* Source() {
  static const uint8_t* s = TouchedBuffer(kBufferBytes).release();
  return s;
}

// Receive destinations, reused across calls.
class BufferPool {
 public:
  uint8_t* Take() {
    absl::MutexLock lock(&mu_);
    if (free_.empty()) return TouchedBuffer(kBufferBytes).release();
    uint8_t* b = free_.back();
    free_.pop_back();
    return b;
  }
  void Give(uint8_t* b) {
    absl::MutexLock lock(&mu_);
    free_.push_back(b);
  }

 private:
  absl::Mutex mu_;
  std::vector<uint8_t*> free_ ABSL_GUARDED_BY(mu_);
};

BufferPool& Pool() {
  static BufferPool* p = new BufferPool;
  return *p;
}

// Copies a received message into `dst` (a kBufferBytes ring), at *pos.
uint64_t CopyOut(const grpc::ByteBuffer& m, uint8_t* dst, uint64_t* pos) {
  std::vector<grpc::Slice> slices;
  uint64_t n = 0;
  if (!m.Dump(&slices).ok()) return 0;
  for (const grpc::Slice& s : slices) {
    size_t left = s.size();
    const uint8_t* p = s.begin();
    while (left > 0) {
      if (*pos == kBufferBytes) *pos = 0;
      const size_t k = std::min<uint64_t>(left, kBufferBytes - *pos);
      std::memcpy(dst + *pos, p, k);
      *pos += k;
      p += k;
      left -= k;
      n += k;
    }
  }
  return n;
}

grpc::ByteBuffer SourceMessage(uint64_t offset, uint64_t size) {
  const uint8_t* p = Source() + offset % (kBufferBytes - size + 1);
  grpc::Slice s(p, size, grpc::Slice::STATIC_SLICE);  // the source buffer lives forever
  return grpc::ByteBuffer(&s, 1);
}

grpc::ByteBuffer U64Pair(uint64_t a, uint64_t b) {
  uint64_t v[2] = {a, b};
  grpc::Slice s(v, sizeof(v));
  return grpc::ByteBuffer(&s, 1);
}

bool ReadU64Pair(const grpc::ByteBuffer& m, uint64_t* a, uint64_t* b) {
  std::vector<grpc::Slice> slices;
  if (!m.Dump(&slices).ok()) return false;
  std::string all;
  for (const grpc::Slice& s : slices) all.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (all.size() != 16) return false;
  std::memcpy(a, all.data(), 8);
  std::memcpy(b, all.data() + 8, 8);
  return true;
}

// ---- The far end -----------------------------------------------------------------------

// The far end registers lossd's own service with raw (ByteBuffer) callback methods, so its
// messages take the same server path as lossd's but are never parsed: PutWeights is the
// upload sink, FetchGradients the download source. (gRPC 1.51's CallbackGenericService left
// new streams unserved after a few rounds of concurrent multi-MiB uploads.)
using RawBase = v1::Loss::WithRawCallbackMethod_PutWeights<
    v1::Loss::WithRawCallbackMethod_FetchGradients<v1::Loss::Service>>;

// Upload: read every message (copying it out once), then answer with the byte count.
class SinkReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  explicit SinkReactor(grpc::ByteBuffer* response) : response_(response), dst_(Pool().Take()) {
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      received_ += CopyOut(in_, dst_, &pos_);
      StartRead(&in_);
      return;
    }
    *response_ = U64Pair(received_, 0);
    Finish(grpc::Status::OK);
  }

  void OnDone() override {
    Pool().Give(dst_);
    delete this;
  }

 private:
  grpc::ByteBuffer* const response_;
  uint8_t* const dst_;
  grpc::ByteBuffer in_;
  uint64_t pos_ = 0, received_ = 0;
};

// Download: {bytes, part} in the request, then that many bytes in parts, no copy.
class SourceReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit SourceReactor(const grpc::ByteBuffer* request) {
    if (!ReadU64Pair(*request, &total_, &part_)) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "bad download request"));
      return;
    }
    if (part_ == 0 || part_ > kBufferBytes) part_ = 4u << 20;
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (sent_ == total_) {
      Finish(grpc::Status::OK);
      return;
    }
    const uint64_t n = std::min(part_, total_ - sent_);
    out_ = SourceMessage(sent_, n);
    sent_ += n;
    StartWrite(&out_);
  }

  grpc::ByteBuffer out_;
  uint64_t total_ = 0, part_ = 0, sent_ = 0;
};

class CeilingService final : public RawBase {
 public:
  grpc::ServerReadReactor<grpc::ByteBuffer>* PutWeights(grpc::CallbackServerContext*,
                                                        grpc::ByteBuffer* response) override {
    return new SinkReactor(response);
  }
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchGradients(
      grpc::CallbackServerContext*, const grpc::ByteBuffer* request) override {
    return new SourceReactor(request);
  }
};

bool ReadAll(int fd, uint8_t* p, uint64_t n) {
  while (n > 0) {
    const ssize_t k = read(fd, p, n);
    if (k <= 0) return false;
    p += k;
    n -= k;
  }
  return true;
}

bool WriteAll(int fd, const uint8_t* p, uint64_t n) {
  while (n > 0) {
    const ssize_t k = write(fd, p, n);
    if (k <= 0) return false;
    p += k;
    n -= k;
  }
  return true;
}

// Moves `bytes` through fd in kBufferBytes pieces: receives into `buf` or sends from it.
bool Pump(int fd, bool send, uint8_t* buf, uint64_t bytes) {
  while (bytes > 0) {
    const uint64_t n = std::min(bytes, kBufferBytes);
    if (!(send ? WriteAll(fd, buf, n) : ReadAll(fd, buf, n))) return false;
    bytes -= n;
  }
  return true;
}

// One TCP connection: {direction (0: client sends), bytes}, the bytes, then a 1-byte ack from
// whoever received.
void ServeTcpConnection(int fd) {
  uint64_t head[2];
  if (ReadAll(fd, reinterpret_cast<uint8_t*>(head), sizeof(head))) {
    uint8_t* buf = Pool().Take();
    const bool client_sends = head[0] == 0;
    uint8_t ack = 1;
    if (client_sends) {
      if (Pump(fd, false, buf, head[1])) WriteAll(fd, &ack, 1);
    } else {
      if (Pump(fd, true, buf, head[1])) ReadAll(fd, &ack, 1);
    }
    Pool().Give(buf);
  }
  close(fd);
}

int ListenTcp(int port, int* bound) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 64) != 0) {
    close(fd);
    return -1;
  }
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *bound = ntohs(a.sin_port);
  return fd;
}

int Serve() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  int tcp_port = 0;
  const int lfd = ListenTcp(absl::GetFlag(FLAGS_tcp_port), &tcp_port);
  if (lfd < 0) {
    std::fprintf(stderr, "net_ceiling: cannot listen on TCP port %d\n",
                 absl::GetFlag(FLAGS_tcp_port));
    return 1;
  }
  std::thread([lfd] {
    for (;;) {
      const int c = accept(lfd, nullptr, nullptr);
      if (c < 0) return;
      std::thread(ServeTcpConnection, c).detach();
    }
  }).detach();

  CeilingService service;
  int grpc_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", absl::GetFlag(FLAGS_grpc_port)),
                           grpc::InsecureServerCredentials(), &grpc_port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(kBufferBytes));
  builder.SetMaxSendMessageSize(static_cast<int>(kBufferBytes));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || grpc_port == 0) {
    std::fprintf(stderr, "net_ceiling: cannot start the gRPC server\n");
    return 1;
  }
  std::printf("net_ceiling serving tcp=%d grpc=%d\n", tcp_port, grpc_port);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&signals, &sig);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  close(lfd);
  return 0;
}

// ---- The measuring end -----------------------------------------------------------------

int ConnectTcp(const std::string& host, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Seconds to move `bytes` over `conns` TCP connections (connections opened beforehand).
absl::StatusOr<double> TcpRun(bool upload, int conns, uint64_t bytes) {
  const std::string host = absl::GetFlag(FLAGS_host);
  const int port = absl::GetFlag(FLAGS_tcp_port);
  std::vector<int> fds;
  for (int i = 0; i < conns; ++i) {
    const int fd = ConnectTcp(host, port);
    if (fd < 0) {
      for (int f : fds) close(f);
      return absl::UnavailableError(absl::StrCat("cannot connect to ", host, ":", port));
    }
    fds.push_back(fd);
  }
  std::vector<uint8_t*> bufs;
  for (int i = 0; i < conns; ++i) bufs.push_back(Pool().Take());
  std::atomic<int> failed{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < conns; ++i) {
    threads.emplace_back([&, i] {
      const uint64_t share = bytes / conns + (i == 0 ? bytes % conns : 0);
      uint64_t head[2] = {upload ? 0u : 1u, share};
      uint8_t ack = 1;
      bool ok = WriteAll(fds[i], reinterpret_cast<uint8_t*>(head), sizeof(head));
      if (upload) {
        ok = ok && Pump(fds[i], true, bufs[i], share) && ReadAll(fds[i], &ack, 1);
      } else {
        ok = ok && Pump(fds[i], false, bufs[i], share) && WriteAll(fds[i], &ack, 1);
      }
      if (!ok) failed.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int f : fds) close(f);
  for (uint8_t* b : bufs) Pool().Give(b);
  if (failed.load() > 0) return absl::DataLossError("a TCP connection failed");
  return s;
}

// Seconds to move `bytes` over `channels` as raw gRPC streams (one stream per channel).
absl::StatusOr<double> GrpcRun(bool upload, std::vector<std::unique_ptr<grpc::GenericStub>>& stubs,
                               uint64_t bytes) {
  const uint64_t part = absl::GetFlag(FLAGS_part_bytes);
  const int conns = static_cast<int>(stubs.size());
  std::vector<absl::Status> status(conns);
  std::vector<uint8_t*> bufs;
  for (int i = 0; i < conns; ++i) bufs.push_back(Pool().Take());
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < conns; ++i) {
    threads.emplace_back([&, i] {
      const uint64_t share = bytes / conns + (i == 0 ? bytes % conns : 0);
      std::vector<grpc::ByteBuffer> out;
      uint64_t got = 0, pos = 0;
      std::function<absl::Status(const grpc::ByteBuffer&)> on;
      if (upload) {
        for (uint64_t off = 0; off < share; off += part) {
          out.push_back(SourceMessage(off, std::min(part, share - off)));
        }
        on = [&](const grpc::ByteBuffer& m) {
          uint64_t b = 0;
          if (!ReadU64Pair(m, &got, &b)) return absl::DataLossError("bad upload reply");
          return absl::OkStatus();
        };
      } else {
        out.push_back(U64Pair(share, part));
        on = [&](const grpc::ByteBuffer& m) {
          got += CopyOut(m, bufs[i], &pos);
          return absl::OkStatus();
        };
      }
      absl::Status s = RunStream(stubs[i].get(), upload ? kUploadMethod : kDownloadMethod,
                                 std::move(out), on, absl::Minutes(5));
      if (s.ok() && got != share) {
        s = absl::DataLossError(absl::StrCat("moved ", got, " of ", share, " bytes"));
      }
      status[i] = s;
    });
  }
  for (auto& t : threads) t.join();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (uint8_t* b : bufs) Pool().Give(b);
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return secs;
}

int Client() {
  const uint64_t bytes = absl::GetFlag(FLAGS_bytes);
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  std::vector<int> counts;
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_connections), ',')) {
    int n = 0;
    if (absl::SimpleAtoi(c, &n) && n > 0) counts.push_back(n);
  }
  const std::string target =
      absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_grpc_port));
  std::vector<std::string> lines;
  int rc = 0;
  for (const int n : counts) {
    std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
    std::vector<std::shared_ptr<grpc::Channel>> channels = MakeChannels(target, n);
    for (auto& ch : channels) stubs.push_back(std::make_unique<grpc::GenericStub>(ch));
    for (const bool up : {true, false}) {
      for (const bool grpc : {false, true}) {
        std::vector<double> gbps;
        // One unmeasured run first: connections, buffers and gRPC threads warm up.
        for (int r = -1; r < runs; ++r) {
          absl::StatusOr<double> s = grpc ? GrpcRun(up, stubs, bytes) : TcpRun(up, n, bytes);
          if (!s.ok()) {
            std::fprintf(stderr, "net_ceiling: %s %s x%d: %s\n", grpc ? "grpc" : "tcp",
                         up ? "upload" : "download", n, s.status().ToString().c_str());
            rc = 1;
            break;
          }
          if (r >= 0) gbps.push_back(Gbps(bytes, *s));
        }
        const std::string key =
            absl::StrCat(grpc ? "grpc" : "tcp", "_", up ? "up" : "down", "_", n);
        std::string all;
        for (double g : gbps) absl::StrAppend(&all, all.empty() ? "" : ",", absl::StrFormat("%.3f", g));
        lines.push_back(absl::StrCat(key, "=", absl::StrFormat("%.3f", Median(gbps))));
        lines.push_back(absl::StrCat(key, "_runs=", all));
        std::printf("%-14s %7.2f GB/s (median of %zu: %s)\n", key.c_str(), Median(gbps),
                    gbps.size(), all.c_str());
        std::fflush(stdout);
      }
    }
  }
  lines.push_back(absl::StrCat("ceiling_bytes=", bytes));
  lines.push_back(absl::StrCat("ceiling_part_bytes=", absl::GetFlag(FLAGS_part_bytes)));
  if (!absl::GetFlag(FLAGS_out).empty()) {
    std::ofstream f(absl::GetFlag(FLAGS_out));
    for (const std::string& l : lines) f << l << "\n";
    if (!f) {
      std::fprintf(stderr, "net_ceiling: cannot write %s\n", absl::GetFlag(FLAGS_out).c_str());
      rc = 1;
    }
  }
  return rc;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) {
  // As lossd does: keep multi-MiB message buffers in the process instead of page-faulting
  // them in again for every message.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
  absl::SetProgramUsageMessage(
      "net_ceiling --serve | --client --tcp_port=P --grpc_port=Q [--bytes --connections --out]");
  absl::ParseCommandLine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  if (absl::GetFlag(FLAGS_serve)) return lossd::bench::Serve();
  if (absl::GetFlag(FLAGS_client)) return lossd::bench::Client();
  std::fprintf(stderr, "give --serve or --client\n");
  return 2;
}
