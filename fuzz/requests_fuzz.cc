// The daemon's request handlers, in process: the real KvCacheService (tenants off, a
// ram-only store, the parse-error interceptor) behind an in-process gRPC channel. Each
// input is one call: its first byte picks the method, the rest are the request's bytes
// (for Put and Prefill, a sequence of messages, each prefixed by a 2-byte length).
// Whatever the bytes, the daemon must not crash, hang or leak (ASan), and must answer
// with a status the contract allows: never INTERNAL or UNKNOWN.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/client_unary_call.h>

#include "server/kv_cache_service.h"
#include "server/lease_table.h"
#include "server/parse_error_interceptor.h"
#include "server/prefill_runner.h"
#include "storage/event_log.h"
#include "storage/layout_spec.h"
#include "storage/log.h"
#include "storage/tiered_store.h"

namespace kvtier {
namespace {

class Harness {
 public:
  Harness()
      : prefill_(PrefillOptions(), nullptr),
        leases_(LeaseTableOptions()),
        events_(1024, 1) {
    SetMinLogLevel(LogLevel::kError);
    TieredStoreOptions o;
    o.write_mode = WriteMode::kRamOnly;
    o.ram.arena.capacity_bytes = 16 << 20;
    o.ram.arena.slot_bytes = 4 << 10;
    o.put_wait = absl::Milliseconds(10);
    o.events = &events_;
    store_ = *TieredStore::Open(o);
    // One registered namespace (512-byte chunks) for the mutated requests to hit; its
    // id is in the seed corpus (fuzz/make_seeds.py).
    LayoutSpec layout;
    layout.model_id = "fuzz";
    layout.dtype = LayoutSpec::DType::kFloat16;
    layout.num_layers = 2;
    layout.num_kv_heads = 1;
    layout.head_dim = 8;
    layout.tokens_per_chunk = 8;
    layout.key_position = LayoutSpec::KeyPosition::kPostRope;
    if (!store_->RegisterLayout(layout).ok()) abort();
    ServiceLimits limits;
    limits.max_frame_bytes = 1 << 10;
    limits.max_keys_per_request = 64;
    service_ = std::make_unique<KvCacheService>(limits, "fuzz", nullptr, &prefill_, &leases_,
                                                DataPlaneInfo{}, &events_);
    service_->SetStore(store_.get());
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    builder.SetMaxReceiveMessageSize(limits.max_frame_bytes + 4096);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> ic;
    ic.push_back(std::make_unique<ParseErrorInterceptorFactory>());
    builder.experimental().SetInterceptorCreators(std::move(ic));
    server_ = builder.BuildAndStart();
    channel_ = server_->InProcessChannel(grpc::ChannelArguments());
  }

  void StopServing() {
    server_->Shutdown();
    server_->Wait();
  }

  void Run(const uint8_t* data, size_t size) {
    if (size == 0) return;
    static const char* const kUnary[] = {"RegisterLayout", "Lookup", "Pin", "Unpin",
                                         "Delete", "Clear", "ReleaseLease", "DataPlane",
                                         "Hint", "Stats"};
    const uint8_t pick = data[0] % 13;
    const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::Status status;
    if (pick < 10) {
      const std::string path = std::string("/kvtier.v1.KvCache/") + kUnary[pick];
      grpc::internal::RpcMethod method(path.c_str(), grpc::internal::RpcMethod::NORMAL_RPC);
      grpc::ByteBuffer response;
      status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
          channel_.get(), method, &ctx, Buffer(body), &response);
    } else if (pick == 10) {  // Get: one request, read every frame.
      grpc::internal::RpcMethod method("/kvtier.v1.KvCache/Get",
                                       grpc::internal::RpcMethod::SERVER_STREAMING);
      std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
          grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
              channel_.get(), method, &ctx, Buffer(body)));
      grpc::ByteBuffer frame;
      while (reader->Read(&frame)) {
      }
      status = reader->Finish();
    } else if (pick == 11) {  // Put: a sequence of frames.
      grpc::internal::RpcMethod method("/kvtier.v1.KvCache/Put",
                                       grpc::internal::RpcMethod::CLIENT_STREAMING);
      grpc::ByteBuffer response;
      std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
          grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel_.get(), method,
                                                                        &ctx, &response));
      for (const std::string& m : Messages(body)) {
        if (!writer->Write(Buffer(m))) break;
      }
      writer->WritesDone();
      status = writer->Finish();
    } else {  // Prefill: a sequence of client messages, then half-close.
      grpc::internal::RpcMethod method("/kvtier.v1.KvCache/Prefill",
                                       grpc::internal::RpcMethod::BIDI_STREAMING);
      std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
          grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
              channel_.get(), method, &ctx));
      // Writes and reads at once, as a worker does: the in-process transport does not
      // buffer, so a client that wrote everything before reading would block the
      // daemon's plan (and itself) where TCP's buffers would hide it.
      std::thread writer([&stream, msgs = Messages(body)] {
        for (const std::string& m : msgs) {
          if (!stream->Write(Buffer(m))) break;
        }
        stream->WritesDone();
      });
      grpc::ByteBuffer reply;
      while (stream->Read(&reply)) {
      }
      writer.join();
      status = stream->Finish();
    }
    switch (status.error_code()) {
      case grpc::StatusCode::INTERNAL:
      case grpc::StatusCode::UNKNOWN:
      case grpc::StatusCode::DEADLINE_EXCEEDED:  // A hang.
        fprintf(stderr, "method %d answered %d: %s\n", pick, status.error_code(),
                status.error_message().c_str());
        abort();
      default:
        break;
    }
  }

 private:
  static PrefillRunnerOptions PrefillOptions() {
    PrefillRunnerOptions o;
    o.max_frame_bytes = 1 << 10;
    o.max_keys = 64;
    return o;
  }
  static grpc::ByteBuffer Buffer(const std::string& bytes) {
    grpc::Slice slice(bytes);
    return grpc::ByteBuffer(&slice, 1);
  }
  // Splits `body` into messages, each prefixed by a 2-byte little-endian length (the
  // last one takes what is left).
  static std::vector<std::string> Messages(const std::string& body) {
    std::vector<std::string> out;
    size_t at = 0;
    while (at + 2 <= body.size() && out.size() < 64) {
      const size_t n = static_cast<uint8_t>(body[at]) | (static_cast<uint8_t>(body[at + 1]) << 8);
      at += 2;
      out.push_back(body.substr(at, n));
      at += std::min(n, body.size() - at);
    }
    return out;
  }

  PrefillRunner prefill_;
  LeaseTable leases_;
  EventLog events_;
  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<KvCacheService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

}  // namespace
}  // namespace kvtier

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Built once and kept: libFuzzer runs many inputs in one process.
  static kvtier::Harness* harness = [] {
    auto* h = new kvtier::Harness();
    // At exit the server stops and joins its threads before LeakSanitizer's check
    // (registered earlier, so run later). Otherwise a synchronous-server worker thread
    // caught being created at exit is reported as a leak that no input caused, and
    // libFuzzer blames the empty input for it.
    std::atexit([] { harness->StopServing(); });
    return h;
  }();
  harness->Run(data, size);
  return 0;
}
