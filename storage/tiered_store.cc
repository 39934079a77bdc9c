#include "storage/tiered_store.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "storage/crc32c.h"
#include "storage/log.h"
#include "storage/eviction_policies.h"

namespace kvtier {
namespace {

// The tail of a rate-limited log line: how many like it were not logged.
std::string HeldBack(uint64_t held) {
  return held == 0 ? "" : absl::StrCat(" (and ", held, " more like it since the last line)");
}

}  // namespace

const char* WriteModeName(WriteMode mode) {
  switch (mode) {
    case WriteMode::kWriteBack: return "write-back";
    case WriteMode::kWriteThrough: return "write-through";
    case WriteMode::kRamOnly: return "ram-only";
  }
  return "unknown";
}

absl::StatusOr<WriteMode> ParseWriteMode(absl::string_view name) {
  if (name == "write-back") return WriteMode::kWriteBack;
  if (name == "write-through") return WriteMode::kWriteThrough;
  if (name == "ram-only") return WriteMode::kRamOnly;
  return absl::InvalidArgumentError(absl::StrCat(
      "write_mode must be write-back, write-through or ram-only, got '", name, "'"));
}

absl::Status TieredStoreOptions::Validate() const {
  if (absl::Status s = ram.Validate(); !s.ok()) return s;
  if (absl::Status s = eviction.Validate(); !s.ok()) return s;
  if (absl::Status s = hints.Validate(); !s.ok()) return s;
  if (absl::Status s = remote.Validate(); !s.ok()) return s;
  if (prefetch_threads < 1) return absl::InvalidArgumentError("prefetch_threads must be >= 1");
  if (write_mode != WriteMode::kRamOnly) {
    if (absl::Status s = ssd.Validate(); !s.ok()) return s;
  }
  if (max_chunk_bytes == 0) {
    return absl::InvalidArgumentError("max_chunk_size must be greater than zero");
  }
  if (stream_buffer_bytes == 0) {
    return absl::InvalidArgumentError("stream_buffer_bytes must be greater than zero");
  }
  if (read_threads < 1 || commit_threads < 1 || flush_threads < 1) {
    return absl::InvalidArgumentError(
        "read_threads, commit_threads and flush_threads must be at least 1");
  }
  if (device != nullptr && gpu_staging.capacity_bytes > 0) {
    if (absl::Status s = gpu_staging.Validate(); !s.ok()) return s;
  }
  return PutAdmissionOptions{put_wait, absl::Milliseconds(1), now}.Validate();
}

absl::Status ChunkWriter::Append(absl::string_view bytes, ParallelCopy* copier) {
  if (bytes.size() > data_->size() - received_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "frame data runs past the chunk's end: chunk is ", data_->size(),
        " bytes, frame covers [", received_, ", ", received_ + bytes.size(), ")"));
  }
  // One pass over the bytes, checksumming the pool's copy: `bytes` may be a client's
  // shared memory that changes under us, and what is checked must be what is stored.
  if (copier == nullptr) {
    crc_ = data_->WriteAndExtendCrc(received_, bytes, crc_);
  } else {
    std::vector<ParallelCopy::Span> spans;
    const char* src = bytes.data();
    data_->ForEachWritablePiece(received_, bytes.size(), [&](char* dst, uint64_t n) {
      spans.push_back({dst, src, n});
      src += n;
    });
    crc_ = copier->CopyAndExtend(crc_, spans, crc32c::CrcOver::kDestination);
  }
  received_ += bytes.size();
  return absl::OkStatus();
}

void ChunkView::ForEachPiece(uint64_t offset, uint64_t len,
                             absl::FunctionRef<void(absl::string_view)> fn) const {
  if (pool_) {
    pool_->ForEachPiece(offset, len, fn);
  } else {
    fn(absl::string_view(*buf_).substr(offset, len));
  }
}

absl::StatusOr<std::unique_ptr<TieredStore>> TieredStore::Open(TieredStoreOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<TieredStore> store(new TieredStore(std::move(options)));
  EvictionPolicyOptions eviction = store->options_.eviction;
  eviction.hints = store->hints_.get();
  HostPoolOptions ram_options = store->options_.ram;
  EventLog* events = store->options_.events;
  if (events != nullptr) {
    ram_options.on_evict = [events](const ChunkId& id) {
      events->Append(ChunkEventKind::kEvicted, id, Tier::kRam);
    };
  }
  auto ram = HostPool::Create(std::move(ram_options), MakeEvictionPolicy(eviction));
  if (!ram.ok()) return ram.status();
  store->ram_ = *std::move(ram);
  if (store->options_.device != nullptr) {
    store->gpu_ = GpuTier::Create(store->options_.device, store->options_.gpu_staging,
                                  store->ram_->memory(), store->ram_->memory_bytes(),
                                  store->options_.gpu_crc_threads);
  }
  if (store->options_.remote.enabled()) {
    RemoteTierOptions remote_options = store->options_.remote;
    // Records carry the layout's fingerprint (its hash), so that a daemon whose layout
    // differs never reads another's bytes as its own.
    remote_options.layout_of = [s = store.get()](uint64_t ns) -> absl::StatusOr<RemoteLayout> {
      absl::StatusOr<LayoutSpec> layout = s->FindLayout(ns);
      if (!layout.ok()) return layout.status();
      return RemoteLayout{layout->NamespaceId(), layout->ChunkBytes()};
    };
    auto remote = RemoteTier::Open(std::move(remote_options));
    if (!remote.ok()) return remote.status();
    store->remote_ = *std::move(remote);
  }
  if (store->options_.write_mode != WriteMode::kRamOnly) {
    SsdTierOptions ssd_options = store->options_.ssd;
    ssd_options.eviction = eviction;
    if (events != nullptr) {
      ssd_options.on_evict = [events](const ChunkId& id) {
        events->Append(ChunkEventKind::kEvicted, id, Tier::kSsd);
      };
      // A corrupt SSD copy is deleted on every path that reads it (a promotion, a
      // streamed Get, a GC move); the SSD tier calls this once per copy. Gone from every
      // local tier unless RAM still holds a sound copy (a streamed read's chunk put
      // again meanwhile, say): then it only left the SSD.
      ssd_options.on_corrupt = [events, ram = store->ram_.get()](const ChunkId& id) {
        if (ram->Contains(id)) {
          events->Append(ChunkEventKind::kEvicted, id, Tier::kSsd);
        } else {
          events->Append(ChunkEventKind::kDeleted, id, Tier::kNone);
        }
      };
    }
    auto ssd = SsdTier::Open(std::move(ssd_options));
    if (!ssd.ok()) return ssd.status();
    store->ssd_ = *std::move(ssd);
  }
  // Fastest first; the copy tier (GPU staging) leads, the shared one comes last.
  for (StorageTier* tier : std::initializer_list<StorageTier*>{
           store->gpu_.get(), store->ram_.get(), store->ssd_.get(), store->remote_.get()}) {
    if (tier != nullptr) store->tiers_.push_back(tier);
  }
  store->backing_ = store->ssd_.get();
  store->shared_ = store->remote_.get();
  if (store->backing_ != nullptr) {
    TieredStore* s = store.get();
    store->promoter_ = std::make_unique<Promoter>(
        store->ram_.get(), store->backing_, [s](const ChunkId& id, const ChunkMeta& meta) {
          s->ram_bytes_in_.fetch_add(meta.size, std::memory_order_relaxed);
          s->Emit(ChunkEventKind::kPromoted, id, Tier::kRam);
        },
        [s](const ChunkId& id, uint64_t bytes) { return s->AdmitPromotion(id, bytes); },
        &s->key_locks_);
  }
  // A chunk must fit each tier it goes to: a layout whose chunk the SSD tier could never
  // hold would have write-back retry its chunks forever.
  uint64_t max_chunk = std::min(store->options_.max_chunk_bytes, store->ram_->capacity_bytes());
  if (store->backing_ != nullptr) {
    max_chunk = std::min(max_chunk, store->backing_->capacity_bytes());
  }
  store->layouts_ = std::make_unique<LayoutRegistry>(store->ssd_.get(), max_chunk,
                                                     store->options_.max_layouts);
  if (absl::Status s = store->layouts_->Load(); !s.ok()) return s;
  // Answers given on the admission thread run on the commit threads: a put's first
  // frame is copied in its answer.
  store->admission_ = std::make_unique<PutAdmission>(
      PutAdmissionOptions{store->options_.put_wait, absl::Milliseconds(1),
                          store->options_.now,
                          [s = store.get()](std::function<void()> task) {
                            s->commit_pool_->Submit(std::move(task));
                          }},
      [s = store.get()](uint64_t size, bool may_block, bool& noted) {
        return s->TryRoom(size, may_block, noted);
      });
  // Last: its threads notify the admission queue. In write-through mode one thread,
  // with nothing to flush, still runs the tiers' TTL upkeep after each (1 s) pass.
  if (store->has_ssd()) {
    TieredStore* s = store.get();
    const bool write_back = store->options_.write_mode == WriteMode::kWriteBack;
    store->flusher_ = std::make_unique<WriteBackFlusher>(
        write_back ? store->options_.flush_threads : 1,
        [s, write_back] { return write_back && s->FlushOne(/*demotion=*/false); },
        [s] {
          for (StorageTier* tier : s->tiers_) tier->ExpireOld();
        });
  }
  if (store->has_ssd()) {
    TieredStore* s = store.get();
    store->prefetcher_ = std::make_unique<Prefetcher>(
        store->options_.prefetch_threads, [s](const ChunkId& id) { s->Prefetch(id); });
  }
  return store;
}

