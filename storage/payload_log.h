// PayloadLog: the SSD tier's payload bytes, in append-only files under one directory.
//
// Every chunk's payload is written exactly once, into the active file at a 4 KiB-aligned
// offset, in io_bytes writes from aligned staging buffers (O_DIRECT where the filesystem
// has it, so the page cache neither doubles the copy nor fills with bytes the RAM pool
// already holds). Up to write_depth writes are in flight across all callers, which is
// the queue depth an SSD wants; reads take one of read_depth buffers each. Memory
// outside the RAM pool is therefore fixed: (write_depth + 1 + read_depth) * io_bytes.
// A CRC32C per piece_bytes of payload is computed in the same pass as the copy into the
// staging buffer, so a reader can verify any piece on its own before its bytes leave.
//
// The log knows files and extents, not chunks: the SSD tier's index (RocksDB) says
// which extent holds which chunk. Each file counts its live bytes (extents committed or
// reserved by a write in flight); a file that is no longer written to and has no live
// bytes is deleted. Reclaiming partly dead files (copying the live extents forward with
// Move) is the caller's decision, since only it knows which chunk an extent holds.
//
// Files are named %08x.kvp by number; numbers only grow. Open() finds the files left by
// an earlier run and treats them as sealed with nothing live: Adopt() then marks the
// extents the index still references, and FinishRecovery() deletes the files that hold
// none (puts cut off by a crash, chunks deleted before it).
//
// Thread-safety: all methods are thread-safe. Reads of a file that is deleted meanwhile
// still complete (an open descriptor keeps the bytes).
#ifndef KVTIER_STORAGE_PAYLOAD_LOG_H_
#define KVTIER_STORAGE_PAYLOAD_LOG_H_

#include <sys/statvfs.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "storage/io_pool.h"

namespace kvtier {

// Payload files are written and read in multiples of this, at offsets aligned to it.
inline constexpr uint64_t kPayloadAlign = 4096;

// Where a chunk's payload lives.
struct PayloadExtent {
  uint32_t file = 0;
  uint64_t offset = 0;  // A multiple of kPayloadAlign.
  uint64_t size = 0;    // Payload bytes.

  // Bytes the extent occupies in its file.
  uint64_t footprint() const { return (size + kPayloadAlign - 1) / kPayloadAlign * kPayloadAlign; }
  friend bool operator==(const PayloadExtent&, const PayloadExtent&) = default;
};

// The system calls the log makes on file descriptors; tests override them to fail.
// Each behaves as its namesake: -1 and errno on failure.
class PayloadFileOps {
 public:
  virtual ~PayloadFileOps() = default;
  virtual ssize_t PWrite(int fd, const void* buf, size_t n, off_t offset);
  virtual ssize_t PRead(int fd, void* buf, size_t n, off_t offset);
  virtual int DataSync(int fd);
  // fsync of a directory (a new file's entry).
  virtual int SyncDir(const std::string& dir);
  // statvfs of the file system holding `path`.
  virtual int StatVfs(const std::string& path, struct statvfs* out);
  virtual int Unlink(const std::string& path);
};

struct PayloadLogOptions {
  std::string dir;  // Created if missing.
  // A file stops taking new extents once it holds this many bytes (a file holds at
  // least one extent, so one larger chunk makes a larger file).
  uint64_t file_bytes = 256ull << 20;
  // Size of one write or read (a multiple of piece_bytes).
  uint64_t io_bytes = 4ull << 20;
  // Payload bytes per checksum (a multiple of kPayloadAlign).
  uint64_t piece_bytes = 256ull << 10;
  // Writes in flight across all callers; each holds one io_bytes staging buffer.
  int write_depth = 4;
  // Reads in flight across all callers; each holds one io_bytes buffer while it runs.
  int read_depth = 8;
  // Open files with O_DIRECT where the filesystem supports it.
  bool direct_io = true;
  // fdatasync a file before Append or Move returns, and fsync the directory after
  // creating a file.
  bool sync = false;
  // Free space the log leaves on the file system holding `dir`: an Append or Move that
  // would leave less is refused (ResourceExhausted, "disk full") before it writes. The
  // SSD tier's index (RocksDB) shares the file system and must always find room to
  // write, flush and reopen: a RocksDB that hit ENOSPC can neither shut down cleanly nor
  // open again until someone frees space. 0: no floor.
  uint64_t min_free_bytes = 0;
  // Null: the real system calls.
  std::shared_ptr<PayloadFileOps> file_ops;

