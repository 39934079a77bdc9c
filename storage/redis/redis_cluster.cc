#include "storage/redis/redis_cluster.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "storage/log.h"
#include "storage/redis/redis_tls_context.h"

namespace kvtier {
namespace {

// A redirection reply: "MOVED 3999 127.0.0.1:6381" or "ASK 3999 127.0.0.1:6381".
struct Redirect {
  bool ask = false;
  int slot = 0;
  RedisEndpoint to;
};

std::optional<Redirect> ParseRedirect(absl::string_view error) {
  Redirect r;
  if (absl::StartsWith(error, "MOVED ")) {
    error.remove_prefix(6);
  } else if (absl::StartsWith(error, "ASK ")) {
    r.ask = true;
    error.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  std::vector<absl::string_view> parts = absl::StrSplit(error, ' ');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &r.slot) || r.slot < 0 ||
      r.slot >= kRedisClusterSlots) {
    return std::nullopt;
  }
  auto to = RedisEndpoint::Parse(parts[1]);
  if (!to.ok()) return std::nullopt;
  r.to = *std::move(to);
  return r;
}

// Whether `conn`, taken idle from its pool (`reused`) when it had received `received`
// bytes, broke the way a connection the server closed while it sat idle does (the
// server's `timeout`, a proxy's idle close, a restart, CLIENT KILL): the stream closed
// or reset rather than silent past a timeout, before a byte of any reply to this use.
// Its commands are then sent once more on a new connection. The server read none of
// them unless it closed the connection between running one and answering it (a crash,
// CLIENT KILL at that moment); every command this client sends bears running twice:
// reads (GET, EXISTS, SCAN, PING, CLUSTER SLOTS), SET of a segment (the same bytes),
// DEL, and the guarded ones, which answer a second run as done already: SET NX of a
// commit record (nil: its writer takes it for another's and deletes its own segments,
// so the record reads torn, a miss its first reader removes) and the compare-and-delete
// EVAL (0: its segments are left to their TTL).
bool ClosedWhileIdle(const RedisConnection& conn, bool reused, uint64_t received) {
  return reused && conn.broken() && !conn.timed_out() && conn.bytes_received() == received;
}

// One command on a connection of `pool`, sent once more on a new connection when the
// idle one taken had been closed by the server (ClosedWhileIdle). A connection that
// broke drops the pool's idle ones: the node failed, or closed them all. Returns: Ok,
// and Acquire's or Read's errors.
absl::StatusOr<RedisReplyPtr> CallOnPool(RedisNodePool& pool,
                                         absl::Span<const absl::string_view> argv) {
  for (int attempt = 0;; ++attempt) {
    bool reused = false;
    auto conn = pool.Acquire(&reused);
    if (!conn.ok()) return conn.status();
    const uint64_t received = (*conn)->bytes_received();
    auto reply = (*conn)->Call(argv);
    const bool closed_while_idle = ClosedWhileIdle(**conn, reused, received);
    if ((*conn)->broken()) pool.DropIdle();
    pool.Release(*std::move(conn));
    if (!closed_while_idle || attempt > 0) return reply;
  }
}

// Errors that say "not now" rather than "never": the command is retried.
bool IsRetryable(absl::string_view error) {
  return absl::StartsWith(error, "TRYAGAIN") || absl::StartsWith(error, "CLUSTERDOWN") ||
         absl::StartsWith(error, "LOADING") || absl::StartsWith(error, "MASTERDOWN");
}

absl::flat_hash_set<std::string> SeedNames(const std::vector<RedisEndpoint>& seeds) {
  absl::flat_hash_set<std::string> names;
  for (const RedisEndpoint& seed : seeds) names.insert(seed.ToString());
  return names;
}

}  // namespace