TieredStore::TieredStore(TieredStoreOptions options)
    : options_(std::move(options)),
      hints_(std::make_unique<HintWindow>(options_.hints)),
      buffered_reads_(std::make_shared<FairGate>(std::max(1, options_.max_buffered_reads))),
      stream_gate_(options_.stream_buffer_bytes),
      read_pool_(std::make_unique<IoPool>(options_.read_threads)),
      commit_pool_(std::make_unique<IoPool>(options_.commit_threads)) {}

TieredStore::~TieredStore() {
  // GPU deliveries still completing must not start reads on pools going away.
  stopping_.store(true, std::memory_order_release);
  if (prefetcher_ != nullptr) prefetcher_->Stop();
  if (flusher_ != nullptr) flusher_->Stop();  // Flushers notify the admission queue.
  admission_.reset();     // Waiting puts are answered Unavailable (on the commit threads),
  commit_pool_.reset();   // commits in flight finish before the tiers go,
  read_pool_.reset();     // and reads finish.
  remote_.reset();        // Queued remote writes are dropped (their chunks are local).
  if (absl::Status s = Close(); !s.ok()) LogWarning("tiered store: close: ", s.message());
}

namespace {

// The room TryRoom gives a write-back put, as the deleter of the shared_ptr handed
// through PutAdmission: the chunk's slots and its backlog reservation travel together,
// and a room dropped before it reaches a ChunkWriter (a put cancelled as it was
// answered) gives both back. TieredStore::TakeRoom moves them out.
struct ReservedRoom {
  std::shared_ptr<PoolChunk> chunk;
  BacklogReservation backlog;
  void operator()(PoolChunk*) {
    chunk.reset();
    backlog.Release();
  }
};

}  // namespace

absl::StatusOr<std::shared_ptr<PoolChunk>> TieredStore::TryRoom(uint64_t size, bool may_block,
                                                                 bool& noted) {
  constexpr auto kWriteFirst = HostPool::DirtyVictim::kWriteFirst;
  BacklogReservation backlog;
  if (options_.write_mode == WriteMode::kWriteBack && options_.max_dirty_bytes != 0) {
    // The backlog is what is dirty in RAM plus what puts admitted before this one will
    // make dirty: counting only the first, puts admitted together before any of them
    // commits would each find it empty. Checked and reserved in one step (the CAS), as
    // puts are admitted on callers' threads too.
    uint64_t admitted = admitted_dirty_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t backlog_bytes = ram_->dirty_bytes() + admitted;
      if (backlog_bytes == 0 || backlog_bytes + size <= options_.max_dirty_bytes) {
        if (admitted_dirty_.compare_exchange_weak(admitted, admitted + size,
                                                  std::memory_order_acq_rel)) {
          backlog = BacklogReservation(&admitted_dirty_, size);
          break;
        }
        continue;  // `admitted` was reloaded.
      }
      if (may_block && FlushOne(/*demotion=*/false)) {
        admitted = admitted_dirty_.load(std::memory_order_acquire);
        continue;
      }
      // Waits in arrival order; a flush that lands, or a commit, wakes it (NotifyRoom).
      // Counted once per put, not per retry.
      if (!noted) backlog_waits_.fetch_add(1, std::memory_order_relaxed);
      noted = true;
      return absl::ResourceExhaustedError(absl::StrCat(
          "write-back backlog full: ", backlog_bytes, " bytes not yet on SSD (",
          admitted, " of them of puts in progress), max_dirty_bytes ",
          options_.max_dirty_bytes));
    }
  }
  absl::StatusOr<std::shared_ptr<PoolChunk>> chunk = ram_->Allocate(size, kWriteFirst);
  // Each demotion makes one dirty chunk clean (evictable) or drops it.
  while (!chunk.ok() && absl::IsResourceExhausted(chunk.status()) && may_block &&
         has_ssd() && FlushOne(/*demotion=*/true)) {
    chunk = ram_->Allocate(size, kWriteFirst);
  }
  if (!chunk.ok() || options_.write_mode != WriteMode::kWriteBack ||
      options_.max_dirty_bytes == 0) {
    return chunk;  // A failed put's reservation goes with `backlog`.
  }
  PoolChunk* raw = chunk->get();
  return std::shared_ptr<PoolChunk>(raw, ReservedRoom{*std::move(chunk), std::move(backlog)});
}

std::unique_ptr<ChunkWriter> TieredStore::TakeRoom(const ChunkId& id, uint32_t token_count,
                                                   std::shared_ptr<PoolChunk> room) {
  ReservedRoom* reserved = std::get_deleter<ReservedRoom>(room);
  if (reserved == nullptr) return std::make_unique<ChunkWriter>(id, token_count, std::move(room));
  auto writer = std::make_unique<ChunkWriter>(id, token_count, std::move(reserved->chunk));
  writer->backlog_ = std::move(reserved->backlog);
  return writer;  // `room` is left holding nothing; its deleter then does nothing.
}

uint64_t TieredStore::BeginPutAsync(const ChunkId& id, uint32_t token_count,
                                    PutStarted done) {
  auto layout = FindLayout(id.ns);
  if (!layout.ok()) {
    done(layout.status());
    return 0;
  }
  if (Locate(id) != Tier::kNone) {
    done(std::unique_ptr<ChunkWriter>());
    return 0;
  }
  if (absl::Status s = layouts_->CheckPuttable(*layout); !s.ok()) {
    done(s);
    return 0;
  }
  return admission_->Admit(
      layout->ChunkBytes(),
      [this, id, token_count, done = std::move(done)](PutAdmission::Room room) {
        if (!room.ok()) {
          if (absl::IsResourceExhausted(room.status())) {
            done(absl::ResourceExhaustedError(absl::StrCat(
                room.status().message(), " (put_wait): back off and retry, or raise "
                "ram_capacity")));
          } else {
            done(room.status());
          }
          return;
        }
        done(TakeRoom(id, token_count, *std::move(room)));
      });
}

absl::StatusOr<std::unique_ptr<ChunkWriter>> TieredStore::BeginPut(const ChunkId& id,
                                                                   uint32_t token_count) {
  absl::Notification answered;
  absl::StatusOr<std::unique_ptr<ChunkWriter>> out;
  BeginPutAsync(id, token_count, [&](absl::StatusOr<std::unique_ptr<ChunkWriter>> w) {
    out = std::move(w);
    answered.Notify();
  });
  answered.WaitForNotification();
  return out;
}

bool TieredStore::CancelPut(uint64_t ticket) { return admission_->Cancel(ticket); }

void TieredStore::CommitPutAsync(std::unique_ptr<ChunkWriter> writer, uint32_t crc32c,
                                 std::function<void(absl::StatusOr<bool>)> done) {
  // CommitPut's own statement, not an argument of done(): GCC destroys a by-value
  // parameter at the end of the caller's full expression, so a refused chunk's slots
  // would go back to the pool only after `done` had answered the client (which could
  // then see them still taken).
  if (options_.write_mode != WriteMode::kWriteThrough) {
    absl::StatusOr<bool> s = Commit(std::move(writer), crc32c);
    done(std::move(s));
    return;
  }
  // std::function needs a copyable task: the writer travels in a shared_ptr.
  auto w = std::make_shared<std::unique_ptr<ChunkWriter>>(std::move(writer));
  commit_pool_->Submit([this, w, crc32c, done = std::move(done)] {
    absl::StatusOr<bool> s = Commit(std::move(*w), crc32c);
    done(std::move(s));
  });
}

absl::Status TieredStore::CommitPut(std::unique_ptr<ChunkWriter> writer, uint32_t crc32c) {
  return Commit(std::move(writer), crc32c).status();
}

