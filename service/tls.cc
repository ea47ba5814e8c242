// SPDX-License-Identifier: Apache-2.0
#include "service/tls.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <sstream>

#include <grpc/support/log.h>
#include <grpcpp/security/server_credentials.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "engine/message_bounds.h"
#include "service/log.h"

namespace lossd {
namespace {

// OpenSSL objects freed when they go out of scope.
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

// No passphrase: gRPC takes unencrypted keys only, and without this callback OpenSSL would
// prompt on the terminal for an encrypted one.
int NoPassphrase(char*, int, int, void*) { return 0; }

std::unique_ptr<BIO, BioFree> MemoryBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The routed log's limiter; set before gRPC's log function points at GrpcLogLine, never freed
// (gRPC's threads may log until the process ends).
std::atomic<IntervalLimiter*> tls_failures{nullptr};

// gRPC's own lines, as InitLogging routes them, with TLS connection failures limited.
void GrpcLogLine(gpr_log_func_args* args) {
  const std::string message = LogClipped(args->message, kMaxStatusMessageBytes);
  const std::string file = absl::StrCat(args->file, ":", args->line);
  IntervalLimiter* limiter = tls_failures.load();
  if (limiter != nullptr && IsTlsConnectionFailure(args->file, args->message)) {
    const int64_t not_logged = limiter->Admit(absl::Now());
    if (not_logged < 0) return;
    // No peer address: gRPC logs this from its TLS layer (tsi), which is handed bytes and
    // never the socket, and the handshaker that has the socket logs its failure only at
    // DEBUG, without the address too. The address reaches gRPC's log only through its tcp
    // trace, which logs every read and write.
    Log(LogLevel::kWarning,
        absl::StrCat("TLS handshake failed (a client without TLS, e.g. plaintext gRPC or "
                     "HTTP, or a certificate this server does not accept): ",
                     message),
        {{"source", "grpc"},
         {"file", file},
         {"not_logged_since_last", not_logged}});
    return;
  }
  Log(args->severity == GPR_LOG_SEVERITY_ERROR ? LogLevel::kError : LogLevel::kInfo, message,
      {{"source", "grpc"}, {"file", file}});
}

}  // namespace

absl::StatusOr<std::string> ReadFileToString(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " ", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::Status CheckKeyMatchesCertificate(const std::string& cert_pem, const std::string& key_pem,
                                        const std::string& cert_path,
                                        const std::string& key_path) {
  auto cert_bio = MemoryBio(cert_pem);
  std::unique_ptr<X509, X509Free> cert(
      PEM_read_bio_X509(cert_bio.get(), nullptr, NoPassphrase, nullptr));
  auto key_bio = MemoryBio(key_pem);
  std::unique_ptr<EVP_PKEY, KeyFree> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, NoPassphrase, nullptr));
  const bool matches =
      cert != nullptr && key != nullptr && X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();  // OpenSSL's error queue is per thread; leave nothing for gRPC to find
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert ", cert_path, " holds no PEM certificate"));
  }
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key ", key_path, " holds no PEM private key (an encrypted key is not taken)"));
  }
  if (!matches) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key ", key_path, " is not the private key of the certificate in "
                     "--tls_cert ", cert_path, " (its first certificate)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_path, const std::string& key_path,
    const std::string& client_ca_path) {
  if (cert_path.empty() && key_path.empty()) {
    if (!client_ca_path.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (cert_path.empty() || key_path.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  auto cert = ReadFileToString(cert_path, "--tls_cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadFileToString(key_path, "--tls_key");
  if (!key.ok()) return key.status();
  if (absl::Status s = CheckKeyMatchesCertificate(*cert, *key, cert_path, key_path); !s.ok()) {
    return s;
  }
  grpc::SslServerCredentialsOptions o(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  o.pem_key_cert_pairs.push_back({*key, *cert});
  if (!client_ca_path.empty()) {
    auto ca = ReadFileToString(client_ca_path, "--tls_client_ca");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
    o.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(o);
}

std::string OpenListenerWarning(const std::string& host, int port, bool tls, bool tokens) {
  if (tls || tokens) return "";
  const std::string bare(absl::StripSuffix(absl::StripPrefix(host, "["), "]"));
  in_addr v4{};
  in6_addr v6{};
  const bool loopback =
      bare == "localhost" ||
      (inet_pton(AF_INET, bare.c_str(), &v4) == 1 && (ntohl(v4.s_addr) >> 24) == 127) ||
      (inet_pton(AF_INET6, bare.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6));
  if (loopback) return "";
  const bool every = bare == "0.0.0.0" || bare == "::" || bare.empty();
  return absl::StrCat("gRPC listens on ", host, ":", port,
                      every ? " (every address of this host)" : "",
                      " in plaintext and without bearer tokens: anyone who can reach the port "
                      "can call lossd, and tensors cross the network unencrypted. Set "
                      "--tls_cert and --tls_key, --auth_tokens_file, or --address=127.0.0.1");
}

int64_t IntervalLimiter::Admit(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (now - last_ < interval_) {
    ++refused_;
    return -1;
  }
  last_ = now;
  const int64_t refused = refused_;
  refused_ = 0;
  return refused;
}

bool IsTlsConnectionFailure(const char* file, const char* message) {
  // ssl_transport_security.cc logs per connection only: the failed handshake and OpenSSL's
  // info callback around it.
  return (file != nullptr && std::strstr(file, "ssl_transport_security") != nullptr) ||
         (message != nullptr && absl::StrContains(message, "andshake failed"));
}

void RouteGrpcLogLimitingTlsFailures(absl::Duration interval) {
  static IntervalLimiter* const limiter = new IntervalLimiter(interval);
  tls_failures.store(limiter);
  gpr_set_log_function(GrpcLogLine);
}

}  // namespace lossd
