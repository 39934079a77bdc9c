#include "storage/remote_tier.h"

#include <hiredis/hiredis.h>

#include <algorithm>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "storage/crc32c.h"
#include "storage/log.h"

namespace kvtier {
namespace {

// Segments outlive their record by this much, so expiry never leaves a record whose
// segments are gone (eviction still can; that read is a miss).
constexpr absl::Duration kSegmentTtlMargin = absl::Minutes(1);

uint64_t NewGeneration() {
  thread_local absl::BitGen gen;
  return absl::Uniform<uint64_t>(gen) | 1;  // Never 0.
}

bool IsOk(const redisReply& r) {
  return r.type == REDIS_REPLY_STATUS && ReplyString(r) == "OK";
}

// A GET answered with neither bytes nor nil: an error reply ("-ERR max number of clients
// reached", an ACL refusal, ...), which says nothing about the key's bytes. The read
// failed, as on a timeout; nothing is known to be corrupt.
absl::Status FailedRead(const redisReply& r) {
  return absl::UnavailableError(
      absl::StrCat("remote tier: a node answered a read with \"", ReplyString(r), "\""));
}

// Deletes KEYS[1] only if it still holds ARGV[1]; returns 1 if it did. A record read
// (or written) earlier may have been replaced since by another writer's, which must
// stay. Redis runs a script atomically, and routes it by its one key.
constexpr absl::string_view kDeleteIfUnchanged =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
    "return 0";

// Bytes [offset, offset + len) of a chunk given as consecutive pieces: a view when they
// sit in one piece, else a copy in `scratch`.
absl::string_view Gather(absl::Span<const absl::string_view> pieces, uint64_t offset,
                         uint64_t len, std::string* scratch) {
  uint64_t at = 0;
  size_t i = 0;
  while (i < pieces.size() && at + pieces[i].size() <= offset) at += pieces[i++].size();
  if (i < pieces.size() && offset - at + len <= pieces[i].size()) {
    return pieces[i].substr(offset - at, len);
  }
  scratch->clear();
  scratch->reserve(len);
  uint64_t skip = offset - at;
  for (; i < pieces.size() && scratch->size() < len; ++i) {
    absl::string_view p = pieces[i].substr(skip);
    skip = 0;
    const size_t take = std::min<uint64_t>(p.size(), len - scratch->size());
    scratch->append(p.data(), take);
  }
  return *scratch;
}

// `verb key` for each of `keys` (GET, EXISTS, DEL), routed by the key. The commands view
// `keys`, which must outlive them.
std::vector<RedisCommand> OnePerKey(absl::string_view verb, const std::vector<std::string>& keys) {
  std::vector<RedisCommand> commands;
  commands.reserve(keys.size());
  for (const std::string& k : keys) commands.push_back({{verb, k}, k});
  return commands;
}

// The commit-record key of each of `ids`.
std::vector<std::string> RecordKeys(absl::string_view prefix, absl::Span<const ChunkId> ids) {
  std::vector<std::string> keys;
  keys.reserve(ids.size());
  for (const ChunkId& id : ids) keys.push_back(RemoteRecordKey(prefix, id));
  return keys;
}

}  // namespace

absl::Status RemoteTierOptions::Validate() const {
  if (!enabled()) return absl::OkStatus();
  if (absl::Status s = cluster.Validate(); !s.ok()) return s;
  if (key_prefix.empty() ||
      key_prefix.find_first_of("*?[]\\:{} \t\r\n") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote key prefix \"", key_prefix,
        "\": must be non-empty, without glob characters, ':', braces or spaces"));
  }
  if (segment_bytes < 4096 || segment_bytes > (512u << 20)) {
    return absl::InvalidArgumentError("remote segment bytes must be in [4KiB, 512MiB]");
  }
  if (ttl < absl::Seconds(1)) return absl::InvalidArgumentError("remote ttl must be >= 1s");
  if (batch_bytes < segment_bytes) {
    return absl::InvalidArgumentError("remote batch bytes must be >= segment bytes");
  }
  if (write_threads < 1) return absl::InvalidArgumentError("remote write threads must be >= 1");
  if (min_backoff <= absl::ZeroDuration() || max_backoff < min_backoff) {
    return absl::InvalidArgumentError("remote backoff: need 0 < min <= max");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RemoteTier>> RemoteTier::Open(RemoteTierOptions options) {
  if (!options.enabled()) return absl::InvalidArgumentError("remote tier: no seed nodes");
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  auto cluster = RedisCluster::Create(options.cluster);
  if (!cluster.ok()) return cluster.status();
  return std::unique_ptr<RemoteTier>(new RemoteTier(std::move(options), *std::move(cluster)));
}

RemoteTier::RemoteTier(RemoteTierOptions options, std::unique_ptr<RedisCluster> cluster)
    : options_(std::move(options)),
      cluster_(std::move(cluster)),
      health_(options_.min_backoff, options_.max_backoff, options_.cluster.now) {
  if (cluster_->stats().slots_covered == 0) {
    health_.Failed(absl::UnavailableError("no node of the cluster answered at start-up"));
  }
  for (int i = 0; i < options_.write_threads; ++i) writers_.emplace_back([this] { WriterLoop(); });
}

RemoteTier::~RemoteTier() {
  std::deque<Job> dropped;
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
    dropped.swap(queue_);
    for (const Job& j : dropped) pending_bytes_ -= j.meta.size;
  }
  writes_dropped_.fetch_add(dropped.size(), std::memory_order_relaxed);
  for (Job& j : dropped) {
    if (j.done) j.done(absl::UnavailableError("remote tier closing: write dropped"));
  }
  for (std::thread& t : writers_) t.join();
}