absl::StatusOr<bool> TieredStore::Commit(std::unique_ptr<ChunkWriter> writer, uint32_t crc32c) {
  if (writer->received_ != writer->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk incomplete: received ", writer->received_, " of ", writer->size(), " bytes"));
  }
  if (writer->crc_ != crc32c) {
    put_checksum_failures_.fetch_add(1, std::memory_order_relaxed);
    // The client's bytes and its checksum disagree: a bad request, not a stored chunk
    // gone bad (DATA_LOSS is kept for those).
    return absl::InvalidArgumentError(absl::StrFormat(
        "crc32c: chunk %s: the payload's CRC32C is %08x but the frame says %08x: the bytes "
        "do not match the crc32c sent; nothing stored (fix the client's checksum or its "
        "bytes)",
        writer->id_.key.ToHex(), writer->crc_, crc32c));
  }
  ChunkMeta meta{writer->size(), crc32c, writer->token_count_, 0, writer->lineage_};
  // Admitted at once, two puts of a chunk both commit. The one that commits second
  // stores nothing if a local tier holds the first's copy: RAM, or SSD once it has left
  // RAM (flushed and evicted), where RAM's insert alone would have taken it as new and
  // both would have reported it stored.
  commits_.WaitAndClaim(writer->id_);
  absl::Cleanup unclaim = [this, id = writer->id_] { commits_.Release({&id, 1}); };
  // (The first put shared it, if there is a shared tier: BeginPut admits no put of a
  // chunk a local tier holds, so only such a race reaches here with one.)
  if (HeldLocally(writer->id_)) return false;
  std::shared_ptr<PoolChunk> data = shared_ != nullptr ? writer->data_ : nullptr;
  // Noted before the chunk is stored anywhere: a Delete of it from here on (which bumps
  // it) keeps this put's copy from going to the shared tier (see below).
  const uint64_t generation = data != nullptr ? key_locks_.Generation(writer->id_) : 0;
  // False when a concurrent put of the same chunk committed first (this one's bytes
  // are dropped): exactly one of them reports it stored.
  bool stored = false;
  switch (options_.write_mode) {
    case WriteMode::kWriteThrough: {
      if (absl::Status s =
              WriteAndWait(*backing_, writer->id_, meta, ChunkBytes::Of(writer->data_));
          !s.ok()) {
        if (absl::IsDataLoss(s)) {
          // The pool's copy changed after it was checked: nothing is stored, and the
          // client's bytes were sound, so sending them again is the fix (DATA_LOSS is
          // kept for stored chunks).
          ram_checksum_failures_.fetch_add(1, std::memory_order_relaxed);
          return absl::UnavailableError(absl::StrCat(s.message(), "; resend the chunk"));
        }
        return s;
      }
      ssd_bytes_in_.fetch_add(meta.size, std::memory_order_relaxed);
      if (ram_->Insert(writer->id_, std::move(writer->data_), meta, /*dirty=*/false)) {
        stored = true;
        ram_bytes_in_.fetch_add(meta.size, std::memory_order_relaxed);
        Emit(ChunkEventKind::kStored, writer->id_, Tier::kRam);
      }
      break;
    }
    case WriteMode::kWriteBack: {
      if (ram_->Insert(writer->id_, std::move(writer->data_), meta, /*dirty=*/true)) {
        stored = true;
        ram_bytes_in_.fetch_add(meta.size, std::memory_order_relaxed);
        flusher_->Notify();
        Emit(ChunkEventKind::kStored, writer->id_, Tier::kRam);
      }
      // Counted as dirty now (or a duplicate, dropped): released only after the insert,
      // so that the backlog is never under-counted in between.
      writer->backlog_.Release();
      break;
    }
    case WriteMode::kRamOnly:
      if (ram_->Insert(writer->id_, std::move(writer->data_), meta, /*dirty=*/false)) {
        stored = true;
        ram_bytes_in_.fetch_add(meta.size, std::memory_order_relaxed);
        Emit(ChunkEventKind::kStored, writer->id_, Tier::kRam);
      }
      break;
  }
  if (stored && data != nullptr) {
    if (options_.before_shared_write) options_.before_shared_write(writer->id_);
    // Under the chunk's KeyLocks stripe, as a Delete's local removals are: either the
    // write is queued first, and the Delete's shared-tier delete cancels it, or the
    // Delete came first and the write is not queued. Queued after the Delete had
    // finished, it once put the deleted chunk back in the shared tier for every daemon.
    // A Delete of another chunk on the stripe (or a Clear of another namespace) leaves
    // this one held here, and then the write still goes.
    key_locks_.InsertIfUnchanged(
        writer->id_, generation, [&] { ToRemote(writer->id_, meta, std::move(data)); },
        [&] { return HeldLocally(writer->id_); });
  }
  return stored;
}

bool TieredStore::HeldLocally(const ChunkId& id) const {
  for (const StorageTier* tier : tiers_) {
    if (tier->role() == StorageTier::Role::kLocal && tier->Contains(id)) return true;
  }
  return false;
}

void TieredStore::ToRemote(const ChunkId& id, const ChunkMeta& meta,
                           std::shared_ptr<PoolChunk> data) {
  // Best effort, counted by the remote tier. A Delete or Clear after this cancels the
  // write (RemoteTier::CancelWrites), so a deleted chunk does not come back from there.
  shared_->Write(id, meta, ChunkBytes::Of(std::move(data)), [](absl::Status) {});
}

bool TieredStore::FlushOne(bool demotion) {
  // A demotion writes the policy's victim; the flusher writes in arrival order.
  std::optional<HostPool::DirtyChunk> d = demotion ? ram_->TakeDirtyVictim() : ram_->TakeDirty();
  if (!d) return false;
  absl::Status s = WriteAndWait(*backing_, d->id, d->meta, ChunkBytes::Of(d->data));
  // Our reference goes before the chunk stops being "flushing": a put's Allocate must
  // not see a clean chunk still held (as if a reader had it) and evict a more recently
  // used one in its place.
  d->data.reset();
  if (s.ok()) {
    if (options_.after_write_back) options_.after_write_back(d->id);
    ssd_bytes_in_.fetch_add(d->meta.size, std::memory_order_relaxed);
    if (demotion) demotions_.fetch_add(1, std::memory_order_relaxed);
    if (ram_->FinishFlush(*d, /*written=*/true) == HostPool::FlushEnd::kGone) {
      // Removed from RAM while we wrote it, other than by a Delete or Clear (those
      // wait for the write, then delete it themselves): do not let it come back from
      // the tier below, nor a promotion that read it put it back in RAM.
      key_locks_.Removing(d->id, [&] {
        backing_->Delete(d->id).IgnoreError();  // Best effort; a leftover is a stale hit.
      });
    }
    if (!demotion) NotifyRoom();  // The chunk is evictable now.
    return true;
  }
  if (absl::IsDataLoss(s)) {
    // The RAM copy no longer matches its checksum: writing it again would fail again,
    // and serving it would be wrong. Dropped; the chunk is recomputed on its next miss.
    ram_checksum_failures_.fetch_add(1, std::memory_order_relaxed);
    if (demotion) demotion_failures_.fetch_add(1, std::memory_order_relaxed);
    LogWarning("tiered store: RAM copy of ", d->id.DebugString(),
               " failed its CRC32C on the way to the SSD, dropped: ", s.message());
    ram_->DropFlushing(*d, /*even_if_pinned=*/true);  // Its eviction event: the pool's.
    if (!demotion) NotifyRoom();
    return true;
  }
  // A full disk fails every write-back and demotion, as fast as puts ask for room: one
  // line a second says so (the counters count them all).
  if (demotion) {
    // The room is needed now and the SSD will not take the chunk: a cache may lose it.
    // (Not one pinned while it was written: it stays, dirty, to be written later.)
    demotion_failures_.fetch_add(1, std::memory_order_relaxed);
    const bool dropped = ram_->DropFlushing(*d, /*even_if_pinned=*/false);
    if (std::optional<uint64_t> held = write_failure_log_.Allow(options_.now())) {
      LogWarning("tiered store: demotion of ", d->id.DebugString(), " failed, ",
                 dropped ? "dropped from RAM: " : "kept in RAM (pinned meanwhile): ",
                 s.message(), HeldBack(*held));
    }
    return true;
  }
  if (std::optional<uint64_t> held = write_failure_log_.Allow(options_.now())) {
    LogWarning("tiered store: write-back of ", d->id.DebugString(), " failed, will retry: ",
               s.message(), HeldBack(*held));
  }
  ram_->FinishFlush(*d, /*written=*/false);
  return false;
}

uint64_t TieredStore::FlushAll() {
  std::atomic<uint64_t> flushed{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < options_.flush_threads; ++i) {
    threads.emplace_back([this, &flushed] {
      while (FlushOne(/*demotion=*/false)) flushed.fetch_add(1, std::memory_order_relaxed);
    });
  }
  for (std::thread& t : threads) t.join();
  return flushed.load();
}

