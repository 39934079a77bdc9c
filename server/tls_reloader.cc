#include "server/tls_reloader.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "storage/log.h"

namespace kvtier {
namespace {

namespace fs = std::filesystem;

constexpr char kCurrent[] = "current";
constexpr char kCurrentTmp[] = "current.tmp";
constexpr char kLock[] = "lock";
constexpr char kKey[] = "key.pem";
constexpr char kCert[] = "cert.pem";
constexpr char kCa[] = "ca.pem";

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Deleter>;

absl::Status Bad(const char* option, const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("option ", option, ": ", path, ": ", what));
}

// The whole file. Errors: InvalidArgument naming the option.
absl::StatusOr<std::string> ReadWhole(const char* option, const std::string& path) {
  // Not blocking: a FIFO put at the path would hang start-up (or the reload thread,
  // and shutdown with it) until something wrote to it.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Bad(option, path, absl::StrCat("cannot open: ", std::strerror(errno)));
  absl::Cleanup close_fd = [fd] { close(fd); };
  if (struct stat st {}; fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return Bad(option, path, "is not a regular file");
  }
  std::string out;
  char buf[16 << 10];
  while (true) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Bad(option, path, absl::StrCat("cannot read: ", std::strerror(errno)));
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    // Certificates and keys are a few KiB; a huge file is a wrong path, not PEM.
    if (out.size() > (16 << 20)) return Bad(option, path, "is larger than 16 MiB");
  }
  if (absl::StripAsciiWhitespace(out).empty()) {
    // What `cp` or `cat > file` leaves for a moment during a rotation.
    return Bad(option, path, "is empty (being written?)");
  }
  return out;
}

// A memory BIO over `pem`, which must outlive it.
std::unique_ptr<BIO, BioDeleter> MemBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioDeleter>(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of `pem`, after checking that every PEM block in it is a
// certificate that parses, as gRPC's own loader (SSL_CTX chain) requires.
absl::StatusOr<X509Ptr> CheckCertificates(const char* option, const std::string& path,
                                          const std::string& pem) {
  auto bio = MemBio(pem);
  if (bio == nullptr) return absl::ResourceExhaustedError("tls: out of memory");
  ERR_clear_error();
  X509Ptr first(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (first == nullptr) {
    ERR_clear_error();
    return Bad(option, path, "holds no PEM certificate");
  }
  while (X509Ptr(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) != nullptr) {
  }
  // The loop ends at the end of the data (no further BEGIN line) or at a block that
  // does not parse: a truncated chain, or a key or other object among the certificates.
  const unsigned long err = ERR_peek_last_error();
  ERR_clear_error();
  if (ERR_GET_LIB(err) != ERR_LIB_PEM || ERR_GET_REASON(err) != PEM_R_NO_START_LINE) {
    return Bad(option, path, "holds a PEM block that is not a whole certificate");
  }
  return first;
}

// Never ask for a passphrase (OpenSSL's default would prompt on the terminal): an
// encrypted key is refused.
int NoPassphrase(char*, int, int, void*) { return -1; }

absl::Status CheckKey(const std::string& path, const std::string& pem, X509* cert) {
  auto bio = MemBio(pem);
  if (bio == nullptr) return absl::ResourceExhaustedError("tls: out of memory");
  std::unique_ptr<EVP_PKEY, KeyDeleter> key(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  const bool matches = key != nullptr && X509_check_private_key(cert, key.get()) == 1;
  ERR_clear_error();
  if (key == nullptr) return Bad("tls_key_file", path, "holds no unencrypted PEM private key");
  if (!matches) return Bad("tls_key_file", path, "does not match the certificate in tls_cert_file");
  return absl::OkStatus();
}

// Writes `data` to a new file `path` (0600) and sets its atime and mtime to `seconds`.
absl::Status WriteStaged(const fs::path& path, const std::string& data, int64_t seconds) {
  auto fail = [&path](const char* what) {
    return absl::UnavailableError(
        absl::StrCat("tls: cannot ", what, " ", path.string(), ": ", std::strerror(errno)));
  };
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fail("create");
  absl::Cleanup close_fd = [fd] { close(fd); };
  for (size_t done = 0; done < data.size();) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail("write");
    done += static_cast<size_t>(n);
  }
  // After the last write, which would set the mtime to now.
  const timespec times[2] = {{.tv_sec = seconds, .tv_nsec = 0}, {.tv_sec = seconds, .tv_nsec = 0}};
  if (futimens(fd, times) != 0) return fail("set the mtime of");
  return absl::OkStatus();
}

// The generation a stage_dir entry name holds ("g12" -> 12), or 0 if it is not one.
uint64_t GenerationOf(const std::string& name) {
  uint64_t n = 0;
  if (name.size() < 2 || name[0] != 'g' || !absl::SimpleAtoi(name.substr(1), &n)) return 0;
  return n;
}

// What `dir` holds. Errors: Unavailable.
absl::StatusOr<std::vector<fs::path>> Entries(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    out.push_back(it->path());
  }
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("tls: cannot list ", dir.string(), ": ", ec.message()));
  }
  return out;
}