bool RemoteTier::WriteAsync(const ChunkId& id, const ChunkMeta& meta, uint64_t layout_fingerprint,
                            std::vector<absl::string_view> pieces,
                            std::shared_ptr<const void> keep_alive, WriteDone done) {
  auto refuse = [&](absl::string_view why) {
    writes_dropped_.fetch_add(1, std::memory_order_relaxed);
    if (done) done(absl::UnavailableError(absl::StrCat("remote write not queued: ", why)));
    return false;
  };
  // Not queued: it would wait on a cluster that is not there, holding pool bytes.
  if (!health_.ProbeDue()) return refuse("the cluster is unreachable");
  {
    absl::MutexLock l(&mu_);
    // One chunk larger than the bound goes when nothing else is pending (it would
    // otherwise never be shared): the bound is then one chunk.
    if (!stopping_ &&
        (pending_bytes_ == 0 || pending_bytes_ + meta.size <= options_.max_pending_bytes)) {
      pending_bytes_ += meta.size;
      queue_.push_back(Job{id, meta, layout_fingerprint, std::move(pieces),
                           std::move(keep_alive), std::move(done)});
      return true;
    }
  }
  return refuse("the queue is full or closing");
}

void RemoteTier::WriterLoop() {
  for (;;) {
    Job job;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](RemoteTier* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) {
            return t->stopping_ || !t->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // Stopping.
      job = std::move(queue_.front());
      queue_.pop_front();
      running_.emplace(&job, false);
    }
    absl::Status written = Write(job);
    const uint64_t size = job.meta.size;
    job.keep_alive.reset();  // The pool bytes go back before the job counts as done.
    if (job.done) job.done(std::move(written));
    absl::MutexLock l(&mu_);
    running_.erase(&job);
    pending_bytes_ -= size;
  }
}