  absl::Status Validate() const;
};

struct PayloadLogStats {
  uint64_t files = 0;
  uint64_t disk_bytes = 0;   // Bytes in all payload files.
  uint64_t live_bytes = 0;   // Footprint of live extents.
  uint64_t bytes_written = 0;  // Since start, padding included.
  bool direct_io = false;    // Whether the files are open with O_DIRECT.
};

class PayloadLog {
 public:
  // Creates the directory if needed and finds the files of an earlier run. Returns: Ok,
  // InvalidArgument (bad options), Unavailable (the directory cannot be used).
  static absl::StatusOr<std::unique_ptr<PayloadLog>> Open(PayloadLogOptions options);
  ~PayloadLog();
  PayloadLog(const PayloadLog&) = delete;
  PayloadLog& operator=(const PayloadLog&) = delete;

  // Recovery, before the first Append: marks an extent an index row references as live.
  // Returns false if no file holds it (the file is gone, or shorter than the extent).
  bool Adopt(const PayloadExtent& extent);
  // Deletes the files Adopt left with nothing live. Returns how many.
  int FinishRecovery();

  // Writes a payload (the concatenation of `parts`, `size` bytes) and returns where it
  // is; `piece_crcs` receives one CRC32C per piece_bytes. The extent is live until
  // Release. Returns: Ok, InvalidArgument (parts shorter than size), ResourceExhausted
  // (no space on the device), Unavailable (other I/O error).
  absl::StatusOr<PayloadExtent> Append(absl::Span<const absl::string_view> parts, uint64_t size,
                                       std::vector<uint32_t>* piece_crcs);
  // Append in two steps, for a caller that keeps its own state in the log's order (the
  // SSD tier's eviction order): Place takes the room of a payload of `size` bytes in the
  // active file, and extents placed one after another lie in that order (by file, then
  // offset); Write then writes the payload there, as Append does. A placement must be
  // given to Write, which frees it if the write fails. Place returns: Ok,
  // ResourceExhausted (no space), Unavailable.
  class Placement;
  absl::StatusOr<Placement> Place(uint64_t size);
  absl::StatusOr<PayloadExtent> Write(Placement placement,
                                      absl::Span<const absl::string_view> parts,
                                      std::vector<uint32_t>* piece_crcs);
  // Copies an extent into the active file, verifying each piece on the way; the old
  // extent stays live until Release. Returns: Ok, DataLoss (a piece failed its check),
  // NotFound (its file is gone), ResourceExhausted, Unavailable.
  absl::StatusOr<PayloadExtent> Move(const PayloadExtent& from,
                                     absl::Span<const uint32_t> piece_crcs);
  // Reads payload bytes [offset, offset + len) of an extent. Reads the whole pieces that
  // cover the range, checks each against its CRC32C, and hands the requested bytes to
  // `out` in order (each call: offset within the payload, bytes). Nothing of a piece
  // that fails is handed out. Returns: Ok, InvalidArgument (range outside the extent),
  // NotFound (the file is gone), DataLoss (a piece failed its check, was short, or the
  // device could not read it: EIO), Unavailable.
  absl::Status Read(const PayloadExtent& extent, absl::Span<const uint32_t> piece_crcs,
                    uint64_t offset, uint64_t len,
                    absl::FunctionRef<void(uint64_t, absl::string_view)> out);
  // The extent holds nothing any more; its file is deleted once none of its extents is
  // live and no more are written to it.
  void Release(const PayloadExtent& extent);

  // Deletes the files with nothing live whose deletion failed before (EIO, EROFS, an
  // immutable file), which no release would try again. Returns how many went.
  int RetryDeletes();