// Removes what this class stages in `stage` (generations and links), never other files.
absl::Status RemoveStaged(const fs::path& stage) {
  absl::StatusOr<std::vector<fs::path>> entries = Entries(stage);
  if (!entries.ok()) return entries.status();
  for (const fs::path& e : *entries) {
    const std::string name = e.filename().string();
    if (name == kCurrent || name == kCurrentTmp || GenerationOf(name) != 0) {
      std::error_code ec;
      fs::remove_all(e, ec);
      if (ec) {
        return absl::UnavailableError(
            absl::StrCat("tls: cannot remove ", e.string(), ": ", ec.message()));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TlsReloaderOptions::Validate() const {
  if (cert_file.empty()) return absl::InvalidArgumentError("tls reloader: cert_file is empty");
  if (key_file.empty()) return absl::InvalidArgumentError("tls reloader: key_file is empty");
  if (stage_dir.empty()) return absl::InvalidArgumentError("tls reloader: stage_dir is empty");
  if (interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("tls reloader: interval must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TlsReloader>> TlsReloader::Create(TlsReloaderOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::error_code ec;
  // Absolute: gRPC resolves the staged paths itself, later, on its own thread.
  const fs::path stage = fs::absolute(options.stage_dir, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("tls: ", options.stage_dir, ": ", ec.message()));
  }
  options.stage_dir = stage.string();
  // The files first: a bad one stops start-up before anything is written.
  absl::StatusOr<Files> files = ReadAndCheck(options);
  if (!files.ok()) return files.status();

  fs::create_directories(stage, ec);
  if (ec || chmod(stage.c_str(), 0700) != 0) {
    return absl::UnavailableError(absl::StrCat("tls: cannot create ", stage.string(), ": ",
                                               ec ? ec.message() : std::strerror(errno)));
  }
  const int lock_fd = open((stage / kLock).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("tls: cannot open ", (stage / kLock).string(), ": ", std::strerror(errno)));
  }
  if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    close(lock_fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "tls: ", stage.string(), " is in use by another kvtierd (same data_dir?)"));
  }
  std::unique_ptr<TlsReloader> reloader(
      new TlsReloader(std::move(options), lock_fd, absl::ToUnixSeconds(absl::Now())));
  // Leftovers of an earlier run that did not exit cleanly.
  if (absl::Status s = RemoveStaged(stage); !s.ok()) return s;
  {
    absl::MutexLock lock(&reloader->mu_);
    if (absl::Status s = reloader->Stage(*files); !s.ok()) return s;
  }
  if (reloader->options_.interval != absl::InfiniteDuration()) {
    reloader->thread_ = std::thread([r = reloader.get()] { r->Loop(); });
  }
  return reloader;
}

TlsReloader::TlsReloader(TlsReloaderOptions options, int lock_fd, int64_t base_seconds)
    : options_(std::move(options)), lock_fd_(lock_fd), base_seconds_(base_seconds) {
  if (options_.registry != nullptr) {
    failures_metric_ = &prometheus::BuildCounter()
                            .Name("kvtier_tls_reload_failures_total")
                            .Help("TLS certificate reloads refused because a file was not "
                                  "valid (or could not be staged); the previous certificate "
                                  "stays in use")
                            .Register(*options_.registry)
                            .Add({});
  }
}

TlsReloader::~TlsReloader() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
  // The copy of the private key does not outlive the daemon (a backup of data_dir would
  // carry it). Removed under the lock, so a daemon starting on this data_dir meanwhile
  // has not staged its own yet.
  if (absl::Status s = RemoveStaged(options_.stage_dir); !s.ok()) LogWarning(s.message());
  close(lock_fd_);
}

void TlsReloader::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(options_.interval)) {
    // Logged (once per distinct error) and counted by ReloadNow; the staged copy stays.
    ReloadNow().IgnoreError();
  }
}

