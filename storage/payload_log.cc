#include "storage/payload_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "storage/crc32c.h"
#include "storage/log.h"

namespace kvtier {
namespace {

// The payload directory was removed behind the daemon's back (found gone when a file is
// made or the free space checked): without it every later put would fail until a
// restart. Makes it again; the files it held are served from their open descriptors
// until dropped, and their chunks are lost at the next start. Returns whether it exists.
bool RemakeRemovedDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    LogError("SSD tier: ", dir, " was removed while kvtierd ran; recreating it failed: ",
             ec.message());
    return false;
  }
  LogError("SSD tier: ", dir, " was removed while kvtierd ran; recreated it (the chunks in "
           "the removed files go at the next start)");
  return true;
}

uint64_t AlignUp(uint64_t n) { return (n + kPayloadAlign - 1) / kPayloadAlign * kPayloadAlign; }

absl::Status IoError(absl::string_view what, const std::string& path, int err) {
  if (err == ENOSPC || err == EDQUOT) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "SSD tier: disk full while ", what, " ", path, " (", std::strerror(err),
        "); free space under data_dir or lower ssd_capacity"));
  }
  if (err == EEXIST) {
    return absl::AlreadyExistsError(
        absl::StrCat("SSD tier: ", what, " ", path, ": ", std::strerror(err)));
  }
  return absl::UnavailableError(
      absl::StrCat("SSD tier: ", what, " ", path, ": ", std::strerror(err)));
}

bool ParseFileName(const std::string& name, uint32_t* number) {
  if (name.size() != 12 || name.substr(8) != ".kvp") return false;
  uint32_t n = 0;
  for (int i = 0; i < 8; ++i) {
    const char c = name[i];
    int v;
    if (c >= '0' && c <= '9') {
      v = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      v = c - 'a' + 10;
    } else {
      return false;
    }
    n = n << 4 | static_cast<uint32_t>(v);
  }
  *number = n;
  return true;
}

}  // namespace

ssize_t PayloadFileOps::PWrite(int fd, const void* buf, size_t n, off_t offset) {
  return ::pwrite(fd, buf, n, offset);
}
ssize_t PayloadFileOps::PRead(int fd, void* buf, size_t n, off_t offset) {
  return ::pread(fd, buf, n, offset);
}
int PayloadFileOps::DataSync(int fd) { return ::fdatasync(fd); }
int PayloadFileOps::SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  const int r = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  errno = err;
  return r;
}
int PayloadFileOps::StatVfs(const std::string& path, struct statvfs* out) {
  return ::statvfs(path.c_str(), out);
}
int PayloadFileOps::Unlink(const std::string& path) { return ::unlink(path.c_str()); }

struct PayloadLog::File {
  uint32_t number = 0;
  std::string path;
  int wfd = -1;  // -1 for the files of an earlier run: never written again.
  int rfd = -1;
  // Guarded by PayloadLog::mu_.
  uint64_t end = 0;    // Bytes reserved; the file's size once the writes land.
  uint64_t live = 0;   // Footprint of live extents.
  int writing = 0;     // Reservations whose writes are in flight.
  bool sealed = false;  // Takes no more reservations.

  ~File() {
    if (wfd >= 0) ::close(wfd);
    if (rfd >= 0) ::close(rfd);
  }
};

// A fixed set of aligned buffers; Acquire waits for a free one.
class PayloadLog::Staging {
 public:
  Staging(int count, size_t bytes) {
    for (int i = 0; i < count; ++i) {
      char* b = static_cast<char*>(std::aligned_alloc(kPayloadAlign, bytes));
      if (b == nullptr) std::abort();
      all_.push_back(b);
    }
    free_ = all_;
  }
  ~Staging() {
    for (char* b : all_) std::free(b);
  }
  char* Acquire() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](std::vector<char*>* f) { return !f->empty(); }, &free_));
    char* b = free_.back();
    free_.pop_back();
    return b;
  }
  void Release(char* b) {
    absl::MutexLock lock(&mu_);
    free_.push_back(b);
  }

 private:
  std::vector<char*> all_;
  absl::Mutex mu_;
  std::vector<char*> free_ ABSL_GUARDED_BY(mu_);
};