  // The file that would free the most space if its live extents were moved, and how
  // much: only files no longer written to that still hold something live (one with
  // nothing live is deleted, not moved). nullopt if none frees anything.
  struct Candidate {
    uint32_t file;
    uint64_t garbage_bytes;
  };
  std::optional<Candidate> MostGarbage() const;
  // The file with the fewest live bytes (some) and no write in flight: the one whose
  // deletion costs the fewest chunks, for a full disk. The file being filled counts too,
  // and is sealed if chosen, so that it is deleted once its extents are released (on a
  // disk smaller than two files it is the only one). nullopt if there is none.
  std::optional<uint32_t> SealLeastLive();

  // fdatasync every file. Returns: Ok, Unavailable.
  absl::Status SyncAll();

  uint64_t piece_bytes() const { return options_.piece_bytes; }
  uint64_t io_bytes() const { return options_.io_bytes; }
  uint64_t disk_bytes() const;
  // The bytes the payload files could take on their file system: those they take now,
  // plus its free space less what writes in flight will take and min_free_bytes.
  // Returns: Ok, Unavailable (statvfs failed).
  absl::StatusOr<uint64_t> Room();
  // Whether a payload of `footprint` bytes would be refused now for want of free space
  // (see min_free_bytes).
  bool Full(uint64_t footprint);
  PayloadLogStats GetStats() const;
  static std::string FileName(uint32_t file);

 private:
  struct File;
  class Staging;
  explicit PayloadLog(PayloadLogOptions options, bool direct_io);

  // Reserves footprint bytes in the active file (opening a new one when it is full).
  // Returns: Ok, ResourceExhausted (under min_free_bytes, or ENOSPC), Unavailable.
  absl::StatusOr<std::pair<std::shared_ptr<File>, PayloadExtent>> Reserve(uint64_t footprint);
  // After the writes into a reservation of `footprint` bytes finished, ok or not.
  void EndWrite(const std::shared_ptr<File>& file, uint64_t footprint);
  // ResourceExhausted if writing `footprint` more bytes would leave the file system
  // under min_free_bytes free.
  absl::Status CheckFreeSpaceLocked(uint64_t footprint) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<File>> OpenFile(uint32_t number, bool create);
  std::shared_ptr<File> FindFile(uint32_t number) const;
  // Writes `n` (aligned) bytes of `buf` at `offset`. Returns: Ok, ResourceExhausted,
  // Unavailable.
  absl::Status WriteAt(const File& file, const char* buf, uint64_t n, uint64_t offset);
  absl::Status ReadAt(const File& file, char* buf, uint64_t n, uint64_t offset, uint64_t* got);
  void DeleteIfDeadLocked(uint32_t number) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PayloadLogOptions options_;
  const bool direct_io_;
  std::shared_ptr<PayloadFileOps> ops_;
  std::unique_ptr<Staging> write_staging_;
  std::unique_ptr<Staging> read_staging_;

  mutable absl::Mutex mu_;
  absl::btree_map<uint32_t, std::shared_ptr<File>> files_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<File> active_ ABSL_GUARDED_BY(mu_);
  uint32_t next_file_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t disk_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_written_ ABSL_GUARDED_BY(mu_) = 0;
  // Footprint of the reservations whose writes have not finished: space the file system
  // does not show as taken yet.
  uint64_t writing_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Last: its threads use the state above and must stop first.
  std::unique_ptr<IoPool> writers_;
};

// Room taken by Place and not yet written. Move-only; one dropped unwritten frees its
// room as a failed write would. Must not outlive its log.
class PayloadLog::Placement {
 public:
  Placement(Placement&& o) noexcept
      : log_(o.log_), file_(std::move(o.file_)), extent_(o.extent_) {}
  Placement& operator=(Placement&&) = delete;
  ~Placement();
  const PayloadExtent& extent() const { return extent_; }

 private:
  friend class PayloadLog;
  Placement(PayloadLog* log, std::shared_ptr<File> file, PayloadExtent extent)
      : log_(log), file_(std::move(file)), extent_(extent) {}
  PayloadLog* log_;
  std::shared_ptr<File> file_;  // Null once written. Its `writing` count includes this.
  PayloadExtent extent_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_PAYLOAD_LOG_H_
