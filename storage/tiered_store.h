// TieredStore: the host-RAM pool in front of the SSD tier, and the registry of layouts.
// This is the one storage object the server talks to.
//
// Write modes:
//  - write-back (default): a put is acknowledged once in RAM; a flusher thread writes
//    it to SSD in the background. Evicting a chunk not yet on SSD writes it first
//    (demotion).
//  - write-through: a put is acknowledged only after it is on SSD as well.
//  - ram-only: no SSD tier; eviction drops chunks.
// A read that misses RAM and hits SSD promotes the chunk into RAM when there is room.
// Without room, Read serves it from a whole-chunk heap buffer (max_buffered_reads of them
// at most), and ReadForStreamAsync lets a Get stream it a frame at a time instead
// (stream_buffer_bytes in all), which is what gRPC Gets do.
//
// Visibility: a chunk is indexed (and so visible to Lookup and Get) only in CommitPut,
// after all its bytes arrived and their CRC32C matched. An abandoned ChunkWriter gives
// its slots back and leaves nothing.
//
// Thread-safety: all methods are thread-safe. One background thread (the flusher) in
// write-back mode; it is stopped by Close() or the destructor.
#ifndef KVTIER_STORAGE_TIERED_STORE_H_
#define KVTIER_STORAGE_TIERED_STORE_H_

#include <atomic>
#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/chunk_id.h"
#include "storage/async_gate.h"
#include "storage/device_backend.h"
#include "storage/event_log.h"
#include "storage/eviction_policies.h"
#include "storage/hint_window.h"
#include "storage/prefetcher.h"
#include "storage/promoter.h"
#include "storage/fair_gate.h"
#include "storage/gpu_tier.h"
#include "storage/host_pool.h"
#include "storage/key_locks.h"
#include "storage/io_pool.h"
#include "storage/layout_registry.h"
#include "storage/layout_spec.h"
#include "storage/log_limiter.h"
#include "storage/parallel_copy.h"
#include "storage/put_admission.h"
#include "storage/fetch_claims.h"
#include "storage/remote_tier.h"
#include "storage/ssd_tier.h"
#include "storage/storage_tier.h"
#include "storage/write_back_flusher.h"