absl::Status PayloadLogOptions::Validate() const {
  if (dir.empty()) return absl::InvalidArgumentError("payload directory must not be empty");
  if (piece_bytes == 0 || piece_bytes % kPayloadAlign != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ssd piece_bytes must be a positive multiple of ", kPayloadAlign));
  }
  if (io_bytes < piece_bytes || io_bytes % piece_bytes != 0) {
    return absl::InvalidArgumentError("ssd io_bytes must be a multiple of piece_bytes");
  }
  if (file_bytes < io_bytes) {
    return absl::InvalidArgumentError("ssd file_bytes must be at least io_bytes");
  }
  if (write_depth < 1) return absl::InvalidArgumentError("ssd write_depth must be >= 1");
  if (read_depth < 1) return absl::InvalidArgumentError("ssd read_depth must be >= 1");
  return absl::OkStatus();
}

std::string PayloadLog::FileName(uint32_t file) { return absl::StrFormat("%08x.kvp", file); }

PayloadLog::PayloadLog(PayloadLogOptions options, bool direct_io)
    : options_(std::move(options)),
      direct_io_(direct_io),
      ops_(options_.file_ops ? options_.file_ops : std::make_shared<PayloadFileOps>()),
      // One being filled while write_depth are written.
      write_staging_(std::make_unique<Staging>(options_.write_depth + 1, options_.io_bytes)),
      read_staging_(std::make_unique<Staging>(options_.read_depth, options_.io_bytes)),
      writers_(std::make_unique<IoPool>(options_.write_depth)) {}

PayloadLog::~PayloadLog() { writers_.reset(); }

absl::StatusOr<std::unique_ptr<PayloadLog>> PayloadLog::Open(PayloadLogOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("SSD tier: cannot create ", options.dir, ": ", ec.message()));
  }
  // Does the filesystem take O_DIRECT? (tmpfs does not.)
  bool direct = false;
  if (options.direct_io) {
    const std::string probe = options.dir + "/.direct-probe";
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd >= 0) {
      direct = true;
      ::close(fd);
    }
    ::unlink(probe.c_str());
  }
  std::unique_ptr<PayloadLog> log(new PayloadLog(std::move(options), direct));
  int removed = 0;
  absl::MutexLock lock(&log->mu_);
  // Advanced with increment(ec): the range-for's operator++ throws on a readdir error.
  std::filesystem::directory_iterator it(log->options_.dir, ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::filesystem::directory_entry& entry = *it;
    const std::string name = entry.path().filename().string();
    uint32_t number = 0;
    if (!ParseFileName(name, &number)) {
      // Nothing else belongs here (a probe or a stray file from a crash). One that
      // cannot be removed is left, and said so: it is not the listing failing.
      std::error_code removal;
      std::filesystem::remove_all(entry.path(), removal);
      if (removal) {
        LogWarning("SSD tier: cannot remove stray ", entry.path().string(), ": ",
                   removal.message());
      } else {
        ++removed;
      }
      continue;
    }
    auto file = log->OpenFile(number, /*create=*/false);
    if (!file.ok()) return file.status();
    struct stat st;
    if (::fstat((*file)->rfd, &st) != 0) {
      return IoError("reading the size of", (*file)->path, errno);
    }
    (*file)->end = static_cast<uint64_t>(st.st_size);
    (*file)->sealed = true;
    log->disk_bytes_ += (*file)->end;
    log->next_file_ = std::max(log->next_file_, number + 1);
    log->files_[number] = *std::move(file);
  }
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("SSD tier: cannot list ", log->options_.dir, ": ", ec.message()));
  }
  if (removed > 0) LogWarning("SSD tier: removed ", removed, " stray files from ", log->options_.dir);
  return log;
}

absl::StatusOr<std::shared_ptr<PayloadLog::File>> PayloadLog::OpenFile(uint32_t number,
                                                                       bool create) {
  auto file = std::make_shared<File>();
  file->number = number;
  file->path = absl::StrCat(options_.dir, "/", FileName(number));
  const int direct = direct_io_ ? O_DIRECT : 0;
  if (create) {
    file->wfd = ::open(file->path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | direct, 0600);
    if (file->wfd < 0 && errno == ENOENT && RemakeRemovedDir(options_.dir)) {
      file->wfd =
          ::open(file->path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | direct, 0600);
    }
    if (file->wfd < 0) return IoError("creating", file->path, errno);
  }
  file->rfd = ::open(file->path.c_str(), O_RDONLY | O_CLOEXEC | direct);
  if (file->rfd < 0) {
    const int err = errno;
    // A file this call created and cannot use is not left behind under a number the
    // next attempt would take again.
    if (create) ::unlink(file->path.c_str());
    return IoError("opening", file->path, err);
  }
  if (create && options_.sync && ops_->SyncDir(options_.dir) != 0) {
    // Its directory entry must be durable before a row that names it is: after a power
    // cut, the file of an acknowledged write-through chunk would otherwise be missing.
    const int err = errno;
    ::unlink(file->path.c_str());
    return IoError("syncing the directory of", file->path, err);
  }
  return file;
}

