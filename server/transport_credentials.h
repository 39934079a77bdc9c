// The gRPC server credentials kvtierd listens with: plaintext, TLS, or mutual TLS, from
// the tls_* options. The certificate files are checked once at start-up (readable PEM,
// key matching the certificate) so that a bad file stops the daemon with its name
// instead of failing every handshake later; after that gRPC's file watcher re-reads them
// every tls_reload_interval, and a rotated certificate applies to new connections.
//
// Thread-safety: called once in main().
#ifndef KVTIER_SERVER_TRANSPORT_CREDENTIALS_H_
#define KVTIER_SERVER_TRANSPORT_CREDENTIALS_H_

#include <grpcpp/security/server_credentials.h>

#include <memory>

#include "absl/status/statusor.h"
#include "server/daemon_config.h"

namespace kvtier {

// Returns InvalidArgument naming the option whose file is unreadable or not valid PEM.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const DaemonConfig& config);

}  // namespace kvtier

#endif  // KVTIER_SERVER_TRANSPORT_CREDENTIALS_H_