absl::Status RedisClusterOptions::Validate() const {
  if (seeds.empty()) return absl::InvalidArgumentError("redis cluster: no seed nodes");
  if (connections_per_node < 1) {
    return absl::InvalidArgumentError("redis cluster: connections_per_node must be >= 1");
  }
  if (max_redirects < 1) {
    return absl::InvalidArgumentError("redis cluster: max_redirects must be >= 1");
  }
  if (connect_timeout <= absl::ZeroDuration() || io_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("redis cluster: timeouts must be positive");
  }
  const char* set_field = !tls.ca_file.empty()       ? "ca_file"
                          : !tls.cert_file.empty()     ? "cert_file"
                          : !tls.key_file.empty()      ? "key_file"
                          : !tls.server_name.empty()   ? "server_name"
                                                       : nullptr;
  if (!tls.enabled && set_field != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("redis cluster: tls.", set_field, " is set but tls.enabled is false"));
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "redis cluster: tls.", tls.cert_file.empty() ? "key_file" : "cert_file", " without tls.",
        tls.cert_file.empty() ? "cert_file" : "key_file",
        ": a client certificate needs both"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RedisCluster>> RedisCluster::Create(RedisClusterOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::shared_ptr<const RedisTlsContext> tls;
  if (options.tls.enabled) {
    auto context = RedisTlsContext::Create(options.tls);
    if (!context.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("redis cluster: tls ", context.status().message()));
    }
    tls = *std::move(context);
  }
  std::unique_ptr<RedisCluster> cluster(new RedisCluster(std::move(options), std::move(tls)));
  if (absl::Status s = cluster->Refresh(); !s.ok()) {
    LogWarning("redis cluster: not reachable yet: ", s.message());
  }
  return cluster;
}

RedisCluster::RedisCluster(RedisClusterOptions options,
                           std::shared_ptr<const RedisTlsContext> tls)
    : options_(std::move(options)), seed_names_(SeedNames(options_.seeds)) {
  pool_options_.auth = options_.auth;
  pool_options_.tls = std::move(tls);
  pool_options_.connect_timeout = options_.connect_timeout;
  pool_options_.io_timeout = options_.io_timeout;
  pool_options_.max_connections = options_.connections_per_node;
  pool_options_.wait = options_.io_timeout;
  absl::MutexLock l(&mu_);
  for (const RedisEndpoint& seed : options_.seeds) PoolForLocked(seed);
}

RedisCluster::PoolPtr RedisCluster::PoolForLocked(const RedisEndpoint& endpoint) {
  PoolPtr& pool = by_endpoint_[endpoint.ToString()];
  if (pool == nullptr) pool = std::make_shared<RedisNodePool>(endpoint, pool_options_);
  return pool;
}

RedisCluster::PoolPtr RedisCluster::PoolFor(const RedisEndpoint& endpoint) {
  absl::MutexLock l(&mu_);
  return PoolForLocked(endpoint);
}

RedisCluster::PoolPtr RedisCluster::PoolForSlot(int slot) {
  absl::ReaderMutexLock l(&mu_);
  return slots_[slot];
}

void RedisCluster::SetSlot(int slot, const RedisEndpoint& endpoint) {
  absl::MutexLock l(&mu_);
  slots_[slot] = PoolForLocked(endpoint);
}

void RedisCluster::MaybeRefresh(absl::Span<RedisNodePool* const> failed) {
  {
    absl::MutexLock l(&mu_);
    if (options_.now() - last_refresh_ < options_.min_refresh_interval) return;
  }
  if (refreshing_.exchange(true)) return;  // Another caller is at it.
  (void)RefreshExcept(failed);
  refreshing_.store(false);
}

absl::Status RedisCluster::Refresh() { return RefreshExcept({}); }

