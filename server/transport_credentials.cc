#include "server/transport_credentials.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

absl::Status Bad(const char* option, const std::string& path, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat("option ", option, ": ", path, ": ", what));
}

// The first certificate in `path`, checked to be PEM.
absl::StatusOr<std::unique_ptr<X509, X509Deleter>> ReadCert(const char* option,
                                                            const std::string& path) {
  std::unique_ptr<BIO, BioDeleter> bio(BIO_new_file(path.c_str(), "r"));
  if (bio == nullptr) return Bad(option, path, "cannot open");
  std::unique_ptr<X509, X509Deleter> cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) return Bad(option, path, "holds no PEM certificate");
  return cert;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const DaemonConfig& config) {
  if (!config.tls()) return grpc::InsecureServerCredentials();
  auto cert = ReadCert("tls_cert_file", config.tls_cert_file);
  if (!cert.ok()) return cert.status();
  std::unique_ptr<BIO, BioDeleter> bio(BIO_new_file(config.tls_key_file.c_str(), "r"));
  if (bio == nullptr) return Bad("tls_key_file", config.tls_key_file, "cannot open");
  std::unique_ptr<EVP_PKEY, KeyDeleter> key(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    return Bad("tls_key_file", config.tls_key_file, "holds no unencrypted PEM private key");
  }
  if (X509_check_private_key(cert->get(), key.get()) != 1) {
    return Bad("tls_key_file", config.tls_key_file,
               "does not match the certificate in tls_cert_file");
  }
  const bool mutual = !config.tls_client_ca_file.empty();
  if (mutual) {
    if (auto ca = ReadCert("tls_client_ca_file", config.tls_client_ca_file); !ca.ok()) {
      return ca.status();
    }
  }
  const auto refresh = static_cast<unsigned int>(
      absl::ToInt64Seconds(config.tls_reload_interval));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      config.tls_key_file, config.tls_cert_file, mutual ? config.tls_client_ca_file : "",
      refresh);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (mutual) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace kvtier
