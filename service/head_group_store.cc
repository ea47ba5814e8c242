// SPDX-License-Identifier: Apache-2.0
#include "service/head_group_store.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"
#include "absl/synchronization/notification.h"
#include "service/request_id.h"
#include "service/status_util.h"

namespace lossd {

absl::Status CheckGroupKey(const v1::GroupKeyRequest& r, bool with_value) {
  const std::string& k = r.key();
  if (k.empty() || k.size() > kGroupKeyMaxBytes) {
    return absl::InvalidArgumentError(absl::StrCat("key must be 1 to ", kGroupKeyMaxBytes,
                                                   " characters, got ", k.size()));
  }
  for (char c : k) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError("key must be printable ASCII");
    }
  }
  if (with_value && r.value().size() > kGroupValueMaxBytes) {
    return absl::InvalidArgumentError(absl::StrCat("value must be at most ", kGroupValueMaxBytes,
                                                   " bytes, got ", r.value().size()));
  }
  if (!with_value && !r.value().empty()) {
    return absl::InvalidArgumentError("value must be empty except in GroupSet");
  }
  return absl::OkStatus();
}

GroupStoreService::GroupStoreService(std::shared_ptr<const TokenAuthenticator> auth)
    : auth_(std::move(auth)), store_(std::make_shared<MemoryGroupStore>()) {}

absl::Status GroupStoreService::Admit(grpc::CallbackServerContext* ctx,
                                      const v1::GroupKeyRequest& r, bool with_value) const {
  absl::Status s = CheckRequestId(ctx->client_metadata());
  if (s.ok() && auth_ != nullptr) s = auth_->Check(ctx->client_metadata());
  if (s.ok()) s = CheckGroupKey(r, with_value);
  return s;
}

namespace {
grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(ToGrpcStatus(s));
  return r;
}
}  // namespace

grpc::ServerUnaryReactor* GroupStoreService::GroupSet(grpc::CallbackServerContext* ctx,
                                                      const v1::GroupKeyRequest* request,
                                                      v1::GroupKeyResponse* response) {
  absl::Status s = Admit(ctx, *request, /*with_value=*/true);
  if (s.ok() && !store_->Has(request->key()) && store_->size() >= kGroupStoreMaxKeys) {
    s = absl::ResourceExhaustedError(absl::StrCat(
        "the head group store holds ", kGroupStoreMaxKeys, " keys; form fewer groups at once"));
  }
  if (s.ok()) s = store_->Set(request->key(), request->value());
  response->set_found(s.ok());
  return Answer(ctx, s);
}

grpc::ServerUnaryReactor* GroupStoreService::GroupGet(grpc::CallbackServerContext* ctx,
                                                      const v1::GroupKeyRequest* request,
                                                      v1::GroupKeyResponse* response) {
  absl::Status s = Admit(ctx, *request, /*with_value=*/false);
  if (s.ok() && store_->Has(request->key())) {
    // Present now: a zero wait returns it at once.
    absl::StatusOr<std::string> v = store_->Get(request->key(), absl::ZeroDuration());
    if (v.ok()) {
      response->set_found(true);
      response->set_value(std::move(*v));
    }
  }
  return Answer(ctx, s);
}

grpc::ServerUnaryReactor* GroupStoreService::GroupDelete(grpc::CallbackServerContext* ctx,
                                                         const v1::GroupKeyRequest* request,
                                                         v1::GroupKeyResponse* response) {
  absl::Status s = Admit(ctx, *request, /*with_value=*/false);
  if (s.ok()) s = store_->Delete(request->key());
  response->set_found(s.ok());
  return Answer(ctx, s);
}