void RemoteTier::CancelWrites(absl::FunctionRef<bool(const ChunkId&)> match) {
  std::vector<Job> dropped;
  {
    absl::MutexLock l(&mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (!match(it->id)) {
        ++it;
        continue;
      }
      pending_bytes_ -= it->meta.size;
      dropped.push_back(std::move(*it));
      it = queue_.erase(it);
    }
    for (auto& [job, cancelled] : running_) {
      if (match(job->id)) cancelled = true;
    }
  }
  writes_cancelled_.fetch_add(dropped.size(), std::memory_order_relaxed);
  for (Job& j : dropped) {
    j.keep_alive.reset();
    if (j.done) j.done(absl::AbortedError("remote write cancelled: the chunk was deleted"));
  }
  // The marked writes end soon: each checks the mark between its batches and after its
  // commit. (A write started since is not marked, and not waited for.)
  struct Marked {
    RemoteTier* tier;
    absl::FunctionRef<bool(const ChunkId&)> match;
    bool Any() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(tier->mu_) {
      return std::any_of(tier->running_.begin(), tier->running_.end(),
                         [this](const auto& r) { return r.second && match(r.first->id); });
    }
  } marked{this, match};
  if (options_.cancel_waits) {
    std::vector<ChunkId> waited;
    {
      absl::MutexLock l(&mu_);
      for (const auto& [job, cancelled] : running_) {
        if (cancelled && match(job->id)) waited.push_back(job->id);
      }
    }
    for (const ChunkId& id : waited) options_.cancel_waits(id);
  }
  // Bounded: a write stuck on a cluster that stopped answering (each of its steps has
  // its I/O timeout, and a batch may take several) does not hold a Delete for longer
  // than a step or two. Past it, the write removes its own record once it sees the mark.
  absl::MutexLock l(&mu_);
  mu_.AwaitWithTimeout(
      absl::Condition(
          +[](Marked* m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(m->tier->mu_) { return !m->Any(); },
          &marked),
      2 * options_.cluster.io_timeout);
}

bool RemoteTier::Cancelled(const Job& job) const {
  absl::MutexLock l(&mu_);
  auto it = running_.find(&job);
  return it != running_.end() && it->second;
}

void RemoteTier::Observe(const absl::Status& s) const {
  if (absl::IsUnavailable(s)) health_.Failed(s);
}

bool RemoteTier::Admit() const {
  return health_.Allow([this] { return cluster_->PingMasters(); });
}

absl::Status RemoteTier::Write(const Job& job) {
  auto cancelled = [&] {
    writes_cancelled_.fetch_add(1, std::memory_order_relaxed);
    return absl::AbortedError("remote write cancelled: the chunk was deleted");
  };
  if (Cancelled(job)) return cancelled();
  if (!Admit()) {
    writes_dropped_.fetch_add(1, std::memory_order_relaxed);
    return absl::UnavailableError("remote tier degraded: write dropped");
  }
  const std::string record_key = RemoteRecordKey(options_.key_prefix, job.id);
  {
    // Another daemon may have stored this chunk already (the same prefix put on two
    // hosts): then its bytes need not travel again.
    auto exists = cluster_->ExecuteOne({{"EXISTS", record_key}, record_key});
    if (!exists.ok()) {
      Observe(exists.status());
      write_failures_.fetch_add(1, std::memory_order_relaxed);
      return exists.status();
    }
    if ((*exists)->type == REDIS_REPLY_INTEGER && (*exists)->integer == 1) {
      writes_present_.fetch_add(1, std::memory_order_relaxed);
      return absl::OkStatus();
    }
  }
  RemoteRecord record;
  record.meta = job.meta;
  record.layout_fingerprint = job.layout_fingerprint;
  record.generation = NewGeneration();
  record.segment_bytes = options_.segment_bytes;
  // A chunk is held in memory (at most max_chunk_bytes): far fewer than 2^32 segments.
  const uint32_t n =
      static_cast<uint32_t>(RemoteSegmentCount(job.meta.size, options_.segment_bytes));
  record.segment_crc32c.resize(n);
  const std::string segment_ttl =
      std::to_string(absl::ToInt64Milliseconds(options_.ttl + kSegmentTtlMargin));
  const std::string record_ttl = std::to_string(absl::ToInt64Milliseconds(options_.ttl));

  auto failed = [&](uint32_t sent, absl::Status why, bool full) {
    if (full) {
      writes_full_.fetch_add(1, std::memory_order_relaxed);
    } else {
      write_failures_.fetch_add(1, std::memory_order_relaxed);
      Observe(why);
    }
    if (!health_.degraded()) DeleteSegments(job.id, record.generation, sent);
    return full ? absl::ResourceExhaustedError(why.message()) : why;
  };
  // Segments, a batch at a time: each batch one pipeline per master.
  for (uint32_t first = 0; first < n;) {
    if (first > 0 && Cancelled(job)) {  // Deleted meanwhile: the rest need not travel.
      if (!health_.degraded()) DeleteSegments(job.id, record.generation, first);
      return cancelled();
    }
    std::vector<std::string> keys;
    std::vector<std::string> scratch;
    std::vector<absl::string_view> values;
    uint64_t batch = 0;
    uint32_t end = first;
    while (end < n && (end == first || batch + record.SegmentSize(end) <= options_.batch_bytes)) {
      batch += record.SegmentSize(end);
      ++end;
    }
    keys.reserve(end - first);
    scratch.resize(end - first);
    for (uint32_t i = first; i < end; ++i) {
      keys.push_back(RemoteSegmentKey(options_.key_prefix, job.id, record.generation, i));
      absl::string_view bytes =
          Gather(job.pieces, static_cast<uint64_t>(i) * options_.segment_bytes,
                 record.SegmentSize(i), &scratch[i - first]);
      record.segment_crc32c[i] = crc32c::Value(bytes);
      values.push_back(bytes);
    }
    std::vector<RedisCommand> commands;
    commands.reserve(keys.size());
    for (size_t k = 0; k < keys.size(); ++k) {
      commands.push_back({{"SET", keys[k], values[k], "PX", segment_ttl}, keys[k]});
    }
    auto replies = cluster_->Execute(commands);
    for (auto& r : replies) {
      if (!r.ok()) return failed(end, r.status(), false);
      if (!IsOk(**r)) {
        const absl::string_view error = ReplyString(**r);
        return failed(end, absl::InternalError(error), absl::StartsWith(error, "OOM"));
      }
    }
    if (options_.after_segment_batch) options_.after_segment_batch(job.id);
    first = end;
  }
  if (Cancelled(job)) {
    DeleteSegments(job.id, record.generation, n);
    return cancelled();
  }
  // The commit record, last: only now can a reader see the chunk. NX: a writer that
  // committed first wins, and this write's segments go.
  const std::string encoded = EncodeRemoteRecord(record);
  if (options_.before_commit) options_.before_commit(job.id);
  auto commit = cluster_->ExecuteOne(
      {{"SET", record_key, encoded, "PX", record_ttl, "NX"}, record_key});
  if (!commit.ok()) return failed(n, commit.status(), false);
  if (IsNilReply(**commit)) {
    writes_present_.fetch_add(1, std::memory_order_relaxed);
    DeleteSegments(job.id, record.generation, n);
    return absl::OkStatus();
  }
  if (!IsOk(**commit)) {
    const absl::string_view error = ReplyString(**commit);
    return failed(n, absl::InternalError(error), absl::StartsWith(error, "OOM"));
  }
  if (options_.after_commit) options_.after_commit(job.id);
  // A Delete or Clear that ran while the commit was on its way may have looked for the
  // record before it landed, and found none. Each marks this write cancelled before it
  // looks (CancelWrites), so either this check sees the mark and the record goes again
  // (unless a newer one replaced it), or the mark came after the commit landed and the
  // Delete's own look finds the record and deletes it.
  if (Cancelled(job)) {
    const RecordToRemove mine[] = {{job.id, encoded, record.generation, n}};
    RemoveRecords(mine);
    return cancelled();
  }
  writes_.fetch_add(1, std::memory_order_relaxed);
  bytes_written_.fetch_add(job.meta.size, std::memory_order_relaxed);
  return absl::OkStatus();
}

void RemoteTier::DeleteSegments(const ChunkId& id, uint64_t generation, uint32_t n) {
  std::vector<std::string> keys;
  keys.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    keys.push_back(RemoteSegmentKey(options_.key_prefix, id, generation, i));
  }
  const std::vector<RedisCommand> commands = OnePerKey("DEL", keys);
  // Best effort: what is left expires with its TTL.
  (void)cluster_->Execute(commands);
}

