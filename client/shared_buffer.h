// SharedBuffer: memory this process shares with a same-host kvtierd. A memfd, sealed so
// it can neither shrink nor grow, mapped here (its pages faulted in now, so they are
// this process's memory, not the daemon's) and registered on a RegionChannel. Gets
// into it and puts from it move each byte once, by the daemon's copy; nothing else
// crosses a socket.
//
// Thread-safety: the bytes are the caller's to synchronise (don't read a range while a
// Get writes it). Destroying the buffer unregisters it (RegionChannel::Remove: it
// waits up to 5 s for calls still using it to end); a call still using it after that
// keeps it registered until the channel closes, and the memory lives on in the daemon's
// mapping until the call ends.
#ifndef KVTIER_CLIENT_SHARED_BUFFER_H_
#define KVTIER_CLIENT_SHARED_BUFFER_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "client/region_channel.h"

namespace kvtier {

class SharedBuffer {
 public:
  // A new buffer of at least `bytes` (rounded up to whole pages), registered on
  // `channel`. Returns: Ok, InvalidArgument (0 bytes), ResourceExhausted (no memory,
  // or the daemon's region limit), the daemon's refusal otherwise.
  static absl::StatusOr<std::shared_ptr<SharedBuffer>> Create(
      std::shared_ptr<RegionChannel> channel, uint64_t bytes);
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  uint64_t region_id() const { return reg_.region_id; }
  uint64_t token() const { return reg_.token; }
  int fd() const { return fd_; }  // For tests that tamper with the memfd.
  // True when [p, p + n) lies within this buffer.
  bool Contains(const void* p, uint64_t n) const;

 private:
  SharedBuffer(std::shared_ptr<RegionChannel> channel, int fd, char* data, uint64_t size,
               RegionChannel::Registration reg)
      : channel_(std::move(channel)), fd_(fd), data_(data), size_(size), reg_(reg) {}
  const std::shared_ptr<RegionChannel> channel_;
  const int fd_;
  char* const data_;
  const uint64_t size_;
  const RegionChannel::Registration reg_;
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_SHARED_BUFFER_H_