namespace kvtier {

class TieredStore;

enum class WriteMode { kWriteBack, kWriteThrough, kRamOnly };
const char* WriteModeName(WriteMode mode);
// Parses "write-back", "write-through" or "ram-only". Returns: Ok, InvalidArgument.
absl::StatusOr<WriteMode> ParseWriteMode(absl::string_view name);

struct TieredStoreOptions {
  HostPoolOptions ram;
  SsdTierOptions ssd;  // Unused in ram-only mode.
  WriteMode write_mode = WriteMode::kWriteBack;
  // Largest chunk a layout may have (bytes); also bounded by the RAM pool's size.
  uint64_t max_chunk_bytes = 512ull << 20;
  // Most layouts registered (persisted ones included); 0: no bound.
  uint64_t max_layouts = 0;
  // Read()s from SSD that find no room in RAM (Prefill sessions) are served from a
  // whole-chunk heap buffer; at most this many such buffers exist at once (more readers
  // wait), which bounds memory outside the pool.
  int max_buffered_reads = 4;
  // Threads running SSD reads for ReadAsync and ReadRangeAsync.
  int read_threads = 4;
  // Streamed SSD reads (ReadForStreamAsync: a chunk with no room in RAM, sent a frame at
  // a time) hold at most this many bytes of frame buffers at once, across all streams;
  // more reads wait their turn. Bounds their memory outside the pool. At least 1.
  uint64_t stream_buffer_bytes = 64ull << 20;
  // How long a put waits (in arrival order) for room in RAM before RESOURCE_EXHAUSTED.
  absl::Duration put_wait = absl::Seconds(5);
  // Write-back: threads writing dirty chunks to SSD, each one chunk at a time (the SSD
  // tier batches concurrent writes into its 4 MiB device writes). Also used by Close.
  int flush_threads = 4;
  // Write-back: the most payload bytes not yet on SSD (the backlog: dirty chunks in
  // RAM, and the chunks of puts admitted and not yet committed); 0: no bound but the
  // pool. A put that would take the backlog past it waits, like one waiting for
  // room, while the flushers (or the admission thread itself, writing the oldest dirty
  // chunk) bring it down; so the rest of the pool stays clean and evictable in the
  // policy's order. A chunk larger than the bound is let in once nothing else is dirty.
  uint64_t max_dirty_bytes = 0;
  // Threads committing write-through puts (their SSD writes), off the callers' threads.
  // Also how many such commits run at once.
  int commit_threads = 8;
  // Clock for put_wait; tests inject a fake one.
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // The GPU, or null for none (not owned; must outlive the store). With one, the host
  // pool is page-locked for it and `gpu_staging` sizes its staging buffers
  // (capacity_bytes 0: none); see GpuTier for the degraded modes.
  DeviceBackend* device = nullptr;
  GpuStagingOptions gpu_staging;
  // Threads that check a host-to-device delivery's CRC32C in parallel parts beside the
  // delivering thread (see GpuTier); 0: half the cores, at most 16.
  int gpu_crc_threads = 0;
  // The RAM and SSD tiers' eviction policy (each tier builds its own instance). Both
  // are wrapped so that chunks in the hint window go last.
  EvictionPolicyOptions eviction;
  // The hint window (Hint): max_bytes is also how much of the window is prefetched
  // from SSD into RAM, by prefetch_threads threads.
  HintWindowOptions hints;
  int prefetch_threads = 2;
  // Where chunk events go (stored, promoted, evicted, deleted); null for none. Not
  // owned; must outlive the store.
  EventLog* events = nullptr;
  // The shared tier on Redis Cluster (L3); off without seed nodes. Chunks stored here
  // are copied to it in the background; a local miss reads through it and keeps the
  // chunk in RAM when there is room (as a promotion from SSD does).
  RemoteTierOptions remote;
  // Before a read brings a chunk of namespace `ns` (`bytes` payload bytes) into RAM from
  // a tier below (a promotion: a Get's, a Pin's, a Hint's prefetch, a read through the
  // shared tier): whether it may, after making what room it wants (the server keeps a
  // tenant's RAM quota here by evicting the tenant's own chunks first). False: the read
  // is served as when RAM has no room, and nothing is promoted. Called on the reading
  // thread with no lock of the store held; it may call the store (Usage,
  // ShrinkNamespaces). Unset: every promotion may go ahead.
  std::function<bool(TieredStore& store, uint64_t ns, uint64_t bytes)> admit_promotion;
  // Tests only: called by a put that stored a chunk, before its write to the shared tier
  // is queued (a sync point for a Delete racing it).
  std::function<void(const ChunkId& id)> before_shared_write;
  // Tests only: called once a RAM chunk's write-back (or demotion) is on SSD, before
  // RAM marks it clean (a sync point for a Delete racing it).
  std::function<void(const ChunkId& id)> after_write_back;
  // Tests only: called by Delete once the copy tiers (GPU staging) let go of the chunk,
  // before the tiers under them do (a sync point for a staging racing it).
  std::function<void(const ChunkId& id)> after_copy_delete;
  // Tests only: called by Delete once the local tiers let go of the chunk, before the
  // shared tier does (a sync point for a read of the shared copy racing it).
  std::function<void(const ChunkId& id)> before_shared_delete;

  absl::Status Validate() const;
};

struct TieredStoreStats {
  HostPoolStats ram;
  SsdTierStats ssd;  // Zero in ram-only mode.
  uint64_t namespaces = 0;
  uint64_t promotions = 0;
  uint64_t prefetched = 0;      // Prefetch jobs run for the hint window (Hint).
  uint64_t hint_clients = 0;    // Clients with a live hint.
  uint64_t hinted_chunks = 0;   // Chunks in the merged hint window.
  uint64_t demotions = 0;
  uint64_t demotion_failures = 0;
  uint64_t writeback_queue_depth = 0;
  uint64_t writeback_dirty_bytes = 0;      // Payload bytes of those chunks.
  uint64_t writeback_max_dirty_bytes = 0;  // The bound on them (0: the pool).
  uint64_t writeback_backlog_waits = 0;    // Put admissions that found the backlog full.
  // Stored chunks found corrupt (and deleted): RAM copies plus the SSD tier's.
  uint64_t checksum_failures = 0;
  uint64_t ram_checksum_failures = 0;
  // Put payloads that did not match the CRC32C their client sent (refused, nothing
  // stored): a client's problem, not the store's.
  uint64_t put_checksum_mismatches = 0;
  // Puts waiting for room in RAM now; puts that ever waited; those that timed out.
  uint64_t puts_waiting = 0;
  uint64_t puts_queued = 0;
  uint64_t put_wait_timeouts = 0;
  // Payload bytes written into and read out of each tier (whole chunks).
  uint64_t ram_bytes_in = 0;
  uint64_t ram_bytes_out = 0;
  uint64_t ssd_bytes_in = 0;
  uint64_t ssd_bytes_out = 0;
  bool gpu_present = false;  // A device backend was given; `gpu` is zero otherwise.
  GpuTierStats gpu;
  bool remote_present = false;  // A remote tier is configured; `remote` is zero otherwise.
  RemoteTierStats remote;
  uint64_t remote_promotions = 0;  // Chunks read from the remote tier and kept in RAM.
};

// Write-back: a put's bytes counted in the backlog bound (max_dirty_bytes) from its
// admission until it commits (its chunk is then dirty in RAM and counted there) or is
// dropped, so that puts admitted together cannot take the backlog past the bound.
// Move-only; gives its bytes back once: on Release or destruction. The counter must
// outlive it (the store's does: writers are dropped before the store).
class BacklogReservation {
 public:
  BacklogReservation() = default;
  BacklogReservation(std::atomic<uint64_t>* admitted, uint64_t bytes)
      : admitted_(admitted), bytes_(bytes) {}
  BacklogReservation(BacklogReservation&& o) noexcept
      : admitted_(std::exchange(o.admitted_, nullptr)), bytes_(o.bytes_) {}
  BacklogReservation& operator=(BacklogReservation&& o) noexcept {
    if (this != &o) {
      Release();
      admitted_ = std::exchange(o.admitted_, nullptr);
      bytes_ = o.bytes_;
    }
    return *this;
  }
  ~BacklogReservation() { Release(); }
  void Release() {
    if (admitted_ != nullptr) admitted_->fetch_sub(bytes_, std::memory_order_acq_rel);
    admitted_ = nullptr;
  }

