// Server credentials from PEM files: plaintext, TLS (certificate + key) or mutual TLS (plus a
// client CA: clients must present a certificate it signed); the warning for a listener open
// to anyone.
#ifndef LOSSD_SERVICE_TLS_H_
#define LOSSD_SERVICE_TLS_H_

#include <memory>
#include <string>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"

namespace lossd {

// Empty cert and key: insecure (plaintext). Cert without key (or the reverse), or a client CA
// without a certificate: INVALID_ARGUMENT. Unreadable files: NOT_FOUND naming the flag.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_path, const std::string& key_path,
    const std::string& client_ca_path);

// Reads a whole file; NOT_FOUND naming `what` when it cannot.
absl::StatusOr<std::string> ReadFileToString(const std::string& path, const std::string& what);

// The warning for a gRPC listener anyone who reaches it may call: `host` (--address) is not a
// loopback address and neither TLS nor bearer tokens are on. Empty where there is none.
std::string OpenListenerWarning(const std::string& host, int port, bool tls, bool tokens);

}  // namespace lossd

#endif  // LOSSD_SERVICE_TLS_H_