std::optional<ChunkMeta> TieredStore::StagedAndBacked(const ChunkId& id) const {
  if (gpu_ == nullptr) return std::nullopt;
  const std::optional<ChunkMeta> staged = gpu_->StagedMeta(id);
  if (!staged.has_value()) return std::nullopt;
  // Staging is a cache of the pool: a staged copy of a chunk that RAM and SSD no longer
  // hold (evicted in ram-only mode, deleted in a race with StageAsync) is dropped, and
  // so is one of other bytes than those they hold: a StageAsync that ran inside a
  // Delete (after the staging let go, before RAM did) stages the deleted bytes, which a
  // later put of new ones would otherwise leave served (deliveries from staging do not
  // check the CRC32C).
  bool backed = false;
  if (std::optional<HostPool::Hit> hit = ram_->Peek(id)) {
    backed = hit->meta == *staged;
  } else if (ssd_ != nullptr) {
    const std::optional<ChunkMeta> on_ssd = ssd_->PeekMeta(id);  // No I/O, no side effect.
    backed = on_ssd.has_value() && *on_ssd == *staged;
  }
  if (backed) return staged;
  gpu_->Remove(id);
  return std::nullopt;
}

Tier TieredStore::Locate(const ChunkId& id) const {
  // A copy tier names the chunk only while a local tier below it backs the copy.
  StorageTier* copy = nullptr;
  for (StorageTier* tier : tiers_) {
    if (tier->role() == StorageTier::Role::kShared) break;
    if (!tier->Contains(id)) continue;
    if (tier->role() == StorageTier::Role::kCopy) {
      if (copy == nullptr) copy = tier;
      continue;
    }
    return copy != nullptr ? copy->tier() : tier->tier();
  }
  // A copy of a chunk no local tier holds any more (evicted in ram-only mode, deleted in
  // a race with StageAsync) is dropped: it must not hold room or stop a restaging.
  if (copy != nullptr) copy->Delete(id).IgnoreError();
  return Tier::kNone;
}

std::optional<ChunkView> TieredStore::HoldInRam(const ChunkId& id) const {
  auto hit = ram_->Peek(id);
  if (!hit) return std::nullopt;
  ChunkView view;
  view.meta_ = hit->meta;
  view.tier_ = Tier::kRam;
  view.pool_ = std::move(hit->data);
  return view;
}

absl::StatusOr<ChunkView> TieredStore::Read(const ChunkId& id) { return Read(id, false); }

absl::StatusOr<ChunkView> TieredStore::Read(const ChunkId& id, bool stream,
                                            uint64_t sent_bytes) {
  ChunkView view;
  if (auto hit = ram_->Find(id)) {
    // What leaves the tier: a layer range of the chunk when that is all the caller sends
    // (a streamed SSD read counts its ranges the same way, in ReadRangeAsync).
    ram_bytes_out_.fetch_add(std::min(hit->meta.size, sent_bytes), std::memory_order_relaxed);
    view.meta_ = hit->meta;
    view.tier_ = Tier::kRam;
    view.pool_ = std::move(hit->data);
    return view;
  }
  if (!has_ssd()) {
    if (shared_ != nullptr) return ReadRemote(id, /*wait_for_buffer=*/!stream);
    return absl::NotFoundError("chunk not cached");
  }
  // Without room in RAM: streamed, nothing read yet (the caller reads a frame at a time
  // with ReadRangeAsync); or else a heap buffer, at most max_buffered_reads of them at
  // once, whose gate is left when the last holder of the buffer drops it (shared with
  // the buffer: a view may outlive the store).
  std::shared_ptr<std::string> buffer;
  std::optional<StringSink> buffer_sink;
  bool streamed = false;
  Promoter::Result below = promoter_->Read(id, [&](const ChunkMeta& meta) -> ChunkSink* {
    if (stream && backing_->reads_ranges()) {
      streamed = true;
      return nullptr;
    }
    buffer = NewBufferedRead(meta.size);
    buffer_sink.emplace(buffer.get());
    return &*buffer_sink;
  });
  if (!below.meta.has_value()) {
    if (absl::IsNotFound(below.status) && shared_ != nullptr) {
      return ReadRemote(id, /*wait_for_buffer=*/!stream);
    }
    return below.status;
  }
  view.meta_ = *below.meta;
  view.tier_ = backing_->tier();
  if (streamed) {
    backing_->CountRangedRead();
    view.streamed_ = true;
    return view;
  }
  if (!below.status.ok()) return below.status;
  if (below.room != nullptr) {
    view.pool_ = std::move(below.room);
  } else {
    view.buf_ = std::move(buffer);
  }
  ssd_bytes_out_.fetch_add(view.meta_.size, std::memory_order_relaxed);
  return view;
}

absl::StatusOr<ChunkView> TieredStore::ReadRemote(const ChunkId& id, bool wait_for_buffer) {
  if (!layouts_->Find(id.ns).ok()) return absl::NotFoundError("chunk not cached");
  // One fetch per chunk: if another reader (or a Get's batched fetch) has it in hand,
  // wait for it; it is in RAM afterwards unless that fetch missed.
  remote_fetches_.WaitAndClaim(id);
  absl::Cleanup release = [&] { remote_fetches_.Release({&id, 1}); };
  if (auto hit = ram_->Find(id)) {
    ram_bytes_out_.fetch_add(hit->meta.size, std::memory_order_relaxed);
    ChunkView view;
    view.meta_ = hit->meta;
    view.tier_ = Tier::kRam;
    view.pool_ = std::move(hit->data);
    return view;
  }
  // Into RAM when there is room (a promotion), else a buffer counted in
  // max_buffered_reads, as for a read from the local tier.
  std::shared_ptr<PoolChunk> room;
  std::optional<PoolSink> room_sink;
  std::shared_ptr<std::string> buffer;
  std::optional<StringSink> buffer_sink;
  const uint64_t generation = key_locks_.Generation(id);
  auto meta = ReadAndWait(*shared_, id, [&](const ChunkMeta& m) -> ChunkSink* {
    if (auto r = AdmitPromotion(id, m.size)
                     ? ram_->Allocate(m.size)
                     : absl::StatusOr<std::shared_ptr<PoolChunk>>(absl::ResourceExhaustedError(""));
        r.ok()) {
      room = *std::move(r);
      return &room_sink.emplace(room.get());
    }
    if (wait_for_buffer) {
      buffer = NewBufferedRead(m.size);
    } else if (buffered_reads_->TryEnter()) {
      buffer = BufferedRead(m.size);
    } else {
      // A streaming reader (a Get) may hold buffers already and keep them until it has
      // read more (layer-major holds each key's chunk across passes): waiting here, it
      // could wait on itself, on a read thread, forever. A miss instead.
      return nullptr;
    }
    return &buffer_sink.emplace(buffer.get());
  });
  // Unreachable, degraded, foreign or corrupt: all a miss to the caller, who computes
  // the chunk instead (the shared tier counted and logged why).
  if (!meta.ok()) return absl::NotFoundError("chunk not cached");
  ChunkView view;
  view.meta_ = *meta;
  view.tier_ = shared_->tier();
  if (room != nullptr) {
    bool inserted = false;  // Not if it was deleted while it was read.
    key_locks_.InsertIfUnchanged(id, generation, [&] {
      inserted = ram_->Insert(id, room, *meta, /*dirty=*/false);
    });
    if (inserted) {
      remote_promotions_.fetch_add(1, std::memory_order_relaxed);
      ram_bytes_in_.fetch_add(meta->size, std::memory_order_relaxed);
      Emit(ChunkEventKind::kPromoted, id, Tier::kRam);
    }
    view.pool_ = std::move(room);
  } else {
    view.buf_ = std::move(buffer);
  }
  return view;
}

std::vector<bool> TieredStore::FetchRemoteAsync(absl::Span<const ChunkId> ids) {
  if (shared_ == nullptr || !shared_->reachable() || stopping_.load()) return {};
  std::vector<ChunkId> missing;
  std::vector<bool> ahead(ids.size(), false);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (Locate(ids[i]) != Tier::kNone) continue;
    missing.push_back(ids[i]);
    ahead[i] = true;
  }
  if (missing.size() < 2) return {};  // One chunk gains nothing over the Get's own read.
  remote_fetches_.JobQueued();
  read_pool_->Submit([this, missing = std::move(missing)] {
    // At shutdown the pool runs what is queued: skip the network then.
    if (!stopping_.load()) FetchRemote(missing);
    remote_fetches_.JobDone();
  });
  return ahead;
}

