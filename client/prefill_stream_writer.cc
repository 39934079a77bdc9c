#include "client/prefill_stream_writer.h"

namespace kvtier {

void PrefillStreamWriter::SendProgress(uint32_t computed) {
  absl::MutexLock lock(&mu_);
  if (closed_ || computed <= sent_) return;
  v1::PrefillClientMessage msg;
  msg.mutable_progress()->set_computed(computed);
  // Held across the Write: gRPC allows one writer at a time, and the value order on
  // the wire must match sent_.
  if (!stream_->Write(msg)) {
    closed_ = true;
    return;
  }
  sent_ = computed;
}

void PrefillStreamWriter::WritesDone() {
  absl::MutexLock lock(&mu_);
  if (closed_) return;
  // False means the call already ended; the reader gets its status from the stream.
  stream_->WritesDone();
  closed_ = true;
}

grpc::Status PrefillStreamWriter::FinishCall() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  return stream_->Finish();
}

}  // namespace kvtier