absl::Status RedisCluster::RefreshExcept(absl::Span<RedisNodePool* const> failed) {
  std::vector<PoolPtr> candidates;
  {
    absl::MutexLock l(&mu_);
    last_refresh_ = options_.now();
    // Masters in the map first (most likely alive and current), then the seeds. Not
    // every node ever seen: one that left the map (a pod gone, back under a new
    // address) would cost a connect timeout per refresh, on a request's thread.
    auto add = [&candidates](PoolPtr p) {
      if (p != nullptr && std::find(candidates.begin(), candidates.end(), p) == candidates.end()) {
        candidates.push_back(std::move(p));
      }
    };
    for (const PoolPtr& p : slots_) add(p);
    for (const RedisEndpoint& seed : options_.seeds) add(PoolForLocked(seed));
  }
  absl::Status last = absl::UnavailableError("redis cluster: no nodes");
  for (const PoolPtr& pool : candidates) {
    if (std::find(failed.begin(), failed.end(), pool.get()) != failed.end()) {
      last = absl::UnavailableError("redis cluster: every node asked has just failed");
      continue;
    }
    last = RefreshFrom(pool.get());
    if (last.ok()) {
      refreshes_.fetch_add(1, std::memory_order_relaxed);
      return last;
    }
    refresh_node_failures_.fetch_add(1, std::memory_order_relaxed);
  }
  refresh_failures_.fetch_add(1, std::memory_order_relaxed);
  return last;
}

absl::Status RedisCluster::RefreshFrom(RedisNodePool* pool) {
  auto reply = CallOnPool(*pool, {"CLUSTER", "SLOTS"});
  const RedisEndpoint asked = pool->endpoint();
  if (!reply.ok()) return reply.status();
  const redisReply& r = **reply;
  if (r.type != REDIS_REPLY_ARRAY) {
    return absl::UnavailableError(absl::StrCat("redis ", asked.ToString(),
                                               ": CLUSTER SLOTS: ", ReplyString(r)));
  }
  // Parse everything before touching the map: a malformed reply changes nothing.
  struct Range {
    int begin, end;
    RedisEndpoint master;
  };
  std::vector<Range> ranges;
  for (size_t i = 0; i < r.elements; ++i) {
    const redisReply* e = r.element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
        e->element[0]->type != REDIS_REPLY_INTEGER || e->element[1]->type != REDIS_REPLY_INTEGER ||
        e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
        e->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
      return absl::UnavailableError(
          absl::StrCat("redis ", asked.ToString(), ": CLUSTER SLOTS: unexpected reply shape"));
    }
    Range range{static_cast<int>(e->element[0]->integer), static_cast<int>(e->element[1]->integer),
                {}};
    if (range.begin < 0 || range.end >= kRedisClusterSlots || range.begin > range.end) {
      return absl::UnavailableError(
          absl::StrCat("redis ", asked.ToString(), ": CLUSTER SLOTS: bad slot range"));
    }
    const redisReply* host = e->element[2]->element[0];
    range.master.host = host->type == REDIS_REPLY_STRING && host->len > 0
                            ? std::string(host->str, host->len)
                            : asked.host;  // An empty host means "the one you asked".
    range.master.port = static_cast<int>(e->element[2]->element[1]->integer);
    ranges.push_back(std::move(range));
  }
  if (ranges.empty()) {
    return absl::UnavailableError(
        absl::StrCat("redis ", asked.ToString(), ": CLUSTER SLOTS: no slots assigned"));
  }
  // Destroyed after the lock is released (closing their connections).
  std::vector<PoolPtr> departed;
  absl::MutexLock l(&mu_);
  slots_.fill(nullptr);
  absl::flat_hash_set<const RedisNodePool*> in_map;
  for (const Range& range : ranges) {
    PoolPtr p = PoolForLocked(range.master);
    in_map.insert(p.get());
    for (int s = range.begin; s <= range.end; ++s) slots_[s] = p;
  }
  // Nodes neither in the map nor seeds (a master removed, a pod replaced under a new
  // address, a redirection's target) keep no pool: their idle connections would hold
  // their sockets and buffers for good. A caller using one keeps it until done.
  absl::erase_if(by_endpoint_, [&](const auto& entry) {
    if (in_map.contains(entry.second.get()) || seed_names_.contains(entry.first)) return false;
    departed.push_back(entry.second);
    return true;
  });
  return absl::OkStatus();
}