std::shared_ptr<PayloadLog::File> PayloadLog::FindFile(uint32_t number) const {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(number);
  return it == files_.end() ? nullptr : it->second;
}

bool PayloadLog::Adopt(const PayloadExtent& extent) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(extent.file);
  if (it == files_.end() || extent.offset % kPayloadAlign != 0 ||
      extent.offset + extent.footprint() > it->second->end) {
    return false;
  }
  it->second->live += extent.footprint();
  live_bytes_ += extent.footprint();
  return true;
}

int PayloadLog::FinishRecovery() {
  absl::MutexLock lock(&mu_);
  std::vector<uint32_t> dead;
  for (const auto& [number, file] : files_) {
    if (file->live == 0) dead.push_back(number);
  }
  for (uint32_t n : dead) DeleteIfDeadLocked(n);
  return static_cast<int>(dead.size());
}

void PayloadLog::DeleteIfDeadLocked(uint32_t number) {
  auto it = files_.find(number);
  if (it == files_.end()) return;
  File& f = *it->second;
  if (!f.sealed || f.live != 0 || f.writing != 0) return;
  if (ops_->Unlink(f.path) != 0 && errno != ENOENT) {
    LogWarning("SSD tier: cannot delete ", f.path, ": ", std::strerror(errno),
               "; tried again at the next sweep");
    return;  // RetryDeletes; its bytes still count.
  }
  disk_bytes_ -= f.end;
  if (active_ == it->second) active_ = nullptr;
  files_.erase(it);  // Readers holding it finish on their open descriptor.
}

absl::StatusOr<std::pair<std::shared_ptr<PayloadLog::File>, PayloadExtent>> PayloadLog::Reserve(
    uint64_t footprint) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckFreeSpaceLocked(footprint); !s.ok()) return s;
  if (active_ && active_->end > 0 && active_->end + footprint > options_.file_bytes) {
    active_->sealed = true;
    const uint32_t old = active_->number;
    active_ = nullptr;
    DeleteIfDeadLocked(old);
  }
  if (!active_) {
    // A number is never tried twice: a failed creation (say, out of descriptors) moves
    // on, and so does a file that appeared under the next name behind the log's back.
    absl::StatusOr<std::shared_ptr<File>> file = OpenFile(next_file_++, /*create=*/true);
    for (int skipped = 0; absl::IsAlreadyExists(file.status()) && skipped < 16; ++skipped) {
      file = OpenFile(next_file_++, /*create=*/true);
    }
    if (absl::IsAlreadyExists(file.status())) {
      return absl::UnavailableError(file.status().message());
    }
    if (!file.ok()) return file.status();
    active_ = *std::move(file);
    files_[active_->number] = active_;
  }
  PayloadExtent ext{active_->number, active_->end, 0};
  active_->end += footprint;
  active_->live += footprint;
  ++active_->writing;
  writing_bytes_ += footprint;
  disk_bytes_ += footprint;
  live_bytes_ += footprint;
  return std::make_pair(active_, ext);
}

absl::Status PayloadLog::CheckFreeSpaceLocked(uint64_t footprint) {
  if (options_.min_free_bytes == 0) return absl::OkStatus();
  struct statvfs fs {};
  if (ops_->StatVfs(options_.dir, &fs) != 0 &&
      (errno != ENOENT || !RemakeRemovedDir(options_.dir) ||
       ops_->StatVfs(options_.dir, &fs) != 0)) {
    return IoError("checking free space on", options_.dir, errno);
  }
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  // Writes in flight will take their reservations' space too.
  const uint64_t available = free_bytes > writing_bytes_ ? free_bytes - writing_bytes_ : 0;
  if (available >= options_.min_free_bytes + footprint) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "SSD tier: disk full: the file system holding ", options_.dir, " has ",
      free_bytes >> 20, " MiB free, and ", options_.min_free_bytes >> 20,
      " MiB of it stay free for the SSD tier's index; free space under data_dir or lower "
      "ssd_capacity"));
}

