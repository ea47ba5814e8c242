// SPDX-License-Identifier: Apache-2.0
// Head groups' NCCL communicator through the CUDA backend (CommAvailable, NewCommId,
// ConnectComm and the BackendComm). One GPU: a communicator of one member leaves random data
// unchanged, bit for bit; bad arguments and a member that never joins are refused; Abort ends
// it. Two GPUs, where the host has them: two members on two threads, their sums and gathers
// against the host's, with slices uniform and not; a collective whose peer never comes times
// out; an Abort from another thread ends a collective in flight.
// Needs NCCL: LOSSD_NCCL_LIBRARY (kernels/cuda/nccl_comm.h). Without it the tests fail, saying
// so, rather than skip.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/nccl_comm.h"

namespace lossd {
namespace cuda {
namespace {

constexpr int64_t kTimeoutMs = 60000;  // a healthy collective ends far sooner

std::unique_ptr<CudaBackend> MakeBackend(int device) {
  CudaBackendOptions o;
  o.device = device;
  absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  return n;
}

// Random floats of both signs over several binades, never all zero.
std::vector<float> RandomFloats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng) * static_cast<float>(1 << (rng() % 8));
  return v;
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

// `bytes` of host data in a fresh buffer of `b`.
std::unique_ptr<BackendBuffer> Upload(Backend& b, const void* data, size_t bytes) {
  absl::StatusOr<std::unique_ptr<BackendBuffer>> buf = b.Allocate(bytes);
  EXPECT_TRUE(buf.ok()) << buf.status();
  if (!buf.ok()) return nullptr;
  const absl::Status st = b.CopyToBackend(**buf, 0, data, bytes);
  EXPECT_TRUE(st.ok()) << st;
  return std::move(*buf);
}

std::vector<uint8_t> Download(Backend& b, const BackendBuffer& buf, size_t bytes) {
  std::vector<uint8_t> out(bytes, 0xEE);
  const absl::Status st = b.CopyFromBackend(buf, 0, out.data(), bytes);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// Member m's slice of n elements among `size` (kernels/backend.h).
int64_t SliceStart(int64_t n, int m, int size) { return n * m / size; }

// Counts the elements where two byte images differ (in units of elem bytes) and names the first.
::testing::AssertionResult SameBytes(const std::vector<uint8_t>& want,
                                     const std::vector<uint8_t>& got, size_t elem,
                                     size_t begin_elem, size_t end_elem) {
  if (want.size() != got.size()) {
    return ::testing::AssertionFailure() << "sizes " << want.size() << " vs " << got.size();
  }
  int64_t bad = 0, first = -1;
  for (size_t i = begin_elem; i < end_elem; ++i) {
    if (std::memcmp(&want[i * elem], &got[i * elem], elem) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << (end_elem - begin_elem)
                                       << " elements differ; the first at " << first;
}

class NcclCommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GE(DeviceCount(), 1) << "no CUDA device";
    backend_ = MakeBackend(0);
    ASSERT_NE(backend_, nullptr);
    // Fails, never skips: a GPU host that runs this test must have NCCL.
    const absl::Status available = backend_->CommAvailable();
    ASSERT_TRUE(available.ok())
        << available << "\nNCCL did not load from " << NcclLibraryPath() << ": set "
        << kNcclLibraryEnv << " to libnccl.so.2 (torch ships it: python3 -c 'import nvidia.nccl; "
        << "print(list(nvidia.nccl.__path__)[0] + \"/lib/libnccl.so.2\")')";
  }

  // A communicator of one member on device 0.
  std::unique_ptr<BackendComm> Solo(int64_t timeout_ms = kTimeoutMs) {
    absl::StatusOr<std::string> id = backend_->NewCommId();
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return nullptr;
    EXPECT_EQ(id->size(), kBackendCommIdBytes);
    absl::StatusOr<std::unique_ptr<BackendComm>> c = backend_->ConnectComm(*id, 1, 0, timeout_ms);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  std::unique_ptr<CudaBackend> backend_;
};

TEST_F(NcclCommTest, IdsAreFreshEachTime) {
  absl::StatusOr<std::string> a = backend_->NewCommId(), b = backend_->NewCommId();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), kBackendCommIdBytes);
  EXPECT_NE(*a, *b);
}

// With one member the sum is the member's own data and every slice is its own: both
// collectives leave the buffer as it was, bit for bit, whatever n.
TEST_F(NcclCommTest, OneMemberLeavesRandomDataUnchanged) {
  std::unique_ptr<BackendComm> comm = Solo();
  ASSERT_NE(comm, nullptr);
  uint32_t seed = 10;
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1024}, int64_t{1000003}}) {
    SCOPED_TRACE(absl::StrCat("n=", n));
    const std::vector<float> data = RandomFloats(n, ++seed);
    const size_t bytes = std::max<size_t>(n * 4, 4);
    std::vector<uint8_t> image(bytes, 0);
    std::memcpy(image.data(), data.data(), n * 4);
    std::unique_ptr<BackendBuffer> buf = Upload(*backend_, image.data(), bytes);
    ASSERT_NE(buf, nullptr);
    const absl::Status rs = comm->ReduceScatter(static_cast<float*>(buf->data()), n);
    ASSERT_TRUE(rs.ok()) << rs;
    EXPECT_TRUE(SameBytes(image, Download(*backend_, *buf, bytes), 4, 0, n));
    for (size_t elem : {size_t{1}, size_t{2}, size_t{4}, size_t{6}}) {
      const std::vector<uint8_t> raw = RandomBytes(std::max<size_t>(n * elem, 1), ++seed);
      std::unique_ptr<BackendBuffer> g = Upload(*backend_, raw.data(), raw.size());
      ASSERT_NE(g, nullptr);
      const absl::Status ag = comm->AllGather(g->data(), n, elem);
      ASSERT_TRUE(ag.ok()) << ag << " elem_bytes " << elem;
      EXPECT_TRUE(SameBytes(raw, Download(*backend_, *g, raw.size()), elem, 0, n))
          << "elem_bytes " << elem;
    }
  }
}

