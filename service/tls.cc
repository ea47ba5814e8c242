#include "service/tls.h"

#include <fstream>
#include <sstream>

#include <grpcpp/security/server_credentials.h>

#include "absl/strings/str_cat.h"

namespace lossd {

absl::StatusOr<std::string> ReadFileToString(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " ", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
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

}  // namespace lossd
