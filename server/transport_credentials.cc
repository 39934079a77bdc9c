#include "server/transport_credentials.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <utility>

namespace kvtier {
namespace {

// How often gRPC re-reads the staged copy. The copy changes only when the reloader
// stages a checked generation, so this is what bounds the delay from a good rotation to
// new connections; reading three small local files a second costs nothing measurable.
constexpr unsigned int kStagedRefreshSeconds = 1;

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const DaemonConfig& config, prometheus::Registry* registry,
    std::unique_ptr<TlsReloader>* reloader) {
  if (!config.tls()) return grpc::InsecureServerCredentials();
  TlsReloaderOptions tls;
  tls.cert_file = config.tls_cert_file;
  tls.key_file = config.tls_key_file;
  tls.client_ca_file = config.tls_client_ca_file;
  tls.stage_dir = config.data_dir + "/tls";
  tls.interval = config.tls_reload_interval;
  tls.registry = registry;
  auto created = TlsReloader::Create(std::move(tls));
  if (!created.ok()) return created.status();
  *reloader = *std::move(created);

  const bool mutual = !config.tls_client_ca_file.empty();
  // The provider reads generation 1 synchronously here; Create staged it already.
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      (*reloader)->staged_key_file(), (*reloader)->staged_cert_file(),
      (*reloader)->staged_ca_file(), kStagedRefreshSeconds);
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