namespace {

// Whether an error reply says the cluster will never run EVAL for this user: an ACL
// refusal (NOPERM), or the command disabled or renamed away (managed services).
bool RefusesEval(const redisReply& reply) {
  const absl::string_view error(reply.str, reply.len);
  return absl::StartsWith(error, "NOPERM") || absl::StartsWith(error, "ERR unknown command");
}

}  // namespace

uint64_t RemoteTier::RemoveRecords(absl::Span<const RecordToRemove> records) {
  if (records.empty()) return 0;
  std::vector<std::string> keys;
  keys.reserve(records.size());
  for (const RecordToRemove& r : records) keys.push_back(RemoteRecordKey(options_.key_prefix, r.id));
  std::vector<RedisCommand> commands;
  commands.reserve(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    commands.push_back({{"EVAL", kDeleteIfUnchanged, "1", keys[i], records[i].expected}, keys[i]});
  }
  auto replies = cluster_->Execute(commands);
  // A cluster whose ACL refuses EVAL (managed services often do) answers each with an
  // error: those records go by a plain DEL instead. It may remove a record another
  // writer committed in between, which costs that chunk's hits until it is put again,
  // never a wrong byte (every read is checked).
  std::vector<size_t> plain;
  uint64_t removed = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    // Best effort: a record left behind expires with its TTL, and the next reader that
    // meets it tries again.
    if (!replies[i].ok()) {
      Observe(replies[i].status());
      continue;
    }
    if ((*replies[i])->type == REDIS_REPLY_ERROR) {
      // Only a refusal of EVAL itself; a transient error (BUSY, LOADING, TRYAGAIN,
      // CLUSTERDOWN, OOM) deletes nothing: the record expires, or a later reader retries.
      if (RefusesEval(**replies[i])) plain.push_back(i);
      continue;
    }
    if ((*replies[i])->type != REDIS_REPLY_INTEGER || (*replies[i])->integer != 1) continue;
    ++removed;
    DeleteSegments(records[i].id, records[i].generation, records[i].segments);
  }
  if (plain.empty()) return removed;
  if (eval_refusals_.fetch_add(plain.size(), std::memory_order_relaxed) == 0) {
    LogWarning("remote tier: the cluster refused EVAL (",
               absl::string_view((*replies[plain[0]])->str, (*replies[plain[0]])->len),
               "); removing records with DEL instead (grant +eval to the tier's user)");
  }
  std::vector<RedisCommand> dels;
  dels.reserve(plain.size());
  for (size_t i : plain) dels.push_back({{"DEL", keys[i]}, keys[i]});
  auto del_replies = cluster_->Execute(dels);
  for (size_t j = 0; j < plain.size(); ++j) {
    if (!del_replies[j].ok()) {
      Observe(del_replies[j].status());
      continue;
    }
    if ((*del_replies[j])->type != REDIS_REPLY_INTEGER || (*del_replies[j])->integer != 1) {
      continue;
    }
    ++removed;
    DeleteSegments(records[plain[j]].id, records[plain[j]].generation,
                   records[plain[j]].segments);
  }
  return removed;
}

absl::StatusOr<RemoteRecord> RemoteTier::ReadRecord(const ChunkId& id,
                                                    const RemoteLayout& layout) {
  return std::move(ReadRecords({&id, 1}, layout)[0]);
}