 private:
  std::atomic<uint64_t>* admitted_ = nullptr;
  uint64_t bytes_ = 0;
};

// Receives one chunk's bytes during a put. Not thread-safe: one stream fills it.
class ChunkWriter {
 public:
  ChunkWriter(ChunkId id, uint32_t token_count, std::shared_ptr<PoolChunk> data)
      : id_(id), token_count_(token_count), data_(std::move(data)) {}

  const ChunkId& id() const { return id_; }
  uint64_t size() const { return data_->size(); }
  uint64_t received() const { return received_; }
  uint32_t token_count() const { return token_count_; }
  // Where the chunk sits in its key chain, as its writer said; kept with the chunk for
  // eviction.
  void set_lineage(const ChunkLineage& lineage) { lineage_ = lineage; }
  // Appends the next bytes. Returns: Ok, InvalidArgument (past the chunk's end).
  // With `copier` (may be null), a large append is copied on its threads (a client's
  // shared memory into the pool).
  absl::Status Append(absl::string_view bytes, ParallelCopy* copier = nullptr);

 private:
  friend class TieredStore;
  ChunkId id_;
  uint32_t token_count_;
  ChunkLineage lineage_;
  std::shared_ptr<PoolChunk> data_;
  BacklogReservation backlog_;  // Write-back: released once the chunk is dirty in RAM.
  uint64_t received_ = 0;
  uint32_t crc_ = 0;  // CRC32C of the bytes so far, computed as they arrive.
};

// A chunk being read: its bytes stay valid while this object lives, even past the store
// that gave it (a lease, or a read answered while the store was being destroyed).
// Buffers from ReadRangeAsync must be dropped before the store.
class ChunkView {
 public:
  const ChunkMeta& meta() const { return meta_; }
  Tier tier() const { return tier_; }
  // True for a view from ReadForStreamAsync that holds no bytes: read them with
  // TieredStore::ReadRangeAsync. ForEachPiece and KeepAlive must not be used on it.
  bool streamed() const { return streamed_; }
  // Calls `fn` on consecutive pieces of [offset, offset + len), no copies.
  void ForEachPiece(uint64_t offset, uint64_t len,
                    absl::FunctionRef<void(absl::string_view)> fn) const;
  // Shares ownership of the bytes, for handing pieces to code that outlives this view
  // (gRPC slices sent without a copy).
  std::shared_ptr<const void> KeepAlive() const {
    if (pool_) return pool_;
    return buf_;
  }

 private:
  friend class TieredStore;
  ChunkMeta meta_;
  Tier tier_ = Tier::kNone;
  bool streamed_ = false;
  std::shared_ptr<PoolChunk> pool_;   // Set when served from RAM.
  std::shared_ptr<std::string> buf_;  // Set when served straight from SSD.
};

class TieredStore {
 public:
  static absl::StatusOr<std::unique_ptr<TieredStore>> Open(TieredStoreOptions options);
  ~TieredStore();

