// PeerCredentials: who is at the other end of a connected Unix-domain socket, as the
// kernel says (SO_PEERCRED, and SO_PEERGROUPS for the supplementary groups), for the
// region socket and listen_unix to admit by.
//
// Thread-safety: plain data; ReadPeerCredentials is thread-safe.
#ifndef KVTIER_SERVER_PEER_CREDENTIALS_H_
#define KVTIER_SERVER_PEER_CREDENTIALS_H_

#include <sys/types.h>

#include <vector>

#include "absl/status/statusor.h"

namespace kvtier {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // Supplementary groups (SO_PEERGROUPS).

  // Whether `group` is the peer's primary or one of its supplementary groups.
  bool InGroup(gid_t group) const;
};

// The credentials of the peer of connected socket `fd` (the supplementary groups are
// left empty on a kernel without SO_PEERGROUPS). Returns: Ok, Internal.
absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd);

}  // namespace kvtier

#endif  // KVTIER_SERVER_PEER_CREDENTIALS_H_