std::vector<absl::StatusOr<RemoteRecord>> RemoteTier::ReadRecords(
    absl::Span<const ChunkId> ids, const RemoteLayout& layout) {
  std::vector<absl::StatusOr<RemoteRecord>> out;
  out.reserve(ids.size());
  if (!Admit()) {
    misses_.fetch_add(ids.size(), std::memory_order_relaxed);
    out.assign(ids.size(), absl::NotFoundError("remote tier degraded"));
    return out;
  }
  const std::vector<std::string> keys = RecordKeys(options_.key_prefix, ids);
  const std::vector<RedisCommand> commands = OnePerKey("GET", keys);
  auto replies = cluster_->Execute(commands);
  for (size_t i = 0; i < ids.size(); ++i) {
    auto& reply = replies[i];
    if (!reply.ok()) {
      Observe(reply.status());
      read_failures_.fetch_add(1, std::memory_order_relaxed);
      out.push_back(reply.status());
      continue;
    }
    const redisReply& r = **reply;
    if (IsNilReply(r)) {
      misses_.fetch_add(1, std::memory_order_relaxed);
      out.push_back(absl::NotFoundError("not in the remote tier"));
      continue;
    }
    if (r.type != REDIS_REPLY_STRING) {
      absl::Status failed = FailedRead(r);
      Observe(failed);
      read_failures_.fetch_add(1, std::memory_order_relaxed);
      out.push_back(std::move(failed));
      continue;
    }
    absl::StatusOr<RemoteRecord> record = DecodeRemoteRecord(ReplyString(r));
    if (absl::IsUnimplemented(record.status())) {
      // Another release's (a rolling upgrade): foreign, not corrupt; it stays for them.
      foreign_.fetch_add(1, std::memory_order_relaxed);
      out.push_back(absl::NotFoundError(record.status().message()));
      continue;
    }
    if (record.ok() && record->layout_fingerprint == layout.fingerprint &&
        layout.chunk_bytes != 0 && record->meta.size != layout.chunk_bytes) {
      // Its CRC holds, so a writer made it so: its size must not reach an allocation.
      record = absl::DataLossError(absl::StrCat(
          "remote commit record: a ", record->meta.size, "-byte chunk of a layout whose "
          "chunks are ", layout.chunk_bytes, " bytes"));
    }
    if (!record.ok()) {
      checksum_failures_.fetch_add(1, std::memory_order_relaxed);
      LogWarning("remote tier: chunk ", ids[i].DebugString(), ": ", record.status().message(),
                 "; record deleted");
      // Its generation is not to be trusted: its segments are left to their TTL.
      const RecordToRemove bad[] = {{ids[i], std::string(ReplyString(r)), 0, 0}};
      RemoveRecords(bad);
      out.push_back(absl::NotFoundError(record.status().message()));
      continue;
    }
    if (record->layout_fingerprint != layout.fingerprint) {
      foreign_.fetch_add(1, std::memory_order_relaxed);
      out.push_back(absl::NotFoundError("remote chunk was stored under another layout"));
      continue;
    }
    out.push_back(*std::move(record));
  }
  // Nodes answering clear nothing (only a probe does, Admit): with one master down the
  // others answer every batch.
  return out;
}

absl::Status RemoteTier::ReadPayload(const ChunkId& id, const RemoteRecord& record,
                                     ChunkSink& sink) {
  const RemoteRecord* records[] = {&record};
  ChunkSink* sinks[] = {&sink};
  return std::move(ReadPayloads({&id, 1}, records, sinks)[0]);
}