void PayloadLog::EndWrite(const std::shared_ptr<File>& file, uint64_t footprint) {
  absl::MutexLock lock(&mu_);
  writing_bytes_ -= std::min(writing_bytes_, footprint);
  --file->writing;
  DeleteIfDeadLocked(file->number);
}

void PayloadLog::Release(const PayloadExtent& extent) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(extent.file);
  if (it == files_.end()) return;
  it->second->live -= std::min(it->second->live, extent.footprint());
  live_bytes_ -= std::min(live_bytes_, extent.footprint());
  DeleteIfDeadLocked(extent.file);
}

absl::Status PayloadLog::WriteAt(const File& file, const char* buf, uint64_t n,
                                 uint64_t offset) {
  while (n > 0) {
    const ssize_t w = ops_->PWrite(file.wfd, buf, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return IoError("writing", file.path, errno);
    }
    if (w == 0) return IoError("writing", file.path, EIO);
    buf += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

absl::Status PayloadLog::ReadAt(const File& file, char* buf, uint64_t n, uint64_t offset,
                                uint64_t* got) {
  *got = 0;
  while (*got < n) {
    const ssize_t r = ops_->PRead(file.rfd, buf + *got, n - *got, static_cast<off_t>(offset + *got));
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EIO) {
        // The device cannot read these bytes (a bad sector, say): as lost as bytes that
        // fail their checksum, and as final. UNAVAILABLE would have clients retry a read
        // that fails every time.
        return absl::DataLossError(absl::StrCat("SSD tier: reading ", file.path, " at ",
                                                offset + *got, ": ", std::strerror(EIO)));
      }
      return IoError("reading", file.path, errno);
    }
    if (r == 0) break;  // End of file.
    *got += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckParts(absl::Span<const absl::string_view> parts, uint64_t size) {
  uint64_t total = 0;
  for (absl::string_view p : parts) total += p.size();
  if (total >= size) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("payload parts hold ", total, " bytes, fewer than the chunk's ", size));
}

}  // namespace

absl::StatusOr<PayloadExtent> PayloadLog::Append(absl::Span<const absl::string_view> parts,
                                                 uint64_t size,
                                                 std::vector<uint32_t>* piece_crcs) {
  if (absl::Status s = CheckParts(parts, size); !s.ok()) return s;  // Before taking room.
  absl::StatusOr<Placement> placement = Place(size);
  if (!placement.ok()) return placement.status();
  return Write(*std::move(placement), parts, piece_crcs);
}

absl::StatusOr<PayloadLog::Placement> PayloadLog::Place(uint64_t size) {
  auto reserved = Reserve(AlignUp(size));
  if (!reserved.ok()) return reserved.status();
  reserved->second.size = size;
  return Placement(this, std::move(reserved->first), reserved->second);
}

PayloadLog::Placement::~Placement() {
  if (file_ == nullptr) return;
  log_->EndWrite(file_, extent_.footprint());
  log_->Release(extent_);
}