std::vector<absl::StatusOr<RedisReplyPtr>> RedisCluster::Execute(
    absl::Span<const RedisCommand> commands) {
  std::vector<absl::StatusOr<RedisReplyPtr>> results;
  results.reserve(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) {
    results.emplace_back(absl::UnavailableError("redis cluster: not sent"));
  }
  struct Pending {
    size_t index;
    PoolPtr ask;  // Set after an ASK: send there, after ASKING.
    bool resent = false;  // Sent again after an idle connection turned out closed.
  };
  std::vector<Pending> todo;
  todo.reserve(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) todo.push_back({i});
  std::vector<int> slot_of(commands.size());
  bool mapped = true;
  for (size_t i = 0; i < commands.size(); ++i) {
    slot_of[i] = RedisHashSlot(commands[i].key);
    mapped = mapped && PoolForSlot(slot_of[i]) != nullptr;
  }
  if (!mapped) MaybeRefresh();

  absl::Duration backoff = options_.retry_backoff;
  // Rounds: the first and one per redirection or retry allowed, and another when the
  // last sends commands again after a connection closed while idle (not a redirection).
  int rounds = options_.max_redirects + 1;
  for (int attempt = 0; attempt < rounds && !todo.empty(); ++attempt) {
    // Group by node, keeping each node's commands in order.
    struct Group {
      PoolPtr pool;
      std::vector<Pending> items;
      std::unique_ptr<RedisConnection> conn;
      bool reused = false;    // conn was idle in the pool.
      uint64_t received = 0;  // conn->bytes_received() when taken.
    };
    std::vector<Group> groups;
    for (const Pending& p : todo) {
      PoolPtr pool = p.ask != nullptr ? p.ask : PoolForSlot(slot_of[p.index]);
      if (pool == nullptr) {
        results[p.index] = absl::UnavailableError(
            absl::StrCat("redis cluster: no node serves slot ", slot_of[p.index]));
        continue;
      }
      auto g = std::find_if(groups.begin(), groups.end(),
                            [&pool](const Group& g) { return g.pool == pool; });
      if (g == groups.end()) {
        groups.push_back({std::move(pool), {}, nullptr});
        g = groups.end() - 1;
      }
      g->items.push_back(p);
    }
    // Connections are taken in one global order (the pools' addresses): a thread holds
    // its earlier nodes' connections while it waits for a later one, so two batches
    // taking the same nodes in opposite orders could otherwise wait on each other
    // until the pool's timeout.
    std::sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
      return std::less<RedisNodePool*>()(a.pool.get(), b.pool.get());
    });
    std::vector<Pending> next;
    bool refresh = false;
    bool wait = false;
    // Nodes that did not answer: not asked again. (`groups` keeps them alive.)
    std::vector<RedisNodePool*> failed;
    auto fail_group = [&](Group& g, size_t from, const absl::Status& s) {
      for (size_t k = from; k < g.items.size(); ++k) results[g.items[k].index] = s;
      // A connection the server closed while it sat idle: not a failure of the node.
      // Its commands (none answered) go again, once, on a new connection (the pool's
      // other idle ones are dropped with it: they are likely closed too).
      const bool resend =
          ClosedWhileIdle(*g.conn, g.reused, g.received) &&
          std::none_of(g.items.begin() + from, g.items.end(),
                       [](const Pending& p) { return p.resent; });
      if (resend) {
        for (size_t k = from; k < g.items.size(); ++k) {
          Pending p = g.items[k];
          p.resent = true;
          next.push_back(p);
        }
        rounds = std::max(rounds, attempt + 2);
        return;
      }
      io_failures_.fetch_add(g.items.size() - from, std::memory_order_relaxed);
      refresh = true;
      failed.push_back(g.pool.get());
    };
    // Send every group before reading any reply: the nodes work in parallel.
    for (Group& g : groups) {
      auto conn = g.pool->Acquire(&g.reused);
      if (absl::IsResourceExhausted(conn.status())) {
        // Every connection to the node busy with this daemon's other calls: the node did
        // not fail, and the map is not in question.
        for (const Pending& p : g.items) results[p.index] = conn.status();
        continue;
      }
      if (!conn.ok()) {
        for (const Pending& p : g.items) results[p.index] = conn.status();
        io_failures_.fetch_add(g.items.size(), std::memory_order_relaxed);
        refresh = true;
        failed.push_back(g.pool.get());
        continue;
      }
      g.conn = *std::move(conn);
      g.received = g.conn->bytes_received();
      for (const Pending& p : g.items) {
        if (p.ask != nullptr) g.conn->Append({"ASKING"});
        g.conn->Append(commands[p.index].argv);
      }
      if (absl::Status s = g.conn->Flush(); !s.ok()) fail_group(g, 0, s);
    }
    // Every node had the timeout from here to start answering: a node read after one
    // that timed out is not given the whole timeout again (with every master hung, a
    // batch once waited the timeout once per node, in turn).
    const absl::Time answer_by = absl::Now() + options_.io_timeout;
    for (Group& g : groups) {
      if (g.conn == nullptr || g.conn->broken()) continue;
      for (size_t k = 0; k < g.items.size(); ++k) {
        const Pending& p = g.items[k];
        // Its first reply's first bytes: by answer_by, or in the moment they take to be
        // read when they are there already (kept at 50 ms for a scheduler's hiccup).
        std::optional<absl::Duration> first_wait;
        if (k == 0) first_wait = std::max(answer_by - absl::Now(), absl::Milliseconds(50));
        if (p.ask != nullptr) {
          auto asking = g.conn->Read(first_wait);
          if (!asking.ok()) {
            fail_group(g, k, asking.status());
            break;
          }
          first_wait.reset();
        }
        auto reply = g.conn->Read(first_wait);
        if (!reply.ok()) {
          fail_group(g, k, reply.status());
          break;
        }
        if (IsErrorReply(**reply)) {
          const absl::string_view error = ReplyString(**reply);
          if (auto redirect = ParseRedirect(error)) {
            if (redirect->ask) {
              ask_.fetch_add(1, std::memory_order_relaxed);
              next.push_back({p.index, PoolFor(redirect->to), p.resent});
            } else {
              moved_.fetch_add(1, std::memory_order_relaxed);
              SetSlot(redirect->slot, redirect->to);
              refresh = true;
              next.push_back({p.index, nullptr, p.resent});
            }
            results[p.index] = absl::UnavailableError(absl::StrCat(
                "redis cluster: slot ", slot_of[p.index], ": too many redirections (", error, ")"));
            continue;
          }
          if (IsRetryable(error)) {
            retried_.fetch_add(1, std::memory_order_relaxed);
            wait = true;
            next.push_back({p.index, nullptr, p.resent});
            results[p.index] = absl::UnavailableError(absl::StrCat("redis cluster: ", error));
            continue;
          }
        }
        results[p.index] = *std::move(reply);
      }
    }
    for (Group& g : groups) {
      if (g.conn == nullptr) continue;
      if (g.conn->broken()) g.pool->DropIdle();  // The node failed: reconnect afresh.
      g.pool->Release(std::move(g.conn));
    }
    if (refresh) MaybeRefresh(failed);
    if (wait && !next.empty() && attempt + 1 < rounds) {
      absl::SleepFor(backoff);  // The cluster said "not now": a failover or a migration.
      backoff = std::min(backoff * 2, absl::Milliseconds(200));
    }
    todo = std::move(next);
  }
  return results;
}

