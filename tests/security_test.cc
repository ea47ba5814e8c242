// SPDX-License-Identifier: Apache-2.0
// TLS, mutual TLS and bearer tokens over real loopback gRPC, with certificates made at test
// time by openssl: right credentials pass; wrong, missing and expired ones are refused, and a
// refusal never echoes the token.
#include <cstdlib>
#include <fstream>
#include <string>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "gtest/gtest.h"
#include "service/auth.h"
#include "service/tls.h"
#include "testing/server_harness.h"
#include "tests/health_status.h"

namespace lossd {
namespace {

using testing_harness::Harness;
using testing_harness::HarnessOptions;

// Makes a CA, a server certificate for 127.0.0.1/localhost, a client certificate, a client
// certificate from another CA and an expired client certificate, in a temporary folder.
class Certs {
 public:
  Certs() {
    dir_ = ::testing::TempDir() + "/certs";
    const std::string script = R"(set -e
mkdir -p ")" + dir_ + R"(" && cd ")" + dir_ + R"("
q() { "$@" >/dev/null 2>&1; }
q openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=lossd-test-ca
q openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other.pem -days 2 -subj /CN=other-ca
q openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost
printf "subjectAltName=DNS:localhost,IP:127.0.0.1\n" > san.ext
q openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile san.ext
q openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=trainer
q openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2
q openssl x509 -req -in client.csr -CA other.pem -CAkey other.key -CAcreateserial -out stranger.pem -days 2
: > index.txt
echo 01 > serial
cat > ca.cnf <<CNF
[ ca ]
default_ca = test
[ test ]
dir = .
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = anything
[ anything ]
commonName = supplied
CNF
q openssl ca -batch -config ca.cnf -cert ca.pem -keyfile ca.key -in client.csr -out expired.pem -startdate 20200101000000Z -enddate 20200102000000Z -notext
)";
    ok_ = std::system(("bash -c '" + Escape(script) + "'").c_str()) == 0;
  }
  bool ok() const { return ok_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Read(const std::string& name) const { return *ReadFileToString(Path(name), name); }

 private:
  static std::string Escape(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (c == '\'') {
        out += "'\\''";
      } else {
        out += c;
      }
    }
    return out;
  }
  std::string dir_;
  bool ok_ = false;
};

const Certs& TestCerts() {
  static const Certs* certs = new Certs();
  return *certs;
}

grpc::Status Info(v1::Loss::Stub& stub, const std::string& token = "") {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  v1::ServerInfoResponse r;
  return stub.ServerInfo(&ctx, v1::ServerInfoRequest(), &r);
}

std::shared_ptr<grpc::ChannelCredentials> Tls(const Certs& c, const std::string& cert = "",
                                              const std::string& key = "") {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = c.Read("ca.pem");
  if (!cert.empty()) {
    o.pem_cert_chain = c.Read(cert);
    o.pem_private_key = c.Read(key);
  }
  return grpc::SslCredentials(o);
}

TEST(SecurityTest, BearerTokens) {
  HarnessOptions o;
  o.service.auth = std::make_shared<const TokenAuthenticator>(
      std::vector<std::string>{"trainer-token-1"});
  Harness h(o);
  EXPECT_TRUE(Info(h.stub(), "trainer-token-1").ok());
  grpc::Status missing = Info(h.stub());
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(missing.error_message().find("missing credentials"), std::string::npos);
  grpc::Status wrong = Info(h.stub(), "guessed-token-xyz");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(wrong.error_message().find("guessed-token-xyz"), std::string::npos)
      << "the refusal echoes the token: " << wrong.error_message();
  // Streams are guarded too.
  testing_harness::ComputeReply r =
      testing_harness::RunCompute(h.stub(), std::vector<v1::ComputeRequest>{});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

// One reflection request for the service list (ServerReflectionRequest.list_services, field
// 7, as raw bytes: this gRPC installs no reflection headers); its status and the bytes of
// every reply.
grpc::Status ListServices(std::shared_ptr<grpc::Channel> channel, const std::string& token,
                          std::string* replies) {
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  grpc::CompletionQueue cq;
  auto call = generic.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  auto step = [&](void* want) {
    return cq.Next(&tag, &ok) && tag == want && ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  if (step(reinterpret_cast<void*>(1))) {
    grpc::Slice request(std::string("\x3a\x00", 2));
    call->Write(grpc::ByteBuffer(&request, 1), reinterpret_cast<void*>(2));
    if (step(reinterpret_cast<void*>(2))) {
      call->WritesDone(reinterpret_cast<void*>(3));
      step(reinterpret_cast<void*>(3));
      grpc::ByteBuffer reply;
      for (;;) {
        call->Read(&reply, reinterpret_cast<void*>(4));
        if (!step(reinterpret_cast<void*>(4))) break;
        std::vector<grpc::Slice> slices;
        (void)reply.Dump(&slices);
        for (const grpc::Slice& s : slices) replies->append(s.begin(), s.end());
      }
    }
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(5)) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// Reflection is off unless asked for (Debian's reflection library registers itself with
// every server it is linked into), and on, it needs the token like the Loss service.
TEST(SecurityTest, ReflectionIsOffByDefaultAndNeedsTheTokenWhenOn) {
  {
    Harness plain;
    std::string replies;
    const grpc::Status off = ListServices(plain.channel(), "", &replies);
    EXPECT_EQ(off.error_code(), grpc::StatusCode::UNIMPLEMENTED) << off.error_message();
    EXPECT_EQ(replies.find("lossd.v1.Loss"), std::string::npos) << "reflection answered";
  }
  {
    HarnessOptions o;
    o.reflection = true;
    Harness open(o);
    std::string replies;
    const grpc::Status on = ListServices(open.channel(), "", &replies);
    EXPECT_TRUE(on.ok()) << on.error_message();
    EXPECT_NE(replies.find("lossd.v1.Loss"), std::string::npos) << "no service list";
  }
  HarnessOptions o;
  o.service.auth = std::make_shared<const TokenAuthenticator>(
      std::vector<std::string>{"trainer-token-1"});
  {
    Harness tokens_off(o);  // tokens, reflection left off
    std::string replies;
    const grpc::Status off = ListServices(tokens_off.channel(), "trainer-token-1", &replies);
    EXPECT_EQ(off.error_code(), grpc::StatusCode::UNIMPLEMENTED) << off.error_message();
    EXPECT_EQ(replies.find("lossd.v1.Loss"), std::string::npos) << "reflection answered";
  }
  o.reflection = true;
  Harness h(o);
  for (const std::string& token : {std::string(), std::string("guessed-token-xyz")}) {
    std::string replies;
    const grpc::Status refused = ListServices(h.channel(), token, &replies);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << "token '" << token << "': " << refused.error_message();
    EXPECT_NE(refused.error_message().find(token.empty() ? "missing credentials"
                                                         : "bearer token is not valid"),
              std::string::npos)
        << refused.error_message();
    EXPECT_TRUE(replies.empty()) << "reflection answered without a valid token";
  }
  std::string replies;
  const grpc::Status allowed = ListServices(h.channel(), "trainer-token-1", &replies);
  EXPECT_TRUE(allowed.ok()) << allowed.error_message();
  EXPECT_NE(replies.find("lossd.v1.Loss"), std::string::npos) << "no service list";
  // Health still needs none, and the Loss service still wants its token.
  EXPECT_EQ(HealthStatus(h.channel()), 1);
  EXPECT_EQ(Info(h.stub()).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Info(h.stub(), "trainer-token-1").ok());
}

// Serves TLS with the test certificates (server.pem, server.key), and wants client
// certificates from c.Path(client_ca) unless client_ca is empty. Callers wrap it in
// ASSERT_NO_FATAL_FAILURE.
void UseServerTls(const Certs& c, const std::string& client_ca, HarnessOptions* o) {
  ASSERT_TRUE(c.ok()) << "openssl failed";
  auto creds = MakeServerCredentials(c.Path("server.pem"), c.Path("server.key"),
                                     client_ca.empty() ? "" : c.Path(client_ca));
  ASSERT_TRUE(creds.ok()) << creds.status();
  o->server_credentials = *creds;
}

TEST(SecurityTest, TlsServesTlsClientsAndRefusesPlaintext) {
  const Certs& c = TestCerts();
  HarnessOptions o;
  ASSERT_NO_FATAL_FAILURE(UseServerTls(c, "", &o));
  Harness h(o);
  auto tls = h.NewStub(Tls(c));
  EXPECT_TRUE(Info(*tls).ok()) << Info(*tls).error_message();
  auto plain = h.NewStub(grpc::InsecureChannelCredentials());
  EXPECT_EQ(Info(*plain).error_code(), grpc::StatusCode::UNAVAILABLE);
}

// Kubernetes' gRPC probes speak plaintext only: behind TLS, a health-only plaintext port
// answers for the server and serves nothing else.
TEST(SecurityTest, APlaintextHealthPortServesHealthAloneBehindTls) {
  const Certs& c = TestCerts();
  HarnessOptions o;
  ASSERT_NO_FATAL_FAILURE(UseServerTls(c, "", &o));
  o.reflection = true;  // on for the main port: the health port must still not serve it
  o.health_address = "127.0.0.1:0";
  Harness h(o);
  ASSERT_NE(h.server().health_port(), 0);
  ASSERT_NE(h.server().health_port(), h.port());
  auto plain = grpc::CreateChannel(absl::StrCat("127.0.0.1:", h.server().health_port()),
                                   grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(plain), 1);  // SERVING
  // Only health: the Loss service and reflection are not there.
  v1::Loss::Stub loss_on_health_port(plain);
  EXPECT_EQ(Info(loss_on_health_port).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  std::string replies;
  EXPECT_EQ(ListServices(plain, "", &replies).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_TRUE(replies.empty());
  // It follows the server's health, and the main port still wants TLS.
  h.server().SetServing(false);
  EXPECT_EQ(HealthStatus(plain), 2);  // NOT_SERVING
  h.server().SetServing(true);
  EXPECT_EQ(HealthStatus(plain), 1);
  auto tls = h.NewStub(Tls(c));
  EXPECT_TRUE(Info(*tls).ok());
  EXPECT_EQ(Info(*h.NewStub(grpc::InsecureChannelCredentials())).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST(SecurityTest, MutualTlsWantsAClientCertificateFromItsCa) {
  const Certs& c = TestCerts();
  HarnessOptions o;
  ASSERT_NO_FATAL_FAILURE(UseServerTls(c, "ca.pem", &o));
  Harness h(o);
  EXPECT_TRUE(Info(*h.NewStub(Tls(c, "client.pem", "client.key"))).ok());
  EXPECT_FALSE(Info(*h.NewStub(Tls(c))).ok()) << "no client certificate";
  EXPECT_FALSE(Info(*h.NewStub(Tls(c, "stranger.pem", "client.key"))).ok())
      << "a certificate from another CA";
  EXPECT_FALSE(Info(*h.NewStub(Tls(c, "expired.pem", "client.key"))).ok())
      << "an expired certificate";
}

TEST(SecurityTest, CredentialFlagsAreChecked) {
  EXPECT_EQ(MakeServerCredentials("cert.pem", "", "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeServerCredentials("", "", "ca.pem").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeServerCredentials("/no/such.pem", "/no/such.key", "").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace lossd