std::vector<absl::Status> RemoteTier::ReadPayloads(absl::Span<const ChunkId> ids,
                                                   absl::Span<const RemoteRecord* const> records,
                                                   absl::Span<ChunkSink* const> sinks) {
  std::vector<absl::Status> out(ids.size());
  // Records to remove once every batch is in: those whose bytes came back and failed
  // their check, and those found torn. Each is compared with the record as read.
  std::vector<RecordToRemove> corrupt_records, torn_records;
  auto to_remove = [&](size_t c) {
    return RecordToRemove{ids[c], EncodeRemoteRecord(*records[c]), records[c]->generation,
                          records[c]->segments()};
  };
  auto corrupt = [&](size_t c, absl::string_view why) {
    checksum_failures_.fetch_add(1, std::memory_order_relaxed);
    LogWarning("remote tier: chunk ", ids[c].DebugString(), ": ", why, "; record deleted");
    corrupt_records.push_back(to_remove(c));
    out[c] = absl::DataLossError(absl::StrCat("remote chunk ", ids[c].key.ToHex(), ": ", why));
  };
  // Every (chunk, segment) in order; a batch takes up to batch_bytes of them, from one
  // chunk or several, so small chunks share a round trip and a large one is split.
  struct Part {
    size_t chunk;
    uint32_t segment;
  };
  std::vector<Part> parts;
  for (size_t c = 0; c < ids.size(); ++c) {
    for (uint32_t i = 0; i < records[c]->segments(); ++i) parts.push_back({c, i});
  }
  std::vector<uint32_t> landed(ids.size(), 0);
  bool unreachable = false;
  for (size_t first = 0; first < parts.size();) {
    if (unreachable) {
      // A node did not answer (after remote_timeout): every chunk has segments on every
      // master, so the rest would wait as long again, batch after batch.
      for (size_t c = 0; c < ids.size(); ++c) {
        if (out[c].ok() && landed[c] != records[c]->segments()) {
          read_failures_.fetch_add(1, std::memory_order_relaxed);
          out[c] = absl::UnavailableError("remote tier unreachable: read abandoned");
        }
      }
      break;
    }
    uint64_t batch = 0;
    size_t end = first;
    std::vector<std::string> keys;
    std::vector<size_t> which;  // Index into parts of each command.
    while (end < parts.size()) {
      const Part& p = parts[end];
      const uint64_t bytes = records[p.chunk]->SegmentSize(p.segment);
      if (end > first && batch + bytes > options_.batch_bytes) break;
      ++end;
      if (!out[p.chunk].ok()) continue;  // That chunk already failed.
      batch += bytes;
      keys.push_back(RemoteSegmentKey(options_.key_prefix, ids[p.chunk],
                                      records[p.chunk]->generation, p.segment));
      which.push_back(end - 1);
    }
    const std::vector<RedisCommand> commands = OnePerKey("GET", keys);
    auto replies = cluster_->Execute(commands);
    for (size_t k = 0; k < replies.size(); ++k) {
      const Part& p = parts[which[k]];
      const RemoteRecord& record = *records[p.chunk];
      if (!out[p.chunk].ok()) continue;
      auto& reply = replies[k];
      if (!reply.ok()) {
        Observe(reply.status());
        unreachable = true;
        read_failures_.fetch_add(1, std::memory_order_relaxed);
        out[p.chunk] = reply.status();
        continue;
      }
      if (IsNilReply(**reply)) {
        torn_.fetch_add(1, std::memory_order_relaxed);
        torn_records.push_back(to_remove(p.chunk));
        out[p.chunk] = absl::NotFoundError(
            absl::StrCat("remote chunk ", ids[p.chunk].key.ToHex(), ": segment ", p.segment,
                         " of ", record.segments(), " is gone (evicted or expired)"));
        continue;
      }
      if ((*reply)->type != REDIS_REPLY_STRING) {
        absl::Status failed = FailedRead(**reply);
        Observe(failed);
        unreachable = true;
        read_failures_.fetch_add(1, std::memory_order_relaxed);
        out[p.chunk] = std::move(failed);
        continue;
      }
      const absl::string_view bytes = ReplyString(**reply);
      if (bytes.size() != record.SegmentSize(p.segment)) {
        corrupt(p.chunk, absl::StrCat("segment ", p.segment, " has the wrong size"));
        continue;
      }
      if (crc32c::Value(bytes) != record.segment_crc32c[p.segment]) {
        corrupt(p.chunk, absl::StrCat("segment ", p.segment, " fails its CRC32C"));
        continue;
      }
      sinks[p.chunk]->Write(static_cast<uint64_t>(p.segment) * record.segment_bytes, bytes);
      ++landed[p.chunk];
    }
    first = end;
  }
  for (size_t c = 0; c < ids.size(); ++c) {
    if (!out[c].ok()) continue;
    if (landed[c] != records[c]->segments()) {  // Cannot happen: every segment answered.
      out[c] = absl::InternalError("remote read: segments unaccounted for");
      continue;
    }
    if (sinks[c]->Crc32c() != records[c]->meta.crc32c) {
      corrupt(c, "the chunk fails its CRC32C");
      continue;
    }
    hits_.fetch_add(1, std::memory_order_relaxed);
    bytes_read_.fetch_add(records[c]->meta.size, std::memory_order_relaxed);
  }
  RemoveRecords(corrupt_records);
  // A torn record would be read, and missed, by every daemon until it expired, and
  // writers would skip its chunk as present meanwhile. Not while a node fails to
  // answer: the record may live there (each removal would wait on it again), and a
  // later read retries.
  if (!unreachable) {
    torn_removed_.fetch_add(RemoveRecords(torn_records), std::memory_order_relaxed);
  }
  return out;
}

std::vector<bool> RemoteTier::ContainsMany(absl::Span<const ChunkId> ids) const {
  // A round trip; what it touches (the cluster's connections, health) is synchronised
  // inside, as for every other read of this tier.
  std::vector<bool> out(ids.size(), false);
  if (ids.empty() || !Admit()) return out;
  const std::vector<std::string> keys = RecordKeys(options_.key_prefix, ids);
  const std::vector<RedisCommand> commands = OnePerKey("EXISTS", keys);
  auto replies = cluster_->Execute(commands);
  for (size_t i = 0; i < replies.size(); ++i) {
    if (!replies[i].ok()) {
      Observe(replies[i].status());
      continue;
    }
    if (IsErrorReply(**replies[i])) {  // Not known either way: as on a timeout.
      Observe(FailedRead(**replies[i]));
      continue;
    }
    out[i] = (*replies[i])->type == REDIS_REPLY_INTEGER && (*replies[i])->integer == 1;
  }
  return out;
}