absl::StatusOr<RedisReplyPtr> RedisCluster::ExecuteOne(const RedisCommand& command) {
  auto results = Execute(absl::MakeConstSpan(&command, 1));
  return std::move(results[0]);
}

absl::StatusOr<std::vector<RedisEndpoint>> RedisCluster::Masters() {
  if (absl::Status s = Refresh(); !s.ok()) return s;
  std::vector<PoolPtr> masters;
  {
    absl::ReaderMutexLock l(&mu_);
    for (const PoolPtr& p : slots_) {
      if (p != nullptr && std::find(masters.begin(), masters.end(), p) == masters.end()) {
        masters.push_back(p);
      }
    }
  }
  std::vector<RedisEndpoint> out;
  out.reserve(masters.size());
  for (const PoolPtr& p : masters) out.push_back(p->endpoint());
  return out;
}

absl::StatusOr<RedisReplyPtr> RedisCluster::CallOn(const RedisEndpoint& node,
                                                   absl::Span<const absl::string_view> argv) {
  PoolPtr pool = PoolFor(node);
  return CallPool(pool.get(), argv);
}

absl::StatusOr<RedisReplyPtr> RedisCluster::CallPool(RedisNodePool* pool,
                                                     absl::Span<const absl::string_view> argv) {
  auto reply = CallOnPool(*pool, argv);
  if (!reply.ok() && !absl::IsResourceExhausted(reply.status())) {
    io_failures_.fetch_add(1, std::memory_order_relaxed);
  }
  return reply;
}