absl::StatusOr<PayloadExtent> PayloadLog::Write(Placement placement,
                                                absl::Span<const absl::string_view> parts,
                                                std::vector<uint32_t>* piece_crcs) {
  if (absl::Status s = CheckParts(parts, placement.extent_.size); !s.ok()) return s;
  // Ours now: `placement` frees nothing when it goes.
  const std::shared_ptr<File> file = std::move(placement.file_);
  const PayloadExtent ext = placement.extent_;
  const uint64_t size = ext.size;

  const uint64_t piece = options_.piece_bytes;
  piece_crcs->assign((size + piece - 1) / piece, 0);
  absl::Mutex mu;
  int pending = 0;
  absl::Status first_error;
  size_t part = 0, part_off = 0;
  for (uint64_t done = 0; done < size;) {
    const uint64_t n = std::min(options_.io_bytes, size - done);
    char* buf = write_staging_->Acquire();
    // Copy the io's pieces into the staging buffer, each piece's CRC in the same pass.
    for (uint64_t at = 0; at < n; at += piece) {
      const uint64_t want = std::min(piece, n - at);
      uint32_t crc = 0;
      for (uint64_t got = 0; got < want;) {
        const uint64_t take = std::min<uint64_t>(want - got, parts[part].size() - part_off);
        crc = crc32c::CopyAndExtend(crc, buf + at + got, parts[part].data() + part_off, take,
                                    crc32c::CrcOver::kSource);
        got += take;
        part_off += take;
        if (part_off == parts[part].size()) {
          ++part;
          part_off = 0;
        }
      }
      (*piece_crcs)[(done + at) / piece] = crc;
    }
    const uint64_t padded = AlignUp(n);
    std::memset(buf + n, 0, padded - n);
    {
      absl::MutexLock lock(&mu);
      ++pending;
    }
    writers_->Submit([this, &mu, &pending, &first_error, file = file.get(), buf, padded,
                      offset = ext.offset + done] {
      absl::Status s = WriteAt(*file, buf, padded, offset);
      write_staging_->Release(buf);
      absl::MutexLock lock(&mu);
      if (!s.ok() && first_error.ok()) first_error = std::move(s);
      --pending;
    });
    done += n;
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(+[](int* p) { return *p == 0; }, &pending));
  }
  absl::Status s = first_error;
  if (s.ok() && options_.sync && ops_->DataSync(file->wfd) != 0) {
    s = IoError("syncing", file->path, errno);
  }
  {
    absl::MutexLock lock(&mu_);
    bytes_written_ += AlignUp(size);
  }
  EndWrite(file, AlignUp(size));
  if (!s.ok()) {
    Release(ext);
    return s;
  }
  return ext;
}

absl::Status PayloadLog::Read(const PayloadExtent& extent, absl::Span<const uint32_t> piece_crcs,
                              uint64_t offset, uint64_t len,
                              absl::FunctionRef<void(uint64_t, absl::string_view)> out) {
  if (offset > extent.size || len > extent.size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("range [", offset, ", +", len,
                                                   ") is past the chunk's ", extent.size,
                                                   " bytes"));
  }
  const uint64_t piece = options_.piece_bytes;
  if (piece_crcs.size() != (extent.size + piece - 1) / piece) {
    return absl::DataLossError(absl::StrCat("SSD tier: the index holds ", piece_crcs.size(),
                                            " piece checksums for a chunk of ", extent.size,
                                            " bytes"));
  }
  if (len == 0) return absl::OkStatus();
  std::shared_ptr<File> file = FindFile(extent.file);
  if (!file) {
    return absl::NotFoundError(
        absl::StrCat("SSD tier: payload file ", FileName(extent.file), " is gone"));
  }
  char* buf = read_staging_->Acquire();
  absl::Status status;
  const uint64_t end = offset + len;
  for (uint64_t at = offset / piece * piece; at < end && status.ok();) {
    // Whole pieces from `at` up to the one holding the range's last byte, io_bytes at most.
    const uint64_t need_end = std::min(extent.size, (end + piece - 1) / piece * piece);
    const uint64_t n = std::min(options_.io_bytes, need_end - at);
    uint64_t got = 0;
    status = ReadAt(*file, buf, AlignUp(n), extent.offset + at, &got);
    if (!status.ok()) break;
    if (got < n) {
      status = absl::DataLossError(absl::StrCat("SSD tier: payload file ", file->path,
                                                " ends before the chunk it should hold"));
      break;
    }
    for (uint64_t p = 0; p < n; p += piece) {
      const uint64_t plen = std::min(piece, n - p);
      const uint32_t want = piece_crcs[(at + p) / piece];
      const uint32_t crc = crc32c::Value(buf + p, plen);
      if (crc != want) {
        status = absl::DataLossError(absl::StrFormat(
            "SSD tier: bytes [%d, +%d) of a chunk in %s fail their CRC32C (%08x, expected "
            "%08x)",
            at + p, plen, file->path, crc, want));
        break;
      }
    }
    if (!status.ok()) break;
    const uint64_t lo = std::max(at, offset), hi = std::min(at + n, end);
    out(lo, absl::string_view(buf + (lo - at), hi - lo));
    at += n;
  }
  read_staging_->Release(buf);
  return status;
}