void TieredStore::FetchRemote(const std::vector<ChunkId>& ids) {
  // Chunks that landed locally meanwhile, or that another reader is fetching, are left
  // alone. All of a Get's chunks share its namespace, so one layout serves.
  std::vector<ChunkId> wanted;
  for (const ChunkId& id : ids) {
    if (Locate(id) == Tier::kNone) wanted.push_back(id);
  }
  std::vector<ChunkId> claimed = remote_fetches_.ClaimFree(wanted);
  // A reader may have fetched one and released its claim between the check above and
  // the claim: check again now that no one else can.
  std::vector<ChunkId> landed;
  claimed.erase(std::remove_if(claimed.begin(), claimed.end(),
                               [&](const ChunkId& id) {
                                 if (Locate(id) == Tier::kNone) return false;
                                 landed.push_back(id);
                                 return true;
                               }),
                claimed.end());
  remote_fetches_.Release(landed);
  if (claimed.empty()) return;
  // Into RAM where there is room without evicting anything unsaved; a chunk with none
  // is left for the Get to read itself. Each claim goes as its chunk lands, so the
  // Get's first chunks need not wait for its last.
  std::vector<std::shared_ptr<PoolChunk>> rooms(claimed.size());
  std::vector<std::optional<PoolSink>> sinks(claimed.size());
  // Chunks given room but not yet in RAM (their group is still being read), which the
  // admission cannot see there: each is asked for with those, so a tenant's quota holds
  // for a group as a whole. ReadMany calls both callbacks on this thread.
  uint64_t admitted = 0;
  std::vector<uint64_t> admitted_bytes(claimed.size(), 0);
  std::vector<uint64_t> generations(claimed.size());
  for (size_t i = 0; i < claimed.size(); ++i) generations[i] = key_locks_.Generation(claimed[i]);
  shared_->ReadMany(
      claimed,
      [&](size_t i, const ChunkMeta& meta) -> ChunkSink* {
        const uint64_t footprint = ram_->Footprint(meta.size);
        if (!AdmitPromotion(claimed[i], admitted + footprint)) return nullptr;
        auto room = ram_->Allocate(meta.size);
        if (!room.ok()) return nullptr;
        rooms[i] = *std::move(room);
        admitted += footprint;
        admitted_bytes[i] = footprint;
        return &sinks[i].emplace(rooms[i].get());
      },
      [&](size_t i, absl::StatusOr<ChunkMeta> meta) {
        admitted -= admitted_bytes[i];  // In RAM now (counted there), or dropped.
        admitted_bytes[i] = 0;
        bool inserted = false;  // Not if it was deleted while it was read.
        if (meta.ok()) {
          key_locks_.InsertIfUnchanged(claimed[i], generations[i], [&] {
            inserted = ram_->Insert(claimed[i], rooms[i], *meta, /*dirty=*/false);
          });
        }
        if (inserted) {
          remote_promotions_.fetch_add(1, std::memory_order_relaxed);
          ram_bytes_in_.fetch_add(meta->size, std::memory_order_relaxed);
          Emit(ChunkEventKind::kPromoted, claimed[i], Tier::kRam);
        }
        rooms[i].reset();
        remote_fetches_.Release({&claimed[i], 1});
      });
}

std::vector<Tier> TieredStore::LocateMany(absl::Span<const ChunkId> ids) {
  std::vector<Tier> tiers;
  tiers.reserve(ids.size());
  std::vector<ChunkId> missing;
  for (const ChunkId& id : ids) {
    tiers.push_back(Locate(id));
    if (tiers.back() == Tier::kNone) missing.push_back(id);
  }
  if (shared_ == nullptr || missing.empty()) return tiers;
  const std::vector<bool> shared = shared_->ContainsMany(missing);
  size_t k = 0;
  for (Tier& t : tiers) {
    if (t != Tier::kNone) continue;
    if (shared[k++]) t = shared_->tier();
  }
  return tiers;
}

absl::StatusOr<TieredStore::HintResult> TieredStore::Hint(
    const std::string& client, std::vector<HintedRequest> requests, const std::string& group) {
  std::vector<HintWindow::Request> window_requests;
  window_requests.reserve(requests.size());
  absl::flat_hash_map<uint64_t, uint64_t> chunk_bytes;
  for (HintedRequest& r : requests) {
    auto it = chunk_bytes.find(r.ns);
    if (it == chunk_bytes.end()) {
      auto layout = layouts_->Find(r.ns);
      if (!layout.ok()) return layout.status();
      it = chunk_bytes.emplace(r.ns, layout->ChunkBytes()).first;
    }
    window_requests.push_back({r.ns, it->second, std::move(r.keys)});
  }
  auto accepted = hints_->Set(client, window_requests, group);
  if (!accepted.ok()) return accepted.status();
  HintResult out;
  out.requests_accepted = accepted->requests;
  out.keys_accepted = accepted->keys;
  out.truncated = accepted->truncated;
  // The merged window, nearest first, as far as max_bytes reaches: what sits only on
  // SSD is fetched. One lock per tier for the whole window.
  const auto snapshot = hints_->snapshot();
  size_t reach = 0;
  uint64_t bytes = 0;
  for (; reach < snapshot->by_rank.size(); ++reach) {
    const uint64_t ns = snapshot->by_rank[reach].ns;
    auto size = chunk_bytes.find(ns);
    if (size == chunk_bytes.end()) {
      auto layout = layouts_->Find(ns);
      size = chunk_bytes.emplace(ns, layout.ok() ? layout->ChunkBytes() : 0).first;
    }
    if (bytes + size->second > options_.hints.max_bytes) break;
    bytes += size->second;
  }
  const absl::Span<const ChunkId> window = absl::MakeConstSpan(snapshot->by_rank).first(reach);
  const std::vector<bool> in_ram = ram_->ContainsMany(window);
  std::vector<bool> on_ssd(reach, false);
  if (has_ssd()) {
    // Only what RAM lacks can need a fetch (hinted chunks mostly stay in RAM).
    std::vector<ChunkId> lacking;
    std::vector<size_t> where;
    for (size_t i = 0; i < reach; ++i) {
      if (!in_ram[i]) lacking.push_back(window[i]), where.push_back(i);
    }
    const std::vector<bool> found = backing_->ContainsMany(lacking);
    for (size_t j = 0; j < lacking.size(); ++j) on_ssd[where[j]] = found[j];
  }
  std::vector<ChunkId> fetch;
  // Staging takes the nearest chunks, up to half its buffers: staging the whole window
  // would evict, in LRU order, the nearest for the farthest. Counted in the whole slots
  // a chunk takes (a chunk smaller than a slot still takes one).
  uint64_t staged = 0;
  const uint64_t stage_budget = gpu_ != nullptr ? gpu_->capacity_bytes() / 2 : 0;
  const uint64_t slot = std::max<uint64_t>(options_.gpu_staging.slot_bytes, 1);
  for (size_t i = 0; i < reach; ++i) {
    if (!in_ram[i] && on_ssd[i]) {
      fetch.push_back(window[i]);
    } else if (in_ram[i] && gpu_ != nullptr) {
      const uint64_t size = (chunk_bytes[window[i].ns] + slot - 1) / slot * slot;
      if (staged + size > stage_budget) continue;
      staged += size;
      StageAsync(window[i]);
    }
  }
  // What became of this client's window (a chunk past the merged reach: only counted).
  for (const ChunkId& id : accepted->window->by_rank) {
    auto at = snapshot->position.find(id);
    if (at != snapshot->position.end() && at->second < reach) {
      if (!in_ram[at->second] && on_ssd[at->second]) {
        ++out.prefetching;
      } else if (in_ram[at->second] || on_ssd[at->second]) {
        ++out.cached;
      }
    } else if (Locate(id) != Tier::kNone) {
      ++out.cached;
    }
  }
  if (prefetcher_ != nullptr) prefetcher_->Replace(std::move(fetch));
  return out;
}

void TieredStore::Prefetch(const ChunkId& id) {
  if (stopping_.load(std::memory_order_acquire) || ram_->Contains(id)) return;
  // Gone meanwhile, no room now, or the read failed (the SSD tier deletes and counts a
  // corrupt chunk): nothing to do.
  // Room is never made by evicting a hinted chunk needed no later than this one (the
  // window's fallback victim is its farthest chunk, whatever this one's rank): each
  // Hint would fetch what the last one evicted, and the next Get miss RAM.
  const std::shared_ptr<const HintWindow::Snapshot> hints = hints_->snapshot();
  const auto at = hints->position.find(id);
  const uint32_t rank = at == hints->position.end() ? UINT32_MAX : at->second;
  Promoter::Result below = promoter_->Read(
      id, [](const ChunkMeta&) -> ChunkSink* { return nullptr; },
      [&](const ChunkId& other) {
        const auto p = hints->position.find(other);
        return p != hints->position.end() && p->second <= rank;
      });
  if (!below.status.ok() || below.room == nullptr) return;
  ssd_bytes_out_.fetch_add(below.meta->size, std::memory_order_relaxed);
  // Staged, if near enough, by the next Hint: now in RAM, it is counted there.
}

