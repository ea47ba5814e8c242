#include "service/tls.h"

#include <arpa/inet.h>

#include <fstream>
#include <sstream>

#include <grpcpp/security/server_credentials.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

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

}  // namespace lossd
