// RedisTlsContext: the OpenSSL client context for TLS to Redis, built once from a
// RedisTls (CA, optional client certificate and key, server name) and shared by every
// connection of a cluster. Each connection gets its own SSL session from it, set to
// verify the server's certificate chain and name.
//
// Thread-safety: thread-safe; immutable after Create (OpenSSL allows one SSL_CTX to
// serve many threads' SSL objects).
#ifndef KVTIER_STORAGE_REDIS_REDIS_TLS_CONTEXT_H_
#define KVTIER_STORAGE_REDIS_REDIS_TLS_CONTEXT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "storage/redis/redis_connection.h"

struct ssl_ctx_st;
struct ssl_st;

namespace kvtier {

class RedisTlsContext {
 public:
  // Loads the trust anchors (ca_file, or the system store when empty) and the client
  // certificate and key, and checks that they match. Returns: Ok, InvalidArgument
  // (TLS not enabled; cert_file without key_file or the reverse; a file that cannot be
  // read or holds no usable PEM). An InvalidArgument message starts with the RedisTls
  // field at fault and names the file: "ca_file: '/etc/x.pem': cannot read: No such
  // file or directory".
  static absl::StatusOr<std::shared_ptr<RedisTlsContext>> Create(const RedisTls& tls);
  ~RedisTlsContext();
  RedisTlsContext(const RedisTlsContext&) = delete;
  RedisTlsContext& operator=(const RedisTlsContext&) = delete;

  // A new client session for a connection to `host`, verifying that the server's
  // certificate names server_name (when set) or `host` (an IP address is matched against
  // IP SANs, a name against DNS SANs and sent as SNI). The caller owns it (SSL_free); it
  // holds its own reference to the context. Null when there is no name to verify (an
  // empty name would turn the check off) or OpenSSL is out of memory.
  ssl_st* NewSession(absl::string_view host) const;

  bool has_client_cert() const { return has_client_cert_; }
  const std::string& server_name() const { return server_name_; }

 private:
  RedisTlsContext(ssl_ctx_st* ctx, std::string server_name, bool has_client_cert)
      : ctx_(ctx), server_name_(std::move(server_name)), has_client_cert_(has_client_cert) {}

  ssl_ctx_st* const ctx_;  // Owned (SSL_CTX_free); sessions hold references of their own.
  const std::string server_name_;
  const bool has_client_cert_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REDIS_REDIS_TLS_CONTEXT_H_