absl::StatusOr<PayloadExtent> PayloadLog::Move(const PayloadExtent& from,
                                               absl::Span<const uint32_t> piece_crcs) {
  std::shared_ptr<File> src = FindFile(from.file);
  if (!src) {
    return absl::NotFoundError(
        absl::StrCat("SSD tier: payload file ", FileName(from.file), " is gone"));
  }
  auto reserved = Reserve(from.footprint());
  if (!reserved.ok()) return reserved.status();
  // Not a structured binding: the lambda below captures them (clang 14 cannot).
  auto dst = std::move(reserved->first);
  auto ext = reserved->second;
  ext.size = from.size;
  // Read verifies every piece; each verified io is written at the same place in the new
  // extent (io boundaries are piece boundaries, and both extents start aligned).
  char* wbuf = write_staging_->Acquire();
  absl::Status written;
  absl::Status s = Read(from, piece_crcs, 0, from.size, [&](uint64_t at, absl::string_view b) {
    if (!written.ok()) return;
    std::memcpy(wbuf, b.data(), b.size());
    const uint64_t padded = AlignUp(b.size());
    std::memset(wbuf + b.size(), 0, padded - b.size());
    written = WriteAt(*dst, wbuf, padded, ext.offset + at);
  });
  write_staging_->Release(wbuf);
  if (s.ok()) s = written;
  if (s.ok() && options_.sync && ops_->DataSync(dst->wfd) != 0) {
    s = IoError("syncing", dst->path, errno);
  }
  {
    absl::MutexLock lock(&mu_);
    bytes_written_ += from.footprint();
  }
  EndWrite(dst, from.footprint());
  if (!s.ok()) {
    Release(ext);
    return s;
  }
  return ext;
}

int PayloadLog::RetryDeletes() {
  absl::MutexLock lock(&mu_);
  std::vector<uint32_t> dead;
  for (const auto& [number, file] : files_) {
    if (file->sealed && file->live == 0 && file->writing == 0) dead.push_back(number);
  }
  int deleted = 0;
  for (uint32_t n : dead) {
    DeleteIfDeadLocked(n);
    if (!files_.contains(n)) ++deleted;
  }
  return deleted;
}

std::optional<PayloadLog::Candidate> PayloadLog::MostGarbage() const {
  absl::MutexLock lock(&mu_);
  std::optional<Candidate> best;
  for (const auto& [number, file] : files_) {
    if (!file->sealed || file->writing != 0 || file->end <= file->live || file->live == 0) {
      continue;
    }
    const uint64_t garbage = file->end - file->live;
    if (!best || garbage > best->garbage_bytes) best = Candidate{number, garbage};
  }
  return best;
}

std::optional<uint32_t> PayloadLog::SealLeastLive() {
  absl::MutexLock lock(&mu_);
  std::optional<uint32_t> best;
  uint64_t best_live = 0;
  for (const auto& [number, file] : files_) {
    if (file->writing != 0 || file->live == 0) continue;
    if (!best || file->live < best_live) {
      best = number;
      best_live = file->live;
    }
  }
  if (best && active_ && active_->number == *best) {
    active_->sealed = true;
    active_ = nullptr;
  }
  return best;
}

absl::Status PayloadLog::SyncAll() {
  std::vector<std::shared_ptr<File>> files;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [_, f] : files_) {
      if (f->wfd >= 0) files.push_back(f);
    }
  }
  for (const auto& f : files) {
    if (ops_->DataSync(f->wfd) != 0) return IoError("syncing", f->path, errno);
  }
  return absl::OkStatus();
}

uint64_t PayloadLog::disk_bytes() const {
  absl::MutexLock lock(&mu_);
  return disk_bytes_;
}

absl::StatusOr<uint64_t> PayloadLog::Room() {
  absl::MutexLock lock(&mu_);
  struct statvfs fs {};
  if (ops_->StatVfs(options_.dir, &fs) != 0) {
    return IoError("checking free space on", options_.dir, errno);
  }
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  // disk_bytes_ counts the reservations of writes in flight already.
  const uint64_t room = disk_bytes_ + (free_bytes > writing_bytes_ ? free_bytes - writing_bytes_ : 0);
  return room > options_.min_free_bytes ? room - options_.min_free_bytes : 0;
}

bool PayloadLog::Full(uint64_t footprint) {
  absl::MutexLock lock(&mu_);
  return absl::IsResourceExhausted(CheckFreeSpaceLocked(footprint));
}

PayloadLogStats PayloadLog::GetStats() const {
  absl::MutexLock lock(&mu_);
  return PayloadLogStats{files_.size(), disk_bytes_, live_bytes_, bytes_written_, direct_io_};
}

}  // namespace kvtier