  // Layouts. Register validates the layout and persists it (when an SSD tier exists).
  // Returns: Ok, InvalidArgument, FailedPrecondition (chunk larger than allowed),
  // Unavailable.
  using Registered = LayoutRegistry::Registered;
  // `ns`: the id to register it under (0: the layout's hash).
  absl::StatusOr<Registered> RegisterLayout(const LayoutSpec& layout, uint64_t ns = 0) {
    return layouts_->Register(layout, ns);
  }
  // Returns: Ok, NotFound.
  absl::StatusOr<LayoutSpec> FindLayout(uint64_t ns) const { return layouts_->Find(ns); }
  std::vector<std::pair<uint64_t, LayoutSpec>> Layouts() const { return layouts_->All(); }
  // FailedPrecondition when this daemon can no longer store `layout`'s chunks (it was
  // registered under larger limits): asked before anything waits or evicts for a put.
  absl::Status CheckPuttable(const LayoutSpec& layout) const {
    return layouts_->CheckPuttable(layout);
  }

  // Starts a put. Returns a writer, or nullptr when the chunk is already stored (the
  // caller drains and discards its bytes). Waits up to put_wait, in arrival order, for
  // room. Returns: Ok, NotFound (namespace), ResourceExhausted (still no room in RAM),
  // Cancelled (CancelPut), Unavailable (closing).
  using PutStarted = std::function<void(absl::StatusOr<std::unique_ptr<ChunkWriter>>)>;
  // The same without blocking the caller: `done` runs inline when the answer is quick
  // (known chunk, room at once), otherwise on the store's admission thread. Returns a
  // ticket for CancelPut, 0 when `done` already ran.
  uint64_t BeginPutAsync(const ChunkId& id, uint32_t token_count, PutStarted done);
  absl::StatusOr<std::unique_ptr<ChunkWriter>> BeginPut(const ChunkId& id,
                                                        uint32_t token_count);
  // Gives up a put still waiting for room; its `done` gets Cancelled on this thread.
  // False when it is no longer waiting.
  bool CancelPut(uint64_t ticket);
  // Verifies and publishes a fully received chunk. Returns: Ok, InvalidArgument
  // (incomplete, or CRC32C mismatch: nothing stored), ResourceExhausted or Unavailable
  // (write-through SSD write failed: nothing stored).
  absl::Status CommitPut(std::unique_ptr<ChunkWriter> writer, uint32_t crc32c);
  // The same without blocking the caller on SSD: a write-through commit runs on the
  // commit threads, which call `done`; the others call `done` inline. `done` gets
  // whether this put stored the chunk (false: a concurrent put of the same chunk
  // committed first, and this one's bytes were dropped).
  void CommitPutAsync(std::unique_ptr<ChunkWriter> writer, uint32_t crc32c,
                      std::function<void(absl::StatusOr<bool>)> done);