absl::StatusOr<TlsReloader::Files> TlsReloader::ReadAndCheck(
    const TlsReloaderOptions& options) {
  Files f;
  absl::StatusOr<std::string> cert = ReadWhole("tls_cert_file", options.cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<X509Ptr> leaf = CheckCertificates("tls_cert_file", options.cert_file, *cert);
  if (!leaf.ok()) return leaf.status();
  absl::StatusOr<std::string> key = ReadWhole("tls_key_file", options.key_file);
  if (!key.ok()) return key.status();
  if (absl::Status s = CheckKey(options.key_file, *key, leaf->get()); !s.ok()) return s;
  f.cert = *std::move(cert);
  f.key = *std::move(key);
  if (!options.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadWhole("tls_client_ca_file", options.client_ca_file);
    if (!ca.ok()) return ca.status();
    if (auto roots = CheckCertificates("tls_client_ca_file", options.client_ca_file, *ca);
        !roots.ok()) {
      return roots.status();
    }
    f.ca = *std::move(ca);
  }
  return f;
}

absl::Status TlsReloader::Stage(const Files& files) {
  const fs::path stage(options_.stage_dir);
  const uint64_t next = generation_ + 1;
  const std::string name = absl::StrCat("g", next);
  const fs::path dir = stage / name;
  std::error_code ec;
  fs::remove_all(dir, ec);  // Left by a failed attempt at this generation, if any.
  if (mkdir(dir.c_str(), 0700) != 0) {
    return absl::UnavailableError(
        absl::StrCat("tls: cannot create ", dir.string(), ": ", std::strerror(errno)));
  }
  const int64_t mtime = base_seconds_ + static_cast<int64_t>(next);
  if (absl::Status s = WriteStaged(dir / kKey, files.key, mtime); !s.ok()) return s;
  if (absl::Status s = WriteStaged(dir / kCert, files.cert, mtime); !s.ok()) return s;
  if (!files.ca.empty()) {
    if (absl::Status s = WriteStaged(dir / kCa, files.ca, mtime); !s.ok()) return s;
  }
  // rename(2) replaces `current` atomically: every lookup through it finds a whole
  // generation, the old or the new. The link is relative, to its sibling.
  const fs::path tmp = stage / kCurrentTmp;
  unlink(tmp.c_str());
  if (symlink(name.c_str(), tmp.c_str()) != 0 ||
      rename(tmp.c_str(), (stage / kCurrent).c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("tls: cannot point ", (stage / kCurrent).string(), " at ", name, ": ",
                     std::strerror(errno)));
  }
  generation_ = next;
  staged_ = files;
  // Keep the generation just replaced (see the header); remove the ones before it. A
  // failure here leaves a stale copy behind, which the next start-up removes.
  absl::StatusOr<std::vector<fs::path>> entries = Entries(stage);
  if (!entries.ok()) {
    LogWarning(entries.status().message());
    return absl::OkStatus();
  }
  for (const fs::path& e : *entries) {
    const uint64_t g = GenerationOf(e.filename().string());
    if (g != 0 && g + 1 < next) {
      fs::remove_all(e, ec);
      if (ec) LogWarning("tls: cannot remove ", e.string(), ": ", ec.message());
    }
  }
  return absl::OkStatus();
}

absl::Status TlsReloader::ReloadNow() {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Files> files = ReadAndCheck(options_);
  absl::Status status = files.status();
  if (files.ok() && *files == staged_) {
    if (!last_error_.empty()) {
      LogInfo("TLS files valid again; still serving generation ", generation_);
      last_error_.clear();
    }
    return absl::OkStatus();
  }
  if (files.ok()) status = Stage(*files);
  if (status.ok()) {
    LogInfo("TLS certificate reloaded from ", options_.cert_file,
            options_.client_ca_file.empty() ? "" : " (with the client CA)", ": generation ",
            generation_, ", served to new connections within about a second");
    last_error_.clear();
    return status;
  }
  ++failures_;
  if (failures_metric_ != nullptr) failures_metric_->Increment();
  if (status.message() != last_error_) {
    last_error_ = std::string(status.message());
    LogWarning("TLS reload refused: ", status.message(), "; still serving generation ",
               generation_, " (logged again only if the error changes)");
  }
  return status;
}

std::string TlsReloader::staged_key_file() const {
  return (fs::path(options_.stage_dir) / kCurrent / kKey).string();
}

std::string TlsReloader::staged_cert_file() const {
  return (fs::path(options_.stage_dir) / kCurrent / kCert).string();
}

std::string TlsReloader::staged_ca_file() const {
  if (options_.client_ca_file.empty()) return "";
  return (fs::path(options_.stage_dir) / kCurrent / kCa).string();
}

uint64_t TlsReloader::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

uint64_t TlsReloader::reload_failures() const {
  absl::MutexLock lock(&mu_);
  return failures_;
}

}  // namespace kvtier
