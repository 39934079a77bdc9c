// The gRPC server credentials kvtierd listens with: plaintext, TLS, or mutual TLS, from
// the tls_* options. The certificate files are checked at start-up (readable PEM, key
// matching the certificate) so that a bad file stops the daemon with its name. gRPC then
// serves a private, checked copy under <data_dir>/tls that a TlsReloader refreshes every
// tls_reload_interval: a rotated certificate applies to new connections, and a file
// that is not valid (half-written, not PEM) is logged while the previous one stays.
//
// Thread-safety: called once in main().
#ifndef KVTIER_SERVER_TRANSPORT_CREDENTIALS_H_
#define KVTIER_SERVER_TRANSPORT_CREDENTIALS_H_

#include <grpcpp/security/server_credentials.h>

#include <memory>

#include "absl/status/statusor.h"
#include "server/daemon_config.h"
#include "server/tls_reloader.h"

namespace kvtier {

// Plaintext without tls_cert_file (`*reloader` is left alone). With it, sets `*reloader`
// to the TlsReloader that checks and stages the files; it must outlive the server.
// `registry` (may be null) gets kvtier_tls_reload_failures_total.
// Returns: InvalidArgument naming the option whose file is unreadable or not valid;
// FailedPrecondition or Unavailable when <data_dir>/tls is in use or cannot be written.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const DaemonConfig& config, prometheus::Registry* registry,
    std::unique_ptr<TlsReloader>* reloader);

}  // namespace kvtier

#endif  // KVTIER_SERVER_TRANSPORT_CREDENTIALS_H_