  // The local tier holding the chunk (GPU, RAM, SSD) or kNone; never asks the remote
  // tier.
  Tier Locate(const ChunkId& id) const;
  // Locate for a batch, asking the remote tier (in one round trip) about the chunks no
  // local tier holds: those it has come back as kRemote.
  std::vector<Tier> LocateMany(absl::Span<const ChunkId> ids);
  // A Get of `ids` is starting: with a remote tier, the chunks of it no local tier
  // holds are fetched into RAM on the read threads in batches (their records in one
  // round trip, their segments in pipelines of the tier's batch size over every
  // master), instead of two round trips per chunk as the Get reaches each. A Read of
  // a chunk being fetched waits for that fetch. Never blocks; a no-op without a remote
  // tier, while it is degraded, or when fewer than two chunks are missing locally.
  // Returns, per id, whether it was missing locally and is being fetched (the Get
  // reports such a chunk as coming from the remote tier though it reads it from RAM);
  // empty when nothing is.
  std::vector<bool> FetchRemoteAsync(absl::Span<const ChunkId> ids);
  // A view of the chunk if it is in RAM, taken without reading it or counting a hit.
  // While the view lives the chunk cannot be evicted (Delete and Clear still remove it
  // from the index). For holding a Lookup's hits until their Get.
  std::optional<ChunkView> HoldInRam(const ChunkId& id) const;
  // Returns: Ok, NotFound, DataLoss (failed its checksum on SSD; deleted), Unavailable.
  // A chunk read from SSD is promoted into RAM when there is room; otherwise it is
  // served from a buffer (at most max_buffered_reads at once: this call may wait).
  // A chunk no local tier holds is read from the remote tier, if any (the view's tier
  // is then kRemote); the remote tier failing or holding a bad copy is a miss.
  absl::StatusOr<ChunkView> Read(const ChunkId& id);
  // The same, without blocking the caller on SSD: a RAM hit (or miss) calls `done`
  // inline; an SSD read runs on the store's read threads, which call `done`.
  void ReadAsync(const ChunkId& id, std::function<void(absl::StatusOr<ChunkView>)> done);
  // The same for a caller that sends the chunk as it reads it: an SSD chunk with no room
  // in RAM comes back as a streamed() view (meta only, no bytes, nothing buffered yet),
  // to be read a frame at a time with ReadRangeAsync. `sent_bytes`: how much of the
  // chunk the caller sends (a layer range), what a RAM hit counts as read out.
  void ReadForStreamAsync(const ChunkId& id, std::function<void(absl::StatusOr<ChunkView>)> done,
                          uint64_t sent_bytes = UINT64_MAX);
  // ReadForStreamAsync on the calling thread (which it may block on SSD or the shared
  // tier): for a caller with a thread of its own, which must not wait on the read pool.
  absl::StatusOr<ChunkView> ReadForStream(const ChunkId& id) { return Read(id, true); }
  // Reads bytes [offset, offset + len) of a streamed chunk into a buffer of len bytes,
  // on the read threads, once stream_buffer_bytes has room for it (never blocks the
  // caller; `done` may run on this thread). The buffer's bytes count against
  // stream_buffer_bytes until the last copy of it is dropped. Returns (to `done`): Ok,
  // NotFound (deleted meanwhile), DataLoss (corrupt: deleted), Unavailable.
  using RangeBuffer = std::shared_ptr<const char>;
  void ReadRangeAsync(const ChunkId& id, const ChunkMeta& meta, uint64_t offset,
                      uint64_t len, std::function<void(absl::StatusOr<RangeBuffer>)> done);
  // For a streamer that found a chunk's CRC32C wrong once it had all the bytes of
  // `view`: drops the copy it read (RAM's or SSD's; the other, if any, stays) and counts
  // it. Returns the DataLoss error to report; Aborted if the SSD copy was stored afresh
  // since (with other bytes: it stays, and a read again may succeed).
  absl::Status DropCorrupt(const ChunkId& id, const ChunkView& view);
  // The same for a copy read from SSD, described by `meta`.
  absl::Status DropCorrupt(const ChunkId& id, const ChunkMeta& meta);
  // GPU. Copies a chunk that is in RAM into the GPU staging buffers, in the
  // background, because a worker on this GPU is about to read it (a Lookup leased it, a
  // Prefill session will stream it). Best effort: no GPU, no staging, not in RAM or no
  // room mean nothing happens.
  void StageAsync(const ChunkId& id);
  // Copies `ranges` of a chunk into device memory (a worker's, mapped through CUDA
  // IPC): device-to-device from staging when staged, else host-to-device from RAM
  // (reading it from SSD first if needed). `done` gets the tier the bytes came from:
  // Ok, NotFound, DataLoss, FailedPrecondition (no GPU), InvalidArgument (a range
  // outside the chunk, a destination the device refuses), Unavailable. Runs on the
  // GPU's completion threads (or the read threads); never blocks the caller.
  // `check_crc` false: the caller delivered this chunk earlier in the same request, its
  // CRC32C checked, and holds it since (HoldInRam), so a host-to-device copy of a
  // range of it does not check the whole chunk again.
  // A range's `record_event` (DeviceBackend::OpenIpcEvent) is recorded on the device
  // right after its bytes. `enqueued`, if set, runs once the copies and those records
  // were submitted to the device's stream (an error there reaches `done`), with the
  // tier the bytes come from, before `done`; not at all when nothing was submitted
  // (absent, a bad range, a read error). A chunk found then, and lost to a device
  // error, is Unavailable, never NotFound.
  // `pin` (may be null) ties several calls for one chunk to one copy of it: an empty
  // *pin is set to the meta of the copy delivered (before `enqueued` and `done`); a set
  // one delivers only a copy with that meta, else Aborted (the chunk was stored afresh
  // with other bytes since: the caller's earlier ranges are of another copy). The
  // caller keeps *pin alive, and orders a call that reads it after the one that set it.
  using DeviceRange = GpuTier::Range;
  void ReadToDeviceAsync(const ChunkId& id, std::vector<DeviceRange> ranges,
                         std::function<void(absl::StatusOr<Tier>)> done, bool check_crc = true,
                         std::function<void(Tier)> enqueued = nullptr,
                         std::optional<ChunkMeta>* pin = nullptr);
  // Put from GPU memory: copies the next `n` bytes of `writer`'s chunk from device
  // address `src` (a worker's mapped memory) straight into its pool slots, then extends
  // the chunk's CRC32C over the pool's copy, as Append does. `writer` must stay alive
  // and untouched until `done` runs (on the GPU's completion thread). Returns (to
  // `done`): Ok, FailedPrecondition (no GPU), InvalidArgument (past the chunk's end, or
  // a source the device refuses), Unavailable (device error).
  void AppendFromDeviceAsync(ChunkWriter* writer, DevicePtr src, uint64_t n,
                             std::function<void(absl::Status)> done);
  bool has_gpu() const { return gpu_ != nullptr; }

