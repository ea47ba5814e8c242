// SPDX-License-Identifier: Apache-2.0
// A head group's communicator across the plugin ABI (6.2's comm_* functions), without a GPU
// or a plugin file: a fake Backend, served as a table by plugin_export and wrapped back into a
// Backend by plugin_backend, whose communicator records every call. Every argument, result
// and status crosses unchanged; a table of an older minor answers UNIMPLEMENTED naming its
// version.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/plugin_abi.h"
#include "kernels/plugin_backend.h"
#include "kernels/plugin_export.h"

namespace lossd {
namespace {

// What the fake communicator and backend saw, and what they answer next.
struct Record {
  absl::Mutex mu;
  std::vector<std::string> calls;  // "ReduceScatter", "AllGather", "Abort", "Destroy", ...
  float* rs_buf = nullptr;
  int64_t rs_n = -1;
  void* ag_buf = nullptr;
  int64_t ag_n = -1;
  size_t ag_elem_bytes = 0;
  std::string connect_id;
  uint32_t connect_size = 0, connect_rank = 0;
  int64_t connect_timeout_ms = 0;
  // The next answers; OK unless a test sets them.
  absl::Status available, new_id_status, connect_status, collective_status;
  std::string new_id;

  void Add(const std::string& call) {
    absl::MutexLock lock(&mu);
    calls.push_back(call);
  }
};

Record* g_record = nullptr;

class RecordingComm final : public BackendComm {
 public:
  ~RecordingComm() override { g_record->Add("Destroy"); }
  absl::Status ReduceScatter(float* buf, int64_t n) override {
    g_record->Add("ReduceScatter");
    g_record->rs_buf = buf;
    g_record->rs_n = n;
    // A visible effect on the caller's memory: the first element doubled.
    if (n > 0) buf[0] *= 2;
    return g_record->collective_status;
  }
  absl::Status AllGather(void* buf, int64_t n, size_t elem_bytes) override {
    g_record->Add("AllGather");
    g_record->ag_buf = buf;
    g_record->ag_n = n;
    g_record->ag_elem_bytes = elem_bytes;
    return g_record->collective_status;
  }
  void Abort() override { g_record->Add("Abort"); }
};

// Only the comm functions matter here; the rest is never called. PlainBackend keeps
// Backend's defaults for them, as the CPU backend does.
class PlainBackend : public Backend {
 public:
  BackendInfo Info() override { return BackendInfo(); }
  absl::StatusOr<std::unique_ptr<BackendBuffer>> Allocate(size_t) override {
    return absl::UnimplementedError("test");
  }
  absl::Status CopyToBackend(BackendBuffer&, size_t, const void*, size_t) override {
    return absl::UnimplementedError("test");
  }
  absl::Status CopyFromBackend(const BackendBuffer&, size_t, void*, size_t) override {
    return absl::UnimplementedError("test");
  }
  absl::Status Zero(BackendBuffer&) override { return absl::UnimplementedError("test"); }
  uint64_t WorkspaceBytes(const WorkspaceShape&) override { return 0; }
  absl::Status Compute(const LossProblem&, const LossOutputs&, LossStats*) override {
    return absl::UnimplementedError("test");
  }
  absl::Status OptimizerStep(const OptimizerParams&, const OptimizerTensors&) override {
    return absl::UnimplementedError("test");
  }
  absl::StatusOr<double> SumOfSquares(const float*, int64_t) override {
    return absl::UnimplementedError("test");
  }
};

class CommBackend final : public PlainBackend {
 public:
  absl::Status CommAvailable() override {
    g_record->Add("CommAvailable");
    return g_record->available;
  }
  absl::StatusOr<std::string> NewCommId() override {
    g_record->Add("NewCommId");
    if (!g_record->new_id_status.ok()) return g_record->new_id_status;
    return g_record->new_id;
  }
  absl::StatusOr<std::unique_ptr<BackendComm>> ConnectComm(const std::string& id, uint32_t size,
                                                           uint32_t rank,
                                                           int64_t timeout_ms) override {
    g_record->Add("ConnectComm");
    g_record->connect_id = id;
    g_record->connect_size = size;
    g_record->connect_rank = rank;
    g_record->connect_timeout_ms = timeout_ms;
    if (!g_record->connect_status.ok()) return g_record->connect_status;
    return std::unique_ptr<BackendComm>(new RecordingComm);
  }
};

// The factory the table's create calls (one per process, as in a plugin): a CommBackend, or
// a PlainBackend while g_plain_backend is set.
bool g_plain_backend = false;

absl::StatusOr<std::unique_ptr<Backend>> MakeCommBackend(const LossdCudaOptions&) {
  if (g_plain_backend) return std::unique_ptr<Backend>(new PlainBackend);
  return std::unique_ptr<Backend>(new CommBackend);
}

std::string RandomId(uint32_t seed) {
  std::mt19937 rng(seed);
  std::string id(kBackendCommIdBytes, '\0');
  // Every byte value, NUL included, must cross: the id is bytes, not a C string.
  for (char& c : id) c = static_cast<char>(rng() & 0xFF);
  id[5] = '\0';
  return id;
}

class PluginCommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_record = &record_;
    uint32_t version = 0;
    api_ = ServePluginApi(LOSSD_PLUGIN_ABI_VERSION, &version, &MakeCommBackend);
    ASSERT_NE(api_, nullptr);
    ASSERT_EQ(version, LOSSD_PLUGIN_ABI_VERSION);
    backend_ = Wrap(*api_);
  }
  void TearDown() override {
    backend_.reset();
    g_record = nullptr;
  }

