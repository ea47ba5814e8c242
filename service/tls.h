// SPDX-License-Identifier: Apache-2.0
// Server credentials from PEM files: plaintext, TLS (certificate + key) or mutual TLS (plus a
// client CA: clients must present a certificate it signed); the key checked against the
// certificate at start, and gRPC's per-connection TLS failures logged at a bounded rate.
// Never reads a file after start.
#ifndef LOSSD_SERVICE_TLS_H_
#define LOSSD_SERVICE_TLS_H_

#include <cstdint>
#include <memory>
#include <string>

#include <grpcpp/security/server_credentials.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lossd {

// Empty cert and key: insecure (plaintext). Cert without key (or the reverse), or a client CA
// without a certificate: INVALID_ARGUMENT. Unreadable files: NOT_FOUND naming the flag. A key
// that is not the certificate's (or either file not PEM): INVALID_ARGUMENT naming the files.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_path, const std::string& key_path,
    const std::string& client_ca_path);

// OK where `key_pem` is the private key of the first certificate of `cert_pem` (the server's
// own; the rest is its chain); else INVALID_ARGUMENT naming --tls_key and --tls_cert with
// their paths. gRPC finds a mismatch only when it builds the listener, and then reports it
// as a port it cannot listen on.
absl::Status CheckKeyMatchesCertificate(const std::string& cert_pem, const std::string& key_pem,
                                        const std::string& cert_path,
                                        const std::string& key_path);

// Reads a whole file; NOT_FOUND naming `what` when it cannot.
absl::StatusOr<std::string> ReadFileToString(const std::string& path, const std::string& what);

// The warning for a gRPC listener anyone who reaches it may call: `host` (--address) is not a
// loopback address and neither TLS nor bearer tokens are on. Empty where there is none.
std::string OpenListenerWarning(const std::string& host, int port, bool tls, bool tokens);

// At most one admission per `interval`; what it refuses in between is counted and reported
// by the next admission.
class IntervalLimiter {
 public:
  explicit IntervalLimiter(absl::Duration interval) : interval_(interval) {}
  // -1: refused (counted). Else admitted, and the number refused since the last admission.
  int64_t Admit(absl::Time now);

 private:
  const absl::Duration interval_;
  absl::Mutex mu_;
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
};

// Routes gRPC's log lines into lossd's log as InitLogging does, but for the TLS layer's
// per-connection failures ("Handshake failed ...": a plaintext or HTTP client on the TLS
// port, a client certificate refused): those are a client's doing, so they are WARNINGs, at
// most one per `interval`, each saying how many were not logged since the last. Call after
// InitLogging, which sets gRPC's log function too.
void RouteGrpcLogLimitingTlsFailures(absl::Duration interval);

// The same rule for one gRPC line, for tests: whether it is a TLS failure of a connection.
bool IsTlsConnectionFailure(const char* file, const char* message);

}  // namespace lossd

#endif  // LOSSD_SERVICE_TLS_H_