TEST_F(NcclCommTest, BadArgumentsAreRefused) {
  absl::StatusOr<std::string> id = backend_->NewCommId();
  ASSERT_TRUE(id.ok()) << id.status();
  struct Case {
    std::string id;
    uint32_t size, rank;
    int64_t timeout_ms;
  };
  for (const Case& c : {Case{id->substr(0, 100), 1, 0, 1000}, Case{*id + "x", 1, 0, 1000},
                        Case{*id, 0, 0, 1000}, Case{*id, 2, 2, 1000}, Case{*id, 1, 0, 0}}) {
    const absl::Status st = backend_->ConnectComm(c.id, c.size, c.rank, c.timeout_ms).status();
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_NE(st.message().find("ConnectComm needs an id of 128 bytes"), std::string::npos)
        << st;
  }
  std::unique_ptr<BackendComm> comm = Solo();
  ASSERT_NE(comm, nullptr);
  std::unique_ptr<BackendBuffer> buf = Upload(*backend_, RandomFloats(4, 1).data(), 16);
  ASSERT_NE(buf, nullptr);
  for (const absl::Status& st :
       {comm->ReduceScatter(static_cast<float*>(buf->data()), -1),
        comm->ReduceScatter(nullptr, 4), comm->AllGather(buf->data(), -1, 4),
        comm->AllGather(buf->data(), 4, 0), comm->AllGather(nullptr, 4, 4)}) {
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  }
  // The communicator stands after a refusal.
  EXPECT_TRUE(comm->ReduceScatter(static_cast<float*>(buf->data()), 4).ok());
}

// A member that never joins: the one that did gives up after the timeout, DEADLINE_EXCEEDED,
// not for ever (NCCL's blocking init would wait for ever).
TEST_F(NcclCommTest, AMemberThatNeverJoinsTimesOut) {
  absl::StatusOr<std::string> id = backend_->NewCommId();
  ASSERT_TRUE(id.ok()) << id.status();
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status st = backend_->ConnectComm(*id, 2, 0, 2000).status();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(absl::IsDeadlineExceeded(st)) << st;
  EXPECT_NE(st.message().find("did not all join within 2000 ms"), std::string::npos) << st;
  EXPECT_GE(seconds, 1.9);
  EXPECT_LT(seconds, 30.0);
  // The backend still forms a communicator afterwards.
  EXPECT_NE(Solo(), nullptr);
}

