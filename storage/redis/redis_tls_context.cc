#include "storage/redis/redis_tls_context.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

// OpenSSL's read buffer per session. With read-ahead on, one recv() takes up to this
// much of the stream (many records) instead of a header and a record at a time; replies
// are bulk strings of a megabyte and more, pipelined by the hundred.
constexpr size_t kTlsReadBuffer = 256 << 10;

// Every reason in this thread's OpenSSL error queue, oldest first (the root cause).
std::string DrainErrors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(e);
    absl::StrAppend(&out, out.empty() ? "" : "; ",
                    reason != nullptr ? reason : absl::StrCat("error ", e));
  }
  return out.empty() ? "unknown OpenSSL error" : out;
}

absl::Status Bad(absl::string_view field, absl::string_view path, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": '", path, "': ", why));
}

// A clear message for the most common mistake (a wrong path) before OpenSSL's own.
// Not blocking, and a regular file: OpenSSL's read of a FIFO would hang start-up.
absl::Status CheckReadable(absl::string_view field, const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Bad(field, path, absl::StrCat("cannot read: ", std::strerror(errno)));
  struct stat st {};
  const bool regular = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  close(fd);
  return regular ? absl::OkStatus() : Bad(field, path, "is not a regular file");
}

// An encrypted private key fails to load instead of prompting on the terminal.
int NoPassword(char*, int, int, void*) { return 0; }

struct CtxFree {
  void operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }
};

bool IsIpLiteral(const std::string& name) {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, name.c_str(), buf) == 1 || inet_pton(AF_INET6, name.c_str(), buf) == 1;
}

}  // namespace

absl::StatusOr<std::shared_ptr<RedisTlsContext>> RedisTlsContext::Create(const RedisTls& tls) {
  if (!tls.enabled) return absl::InvalidArgumentError("enabled: TLS is not enabled");
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        tls.cert_file.empty() ? "cert_file" : "key_file",
        ": missing: a client certificate needs both cert_file and key_file"));
  }
  ERR_clear_error();
  std::unique_ptr<SSL_CTX, CtxFree> ctx(SSL_CTX_new(TLS_client_method()));
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", DrainErrors()));
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  SSL_CTX_set_default_passwd_cb(ctx.get(), NoPassword);
  // Partial writes: SSL_write returns once some records are out, so a write of a 16 MiB
  // pipeline makes progress (and resets the I/O timeout) record by record. Moving
  // buffer: a retried write may come from a different address than the first attempt.
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_CTX_set_read_ahead(ctx.get(), 1);
  SSL_CTX_set_default_read_buffer_len(ctx.get(), kTlsReadBuffer);

  if (tls.ca_file.empty()) {
    if (SSL_CTX_set_default_verify_paths(ctx.get()) != 1) {
      return Bad("ca_file", "", absl::StrCat("cannot load the system trust store: ", DrainErrors()));
    }
  } else {
    if (absl::Status s = CheckReadable("ca_file", tls.ca_file); !s.ok()) return s;
    if (SSL_CTX_load_verify_locations(ctx.get(), tls.ca_file.c_str(), nullptr) != 1) {
      return Bad("ca_file", tls.ca_file, absl::StrCat("no PEM CA certificate: ", DrainErrors()));
    }
  }
  if (!tls.cert_file.empty()) {
    if (absl::Status s = CheckReadable("cert_file", tls.cert_file); !s.ok()) return s;
    if (absl::Status s = CheckReadable("key_file", tls.key_file); !s.ok()) return s;
    if (SSL_CTX_use_certificate_chain_file(ctx.get(), tls.cert_file.c_str()) != 1) {
      return Bad("cert_file", tls.cert_file,
                 absl::StrCat("no PEM certificate chain: ", DrainErrors()));
    }
    if (SSL_CTX_use_PrivateKey_file(ctx.get(), tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
      return Bad("key_file", tls.key_file,
                 absl::StrCat("no unencrypted PEM private key for cert_file: ", DrainErrors()));
    }
    if (SSL_CTX_check_private_key(ctx.get()) != 1) {
      return Bad("key_file", tls.key_file,
                 absl::StrCat("does not match cert_file '", tls.cert_file, "': ", DrainErrors()));
    }
  }
  return std::shared_ptr<RedisTlsContext>(
      new RedisTlsContext(ctx.release(), tls.server_name, !tls.cert_file.empty()));
}

RedisTlsContext::~RedisTlsContext() { SSL_CTX_free(ctx_); }

ssl_st* RedisTlsContext::NewSession(absl::string_view host) const {
  const std::string name = server_name_.empty() ? std::string(host) : server_name_;
  // An empty name would turn the name check off rather than fail it.
  if (name.empty()) return nullptr;
  SSL* ssl = SSL_new(ctx_);
  if (ssl == nullptr) return nullptr;
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
  X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
  bool ok;
  if (IsIpLiteral(name)) {
    // No SNI for an address (RFC 6066 allows only host names there).
    ok = X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str()) == 1;
  } else {
    ok = X509_VERIFY_PARAM_set1_host(param, name.c_str(), name.size()) == 1 &&
         SSL_set_tlsext_host_name(ssl, name.c_str()) == 1;
  }
  if (!ok) {
    SSL_free(ssl);
    return nullptr;
  }
  return ssl;
}

}  // namespace kvtier