  // A scheduler's queue (see HintWindow): replaces `client`'s hint, then prefetches the
  // merged window's chunks that sit only on SSD into RAM, nearest first, as far as
  // hints.max_bytes reaches (staging them on the GPU too where there is one). Returns:
  // Ok, NotFound (a namespace is not registered: nothing changes), ResourceExhausted
  // (too many clients hold hints).
  struct HintResult {
    uint32_t requests_accepted = 0;
    uint32_t keys_accepted = 0;
    bool truncated = false;
    uint32_t prefetching = 0;  // Of this client's window: queued for promotion.
    uint32_t cached = 0;       // Of this client's window: in some tier now.
  };
  struct HintedRequest {
    uint64_t ns = 0;
    std::vector<ChunkKey> keys;
  };
  absl::StatusOr<HintResult> Hint(const std::string& client,
                                  std::vector<HintedRequest> requests,
                                  const std::string& group = "");
  uint64_t prefetched() const { return prefetcher_ ? prefetcher_->fetched() : 0; }
  // Waits until the prefetch queue is drained (tests, benchmarks).
  void WaitForPrefetch() {
    if (prefetcher_) prefetcher_->WaitIdle();
  }
  size_t hint_clients() const { return hints_->clients(); }
  // Readers waiting for one of the max_buffered_reads buffers now (tests).
  uint64_t buffered_read_waiters() const { return buffered_reads_->waiting(); }

  // Pins in RAM (promoting from SSD first). `budget` (may be null) bounds the pinned
  // bytes of a group of namespaces (HostPool::PinBudget). Returns: Ok, NotFound,
  // ResourceExhausted.
  absl::Status Pin(const ChunkId& id, absl::Duration ttl,
                   const HostPool::PinBudget* budget = nullptr);
  // Before pinning `ids` one by one: InvalidArgument if the distinct ones that are
  // stored could never be pinned together, even with nothing else pinned: their pool
  // slots exceed max_pinned_fraction, or their payload bytes `budget` (may be null). A
  // request refused here pins nothing, where pinning would stop part-way with a
  // ResourceExhausted that no retry can clear.
  absl::Status CheckPinsCanFit(absl::Span<const ChunkId> ids,
                               const HostPool::PinBudget* budget = nullptr);
  bool Unpin(const ChunkId& id);
  // Unpins every chunk of the namespaces `ns` (a tenant that is gone); returns how many.
  uint64_t UnpinNamespaces(const absl::flat_hash_set<uint64_t>& ns);
  // Returns whether the chunk was present anywhere. Errors: Unavailable.
  absl::StatusOr<bool> Delete(const ChunkId& id);
  absl::StatusOr<uint64_t> Clear(uint64_t ns);

  // What a group of namespaces (a tenant's) holds in RAM, on SSD, and pinned in RAM
  // now: in RAM and pinned, the pool slots its chunks take; on SSD, their payload bytes.
  struct NamespaceUsage {
    uint64_t ram_bytes = 0;
    uint64_t ssd_bytes = 0;
    uint64_t pinned_bytes = 0;
  };
  NamespaceUsage Usage(const absl::flat_hash_set<uint64_t>& ns) const;
  // The bytes of pool slots a chunk of `size` payload bytes takes in RAM.
  uint64_t RamFootprint(uint64_t size) const;
  // Evicts chunks of the namespaces `ns` from `tier` (kRam or kSsd), in that tier's
  // policy order, until they hold at most `keep` bytes there (as Usage counts them);
  // returns what they
  // hold afterwards. RAM evicts only chunks that are clean, unpinned and unread; an SSD
  // eviction takes the chunk off the daemon unless RAM still holds it; 0 where the
  // daemon has no such tier. Errors: Unavailable (SSD rows could not be deleted),
  // Unimplemented (a tier that keeps no quota).
  absl::StatusOr<uint64_t> ShrinkNamespaces(const absl::flat_hash_set<uint64_t>& ns, Tier tier,
                                            uint64_t keep);
  bool has_ssd_tier() const { return ssd_ != nullptr; }
  bool has_remote_tier() const { return remote_ != nullptr; }
  // Waits until no FetchRemoteAsync job is queued or running (tests, benchmarks).
  void WaitForRemoteFetches() { remote_fetches_.WaitForJobs(); }
  // Waits until the remote tier has no write queued or running (tests, benchmarks).
  void WaitForRemoteWrites() {
    if (remote_) remote_->WaitIdle();
  }