namespace {

class RpcGroupStore final : public HeadGroupStore {
 public:
  explicit RpcGroupStore(const GroupStoreClientOptions& o)
      : stub_(v1::HeadGroupRendezvous::NewStub(grpc::CreateChannel(
            o.target, o.credentials ? o.credentials : grpc::InsecureChannelCredentials()))),
        token_(o.token),
        call_timeout_(o.call_timeout),
        target_(o.target) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    v1::GroupKeyRequest req;
    req.set_key(key);
    req.set_value(value);
    v1::GroupKeyResponse resp;
    return Call(&v1::HeadGroupRendezvous::Stub::GroupSet, req, &resp, call_timeout_);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    const absl::Time end = absl::Now() + timeout;
    absl::Duration pause = absl::Milliseconds(5);
    while (true) {
      v1::GroupKeyResponse resp;
      absl::Status s = Lookup(key, &resp, std::max(end - absl::Now(), absl::Milliseconds(100)));
      if (!s.ok()) return s;
      if (resp.found()) return std::move(*resp.mutable_value());
      if (absl::Now() + pause > end) {
        return absl::DeadlineExceededError(absl::StrCat(
            "head group key '", key, "' was not set within ", absl::FormatDuration(timeout)));
      }
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Milliseconds(100));
    }
  }
  bool Has(const std::string& key) override {
    v1::GroupKeyResponse resp;
    return Lookup(key, &resp, call_timeout_).ok() && resp.found();
  }
  absl::Status Delete(const std::string& key) override {
    v1::GroupKeyRequest req;
    req.set_key(key);
    v1::GroupKeyResponse resp;
    return Call(&v1::HeadGroupRendezvous::Stub::GroupDelete, req, &resp, call_timeout_);
  }

 private:
  using Method = grpc::Status (v1::HeadGroupRendezvous::Stub::*)(
      grpc::ClientContext*, const v1::GroupKeyRequest&, v1::GroupKeyResponse*);
  absl::Status Lookup(const std::string& key, v1::GroupKeyResponse* resp, absl::Duration d) {
    v1::GroupKeyRequest req;
    req.set_key(key);
    return Call(&v1::HeadGroupRendezvous::Stub::GroupGet, req, resp, std::min(d, call_timeout_));
  }
  absl::Status Call(Method m, const v1::GroupKeyRequest& req, v1::GroupKeyResponse* resp,
                    absl::Duration timeout) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    if (!token_.empty()) ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
    grpc::Status s = ((*stub_).*m)(&ctx, req, resp);
    if (s.ok()) return absl::OkStatus();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("head group store at member 0 (", target_,
                                     "): ", s.error_message()));
  }
  std::unique_ptr<v1::HeadGroupRendezvous::Stub> stub_;
  const std::string token_;
  const absl::Duration call_timeout_;
  const std::string target_;
};

}  // namespace

std::shared_ptr<HeadGroupStore> MakeRpcGroupStore(const GroupStoreClientOptions& options) {
  return std::make_shared<RpcGroupStore>(options);
}

namespace {
absl::StatusOr<std::string> ReadFlagFile(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in.is_open()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", path, " cannot be read"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", path, " is empty or absent"));
  }
  return text;
}
}  // namespace

absl::StatusOr<GroupStoreClientOptions> GroupStoreClientFromFiles(
    const std::string& token_file, const std::string& tls_ca_file,
    const std::string& tls_cert_file, const std::string& tls_key_file) {
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--head_group_tls_cert and --head_group_tls_key go together (this member's client "
        "certificate and its key), got '", tls_cert_file, "' and '", tls_key_file, "'"));
  }
  if (!tls_cert_file.empty() && tls_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--head_group_tls_cert needs --head_group_tls_ca: a client certificate is presented "
        "over TLS only");
  }
  GroupStoreClientOptions o;
  if (!token_file.empty()) {
    absl::StatusOr<std::string> t = ReadFlagFile(token_file, "head_group_token_file");
    if (!t.ok()) return t.status();
    const std::string line = t->substr(0, t->find('\n'));
    o.token = std::string(absl::StripAsciiWhitespace(line));
  }
  if (!tls_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadFlagFile(tls_ca_file, "head_group_tls_ca");
    if (!ca.ok()) return ca.status();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = *ca;
    if (!tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadFlagFile(tls_cert_file, "head_group_tls_cert");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadFlagFile(tls_key_file, "head_group_tls_key");
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    o.credentials = grpc::SslCredentials(ssl);
  }
  return o;
}

ConnectHeadGroupFn MakeConnectGroup(std::shared_ptr<HeadGroupStore> local,
                                    GroupStoreClientOptions client, GlooOptions gloo) {
  return [local = std::move(local), client = std::move(client), gloo](
             const HeadGroup& g, Backend* memory_of) -> absl::StatusOr<std::shared_ptr<HeadComm>> {
    std::shared_ptr<HeadGroupStore> store = local;
    if (g.member != 0 && !g.members.empty()) {
      GroupStoreClientOptions o = client;
      o.target = g.members[0];
      store = MakeRpcGroupStore(o);
    }
    return ConnectHeadGroup(memory_of, std::move(store), g, gloo);
  };
}

absl::Status ConfigureHeadGroups(const HeadGroupFlags& flags,
                                 std::shared_ptr<const TokenAuthenticator> auth,
                                 EngineOptions* eo,
                                 std::unique_ptr<GroupStoreService>* service) {
  if (flags.address.empty()) return absl::OkStatus();
  GlooOptions gloo;
  gloo.hostname = flags.address;
  gloo.timeout = flags.timeout;
  if (gloo.timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--head_group_timeout must be >= 0 (0 = --head_step_timeout); got ",
                     absl::FormatDuration(gloo.timeout)));
  }
  if (gloo.timeout == absl::ZeroDuration()) gloo.timeout = eo->head_step_timeout;
  absl::StatusOr<GroupStoreClientOptions> client =
      GroupStoreClientFromFiles(flags.token_file, flags.tls_ca, flags.tls_cert, flags.tls_key);
  if (!client.ok()) return client.status();
  *service = std::make_unique<GroupStoreService>(std::move(auth));
  eo->head_connect_group = MakeConnectGroup((*service)->store(), std::move(*client), gloo);
  return absl::OkStatus();
}

}  // namespace lossd