TEST_F(NcclCommTest, AbortRefusesEveryLaterCall) {
  std::unique_ptr<BackendComm> comm = Solo();
  ASSERT_NE(comm, nullptr);
  std::unique_ptr<BackendBuffer> buf = Upload(*backend_, RandomFloats(8, 2).data(), 32);
  ASSERT_NE(buf, nullptr);
  ASSERT_TRUE(comm->ReduceScatter(static_cast<float*>(buf->data()), 8).ok());
  comm->Abort();
  comm->Abort();  // idempotent
  for (const absl::Status& st : {comm->ReduceScatter(static_cast<float*>(buf->data()), 8),
                                 comm->AllGather(buf->data(), 8, 4)}) {
    EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
    EXPECT_NE(st.message().find("was aborted: Abort() was called"), std::string::npos) << st;
  }
  comm.reset();  // destroying an aborted communicator is safe
  EXPECT_TRUE(backend_->CommAvailable().ok());
}

// Two members, one per GPU, each on a thread of its own (as two lossd processes would be).
class TwoMemberTest : public NcclCommTest {
 protected:
  void SetUp() override {
    NcclCommTest::SetUp();
    if (HasFatalFailure()) return;
    const int devices = DeviceCount();
    if (devices < 2) {
      GTEST_SKIP() << "a group of two members needs two GPUs; this host has " << devices;
    }
    backends_[0] = std::move(backend_);
    backends_[1] = MakeBackend(1);
    ASSERT_NE(backends_[1], nullptr);
    absl::StatusOr<std::string> id = backends_[0]->NewCommId();
    ASSERT_TRUE(id.ok()) << id.status();
    absl::Status joined[2];
    Both([&](int m) {
      absl::StatusOr<std::unique_ptr<BackendComm>> c =
          backends_[m]->ConnectComm(*id, 2, m, kTimeoutMs);
      joined[m] = c.status();
      if (c.ok()) comms_[m] = std::move(*c);
    });
    for (int m = 0; m < 2; ++m) ASSERT_TRUE(joined[m].ok()) << "member " << m << ": " << joined[m];
  }

  // Runs f(0) and f(1) on two threads and waits for both.
  static void Both(const std::function<void(int)>& f) {
    std::thread t1(f, 1);
    f(0);
    t1.join();
  }

  std::unique_ptr<CudaBackend> backends_[2];
  std::unique_ptr<BackendComm> comms_[2];
};

// Each member's slice holds the sum of both members' data there: a float sum of two numbers
// is the same in either order, so the host's a + b is exact.
TEST_F(TwoMemberTest, ReduceScatterSumsEachMembersSlice) {
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{1000}, int64_t{1001}, int64_t{262147}}) {
    SCOPED_TRACE(absl::StrCat("n=", n, n % 2 == 0 ? " (uniform)" : " (not uniform)"));
    const std::vector<float> data[2] = {RandomFloats(n, 100 + n), RandomFloats(n, 200 + n)};
    std::unique_ptr<BackendBuffer> bufs[2];
    for (int m = 0; m < 2; ++m) {
      bufs[m] = Upload(*backends_[m], data[m].data(), n * 4);
      ASSERT_NE(bufs[m], nullptr);
    }
    absl::Status st[2];
    Both([&](int m) { st[m] = comms_[m]->ReduceScatter(static_cast<float*>(bufs[m]->data()), n); });
    for (int m = 0; m < 2; ++m) {
      ASSERT_TRUE(st[m].ok()) << "member " << m << ": " << st[m];
      std::vector<float> sum(n);
      for (int64_t i = 0; i < n; ++i) sum[i] = data[0][i] + data[1][i];
      std::vector<uint8_t> want(n * 4);
      std::memcpy(want.data(), sum.data(), n * 4);
      EXPECT_TRUE(SameBytes(want, Download(*backends_[m], *bufs[m], n * 4), 4,
                            SliceStart(n, m, 2), SliceStart(n, m + 1, 2)))
          << "member " << m;
    }
  }
}