  TieredStoreStats GetStats() const;
  // Each local tier's stats in the same terms, fastest first (a GPU without staging
  // buffers is left out).
  std::vector<TierStats> LocalTierStats() const;
  WriteMode write_mode() const { return options_.write_mode; }

  // Stops the flusher after writing every dirty chunk to SSD, then flushes RocksDB.
  // Idempotent. Returns the first error met (the remaining work is still attempted).
  absl::Status Close();

 private:
  // CommitPut, with whether this put stored the chunk.
  absl::StatusOr<bool> Commit(std::unique_ptr<ChunkWriter> writer, uint32_t crc32c);
  explicit TieredStore(TieredStoreOptions options);
  // Writes one dirty chunk to SSD. Returns false if there was none.
  bool FlushOne(bool demotion);
  // Writes dirty chunks until none is left, on flush_threads threads. Returns how many.
  uint64_t FlushAll();
  // RAM for a chunk, evicting clean chunks; with `may_block`, also demoting dirty
  // chunks to SSD if that is what it takes. PutAdmission's TryRoom. In write-back,
  // first keeps the backlog (dirty chunks, and puts admitted but not yet committed)
  // within max_dirty_bytes (with `may_block`, by writing the oldest dirty chunks itself),
  // and reserves the put's bytes in it: the room returned carries a BacklogReservation
  // (TakeRoom). Returns ResourceExhausted while there is no room.
  absl::StatusOr<std::shared_ptr<PoolChunk>> TryRoom(uint64_t size, bool may_block,
                                                     bool& noted);
  // A ChunkWriter for the room TryRoom gave, with the room's backlog reservation.
  static std::unique_ptr<ChunkWriter> TakeRoom(const ChunkId& id, uint32_t token_count,
                                               std::shared_ptr<PoolChunk> room);
  bool has_ssd() const { return backing_ != nullptr; }
  // Staged on the GPU and still held by RAM or SSD (a staged copy of neither is dropped).
  // The staged copy's meta, when it is staged and backed (RAM or SSD holds the same).
  std::optional<ChunkMeta> StagedAndBacked(const ChunkId& id) const;
  // A RAM chunk whose bytes failed their CRC32C (`chunk`, its pool memory): removed from
  // RAM and staging, counted and logged, unless a newer put replaced it meanwhile.
  // Drops RAM's copy of `id` if it is `chunk`, counting it; returns whether it was.
  bool DropCorruptInRam(const ChunkId& id, const std::shared_ptr<const void>& chunk);
  // Room in RAM may have appeared: puts waiting for it retry now.
  void NotifyRoom();
  // options_.admit_promotion for chunk `id` of `bytes` payload bytes, or for that many
  // bytes of pool slots (true when unset).
  bool AdmitPromotion(const ChunkId& id, uint64_t bytes);
  absl::StatusOr<ChunkView> Read(const ChunkId& id, bool stream,
                                 uint64_t sent_bytes = UINT64_MAX);
  // A local miss read through the remote tier: into RAM when there is room (kept
  // there, clean), else into a whole-chunk buffer (max_buffered_reads). NotFound for
  // anything short of a verified chunk.
  // `wait_for_buffer` false (a streaming reader, which may hold buffers already): no
  // buffer free at once is a miss rather than a wait.
  absl::StatusOr<ChunkView> ReadRemote(const ChunkId& id, bool wait_for_buffer);
  // FetchRemoteAsync's job, on a read thread.
  void FetchRemote(const std::vector<ChunkId>& ids);
  // Clear's removal from the local and copy tiers, run under every KeyLocks stripe;
  // returns the chunks removed, each counted once.
  absl::StatusOr<uint64_t> ClearLocal(uint64_t ns);
  // Whether a local tier (RAM, SSD; not a copy tier) holds `id`.
  bool HeldLocally(const ChunkId& id) const;
  // Hands a chunk that was just stored locally to the remote tier, if any.
  void ToRemote(const ChunkId& id, const ChunkMeta& meta, std::shared_ptr<PoolChunk> data);
  // A prefetch thread's job: promote `id` if it is still only on SSD, then stage it.
  void Prefetch(const ChunkId& id);
  void Emit(ChunkEventKind kind, const ChunkId& id, Tier tier);
  // A heap buffer of `size` bytes for a read RAM has no room for, counted in
  // max_buffered_reads (waits for a place) until its last holder drops it.
  std::shared_ptr<std::string> NewBufferedRead(uint64_t size);
  // The same for a caller already in the gate (TryEnter).
  std::shared_ptr<std::string> BufferedRead(uint64_t size);
  // The tier of that kind among tiers_, or null.
  StorageTier* TierOf(Tier tier) const;
  // Frame buffers of streamed reads: recycled, so steady streaming does not map, fault
  // in and unmap a fresh buffer per frame. Only segment-sized ones are kept.
  char* TakeRangeBuffer(uint64_t len);
  void GiveRangeBuffer(char* buf, uint64_t len);