void TieredStore::ReadAsync(const ChunkId& id,
                            std::function<void(absl::StatusOr<ChunkView>)> done) {
  if (ram_->Contains(id) || (shared_ == nullptr && (!has_ssd() || !backing_->Contains(id)))) {
    done(Read(id));  // RAM hit or a miss: no I/O, answer inline.
    return;
  }
  read_pool_->Submit([this, id, done = std::move(done)] { done(Read(id)); });
}

void TieredStore::ReadForStreamAsync(const ChunkId& id,
                                     std::function<void(absl::StatusOr<ChunkView>)> done,
                                     uint64_t sent_bytes) {
  if (ram_->Contains(id) || (shared_ == nullptr && (!has_ssd() || !backing_->Contains(id)))) {
    done(Read(id, true, sent_bytes));
    return;
  }
  read_pool_->Submit([this, id, done = std::move(done), sent_bytes] {
    done(Read(id, true, sent_bytes));
  });
}

char* TieredStore::TakeRangeBuffer(uint64_t len) {
  if (has_ssd() && len == options_.ssd.io_bytes) {
    absl::MutexLock lock(&spare_mu_);
    if (!spare_buffers_.empty()) {
      char* buf = spare_buffers_.back().release();
      spare_buffers_.pop_back();
      return buf;
    }
  }
  return new char[len];
}

void TieredStore::GiveRangeBuffer(char* buf, uint64_t len) {
  if (has_ssd() && len == options_.ssd.io_bytes) {
    absl::MutexLock lock(&spare_mu_);
    // Never more spares than the budget could hold at once.
    if ((spare_buffers_.size() + 1) * len <= options_.stream_buffer_bytes) {
      spare_buffers_.emplace_back(buf);
      return;
    }
  }
  delete[] buf;
}

void TieredStore::ReadRangeAsync(const ChunkId& id, const ChunkMeta& meta, uint64_t offset,
                                 uint64_t len,
                                 std::function<void(absl::StatusOr<RangeBuffer>)> done) {
  if (backing_ == nullptr || !backing_->reads_ranges()) {
    done(absl::NotFoundError("no tier under RAM reads ranges of a chunk"));
    return;
  }
  stream_gate_.Acquire(len, [this, id, meta, offset, len, done = std::move(done)]() mutable {
    read_pool_->Submit([this, id, meta, offset, len, done = std::move(done)] {
      // The buffer leaves the budget when its last holder (a gRPC slice, say) drops it.
      RangeBuffer buf(TakeRangeBuffer(len), [this, len](const char* b) {
        GiveRangeBuffer(const_cast<char*>(b), len);
        stream_gate_.Release(len);
      });
      absl::Status s = backing_->ReadRange(id, meta, offset, len, const_cast<char*>(buf.get()));
      if (!s.ok()) {
        buf.reset();
        done(std::move(s));
        return;
      }
      ssd_bytes_out_.fetch_add(len, std::memory_order_relaxed);
      done(std::move(buf));
    });
  });
}

absl::Status TieredStore::DropCorrupt(const ChunkId& id, const ChunkView& view) {
  // The copy that was read goes, and only it: the other tier's copy, if any, still
  // serves. A view that holds pool bytes was read from RAM, whatever tier it names: one
  // promoted from SSD or the shared tier says where its bytes came from (and were
  // checked), but what failed is the RAM copy made of them.
  if (view.pool_ != nullptr) {
    if (!DropCorruptInRam(id, view.KeepAlive())) {
      // Not a stored copy (a promotion's buffer that was never inserted, or one RAM has
      // replaced or let go of since): nothing stored was found bad, and a read again
      // finds what is.
      return absl::AbortedError(absl::StrCat(
          "chunk ", id.key.ToHex(), ": the copy read failed its CRC32C but is no longer "
          "the one stored; read it again"));
    }
    return absl::DataLossError(absl::StrCat(
        "chunk ", id.key.ToHex(), ": its RAM copy failed its CRC32C and was dropped"));
  }
  if (view.tier() != Tier::kSsd || !has_ssd()) {
    return absl::DataLossError(absl::StrCat("chunk ", id.key.ToHex(), " from the ",
                                            TierName(view.tier()), " tier failed its CRC32C"));
  }
  return DropCorrupt(id, view.meta());
}

absl::Status TieredStore::DropCorrupt(const ChunkId& id, const ChunkMeta& meta) {
  if (!has_ssd()) return absl::DataLossError("chunk failed its checksum");
  // Its event goes out from the SSD tier (on_corrupt), as for a copy found corrupt on
  // any other path.
  return backing_->DropCorrupt(id, meta);
}

std::shared_ptr<std::string> TieredStore::NewBufferedRead(uint64_t size) {
  buffered_reads_->Enter();
  return BufferedRead(size);
}

std::shared_ptr<std::string> TieredStore::BufferedRead(uint64_t size) {
  // Leaves the gate when its last holder drops it; the gate is shared with the buffer,
  // which a view may keep past the store.
  return std::shared_ptr<std::string>(new std::string(size, '\0'),
                                      [gate = buffered_reads_](std::string* b) {
                                        delete b;
                                        gate->Leave();
                                      });
}

StorageTier* TieredStore::TierOf(Tier tier) const {
  for (StorageTier* t : tiers_) {
    if (t->tier() == tier) return t;
  }
  return nullptr;
}

void TieredStore::Emit(ChunkEventKind kind, const ChunkId& id, Tier tier) {
  if (options_.events != nullptr) options_.events->Append(kind, id, tier);
}

absl::Status TieredStore::Pin(const ChunkId& id, absl::Duration ttl,
                              const HostPool::PinBudget* budget) {
  // A chunk that cannot be pinned even alone is refused before it is promoted (which
  // would evict other chunks for nothing), and as final: RESOURCE_EXHAUSTED says retry.
  if (auto layout = FindLayout(id.ns); layout.ok()) {
    if (budget != nullptr && layout->ChunkBytes() > budget->max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pinning a ", layout->ChunkBytes(), "-byte chunk cannot fit the tenant's ",
          budget->quota, " (", budget->max_bytes, " bytes) even with nothing else pinned"));
    }
    if (absl::Status s = ram_->CheckPinCanFit({layout->ChunkBytes()}); !s.ok()) return s;
  }
  if (!ram_->Contains(id)) {
    if (!has_ssd() || !backing_->Contains(id)) return absl::NotFoundError("chunk not cached");
    auto view = Read(id);  // Promotes.
    if (!view.ok()) return view.status();
    if (!ram_->Contains(id)) {
      // A tenant's promotions stay within its ram_quota (admit_promotion).
      return absl::ResourceExhaustedError(
          budget != nullptr
              ? "no room in RAM to pin this chunk, within the tenant's ram_quota or the "
                "pool: what is there is pinned, being read or not yet on SSD; retry later"
              : "no room in the host pool to pin this chunk");
    }
  }
  // The pool judges expiry by its own clock (options_.ram.now), so the deadline must
  // be on that clock too.
  const absl::Time until =
      ttl > absl::ZeroDuration() ? options_.ram.now() + ttl : absl::InfiniteFuture();
  return ram_->Pin(id, until, budget);
}

absl::Status TieredStore::CheckPinsCanFit(absl::Span<const ChunkId> ids,
                                          const HostPool::PinBudget* budget) {
  absl::flat_hash_set<ChunkId> distinct(ids.begin(), ids.end());
  std::vector<ChunkId> unique(distinct.begin(), distinct.end());
  absl::flat_hash_map<uint64_t, uint64_t> chunk_bytes;  // By namespace.
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  for (size_t i = 0; i < unique.size(); ++i) {
    // Local tiers only, as Pin: a chunk only the shared tier holds is answered as not
    // found and pins nothing (and asking the cluster here would cost a round trip).
    if (Locate(unique[i]) == Tier::kNone) continue;
    auto it = chunk_bytes.find(unique[i].ns);
    if (it == chunk_bytes.end()) {
      auto layout = FindLayout(unique[i].ns);
      if (!layout.ok()) continue;
      it = chunk_bytes.emplace(unique[i].ns, layout->ChunkBytes()).first;
    }
    sizes.push_back(it->second);
    total += ram_->Footprint(it->second);  // As a tenant's pins count.
  }
  if (sizes.size() < 2) return absl::OkStatus();  // One chunk: Pin checks it.
  if (budget != nullptr && total > budget->max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pinning ", sizes.size(), " chunks together (", total, " bytes) cannot fit the "
        "tenant's ", budget->quota, " (", budget->max_bytes,
        " bytes) even with nothing else pinned; pin fewer keys"));
  }
  if (absl::Status s = ram_->CheckPinCanFit(sizes); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(s.message(), "; pin fewer keys"));
  }
  return absl::OkStatus();
}