absl::StatusOr<bool> RemoteTier::Delete(const ChunkId& id) {
  // First, even while degraded: a write queued before this Delete must not bring the
  // chunk back.
  CancelWrites([&id](const ChunkId& j) { return j == id; });
  // Degraded: not even as a probe (a delete that got through would not clear the state,
  // so deletes would use up the probes that reads and writes recover with).
  if (health_.degraded()) {
    return absl::UnavailableError("remote tier degraded: the remote copy is left to expire");
  }
  const std::string key = RemoteRecordKey(options_.key_prefix, id);
  auto reply = cluster_->ExecuteOne({{"GET", key}, key});
  if (!reply.ok()) {
    Observe(reply.status());
    return reply.status();
  }
  if (IsNilReply(**reply)) return false;
  if (IsErrorReply(**reply)) {
    absl::Status failed = FailedRead(**reply);
    Observe(failed);
    return failed;
  }
  auto record = DecodeRemoteRecord(ReplyString(**reply));
  auto del = cluster_->ExecuteOne({{"DEL", key}, key});
  if (!del.ok()) {
    Observe(del.status());
    return del.status();
  }
  if (IsErrorReply(**del)) {
    absl::Status failed = absl::UnavailableError(
        absl::StrCat("remote tier: DEL ", key, ": ", ReplyString(**del)));
    Observe(failed);
    return failed;
  }
  if (record.ok()) DeleteSegments(id, record->generation, record->segments());
  return true;
}