  // A Backend over `table`'s create, as the loader makes one.
  std::unique_ptr<Backend> Wrap(const LossdBackendApi& table) {
    LossdBackend* handle = nullptr;
    LossdStatus st{0, nullptr, 0};
    EXPECT_EQ(table.create(nullptr, &handle, &st), 0);
    EXPECT_NE(handle, nullptr);
    return NewPluginBackend(&table, handle);
  }

  std::vector<std::string> Calls() {
    absl::MutexLock lock(&record_.mu);
    return record_.calls;
  }

  Record record_;
  const LossdBackendApi* api_ = nullptr;
  std::unique_ptr<Backend> backend_;
};

TEST_F(PluginCommTest, TheTableReachesTheCommFunctions) {
  EXPECT_EQ(api_->struct_size, sizeof(LossdBackendApi));
  EXPECT_EQ(LOSSD_PLUGIN_ABI_MINOR_OF(api_->abi_version), LOSSD_PLUGIN_ABI_CURRENT_MINOR);
  for (const void* f :
       {reinterpret_cast<const void*>(api_->comm_available),
        reinterpret_cast<const void*>(api_->comm_new_id),
        reinterpret_cast<const void*>(api_->comm_connect),
        reinterpret_cast<const void*>(api_->comm_reduce_scatter),
        reinterpret_cast<const void*>(api_->comm_all_gather),
        reinterpret_cast<const void*>(api_->comm_abort),
        reinterpret_cast<const void*>(api_->comm_destroy)}) {
    EXPECT_NE(f, nullptr);
  }
}

TEST_F(PluginCommTest, AvailabilityAndIdCross) {
  EXPECT_TRUE(backend_->CommAvailable().ok());
  record_.available = absl::FailedPreconditionError("nccl: dlopen(libnccl.so.2): not found");
  EXPECT_EQ(backend_->CommAvailable(), record_.available);

  record_.new_id = RandomId(1);
  absl::StatusOr<std::string> id = backend_->NewCommId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, record_.new_id);
  EXPECT_EQ(id->size(), kBackendCommIdBytes);

  record_.new_id_status = absl::UnavailableError("nccl: ncclGetUniqueId: system error");
  EXPECT_EQ(backend_->NewCommId().status(), record_.new_id_status);
  record_.new_id_status = absl::OkStatus();

  // An id of another size cannot cross the C boundary: refused on the plugin's side.
  record_.new_id = "short";
  const absl::Status wrong = backend_->NewCommId().status();
  EXPECT_TRUE(absl::IsInternal(wrong)) << wrong;
  EXPECT_NE(wrong.message().find("an id of 5 bytes; the plugin ABI carries 128"),
            std::string::npos)
      << wrong;
  EXPECT_EQ(Calls(), (std::vector<std::string>{"CommAvailable", "CommAvailable", "NewCommId",
                                               "NewCommId", "NewCommId"}));
}

