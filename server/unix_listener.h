// UnixListener: serves the gRPC API on a Unix-domain socket (option listen_unix) and
// knows who is on the other end of each connection.
//
// gRPC's own unix: listener does not tell a handler the peer's credentials, so the
// listener accepts connections itself, reads SO_PEERCRED, and hands each connection to
// the server with grpc::AddInsecureChannelFromFd. gRPC names such a peer "fd:N"; PeerUid()
// maps that back to the uid read at accept. An fd number is reused only after gRPC has
// closed the connection and every call on it has ended, and the listener records the
// new connection's uid before gRPC sees it, so a name never resolves to a stale uid.
//
// `admit` decides at accept time (for example: without a tenants file only the daemon's
// user, root and shm_allowed_group). A refused connection is logged and still handed to
// gRPC, so that each of its calls gets a final answer, PERMISSION_DENIED with admit's
// reason (Refusal()), instead of a closed connection, which a client reads as
// UNAVAILABLE and retries forever.
//
// Thread-safety: thread-safe. Stop() (or the destructor) must run before the server
// shuts down.
#ifndef KVTIER_SERVER_UNIX_LISTENER_H_
#define KVTIER_SERVER_UNIX_LISTENER_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/peer_credentials.h"

namespace grpc {
class Server;
}

namespace kvtier {

class UnixListener {
 public:
  using AdmitFn = std::function<absl::Status(const PeerCredentials&)>;

  // Binds `path` (an absolute path; a stale socket file there is replaced, anything else
  // is an error) with mode `mode`. Accepting starts with Serve().
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(const std::string& path, mode_t mode,
                                                            AdmitFn admit);
  ~UnixListener();

  // Starts accepting connections into `server`, which must outlive Stop().
  void Serve(grpc::Server* server);
  // Stops accepting and removes the socket file. Connections already handed to gRPC
  // live on until the server shuts down.
  void Stop();

  // The connection gRPC calls `peer` ("fd:N"), if it is one of ours: its uid, and
  // `refusal` (PERMISSION_DENIED, naming the uid and admit's reason) if admit refused it.
  struct Connection {
    uid_t uid = 0;
    absl::Status refusal;
  };
  std::optional<Connection> Find(absl::string_view peer) const;

  uint64_t refused() const;

 private:
  UnixListener(int fd, std::string path, AdmitFn admit)
      : fd_(fd), path_(std::move(path)), admit_(std::move(admit)) {}
  void AcceptLoop(grpc::Server* server);

  const int fd_;
  const std::string path_;
  const AdmitFn admit_;
  std::thread thread_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, Connection> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_UNIX_LISTENER_H_
