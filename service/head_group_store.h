// SPDX-License-Identifier: Apache-2.0
// The service half of a head group's rendezvous (engine/head_group.h HeadGroupStore): the
// HeadGroupRendezvous service every group-enabled lossd serves and member 0's store is read
// through, and the client the other members use. gloo's own stores are file, Redis or
// in-process; this one needs nothing but lossd's port and the callers' usual credentials.
#ifndef LOSSD_SERVICE_HEAD_GROUP_STORE_H_
#define LOSSD_SERVICE_HEAD_GROUP_STORE_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "engine/head_group.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "service/auth.h"

namespace lossd {

// Bounds of what one caller may put in the store: a group of S members sets O(S) keys of a
// few hundred bytes (gloo's addresses, the join and arrival marks).
inline constexpr size_t kGroupKeyMaxBytes = 256;
inline constexpr size_t kGroupValueMaxBytes = 64 << 10;
inline constexpr size_t kGroupStoreMaxKeys = 1 << 16;

// Validates a GroupKeyRequest's key (and value when `with_value`): INVALID_ARGUMENT naming
// the field.
absl::Status CheckGroupKey(const v1::GroupKeyRequest& r, bool with_value);

class GroupStoreService final : public v1::HeadGroupRendezvous::CallbackService {
 public:
  // auth null: no token needed (as the Loss service).
  explicit GroupStoreService(std::shared_ptr<const TokenAuthenticator> auth);

  // Member 0's own view of the store (no RPC to itself).
  std::shared_ptr<HeadGroupStore> store() { return store_; }

  grpc::ServerUnaryReactor* GroupSet(grpc::CallbackServerContext* ctx,
                                     const v1::GroupKeyRequest* request,
                                     v1::GroupKeyResponse* response) override;
  grpc::ServerUnaryReactor* GroupGet(grpc::CallbackServerContext* ctx,
                                     const v1::GroupKeyRequest* request,
                                     v1::GroupKeyResponse* response) override;
  grpc::ServerUnaryReactor* GroupDelete(grpc::CallbackServerContext* ctx,
                                        const v1::GroupKeyRequest* request,
                                        v1::GroupKeyResponse* response) override;

 private:
  absl::Status Admit(grpc::CallbackServerContext* ctx, const v1::GroupKeyRequest& r,
                     bool with_value) const;
  const std::shared_ptr<const TokenAuthenticator> auth_;
  const std::shared_ptr<MemoryGroupStore> store_;
};

struct GroupStoreClientOptions {
  std::string target;  // member 0's endpoint (HeadGroup::members[0])
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: plaintext
  std::string token;   // bearer token for member 0 ("" = none)
  absl::Duration call_timeout = absl::Seconds(10);  // each RPC's deadline
};

// A HeadGroupStore read through member 0's GroupStoreService. Get waits by asking again
// (5 ms, doubling to 100 ms) so that no server thread ever blocks on a key.
std::shared_ptr<HeadGroupStore> MakeRpcGroupStore(const GroupStoreClientOptions& options);

// The credentials a member presents to member 0: the bearer token in `token_file` (its first
// line; "" = none), TLS verified against the PEM roots in `tls_ca_file` ("" = plaintext), and
// for a member 0 that asks for client certificates (--tls_client_ca) the PEM certificate
// chain and key this member presents (both or neither, and only with TLS). INVALID_ARGUMENT
// naming the flag where a file cannot be read or is empty, or the flags do not go together.
absl::StatusOr<GroupStoreClientOptions> GroupStoreClientFromFiles(
    const std::string& token_file, const std::string& tls_ca_file,
    const std::string& tls_cert_file = "", const std::string& tls_key_file = "");

// EngineOptions::head_connect_group for this server: member 0 forms the group through
// `local` (its own GroupStoreService's store), the others through member 0's service, with
// `client`'s credentials (its target is set per group); gloo over TCP (`gloo`) or the
// backend's own collectives, as ConnectHeadGroup picks them.
ConnectHeadGroupFn MakeConnectGroup(
    std::shared_ptr<HeadGroupStore> local, GroupStoreClientOptions client, GlooOptions gloo);

// lossd's head group flags.
struct HeadGroupFlags {
  std::string address;  // --head_group_address: gloo's listener; empty: groups refused
  absl::Duration timeout;  // --head_group_timeout; 0: eo->head_step_timeout
  std::string token_file;  // --head_group_token_file
  std::string tls_ca;      // --head_group_tls_ca
  std::string tls_cert;    // --head_group_tls_cert: this member's client certificate (mTLS)
  std::string tls_key;     // --head_group_tls_key
};

// Where flags.address is set: makes the rendezvous service (`auth` as the Loss service's) and
// sets eo->head_connect_group (after eo->head_step_timeout is set). INVALID_ARGUMENT naming
// the flag where one is wrong; OK and nothing made without an address.
absl::Status ConfigureHeadGroups(const HeadGroupFlags& flags,
                                 std::shared_ptr<const TokenAuthenticator> auth,
                                 EngineOptions* eo,
                                 std::unique_ptr<GroupStoreService>* service);

}  // namespace lossd

#endif  // LOSSD_SERVICE_HEAD_GROUP_STORE_H_