// Each member holds its own slice (the rest poisoned, differently on each); afterwards both
// hold every slice.
TEST_F(TwoMemberTest, AllGatherGivesEveryMemberEverySlice) {
  uint32_t seed = 300;
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{1000}, int64_t{1001}, int64_t{262147}}) {
    for (size_t elem : {size_t{2}, size_t{4}}) {
      SCOPED_TRACE(absl::StrCat("n=", n, " elem_bytes=", elem));
      const std::vector<uint8_t> whole = RandomBytes(n * elem, ++seed);
      std::unique_ptr<BackendBuffer> bufs[2];
      for (int m = 0; m < 2; ++m) {
        std::vector<uint8_t> mine(n * elem, m == 0 ? 0xA5 : 0x5A);
        const int64_t b = SliceStart(n, m, 2), e = SliceStart(n, m + 1, 2);
        std::memcpy(&mine[b * elem], &whole[b * elem], (e - b) * elem);
        bufs[m] = Upload(*backends_[m], mine.data(), mine.size());
        ASSERT_NE(bufs[m], nullptr);
      }
      absl::Status st[2];
      Both([&](int m) { st[m] = comms_[m]->AllGather(bufs[m]->data(), n, elem); });
      for (int m = 0; m < 2; ++m) {
        ASSERT_TRUE(st[m].ok()) << "member " << m << ": " << st[m];
        EXPECT_TRUE(SameBytes(whole, Download(*backends_[m], *bufs[m], n * elem), elem, 0, n))
            << "member " << m;
      }
    }
  }
}

// Member 1 never calls: member 0's collective fails after the timeout, UNAVAILABLE naming it,
// and every later call is refused.
TEST_F(TwoMemberTest, ACollectiveWhosePeerNeverComesTimesOut) {
  absl::StatusOr<std::string> id = backends_[0]->NewCommId();
  ASSERT_TRUE(id.ok());
  std::unique_ptr<BackendComm> short_comms[2];
  absl::Status joined[2];
  Both([&](int m) {
    absl::StatusOr<std::unique_ptr<BackendComm>> c = backends_[m]->ConnectComm(*id, 2, m, 1500);
    joined[m] = c.status();
    if (c.ok()) short_comms[m] = std::move(*c);
  });
  ASSERT_TRUE(joined[0].ok() && joined[1].ok()) << joined[0] << " / " << joined[1];
  std::unique_ptr<BackendBuffer> buf = Upload(*backends_[0], RandomFloats(4096, 5).data(), 16384);
  ASSERT_NE(buf, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status st = short_comms[0]->ReduceScatter(static_cast<float*>(buf->data()), 4096);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  EXPECT_NE(st.message().find("nccl: ReduceScatter failed (member 0 of 2"), std::string::npos)
      << st;
  EXPECT_NE(st.message().find("did not finish within 1500 ms"), std::string::npos) << st;
  EXPECT_GE(seconds, 1.4);
  EXPECT_LT(seconds, 30.0);
  const absl::Status later = short_comms[0]->AllGather(buf->data(), 4096, 4);
  EXPECT_TRUE(absl::IsFailedPrecondition(later)) << later;
  EXPECT_NE(later.message().find("aborted"), std::string::npos) << later;
  short_comms[1]->Abort();  // its peer is gone; destroying it must not wait for member 0
}

// Abort from another thread ends a collective in flight long before its timeout.
TEST_F(TwoMemberTest, AbortFromAnotherThreadEndsACollectiveInFlight) {
  std::unique_ptr<BackendBuffer> buf = Upload(*backends_[0], RandomFloats(4096, 6).data(), 16384);
  ASSERT_NE(buf, nullptr);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    comms_[0]->Abort();
  });
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status st = comms_[0]->ReduceScatter(static_cast<float*>(buf->data()), 4096);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  aborter.join();
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  EXPECT_NE(st.message().find("the communicator was aborted: Abort() was called"),
            std::string::npos)
      << st;
  EXPECT_LT(seconds, kTimeoutMs / 2000.0);
  comms_[1]->Abort();
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