TieredStore::NamespaceUsage TieredStore::Usage(const absl::flat_hash_set<uint64_t>& ns) const {
  NamespaceUsage u;
  const HostPool::NamespaceBytes ram = ram_->BytesOf(ns);
  u.ram_bytes = ram.bytes;
  u.pinned_bytes = ram.pinned;
  if (StorageTier* ssd = TierOf(Tier::kSsd)) u.ssd_bytes = ssd->NamespaceQuotaBytes(ns);
  return u;
}

bool TieredStore::AdmitPromotion(const ChunkId& id, uint64_t bytes) {
  // What a tenant's ram_quota counts: pool slots (a sum of footprints is its own).
  return !options_.admit_promotion ||
         options_.admit_promotion(*this, id.ns, ram_->Footprint(bytes));
}

uint64_t TieredStore::RamFootprint(uint64_t size) const { return ram_->Footprint(size); }

absl::StatusOr<uint64_t> TieredStore::ShrinkNamespaces(const absl::flat_hash_set<uint64_t>& ns,
                                                       Tier tier, uint64_t keep) {
  StorageTier* shrunk = TierOf(tier);
  if (shrunk == nullptr) return 0;  // Nothing held there.
  absl::StatusOr<uint64_t> held = shrunk->ShrinkNamespaces(ns, keep);
  if (shrunk == ram_.get()) NotifyRoom();  // Slots freed for puts waiting for room.
  return held;
}

bool TieredStore::Unpin(const ChunkId& id) {
  const bool unpinned = ram_->Unpin(id);
  if (unpinned) NotifyRoom();
  return unpinned;
}

uint64_t TieredStore::UnpinNamespaces(const absl::flat_hash_set<uint64_t>& ns) {
  const uint64_t unpinned = ram_->UnpinNamespaces(ns);
  if (unpinned > 0) NotifyRoom();
  return unpinned;
}

void TieredStore::NotifyRoom() {
  if (admission_ != nullptr) admission_->Notify();
}

void TieredStore::AppendFromDeviceAsync(ChunkWriter* writer, DevicePtr src, uint64_t n,
                                        std::function<void(absl::Status)> done) {
  if (gpu_ == nullptr) {
    done(absl::FailedPreconditionError("this daemon has no GPU"));
    return;
  }
  const uint64_t at = writer->received_;
  if (n > writer->size() - at) {
    done(absl::InvalidArgumentError(absl::StrCat(
        "frame data runs past the chunk's end: chunk is ", writer->size(),
        " bytes, frame covers [", at, ", ", at + n, ")")));
    return;
  }
  std::vector<DeviceCopy> copies;
  uint64_t off = 0;
  writer->data_->ForEachWritablePiece(at, n, [&](char* dst, uint64_t len) {
    copies.push_back(DeviceCopy::DeviceToHost(dst, src + off, len));
    off += len;
  });
  gpu_->Copy(std::move(copies), [writer, at, n, done = std::move(done)](absl::Status s) {
    if (!s.ok()) {
      done(absl::Status(s.code(), absl::StrCat("copy from GPU memory: ", s.message())));
      return;
    }
    // Checksum what the pool now holds: what is checked is what is stored.
    writer->data_->ForEachPiece(at, n, [&](absl::string_view p) {
      writer->crc_ = crc32c::Extend(writer->crc_, p.data(), p.size());
    });
    writer->received_ += n;
    done(absl::OkStatus());
  });
}

bool TieredStore::DropCorruptInRam(const ChunkId& id, const std::shared_ptr<const void>& chunk) {
  // Only if the index still holds the very chunk that failed (not a newer put of it).
  std::optional<HostPool::Hit> now = ram_->Peek(id);
  if (!now || std::static_pointer_cast<const void>(now->data) != chunk) return false;
  if (gpu_ != nullptr) gpu_->Remove(id);
  if (ram_->Remove(id)) {
    NotifyRoom();
    Emit(ChunkEventKind::kEvicted, id, Tier::kRam);
  }
  ram_checksum_failures_.fetch_add(1, std::memory_order_relaxed);
  LogWarning("RAM copy of ", id.DebugString(), " failed its CRC32C on the way to a reader; "
             "dropped (an SSD copy, if any, is still served)");
  return true;
}

void TieredStore::StageAsync(const ChunkId& id) {
  if (gpu_ == nullptr || gpu_->capacity_bytes() == 0 || gpu_->Contains(id)) return;
  std::optional<HostPool::Hit> hit = ram_->Peek(id);
  if (!hit) return;
  // Failures are counted by the staging tier (stage_failures, no_room). Pool bytes that
  // fail their check are corrupt: dropped, as a delivery from RAM that found them would.
  gpu_->Write(id, hit->meta, ChunkBytes::Of(hit->data),
              [this, id, chunk = std::shared_ptr<const void>(hit->data)](absl::Status s) {
                if (absl::IsDataLoss(s)) DropCorruptInRam(id, chunk);
              });
  // A Delete (or a Delete and a new put) between the Peek and the Stage would leave a
  // staged copy of bytes the store no longer has: Delete removes from staging before
  // RAM, so checking that RAM still holds the very chunk staged closes the gap.
  std::optional<HostPool::Hit> now = ram_->Peek(id);
  if (!now || now->data != hit->data) gpu_->Remove(id);
}

void TieredStore::ReadToDeviceAsync(const ChunkId& id, std::vector<DeviceRange> ranges,
                                    std::function<void(absl::StatusOr<Tier>)> done,
                                    bool check_crc, std::function<void(Tier)> enqueued,
                                    std::optional<ChunkMeta>* pin) {
  if (gpu_ == nullptr) {
    done(absl::FailedPreconditionError("this daemon has no GPU"));
    return;
  }
  // Whether `meta` is the pinned copy's (pinning it if none is yet).
  auto pinned = [pin](const ChunkMeta& meta) {
    if (pin == nullptr) return true;
    if (!pin->has_value()) *pin = meta;
    return **pin == meta;
  };
  auto from_host = [this, id, ranges, done, check_crc, enqueued,
                    pinned](absl::StatusOr<ChunkView> view) mutable {
    if (!view.ok()) {
      done(view.status());
      return;
    }
    if (!pinned(view->meta())) {
      done(absl::AbortedError(absl::StrCat(
          "chunk ", id.key.ToHex(), " was stored afresh, with other bytes, during the "
          "request that read part of it before")));
      return;
    }
    std::shared_ptr<const void> chunk = view->KeepAlive();
    std::vector<absl::string_view> pieces;
    view->ForEachPiece(0, view->meta().size,
                       [&](absl::string_view p) { pieces.push_back(p); });
    const Tier from = view->tier();
    gpu_->DeliverFromHost(view->meta(), std::move(pieces), view->KeepAlive(), std::move(ranges),
                          [this, id, done = std::move(done), from, chunk](absl::Status s) {
                            if (absl::IsDataLoss(s)) DropCorruptInRam(id, chunk);
                            if (absl::IsNotFound(s)) {
                              // The chunk was read: this is the device's (no device).
                              s = absl::UnavailableError(s.message());
                            }
                            if (!s.ok()) {
                              done(s);
                              return;
                            }
                            // A worker on this GPU asked for it: likely again soon.
                            StageAsync(id);
                            done(from);
                          },
                          check_crc,
                          enqueued ? std::function<void()>([enqueued, from] { enqueued(from); })
                                   : nullptr);
  };
  const std::optional<ChunkMeta> staged = StagedAndBacked(id);
  // A staged copy other than the pinned one: the host path finds whether RAM's is.
  if (!staged.has_value() || !pinned(*staged)) {
    ReadAsync(id, std::move(from_host));
    return;
  }
  // NotFound before anything was submitted means not staged (any more); after, it is
  // the device's error and must not send the item to the host path a second time.
  auto submitted = std::make_shared<std::atomic<bool>>(false);
  gpu_->DeliverFromStaging(
      id, ranges,
      [this, id, from_host = std::move(from_host), done, submitted](absl::Status s) mutable {
        if (s.ok()) {
          done(Tier::kGpu);
        } else if (absl::IsNotFound(s) && submitted->load(std::memory_order_acquire)) {
          done(absl::UnavailableError(s.message()));
        } else if (absl::IsNotFound(s) && stopping_.load(std::memory_order_acquire)) {
          done(absl::UnavailableError("kvtierd is shutting down"));
        } else if (absl::IsNotFound(s)) {
          // Evicted from staging since Contains: the host copy is still there.
          ReadAsync(id, std::move(from_host));
        } else {
          done(s);
        }
      },
      [enqueued, submitted] {
        submitted->store(true, std::memory_order_release);
        if (enqueued) enqueued(Tier::kGpu);
      });
}

