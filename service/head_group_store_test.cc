// SPDX-License-Identifier: Apache-2.0
// The head group rendezvous over lossd's gRPC: member 0 serves the store, the other members
// read it through MakeRpcGroupStore, and three members form a gloo communicator through it.
#include "service/head_group_store.h"

#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "engine/head_group.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "service/auth.h"

namespace lossd {
namespace {

class GroupStoreServer {
 public:
  explicit GroupStoreServer(std::shared_ptr<const TokenAuthenticator> auth)
      : service_(std::move(auth)) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
  }
  ~GroupStoreServer() { server_->Shutdown(); }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  GroupStoreService& service() { return service_; }

 private:
  GroupStoreService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

std::shared_ptr<HeadGroupStore> Client(const std::string& target, const std::string& token = "") {
  GroupStoreClientOptions o;
  o.target = target;
  o.token = token;
  return MakeRpcGroupStore(o);
}

TEST(HeadGroupStore, SetGetWaitDelete) {
  GroupStoreServer server(nullptr);
  auto a = Client(server.target());
  auto b = Client(server.target());
  EXPECT_FALSE(b->Has("g/k"));
  std::thread later([&] {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(a->Set("g/k", std::string("v\0w", 3)).ok());
  });
  auto v = b->Get("g/k", absl::Seconds(5));  // waits for the other member
  later.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("v\0w", 3));
  EXPECT_TRUE(server.service().store()->Has("g/k"));  // member 0 sees the same store
  ASSERT_TRUE(b->Delete("g/k").ok());
  EXPECT_FALSE(a->Has("g/k"));
  auto missing = b->Get("g/none", absl::Milliseconds(50));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(missing.status().message().find("'g/none' was not set within"), std::string::npos);
}

TEST(HeadGroupStore, RefusesBadKeysAndValues) {
  GroupStoreServer server(nullptr);
  auto a = Client(server.target());
  absl::Status s = a->Set("", "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("key must be 1 to 256 characters, got 0"), std::string::npos) << s;
  s = a->Set(std::string(257, 'k'), "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = a->Set("g/\n", "v");
  EXPECT_NE(s.message().find("key must be printable ASCII"), std::string::npos) << s;
  s = a->Set("g/big", std::string(kGroupValueMaxBytes + 1, 'x'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("value must be at most 65536 bytes, got 65537"), std::string::npos);
}

TEST(HeadGroupStore, NeedsTheCallersToken) {
  GroupStoreServer server(std::make_shared<const TokenAuthenticator>(
      std::vector<std::string>{"secret-token-0123456789"}));
  absl::Status s = Client(server.target())->Set("g/k", "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_FALSE(server.service().store()->Has("g/k"));
  EXPECT_TRUE(Client(server.target(), "secret-token-0123456789")->Set("g/k", "v").ok());
}

// Member 0 reads its own store; members 1 and 2 reach it over gRPC; the three form gloo's
// full mesh and reduce-scatter.
TEST(HeadGroupStore, ThreeMembersFormAGroupThroughIt) {
  GroupStoreServer server(nullptr);
  HeadGroup g;
  g.members = {server.target(), "m1", "m2"};
  g.id = "rpc-group";
  GlooOptions o;
  o.timeout = absl::Seconds(20);
  std::vector<std::vector<float>> bufs(3, std::vector<float>(7));
  std::vector<absl::Status> st(3);
  std::vector<std::thread> ts;
  for (uint32_t m = 0; m < 3; ++m) {
    ts.emplace_back([&, m] {
      HeadGroup mine = g;
      mine.member = m;
      auto store = m == 0 ? server.service().store() : Client(server.target());
      auto comm = ConnectGloo(store, mine, o);
      if (!comm.ok()) {
        st[m] = comm.status();
        return;
      }
      for (int i = 0; i < 7; ++i) bufs[m][i] = static_cast<float>(i + 10 * m);
      st[m] = (*comm)->ReduceScatter(bufs[m].data(), 7);
    });
  }
  for (auto& t : ts) t.join();
  for (uint32_t m = 0; m < 3; ++m) {
    ASSERT_TRUE(st[m].ok()) << st[m];
    const HeadSlice sl = HeadSliceOf(7, m, 3);
    for (int64_t i = sl.lo; i < sl.hi; ++i) EXPECT_EQ(bufs[m][i], 3.0f * i + 30.0f);
  }
}

TEST(HeadGroupStore, AMemberThatNeverJoinsIsNamed) {
  GroupStoreServer server(nullptr);
  HeadGroup g;
  g.members = {server.target(), "m1", "m2"};
  g.id = "short-group";
  GlooOptions o;
  o.timeout = absl::Seconds(1);
  std::vector<absl::Status> st(2);
  std::vector<std::thread> ts;
  for (uint32_t m = 0; m < 2; ++m) {
    ts.emplace_back([&, m] {
      HeadGroup mine = g;
      mine.member = m;
      auto store = m == 0 ? server.service().store() : Client(server.target());
      st[m] = ConnectGloo(store, mine, o).status();
    });
  }
  for (auto& t : ts) t.join();
  for (const absl::Status& s : st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("member 2 (m2) never joined"), std::string::npos) << s;
  }
}

TEST(HeadGroupStore, TheFlagsAreChecked) {
  EngineOptions eo;
  std::unique_ptr<GroupStoreService> service;
  EXPECT_TRUE(ConfigureHeadGroups({"", absl::ZeroDuration(), "", ""}, nullptr, &eo, &service).ok());
  EXPECT_EQ(service, nullptr);
  EXPECT_FALSE(eo.head_connect_group);  // groups stay refused
  absl::Status s =
      ConfigureHeadGroups({"127.0.0.1", absl::Seconds(-1), "", ""}, nullptr, &eo, &service);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--head_group_timeout must be >= 0"), std::string::npos) << s;
  s = ConfigureHeadGroups({"127.0.0.1", absl::ZeroDuration(), "/nonexistent/token", ""}, nullptr,
                          &eo, &service);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--head_group_token_file: /nonexistent/token"), std::string::npos)
      << s;
  ASSERT_TRUE(
      ConfigureHeadGroups({"127.0.0.1", absl::ZeroDuration(), "", ""}, nullptr, &eo, &service)
          .ok());
  EXPECT_NE(service, nullptr);
  EXPECT_TRUE(eo.head_connect_group);
}

// A member's client certificate for a member 0 that asks for one (mutual TLS): the
// certificate and its key together, over TLS only, and files that can be read.
TEST(HeadGroupStore, TheClientCertificateFlagsGoTogether) {
  const std::string dir = ::testing::TempDir();
  const std::string pem = dir + "/head_group_store_test.pem";
  { std::ofstream(pem) << "-----BEGIN CERTIFICATE-----\nnot checked here\n"; }
  EngineOptions eo;
  std::unique_ptr<GroupStoreService> service;
  auto configure = [&](std::string ca, std::string cert, std::string key) {
    return ConfigureHeadGroups({"127.0.0.1", absl::ZeroDuration(), "", ca, cert, key}, nullptr,
                               &eo, &service);
  };
  absl::Status s = configure(pem, pem, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--head_group_tls_cert and --head_group_tls_key go together"),
            std::string::npos) << s;
  s = configure(pem, "", pem);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = configure("", pem, pem);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--head_group_tls_cert needs --head_group_tls_ca"),
            std::string::npos) << s;
  s = configure(pem, pem, "/nonexistent/key.pem");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--head_group_tls_key: /nonexistent/key.pem cannot be read"),
            std::string::npos) << s;
  EXPECT_TRUE(configure(pem, pem, pem).ok());  // the PEM's contents are gRPC's to check
  EXPECT_TRUE(eo.head_connect_group);
}

}  // namespace
}  // namespace lossd
