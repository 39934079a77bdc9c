// PrefillStreamWriter: the write side of one Prefill call, for PrefillSession. gRPC
// allows one writer at a time on a stream, and the stream's Finish must not race a
// Write; this class serializes Progress, the half-close and Finish, and keeps the
// Progress values it sends increasing (the daemon rejects a decreasing one), so callers
// on different threads need no ordering of their own.
//
// Thread-safety: thread-safe. Lifetimes: `stream` must outlive the writer.
#ifndef KVTIER_CLIENT_PREFILL_STREAM_WRITER_H_
#define KVTIER_CLIENT_PREFILL_STREAM_WRITER_H_

#include <cstdint>

#include <grpcpp/support/status.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

class PrefillStreamWriter {
 public:
  using Stream =
      grpc::ClientReaderWriter<v1::PrefillClientMessage, v1::PrefillServerMessage>;

  explicit PrefillStreamWriter(Stream* stream) : stream_(stream) {}

  PrefillStreamWriter(const PrefillStreamWriter&) = delete;
  PrefillStreamWriter& operator=(const PrefillStreamWriter&) = delete;

  // Sends Progress{computed}, unless the writes are closed or a value >= computed was
  // sent already (a caller that lost the race to a later value has nothing to add).
  // A failed Write means the call has ended: the writes close, and the reader learns
  // why from the stream.
  void SendProgress(uint32_t computed);
  // Half-closes the call (once; nothing is written after it).
  void WritesDone();
  // Closes the writes for good and returns the call's status. Call it once, after a
  // Read returned false.
  grpc::Status FinishCall();

 private:
  Stream* const stream_;
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // Half-closed, broken or finished.
  uint32_t sent_ ABSL_GUARDED_BY(mu_) = 0;    // Largest Progress.computed sent.
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_PREFILL_STREAM_WRITER_H_