TEST_F(PluginCommTest, ConnectAndCollectivesCrossEveryArgument) {
  const std::string id = RandomId(2);
  absl::StatusOr<std::unique_ptr<BackendComm>> comm =
      backend_->ConnectComm(id, 3, 2, int64_t{1} << 40);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ(record_.connect_id, id);
  EXPECT_EQ(record_.connect_size, 3u);
  EXPECT_EQ(record_.connect_rank, 2u);
  EXPECT_EQ(record_.connect_timeout_ms, int64_t{1} << 40);

  std::vector<float> buf = {1.5f, -2.0f, 3.25f, 7.0f};
  ASSERT_TRUE((*comm)->ReduceScatter(buf.data(), 4).ok());
  EXPECT_EQ(record_.rs_buf, buf.data());
  EXPECT_EQ(record_.rs_n, 4);
  EXPECT_EQ(buf[0], 3.0f);  // the callee wrote the caller's memory

  // A count past 2^31 crosses as 64 bits; the sizes as size_t.
  std::vector<uint16_t> half(6, 0x3C00);
  const int64_t big = (int64_t{1} << 33) + 7;
  ASSERT_TRUE((*comm)->AllGather(half.data(), big, 2).ok());
  EXPECT_EQ(record_.ag_buf, half.data());
  EXPECT_EQ(record_.ag_n, big);
  EXPECT_EQ(record_.ag_elem_bytes, 2u);
  ASSERT_TRUE((*comm)->AllGather(half.data(), 3, 4).ok());
  EXPECT_EQ(record_.ag_n, 3);
  EXPECT_EQ(record_.ag_elem_bytes, 4u);

  // Errors keep their code and message, word for word.
  record_.collective_status = absl::UnavailableError(
      "nccl: ncclReduceScatter did not finish within 5000 ms (member 1 of 3): aborted");
  EXPECT_EQ((*comm)->ReduceScatter(buf.data(), 4), record_.collective_status);
  record_.collective_status =
      absl::FailedPreconditionError("nccl: AllGather refused: the communicator was aborted");
  EXPECT_EQ((*comm)->AllGather(half.data(), 6, 2), record_.collective_status);

  (*comm)->Abort();
  (*comm)->Abort();  // idempotent on the backend's side; both calls cross
  comm->reset();     // comm_destroy: the backend's comm is destroyed
  EXPECT_EQ(Calls(),
            (std::vector<std::string>{"ConnectComm", "ReduceScatter", "AllGather", "AllGather",
                                      "ReduceScatter", "AllGather", "Abort", "Abort",
                                      "Destroy"}));
}

TEST_F(PluginCommTest, ConnectErrorsCross) {
  record_.connect_status = absl::DeadlineExceededError(
      "nccl: ncclCommInitRankConfig: 2 of 4 members did not join within 100 ms");
  absl::StatusOr<std::unique_ptr<BackendComm>> comm =
      backend_->ConnectComm(RandomId(3), 4, 0, 100);
  EXPECT_EQ(comm.status(), record_.connect_status);
  EXPECT_EQ(record_.connect_size, 4u);
  EXPECT_EQ(record_.connect_rank, 0u);
  EXPECT_EQ(record_.connect_timeout_ms, 100);
  // An id of the wrong size never reaches the plugin: it reads exactly 128 bytes.
  const absl::Status wrong = backend_->ConnectComm("short", 4, 0, 100).status();
  EXPECT_TRUE(absl::IsInvalidArgument(wrong)) << wrong;
  EXPECT_NE(wrong.message().find("is 128 bytes (NewCommId's); got 5"), std::string::npos)
      << wrong;
  EXPECT_EQ(Calls(), std::vector<std::string>{"ConnectComm"});
}

// A plugin of 6.1 (its table ends before comm_available) is never called past its end: every
// comm call is UNIMPLEMENTED, naming its version and the one head groups need.
TEST_F(PluginCommTest, AnOlderMinorsTableAnswersUnimplemented) {
  LossdBackendApi older = *api_;
  older.struct_size = offsetof(LossdBackendApi, comm_available);
  older.abi_version = LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR, 1);
  // Past struct_size the table is not the plugin's: poisoned, so a call there would crash.
  older.comm_available = reinterpret_cast<decltype(older.comm_available)>(0x1);
  std::unique_ptr<Backend> b = Wrap(older);
  const std::string want = "the plugin speaks ABI 6.1, which carries no head-group "
                           "collectives; head groups on it need a plugin of ABI 6.2 or newer";
  for (const absl::Status& st :
       {b->CommAvailable(), b->NewCommId().status(),
        b->ConnectComm(RandomId(4), 2, 0, 1000).status()}) {
    EXPECT_TRUE(absl::IsUnimplemented(st)) << st;
    EXPECT_NE(st.message().find(want), std::string::npos) << st;
  }
  EXPECT_EQ(Calls(), std::vector<std::string>{});
}

// A Backend that does not override the comm functions (the CPU backend's case) answers
// UNIMPLEMENTED through the table too, with the backend's own message.
TEST_F(PluginCommTest, BackendWithoutCollectivesStaysUnimplemented) {
  g_plain_backend = true;
  std::unique_ptr<Backend> plain = Wrap(*api_);
  g_plain_backend = false;
  for (const absl::Status& st : {plain->CommAvailable(), plain->NewCommId().status(),
                                 plain->ConnectComm(RandomId(5), 2, 1, 1000).status()}) {
    EXPECT_TRUE(absl::IsUnimplemented(st)) << st;
    EXPECT_EQ(st.message(), "this backend has no collectives of its own");
  }
  EXPECT_EQ(Calls(), std::vector<std::string>{});
}

}  // namespace
}  // namespace lossd
