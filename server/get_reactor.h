// GetReactor: serves one Get call on gRPC's callback API with raw byte buffers, so that
// chunk bytes go from the RAM pool to the socket without a copy: each frame is a small
// serialized header (every GetFrame field but `data`, then data's tag and length) plus
// gRPC slices that point into the pool, each holding a reference on the chunk until
// gRPC is done with it. Protobuf accepts fields in any order, so clients parse the
// frames as ordinary GetFrame messages.
//
// Thread-safety: one step runs at a time for a call: the constructor or OnWriteDone
// (gRPC's callback threads) starts the next write, or asks the store for the next chunk
// and returns; an SSD read then completes on the store's read threads, which start the
// write. gRPC threads never wait for the SSD.
#ifndef KVTIER_SERVER_GET_REACTOR_H_
#define KVTIER_SERVER_GET_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <optional>
#include <vector>

#include "kvtier/v1/kvtier.pb.h"
#include "server/rpc_metrics.h"
#include "storage/tiered_store.h"

namespace kvtier {

class GetReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  // `store` may be null (still starting: the call fails UNAVAILABLE). `metrics` may be
  // null. Both must outlive the call.
  GetReactor(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
             TieredStore* store, RpcMetrics* metrics, uint64_t max_frame_bytes,
             uint32_t max_keys);

  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  absl::Status Start(const grpc::ByteBuffer* request, uint64_t max_frame_bytes, uint32_t max_keys);
  // Writes the next frame (reading the next chunk first if needed), or finishes.
  void Next();
  void OnRead(absl::StatusOr<ChunkView> view);
  void WriteFrame();
  void End(const absl::Status& status);

  grpc::CallbackServerContext* const ctx_;
  TieredStore* const store_;
  RpcMetrics::Scope scope_;
  std::vector<ChunkId> ids_;
  uint32_t num_layers_ = 1;
  uint32_t first_layer_ = 0, end_layer_ = 1;
  uint64_t frame_bytes_ = 0;

  size_t key_ = 0;                 // Key being sent.
  std::optional<ChunkView> view_;  // Its bytes, once read.
  uint64_t begin_ = 0, end_ = 0, off_ = 0;  // Byte range of the key, next offset.
  grpc::ByteBuffer frame_;         // The frame in flight.
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_GET_REACTOR_H_