absl::StatusOr<uint64_t> RemoteTier::Clear(uint64_t ns) {
  // First: a write queued before this Clear must not bring a chunk back.
  CancelWrites([ns](const ChunkId& j) { return j.ns == ns; });
  if (options_.after_clear_cancel) options_.after_clear_cancel(ns);
  const std::string pattern = RemoteNamespacePattern(options_.key_prefix, ns);
  // A record's key has no ':' after the namespace's; a segment's has two.
  const size_t record_colons = 2;
  uint64_t records = 0;
  // Every master of a map read now: one that joined or took slots since the cached map
  // was read holds keys too.
  auto masters = cluster_->Masters();
  if (!masters.ok()) {
    Observe(masters.status());
    return masters.status();
  }
  auto fail = [&](absl::Status s) {
    Observe(s);
    return absl::Status(s.code(), absl::StrCat(s.message(), " (", records,
                                               " records of the namespace deleted before)"));
  };
  for (const RedisEndpoint& master : *masters) {
    std::string cursor = "0";
    do {
      auto reply = cluster_->CallOn(master, {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
      if (!reply.ok()) return fail(reply.status());
      const redisReply& r = **reply;
      if (r.type != REDIS_REPLY_ARRAY || r.elements != 2 ||
          r.element[1]->type != REDIS_REPLY_ARRAY) {
        return fail(absl::UnavailableError(
            absl::StrCat("redis ", master.ToString(), ": SCAN: ", ReplyString(r))));
      }
      cursor = std::string(ReplyString(*r.element[0]));
      const redisReply& keys = *r.element[1];
      // Routed by key, not sent to the node SCAN asked: its slot may be migrating (this
      // node, importing it, answers MOVED to a DEL without ASKING) or have moved since.
      std::vector<RedisCommand> dels;
      dels.reserve(keys.elements);
      for (size_t i = 0; i < keys.elements; ++i) {
        const absl::string_view k = ReplyString(*keys.element[i]);
        dels.push_back({{"DEL", k}, k});
      }
      auto deleted = cluster_->Execute(dels);
      for (size_t i = 0; i < deleted.size(); ++i) {
        if (!deleted[i].ok()) return fail(deleted[i].status());
        const redisReply& d = **deleted[i];
        if (d.type != REDIS_REPLY_INTEGER) {
          return fail(absl::UnavailableError(
              absl::StrCat("redis: DEL ", dels[i].key, ": ", ReplyString(d))));
        }
        const absl::string_view k = dels[i].key;
        // 0: gone meanwhile (expired, or another daemon's Clear): not this one's to count.
        if (d.integer == 1 &&
            static_cast<size_t>(std::count(k.begin(), k.end(), ':')) == record_colons) {
          ++records;
        }
      }
    } while (cursor != "0");
  }
  return records;
}

void RemoteTier::WaitIdle() {
  absl::MutexLock l(&mu_);
  mu_.Await(absl::Condition(
      +[](RemoteTier* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) {
        return t->queue_.empty() && t->running_.empty();
      },
      this));
}

RemoteTierStats RemoteTier::GetStats() const {
  RemoteTierStats s;
  s.degraded = health_.degraded();
  s.degradations = health_.degradations();
  s.hits = hits_.load(std::memory_order_relaxed);
  s.misses = misses_.load(std::memory_order_relaxed);
  s.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  s.bytes_written = bytes_written_.load(std::memory_order_relaxed);
  s.writes = writes_.load(std::memory_order_relaxed);
  s.writes_present = writes_present_.load(std::memory_order_relaxed);
  s.writes_dropped = writes_dropped_.load(std::memory_order_relaxed);
  s.write_failures = write_failures_.load(std::memory_order_relaxed);
  s.writes_full = writes_full_.load(std::memory_order_relaxed);
  s.writes_cancelled = writes_cancelled_.load(std::memory_order_relaxed);
  s.read_failures = read_failures_.load(std::memory_order_relaxed);
  s.checksum_failures = checksum_failures_.load(std::memory_order_relaxed);
  s.torn = torn_.load(std::memory_order_relaxed);
  s.torn_removed = torn_removed_.load(std::memory_order_relaxed);
  s.foreign = foreign_.load(std::memory_order_relaxed);
  s.eval_refusals = eval_refusals_.load(std::memory_order_relaxed);
  {
    absl::MutexLock l(&mu_);
    s.pending_bytes = pending_bytes_;
  }
  s.cluster = cluster_->stats();
  return s;
}

bool RemoteTier::Contains(const ChunkId& id) const { return ContainsMany({&id, 1})[0]; }

absl::StatusOr<RemoteLayout> RemoteTier::LayoutOf(uint64_t ns) const {
  if (!options_.layout_of) {
    return absl::FailedPreconditionError("remote tier: no layouts given");
  }
  return options_.layout_of(ns);
}

void RemoteTier::Write(const ChunkId& id, const ChunkMeta& meta, ChunkBytes bytes,
                       WriteDone done) {
  absl::StatusOr<RemoteLayout> layout = LayoutOf(id.ns);
  if (!layout.ok()) return done(layout.status());
  if (absl::Status s = CheckChunkBytes(Tier::kRemote, id, meta, bytes); !s.ok()) {
    return done(s);
  }
  WriteAsync(id, meta, layout->fingerprint, std::move(bytes.pieces), std::move(bytes.keep_alive),
             std::move(done));
}

void RemoteTier::Read(const ChunkId& id, SinkFor sink_for, ReadDone done) {
  absl::StatusOr<RemoteLayout> layout = LayoutOf(id.ns);
  if (!layout.ok()) return done(layout.status());
  absl::StatusOr<RemoteRecord> record = ReadRecord(id, *layout);
  if (!record.ok()) return done(record.status());
  ChunkSink* sink = sink_for(record->meta);
  if (sink == nullptr) {
    return done(NoSinkError());
  }
  if (absl::Status s = ReadPayload(id, *record, *sink); !s.ok()) return done(s);
  done(record->meta);
}

void RemoteTier::ReadMany(absl::Span<const ChunkId> ids, SinkForEach sink_for,
                          ReadEachDone done) {
  // The chunks of each namespace together (a Get's all share one), in the order given.
  std::vector<uint64_t> namespaces;
  for (const ChunkId& id : ids) {
    if (std::find(namespaces.begin(), namespaces.end(), id.ns) == namespaces.end()) {
      namespaces.push_back(id.ns);
    }
  }
  for (uint64_t ns : namespaces) {
    std::vector<size_t> at;  // Indexes into `ids` of this namespace's chunks.
    std::vector<ChunkId> of_ns;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i].ns == ns) at.push_back(i), of_ns.push_back(ids[i]);
    }
    absl::StatusOr<RemoteLayout> layout = LayoutOf(ns);
    if (!layout.ok()) {
      for (size_t i : at) done(i, layout.status());
      continue;
    }
    std::vector<absl::StatusOr<RemoteRecord>> records = ReadRecords(of_ns, *layout);
    // In groups of about one pipeline's bytes: the first chunks need not wait for the
    // last.
    size_t next = 0;
    while (next < of_ns.size()) {
      if (health_.degraded()) {
        // A group failed meanwhile: the rest miss now instead of each waiting out
        // remote_timeout on the node that did not answer.
        for (; next < of_ns.size(); ++next) {
          if (records[next].ok()) misses_.fetch_add(1, std::memory_order_relaxed);
          done(at[next], records[next].ok() ? absl::NotFoundError("remote tier degraded")
                                            : records[next].status());
        }
        break;
      }
      std::vector<size_t> group;  // Indexes into of_ns.
      std::vector<ChunkId> group_ids;
      std::vector<const RemoteRecord*> group_records;
      std::vector<ChunkSink*> sinks;
      uint64_t bytes = 0;
      for (; next < of_ns.size(); ++next) {
        if (!records[next].ok()) {
          done(at[next], records[next].status());
          continue;
        }
        const uint64_t size = records[next]->meta.size;
        if (!group.empty() && bytes + size > options_.batch_bytes) break;
        ChunkSink* sink = sink_for(at[next], records[next]->meta);
        if (sink == nullptr) {
          done(at[next], NoSinkError());
          continue;
        }
        bytes += size;
        group.push_back(next);
        group_ids.push_back(of_ns[next]);
        group_records.push_back(&*records[next]);
        sinks.push_back(sink);
      }
      if (group.empty()) continue;
      const std::vector<absl::Status> landed = ReadPayloads(group_ids, group_records, sinks);
      for (size_t k = 0; k < group.size(); ++k) {
        if (landed[k].ok()) {
          done(at[group[k]], records[group[k]]->meta);
        } else {
          done(at[group[k]], landed[k]);
        }
      }
    }
  }
}

TierStats RemoteTier::Stats() const {
  const RemoteTierStats s = GetStats();
  TierStats t;
  t.tier = Tier::kRemote;
  t.hits = s.hits;
  t.misses = s.misses;
  return t;
}

}  // namespace kvtier
