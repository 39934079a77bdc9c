// TlsReloader: keeps a validated private copy of the operator's TLS files for gRPC to
// serve from, so that a bad or half-written file never reaches gRPC.
//
// gRPC's FileWatcherCertificateProvider re-reads the files it is given on a timer and
// trusts whatever it finds: an empty certificate or key (what `cp` or `cat > file` leaves
// for a moment) aborts the process inside gRPC, and a file that is not PEM fails every
// new handshake until it is fixed. gRPC 1.51's C++ API has no provider of our own, so the
// provider is pointed at a copy instead: this class reads the operator's files, checks
// them from memory (PEM certificate chain, unencrypted PEM key matching the first
// certificate, PEM client CA) and only then stages them as a new generation:
//
//   <stage_dir>/g<N>/{key.pem,cert.pem,ca.pem}   written 0600, then
//   <stage_dir>/current -> g<N>                  swapped atomically (symlink + rename)
//
// gRPC reads <stage_dir>/current/*. Its reader stats key.pem and cert.pem before and
// after reading them and retries when either changed, but compares whole seconds; so each
// generation's key.pem and cert.pem get an mtime of their own, start-up time + N seconds,
// and a read that straddles a swap is retried instead of pairing a new certificate with
// the old key. The previous generation is kept until the next swap, so a path that gRPC
// resolved just before a swap still opens; older ones are removed.
//
// A reload whose files are not valid changes nothing: the staged generation keeps being
// served, the failure is counted (kvtier_tls_reload_failures_total) and logged as a
// warning once per distinct error, not every interval.
//
// Thread-safety: thread-safe. ReloadNow runs on the caller's thread and on the
// reloader's own thread (every `interval`), serialised by a mutex. The staged paths are
// fixed for the reloader's life. The destructor removes the staged files (the copy of
// the private key must not outlive the daemon), so the reloader must outlive the
// server and the credentials that read them; a start-up after a crash removes what
// that run left.
#ifndef KVTIER_SERVER_TLS_RELOADER_H_
#define KVTIER_SERVER_TLS_RELOADER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace prometheus {
class Counter;
class Registry;
}  // namespace prometheus

namespace kvtier {

struct TlsReloaderOptions {
  std::string cert_file;       // tls_cert_file: PEM certificate chain, leaf first.
  std::string key_file;        // tls_key_file: unencrypted PEM private key.
  std::string client_ca_file;  // tls_client_ca_file; empty: no client CA (plain TLS).
  // The private copy gRPC reads; created 0700. Entries this class names (g<N>, current,
  // current.tmp) are removed at start-up; nothing else in it is touched.
  std::string stage_dir;
  // How often the operator's files are re-read. InfiniteDuration: only by ReloadNow
  // (tests); no thread is started.
  absl::Duration interval = absl::Seconds(60);
  // Gets kvtier_tls_reload_failures_total; may be null. Must outlive the reloader.
  prometheus::Registry* registry = nullptr;

  // Returns InvalidArgument naming the first bad field.
  absl::Status Validate() const;
};

class TlsReloader {
 public:
  // Reads and checks the files, stages generation 1 and starts the reload thread.
  // Returns: InvalidArgument naming the option (tls_cert_file, tls_key_file,
  // tls_client_ca_file) and path of a file that is unreadable or not valid;
  // FailedPrecondition if another process holds stage_dir; Unavailable if stage_dir
  // cannot be written.
  static absl::StatusOr<std::unique_ptr<TlsReloader>> Create(TlsReloaderOptions options);
  ~TlsReloader();  // Stops the reload thread (promptly: it waits on a notification).

  TlsReloader(const TlsReloader&) = delete;
  TlsReloader& operator=(const TlsReloader&) = delete;

  // Re-reads the operator's files. Valid and different from the staged copy: stages a
  // new generation (logged). Valid and the same: nothing. Not valid: the staged copy
  // stays. Returns: Ok; InvalidArgument naming the option and path of the bad file;
  // Unavailable if staging failed (the previous generation stays).
  absl::Status ReloadNow();

  // The staged files gRPC reads (through the `current` link). ca is empty without
  // client_ca_file.
  std::string staged_key_file() const;
  std::string staged_cert_file() const;
  std::string staged_ca_file() const;

  uint64_t generation() const;       // The staged generation, from 1.
  uint64_t reload_failures() const;  // Reloads that kept the previous generation.

 private:
  // One generation's file contents, as read from the operator's files.
  struct Files {
    std::string key, cert, ca;
    bool operator==(const Files&) const = default;
  };

  TlsReloader(TlsReloaderOptions options, int lock_fd, int64_t base_seconds);
  // The operator's files, read whole and checked from memory. Errors: InvalidArgument
  // naming the option and path.
  static absl::StatusOr<Files> ReadAndCheck(const TlsReloaderOptions& options);
  // Writes generation generation_ + 1 and points `current` at it.
  absl::Status Stage(const Files& files) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();

  const TlsReloaderOptions options_;
  // flock(2)ed for the reloader's life: a second daemon on the same data_dir must not
  // clean or overwrite the copy this one serves from.
  const int lock_fd_;
  // Staged key/cert mtimes are base_seconds_ + generation: unique per generation and
  // increasing, which is what gRPC's read-retry check needs (see the file comment).
  const int64_t base_seconds_;
  prometheus::Counter* failures_metric_ = nullptr;

  mutable absl::Mutex mu_;
  Files staged_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failures_ ABSL_GUARDED_BY(mu_) = 0;
  // The last error logged; empty once a reload succeeds, so a problem that comes back
  // is logged again.
  std::string last_error_ ABSL_GUARDED_BY(mu_);

  absl::Notification stop_;
  std::thread thread_;  // Last: started after everything above is set up.
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TLS_RELOADER_H_
