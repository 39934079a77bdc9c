// RegionSocket: the Unix-domain socket on which same-host clients register shared memory
// with the daemon (the protocol is in kvtier.proto, "Same-host data plane").
//
// A SOCK_SEQPACKET socket, in the abstract namespace ("@name", nothing on disk to
// clean up or to guard with file modes) or at a path (created with `mode`). Each
// connection's peer is identified once, at accept, by SO_PEERCRED and SO_PEERGROUPS,
// and admitted only if it runs as the daemon's own user, as root, or with
// `allowed_gid` among its groups (a path socket's group is set to it); a peer that is
// not admitted gets PERMISSION_DENIED on its first request and is disconnected. A
// registration is a memfd passed with SCM_RIGHTS; the daemon maps it
// (RegionTable) and closes its descriptor. When a connection closes, however the client
// ended, its regions are forgotten.
//
// One thread serves every connection with poll(): requests are small and answered at
// once (mapping a region is one mmap). Answers are sent without blocking; a client that
// does not read its answers is disconnected rather than allowed to stall the others.
//
// Thread-safety: Start and the destructor from one thread; the server thread owns the
// connections.
#ifndef KVTIER_SERVER_REGION_SOCKET_H_
#define KVTIER_SERVER_REGION_SOCKET_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "server/peer_credentials.h"
#include "server/region_table.h"
#include "storage/device_backend.h"
#include "storage/log_limiter.h"

namespace kvtier {

// Ok if `peer` may register memory with a daemon running as `self_uid`: same uid,
// root, or `allowed_gid` (if set) as its primary or a supplementary group. Else
// PermissionDenied saying how to be admitted.
absl::Status AdmitPeer(const PeerCredentials& peer, uid_t self_uid,
                       std::optional<gid_t> allowed_gid);

struct RegionSocketOptions {
  std::string name;                 // "@abstract-name" or an absolute path.
  uint32_t mode = 0660;             // File mode of a path socket.
  std::optional<gid_t> allowed_gid;  // Group admitted besides the daemon's user and root.
  uint64_t instance_id = 0;         // Told to every client (DataPlane says the same).
  // Connections of admitted peers; further ones are closed at accept. Peers the daemon
  // does not admit are answered once and closed, a few at a time, outside this.
  uint32_t max_connections = 1024;
  // The GPU device memory registrations are opened on; null: they are refused.
  DeviceBackend* device = nullptr;
};

class RegionSocket {
 public:
  // Binds and starts serving. Returns: Ok, InvalidArgument (bad name), Unavailable
  // (cannot bind: in use, or no permission on the path's directory).
  static absl::StatusOr<std::unique_ptr<RegionSocket>> Start(RegionSocketOptions options,
                                                             RegionTable* regions);
  // Stops serving, closes every connection (forgetting their regions) and removes a
  // path socket.
  ~RegionSocket();
  RegionSocket(const RegionSocket&) = delete;
  RegionSocket& operator=(const RegionSocket&) = delete;

  const std::string& name() const { return options_.name; }

 private:
  struct Connection;
  RegionSocket(RegionSocketOptions options, RegionTable* regions, int listen_fd, int wake_fd);
  void Loop();
  // Accepts what is pending. Returns false when the descriptor table is full and no
  // reserve descriptor is left to refuse a connection with (the loop then waits
  // kAcceptRetry before it tries again).
  bool Accept(std::vector<Connection>& conns);
  // With the descriptor table full: accepts and closes one pending connection using the
  // reserve descriptor. Returns whether one was closed.
  bool RefuseWithReserve();
  // Reads and answers one request; false when the connection should be closed.
  bool Serve(Connection& conn);

  const RegionSocketOptions options_;
  RegionTable* const regions_;
  const int listen_fd_;
  const int wake_fd_;  // eventfd: written by the destructor to stop the loop.
  uint64_t next_connection_id_ = 0;  // Touched only by the server thread.
  int reserve_fd_;                    // /dev/null, given up by RefuseWithReserve; or -1.
  LogLimiter limiter_{absl::Seconds(10)};  // Warnings a client can cause.
  // The packet being read (up to 64 KiB: a device registration with its events), by
  // the server thread only; on the heap, not its stack.
  std::vector<char> packet_;
  std::thread thread_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_REGION_SOCKET_H_