  const TieredStoreOptions options_;
  // Before the tiers: their policies read it until they are gone.
  const std::unique_ptr<HintWindow> hints_;
  std::unique_ptr<HostPool> ram_;
  std::unique_ptr<SsdTier> ssd_;  // Null in ram-only mode.
  // After ram_: destroyed first, unpinning the pool's memory before it is unmapped.
  std::unique_ptr<GpuTier> gpu_;  // Null without a device.
  // After ram_: destroyed first, its queued writes hold pool chunks. Null without one.
  std::unique_ptr<RemoteTier> remote_;
  // The tiers above, fastest first (GPU, RAM, SSD, remote; those that exist), for what
  // the store does to every tier alike. Set in Open, fixed after.
  std::vector<StorageTier*> tiers_;
  // The local tier under RAM that write-back and write-through write to, and that
  // streams what RAM has no room for (SSD); null in ram-only mode.
  StorageTier* backing_ = nullptr;
  // The tier shared with other daemons, read when no local tier holds a chunk (remote);
  // null without one.
  StorageTier* shared_ = nullptr;
  // Reads from backing_ into RAM; null in ram-only mode. After ram_ and ssd_, which it
  // reads and fills.
  // Before promoter_, which holds a pointer to it.
  KeyLocks key_locks_;
  std::unique_ptr<Promoter> promoter_;
  FetchClaims remote_fetches_;  // Chunks being read from the remote tier now.
  // Chunks being committed now: two puts of one chunk commit one at a time, so that the
  // second finds the first's copy wherever it has gone since (and reports no store).
  FetchClaims commits_;
  // max_buffered_reads; shared with the buffers, which a view may keep past the store.
  const std::shared_ptr<FairGate> buffered_reads_;
  AsyncGate stream_gate_;   // stream_buffer_bytes.
  absl::Mutex spare_mu_;
  std::vector<std::unique_ptr<char[]>> spare_buffers_ ABSL_GUARDED_BY(spare_mu_);
  // Declared after ssd_ and ram_: destroyed first, so no read or commit outlives them.
  std::unique_ptr<IoPool> read_pool_;
  std::unique_ptr<IoPool> commit_pool_;
  std::unique_ptr<PutAdmission> admission_;  // Set in Open.

  std::unique_ptr<LayoutRegistry> layouts_;  // Set in Open, after ssd_.

  std::atomic<uint64_t> remote_promotions_{0};
  std::atomic<uint64_t> demotions_{0};
  std::atomic<uint64_t> demotion_failures_{0};
  std::atomic<uint64_t> backlog_waits_{0};  // Puts that found the backlog full (once each).
  // Write-back: payload bytes of puts admitted and not yet committed or dropped (their
  // BacklogReservations), counted with the dirty bytes against max_dirty_bytes.
  std::atomic<uint64_t> admitted_dirty_{0};
  std::atomic<uint64_t> put_checksum_failures_{0};
  std::atomic<uint64_t> ram_checksum_failures_{0};  // Pool copies found corrupt.
  LogLimiter write_failure_log_{absl::Seconds(1)};  // Failed write-backs and demotions.
  LogLimiter remote_delete_log_{absl::Seconds(1)};  // Deletes that left a remote copy.
  std::atomic<bool> stopping_{false};               // The destructor has begun.
  std::atomic<uint64_t> ram_bytes_in_{0};
  std::atomic<uint64_t> ram_bytes_out_{0};
  std::atomic<uint64_t> ssd_bytes_in_{0};
  std::atomic<uint64_t> ssd_bytes_out_{0};

  absl::Mutex close_mu_;
  bool closed_ ABSL_GUARDED_BY(close_mu_) = false;
  // With an SSD tier; set in Open. Write-through: TTL upkeep only.
  std::unique_ptr<WriteBackFlusher> flusher_;
  // Last: destroyed first, its fetches use the tiers. Null in ram-only mode.
  std::unique_ptr<Prefetcher> prefetcher_;
};

}  // namespace kvtier

#endif  // KVTIER_STORAGE_TIERED_STORE_H_