absl::Status RedisCluster::PingMasters() {
  auto masters = [this] {
    std::vector<PoolPtr> out;
    int covered = 0;
    absl::ReaderMutexLock l(&mu_);
    for (const PoolPtr& p : slots_) {
      if (p == nullptr) continue;
      ++covered;
      if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
    }
    return std::make_pair(std::move(out), covered);
  };
  auto [pools, covered] = masters();
  if (covered < kRedisClusterSlots) {
    if (absl::Status s = Refresh(); !s.ok()) return s;
    std::tie(pools, covered) = masters();
    if (covered < kRedisClusterSlots) {
      return absl::UnavailableError(absl::StrCat("redis cluster: ", kRedisClusterSlots - covered,
                                                 " slots have no master"));
    }
  }
  for (const PoolPtr& pool : pools) {
    auto reply = CallPool(pool.get(), {"PING"});
    absl::Status failed;
    if (!reply.ok()) {
      failed = reply.status();
    } else if ((*reply)->type != REDIS_REPLY_STATUS || ReplyString(**reply) != "PONG") {
      failed = absl::UnavailableError(absl::StrCat("redis ", pool->endpoint().ToString(),
                                                   ": PING: ", ReplyString(**reply)));
    }
    if (!failed.ok()) {
      RedisNodePool* const failed_pools[] = {pool.get()};
      MaybeRefresh(failed_pools);
      return failed;
    }
  }
  return absl::OkStatus();
}

RedisClusterStats RedisCluster::stats() const {
  RedisClusterStats s;
  s.moved = moved_.load(std::memory_order_relaxed);
  s.ask = ask_.load(std::memory_order_relaxed);
  s.retried = retried_.load(std::memory_order_relaxed);
  s.refreshes = refreshes_.load(std::memory_order_relaxed);
  s.refresh_failures = refresh_failures_.load(std::memory_order_relaxed);
  s.refresh_node_failures = refresh_node_failures_.load(std::memory_order_relaxed);
  s.io_failures = io_failures_.load(std::memory_order_relaxed);
  absl::ReaderMutexLock l(&mu_);
  std::vector<const RedisNodePool*> masters;
  for (const PoolPtr& p : slots_) {
    if (p == nullptr) continue;
    ++s.slots_covered;
    if (std::find(masters.begin(), masters.end(), p.get()) == masters.end()) {
      masters.push_back(p.get());
    }
  }
  s.masters = masters.size();
  s.nodes = by_endpoint_.size();
  return s;
}

int RedisCluster::OpenConnections(const RedisEndpoint& node) const {
  absl::ReaderMutexLock l(&mu_);
  auto it = by_endpoint_.find(node.ToString());
  return it == by_endpoint_.end() ? 0 : it->second->open();
}

}  // namespace kvtier