absl::StatusOr<bool> TieredStore::Delete(const ChunkId& id) {
  // Fastest first: a copy tier's copy goes before the chunk it copies.
  bool present = false;
  // The local tiers under the chunk's KeyLocks stripe: a promotion that read it before
  // does not put it back. The shared tier's, over the network, after, while no
  // promotion of it may insert (one from the shared tier would read the copy about to
  // be deleted, and put the deleted chunk back in RAM once the Delete had returned).
  absl::Status local = absl::OkStatus();
  auto remove_local = [&] {
    for (StorageTier* tier : tiers_) {
      if (tier->role() == StorageTier::Role::kShared) continue;
      absl::StatusOr<bool> removed = tier->Delete(id);
      if (!removed.ok()) {
        local = removed.status();
        return;
      }
      if (*removed && tier == ram_.get()) NotifyRoom();
      if (tier->role() != StorageTier::Role::kCopy) {
        present = present || *removed;
      } else if (options_.after_copy_delete) {
        options_.after_copy_delete(id);
      }
    }
  };
  auto remove_shared = [&] {
    if (!local.ok() || shared_ == nullptr) return;
    if (options_.before_shared_delete) options_.before_shared_delete(id);
    for (StorageTier* tier : tiers_) {
      if (tier->role() != StorageTier::Role::kShared) continue;
      absl::StatusOr<bool> removed = tier->Delete(id);
      if (!removed.ok()) {
        // Or another daemon's read would bring it back. A cluster that cannot be reached
        // leaves the remote copy (it expires with its TTL); that is logged, not an
        // error.
        if (auto held = remote_delete_log_.Allow(absl::Now())) {
          LogWarning("tiered store: delete ", id.DebugString(), " from the ",
                     TierName(tier->tier()), " tier: ", removed.status().message(),
                     *held > 0 ? absl::StrCat(" (and ", *held, " more since the last line)")
                               : "");
        }
        continue;
      }
      present = present || *removed;
    }
  };
  // No write-back of the chunk lands on SSD after its SSD copy is deleted.
  const auto fenced_remove_local = [&] {
    ram_->Fence(id);
    remove_local();
    ram_->Unfence(id);
  };
  if (shared_ == nullptr) {
    key_locks_.Removing(id, fenced_remove_local);
  } else {
    key_locks_.Removing(id, fenced_remove_local, remove_shared);
  }
  if (!local.ok()) return local;
  if (present) Emit(ChunkEventKind::kDeleted, id, Tier::kNone);
  return present;
}

absl::StatusOr<uint64_t> TieredStore::Clear(uint64_t ns) {
  // The local tiers under every KeyLocks stripe: no promotion that read one of these
  // chunks puts it back. The shared tier's copies after, over the network, while no
  // promotion of the namespace may insert (one from the shared tier would read a copy
  // about to be deleted). Shared first, a put committing meanwhile queued its shared
  // write after the shared tier's clear had cancelled writes and passed its key, and
  // the chunk came back from there once Clear had returned.
  absl::StatusOr<uint64_t> local = uint64_t{0};
  uint64_t in_remote = 0;
  const auto remove_local = [&] { local = ClearLocal(ns); };
  if (shared_ == nullptr) {
    key_locks_.RemovingAll(remove_local);
  } else {
    key_locks_.RemovingAll(ns, remove_local, [&] {
      if (!local.ok()) return;
      auto removed = shared_->DeleteNamespace(ns);
      if (removed.ok()) {
        in_remote = *removed;
      } else {
        LogWarning("tiered store: clear namespace ", ns, " in the remote tier: ",
                   removed.status().message());
      }
    });
  }
  if (!local.ok()) return local.status();
  const uint64_t removed = std::max(*local, in_remote);
  // One event for the whole namespace: a zero key.
  if (removed > 0) Emit(ChunkEventKind::kDeleted, ChunkId{ns, ChunkKey{}}, Tier::kNone);
  return removed;
}

absl::StatusOr<uint64_t> TieredStore::ClearLocal(uint64_t ns) {
  // A chunk in RAM and on SSD counts once: RAM's, plus SSD's that RAM did not hold.
  uint64_t removed = 0;
  // No write-back of the namespace lands on SSD after its SSD copies are deleted.
  ram_->FenceNamespace(ns);
  absl::Cleanup unfence = [&] { ram_->UnfenceNamespace(ns); };
  std::vector<ChunkId> in_ram;
  for (StorageTier* tier : tiers_) {
    if (tier->role() == StorageTier::Role::kShared) continue;
    if (tier == ram_.get()) {
      removed += ram_->RemoveNamespace(ns, &in_ram);
      if (!in_ram.empty()) NotifyRoom();
      continue;
    }
    // Counted by id: a write-back flush may index a chunk on this tier while RAM's
    // copy is being removed, so a count of what it held before would be off by it.
    std::vector<ChunkId> gone;
    const bool local = tier->role() == StorageTier::Role::kLocal;
    absl::StatusOr<uint64_t> n = tier->DeleteNamespace(ns, local ? &gone : nullptr);
    if (!n.ok()) return n.status();
    if (local) {
      const absl::flat_hash_set<ChunkId> ram(in_ram.begin(), in_ram.end());
      for (const ChunkId& id : gone) removed += ram.contains(id) ? 0 : 1;
    }
  }
  return removed;
}

std::vector<TierStats> TieredStore::LocalTierStats() const {
  std::vector<TierStats> out;
  for (const StorageTier* tier : tiers_) {
    if (tier->role() == StorageTier::Role::kShared || tier->capacity_bytes() == 0) continue;
    out.push_back(tier->Stats());
  }
  return out;
}

TieredStoreStats TieredStore::GetStats() const {
  TieredStoreStats s;
  s.ram = ram_->GetStats();
  if (has_ssd()) s.ssd = ssd_->GetStats();
  s.namespaces = layouts_->size();
  s.promotions = promoter_ != nullptr ? promoter_->promotions() : 0;
  s.prefetched = prefetched();
  s.hint_clients = hints_->clients();
  s.hinted_chunks = hints_->snapshot()->by_rank.size();
  s.demotions = demotions_.load(std::memory_order_relaxed);
  s.demotion_failures = demotion_failures_.load(std::memory_order_relaxed);
  s.writeback_queue_depth = s.ram.dirty_chunks;
  s.writeback_dirty_bytes = s.ram.dirty_bytes;
  s.writeback_max_dirty_bytes =
      options_.write_mode == WriteMode::kWriteBack ? options_.max_dirty_bytes : 0;
  s.writeback_backlog_waits = backlog_waits_.load(std::memory_order_relaxed);
  s.ram_checksum_failures = ram_checksum_failures_.load(std::memory_order_relaxed);
  s.checksum_failures = s.ram_checksum_failures + s.ssd.checksum_failures;
  s.put_checksum_mismatches = put_checksum_failures_.load(std::memory_order_relaxed);
  s.ram_bytes_in = ram_bytes_in_.load(std::memory_order_relaxed);
  s.ram_bytes_out = ram_bytes_out_.load(std::memory_order_relaxed);
  s.ssd_bytes_in = ssd_bytes_in_.load(std::memory_order_relaxed);
  s.ssd_bytes_out = ssd_bytes_out_.load(std::memory_order_relaxed);
  if (gpu_ != nullptr) {
    s.gpu_present = true;
    s.gpu = gpu_->GetStats();
  }
  if (remote_ != nullptr) {
    s.remote_present = true;
    s.remote = remote_->GetStats();
  }
  s.remote_promotions = remote_promotions_.load(std::memory_order_relaxed);
  if (admission_ != nullptr) {
    s.puts_waiting = admission_->waiting();
    s.puts_queued = admission_->queued_total();
    s.put_wait_timeouts = admission_->timed_out_total();
  }
  return s;
}

absl::Status TieredStore::Close() {
  {
    absl::MutexLock lock(&close_mu_);
    if (closed_) return absl::OkStatus();
    closed_ = true;
  }
  if (prefetcher_ != nullptr) prefetcher_->Stop();
  if (flusher_ != nullptr) flusher_->Stop();
  if (!has_ssd()) return absl::OkStatus();
  const uint64_t flushed = FlushAll();
  const uint64_t left = ram_->dirty_count();
  if (flushed > 0 || left > 0) {
    LogInfo("tiered store: flushed ", flushed, " write-back chunks at close; ", left,
            " could not be written");
  }
  absl::Status s = backing_->Flush();
  if (left > 0 && s.ok()) {
    s = absl::UnavailableError(absl::StrCat(left, " dirty chunks could not be written to SSD"));
  }
  return s;
}

}  // namespace kvtier
