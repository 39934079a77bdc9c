#include "server/store_collector.h"

#include <utility>

namespace kvtier {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// Builds one family from (label set, value) pairs.
MetricFamily Family(std::string name, std::string help, MetricType type,
                    std::vector<std::pair<std::vector<ClientMetric::Label>, double>> series) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  for (auto& [labels, value] : series) {
    ClientMetric m;
    m.label = std::move(labels);
    if (type == MetricType::Counter) {
      m.counter.value = value;
    } else {
      m.gauge.value = value;
    }
    f.metric.push_back(std::move(m));
  }
  return f;
}

std::vector<ClientMetric::Label> TierLabel(const char* tier) { return {{"tier", tier}}; }

}  // namespace

StoreCollector::StoreCollector(const TieredStore* store, std::string version)
    : store_(store), version_(std::move(version)) {}

std::vector<MetricFamily> StoreCollector::Collect() const {
  const TieredStoreStats s = store_->GetStats();
  const bool ssd = store_->write_mode() != WriteMode::kRamOnly;
  // The GPU staging tier shows as tier="gpu" where this daemon has one.
  const bool gpu = s.gpu.staging_enabled;
  auto per_tier = [&](double ram, double ssd_value, double gpu_value = 0) {
    std::vector<std::pair<std::vector<ClientMetric::Label>, double>> out = {{TierLabel("ram"), ram}};
    if (ssd) out.push_back({TierLabel("ssd"), ssd_value});
    if (gpu) out.push_back({TierLabel("gpu"), gpu_value});
    return out;
  };
  const GpuStagingStats& g = s.gpu.staging;
  const auto C = MetricType::Counter;
  const auto G = MetricType::Gauge;
  std::vector<MetricFamily> f;
  f.push_back(Family("kvtier_up", "1 while kvtierd is serving", G, {{{}, 1}}));
  f.push_back(Family("kvtier_build_info", "Version and write mode of this kvtierd", G,
                     {{{{"version", version_}, {"write_mode", WriteModeName(store_->write_mode())}},
                       1}}));
  f.push_back(Family("kvtier_tier_capacity_bytes", "Configured capacity of each tier", G,
                     per_tier(s.ram.capacity_bytes, s.ssd.capacity_bytes, g.capacity_bytes)));
  f.push_back(Family("kvtier_tier_used_bytes",
                     "Bytes taken in each tier (RAM: whole slots, puts in flight included; SSD: "
                     "chunks rounded up to 4 KiB)", G,
                     per_tier(s.ram.used_bytes, s.ssd.used_bytes, g.used_bytes)));
  f.push_back(Family("kvtier_tier_payload_bytes",
                     "Payload bytes of the chunks held in each tier (no slot or 4 KiB rounding)",
                     G, per_tier(s.ram.chunk_bytes, s.ssd.payload_bytes, g.chunk_bytes)));
  f.push_back(Family("kvtier_tier_chunks", "Chunks held in each tier", G,
                     per_tier(s.ram.chunks, s.ssd.chunks, g.chunks)));
  f.push_back(Family("kvtier_tier_pinned_bytes", "Payload bytes of pinned chunks", G,
                     {{TierLabel("ram"), static_cast<double>(s.ram.pinned_bytes)}}));
  f.push_back(Family("kvtier_tier_hits_total", "Chunk reads that found the chunk in the tier",
                     C, per_tier(s.ram.hits, s.ssd.hits, g.hits)));
  f.push_back(Family("kvtier_tier_misses_total",
                     "Chunk reads that did not find the chunk in the tier", C,
                     per_tier(s.ram.misses, s.ssd.misses, g.misses)));
  f.push_back(Family("kvtier_tier_bytes_in_total", "Payload bytes written into each tier", C,
                     per_tier(s.ram_bytes_in, s.ssd_bytes_in, g.bytes_in)));
  f.push_back(Family("kvtier_tier_bytes_out_total", "Payload bytes read out of each tier", C,
                     per_tier(s.ram_bytes_out, s.ssd_bytes_out, g.bytes_out)));
  f.push_back(Family("kvtier_tier_evictions_total",
                     "Chunks evicted from each tier for room (SSD chunks dropped by ssd_ttl: "
                     "kvtier_ssd_expirations_total)",
                     C,
                     per_tier(s.ram.evictions, s.ssd.evictions, g.evictions)));
  f.push_back(Family("kvtier_gpu_available",
                     "1 when this kvtierd drives a GPU (CUDA build, device present)", G,
                     {{{}, s.gpu_present ? 1.0 : 0.0}}));
  if (s.gpu_present) {
    f.push_back(Family("kvtier_gpu_pool_pinned",
                       "1 when the host pool is page-locked for the GPU; 0 is a degraded mode "
                       "(copies run unpinned)", G, {{{}, s.gpu.pool_pinned ? 1.0 : 0.0}}));
    f.push_back(Family("kvtier_gpu_staging_enabled",
                       "1 when GPU staging buffers were allocated; 0 is a degraded mode", G,
                       {{{}, s.gpu.staging_enabled ? 1.0 : 0.0}}));
    f.push_back(Family("kvtier_gpu_deliveries_total",
                       "Chunk deliveries into workers' GPU memory, by where the bytes came from",
                       C, {{{{"source", "staging"}}, double(s.gpu.deliveries_from_staging)},
                           {{{"source", "host"}}, double(s.gpu.deliveries_from_host)}}));
    f.push_back(Family("kvtier_gpu_delivered_bytes_total",
                       "Bytes delivered into workers' GPU memory", C,
                       {{{}, double(s.gpu.delivered_bytes)}}));
    f.push_back(Family("kvtier_gpu_crc_checked_bytes_total",
                       "Bytes whose CRC32C a delivery into GPU memory checked, by where: the "
                       "CPU (the pool's copy) or the GPU (what landed)", C,
                       {{{{"on", "cpu"}}, double(s.gpu.crc_checked_bytes)},
                        {{{"on", "gpu"}}, double(s.gpu.device_crc_checked_bytes)}}));
    f.push_back(Family("kvtier_gpu_delivery_failures_total",
                       "Deliveries into GPU memory that failed (device error, bad checksum)", C,
                       {{{}, double(s.gpu.delivery_failures)}}));
    f.push_back(Family("kvtier_gpu_stage_crc_checked_bytes_total",
                       "Pool bytes whose CRC32C was checked on the CPU before they were staged",
                       C, {{{}, double(s.gpu.stage_crc_checked_bytes)}}));
    f.push_back(Family("kvtier_gpu_staging_failures_total",
                       "Copies into the staging buffers that failed, or found no room", C,
                       {{{{"reason", "error"}}, double(g.stage_failures)},
                        {{{"reason", "no_room"}}, double(g.no_room)}}));
  }
  if (s.remote_present) {
    const RemoteTierStats& r = s.remote;
    f.push_back(Family("kvtier_remote_degraded",
                       "1 while the shared tier (Redis Cluster) is unreachable: reads miss, "
                       "writes are dropped, probes retry with backoff",
                       G, {{{}, r.degraded ? 1.0 : 0.0}}));
    f.push_back(Family("kvtier_remote_degradations_total",
                       "Times the shared tier went from reachable to degraded", C,
                       {{{}, double(r.degradations)}}));
    f.push_back(Family("kvtier_remote_reads_total",
                       "Shared-tier reads by outcome (only hit serves bytes)", C,
                       {{{{"result", "hit"}}, double(r.hits)},
                        {{{"result", "miss"}}, double(r.misses)},
                        {{{"result", "torn"}}, double(r.torn)},
                        {{{"result", "foreign"}}, double(r.foreign)},
                        {{{"result", "corrupt"}}, double(r.checksum_failures)},
                        {{{"result", "failed"}}, double(r.read_failures)}}));
    f.push_back(Family("kvtier_remote_writes_total",
                       "Chunks handed to the shared tier, by outcome", C,
                       {{{{"result", "stored"}}, double(r.writes)},
                        {{{"result", "present"}}, double(r.writes_present)},
                        {{{"result", "dropped"}}, double(r.writes_dropped)},
                        {{{"result", "full"}}, double(r.writes_full)},
                        {{{"result", "cancelled"}}, double(r.writes_cancelled)},
                        {{{"result", "failed"}}, double(r.write_failures)}}));
    f.push_back(Family("kvtier_remote_torn_removed_total",
                       "Shared-tier records whose segments were gone (evicted, a master "
                       "flushed), removed by this daemon so the chunk can be shared again",
                       C, {{{}, double(r.torn_removed)}}));
    f.push_back(Family("kvtier_remote_eval_refusals_total",
                       "Record deletes the cluster refused as EVAL (ACL, command "
                       "disabled), made with DEL instead: grant +eval to the tier's user",
                       C, {{{}, double(r.eval_refusals)}}));
    f.push_back(Family("kvtier_remote_bytes_total", "Payload bytes moved to and from the shared tier",
                       C, {{{{"direction", "read"}}, double(r.bytes_read)},
                           {{{"direction", "written"}}, double(r.bytes_written)}}));
    f.push_back(Family("kvtier_remote_pending_bytes",
                       "Chunk bytes queued or being written to the shared tier", G,
                       {{{}, double(r.pending_bytes)}}));
    f.push_back(Family("kvtier_remote_redirects_total",
                       "Redis Cluster redirections followed (moved, ask) and commands retried",
                       C, {{{{"kind", "moved"}}, double(r.cluster.moved)},
                           {{{"kind", "ask"}}, double(r.cluster.ask)},
                           {{{"kind", "retry"}}, double(r.cluster.retried)}}));
    f.push_back(Family("kvtier_remote_topology_refreshes_total",
                       "Cluster slot maps read (ok) or not obtainable from any node (failed)", C,
                       {{{{"result", "ok"}}, double(r.cluster.refreshes)},
                        {{{"result", "failed"}}, double(r.cluster.refresh_failures)}}));
    f.push_back(Family("kvtier_remote_masters", "Redis masters serving slots in the current map",
                       G, {{{}, double(r.cluster.masters)}}));
    f.push_back(Family("kvtier_remote_promotions_total",
                       "Chunks read from the shared tier and kept in RAM", C,
                       {{{}, double(s.remote_promotions)}}));
  }
  f.push_back(Family("kvtier_promotions_total", "Chunks copied from SSD into RAM on a read", C,
                     {{{}, static_cast<double>(s.promotions)}}));
  f.push_back(Family("kvtier_hint_clients", "Clients with a live Hint", G,
                     {{{}, static_cast<double>(s.hint_clients)}}));
  f.push_back(Family("kvtier_hint_window_chunks", "Chunks in the merged hint window", G,
                     {{{}, static_cast<double>(s.hinted_chunks)}}));
  f.push_back(Family("kvtier_hint_prefetches_total",
                     "Hint window chunks the prefetcher looked at (promoted from SSD if there)",
                     C, {{{}, static_cast<double>(s.prefetched)}}));
  f.push_back(Family("kvtier_demotions_total",
                     "Chunks written to SSD because RAM needed their room", C,
                     {{{}, static_cast<double>(s.demotions)}}));
  f.push_back(Family("kvtier_demotion_failures_total",
                     "Chunks dropped from RAM because writing them to SSD failed", C,
                     {{{}, static_cast<double>(s.demotion_failures)}}));
  f.push_back(Family(
      "kvtier_checksum_failures_total",
      "Stored chunks found corrupt by their CRC32C (deleted, never served), by tier",
      C,
      {{{{"source", "ssd"}}, static_cast<double>(s.ssd.checksum_failures)},
       {{{"source", "ram"}}, static_cast<double>(s.ram_checksum_failures)}}));
  f.push_back(Family("kvtier_put_checksum_mismatches_total",
                     "Put payloads that did not match the CRC32C their client sent (refused "
                     "with INVALID_ARGUMENT, nothing stored)",
                     C, {{{}, static_cast<double>(s.put_checksum_mismatches)}}));
  f.push_back(Family("kvtier_writeback_queue_depth", "Chunks in RAM waiting to be written to SSD",
                     G, {{{}, static_cast<double>(s.writeback_queue_depth)}}));
  f.push_back(Family("kvtier_writeback_dirty_bytes",
                     "Payload bytes in RAM waiting to be written to SSD (the write-back backlog)",
                     G, {{{}, static_cast<double>(s.writeback_dirty_bytes)}}));
  f.push_back(Family("kvtier_writeback_max_dirty_bytes",
                     "Bound on the write-back backlog (writeback_max_dirty; 0: the pool)", G,
                     {{{}, static_cast<double>(s.writeback_max_dirty_bytes)}}));
  f.push_back(Family("kvtier_writeback_backlog_waits_total",
                     "Put admissions that found the write-back backlog full and waited", C,
                     {{{}, static_cast<double>(s.writeback_backlog_waits)}}));
  f.push_back(Family("kvtier_ram_prefaulted_bytes",
                     "Bytes of the RAM pool faulted in ahead of use (ram_prefault)", G,
                     {{{}, static_cast<double>(s.ram.prefaulted_bytes)}}));
  f.push_back(Family("kvtier_puts_waiting", "Puts waiting for room in RAM now", G,
                     {{{}, static_cast<double>(s.puts_waiting)}}));
  f.push_back(Family("kvtier_puts_queued_total",
                     "Puts that found no room in RAM at once and waited for it (put_wait)", C,
                     {{{}, static_cast<double>(s.puts_queued)}}));
  f.push_back(Family("kvtier_put_wait_timeouts_total",
                     "Puts refused RESOURCE_EXHAUSTED after waiting put_wait for room", C,
                     {{{}, static_cast<double>(s.put_wait_timeouts)}}));
  f.push_back(Family("kvtier_namespaces", "Registered layouts", G,
                     {{{}, static_cast<double>(s.namespaces)}}));
  if (ssd) {
    f.push_back(Family("kvtier_ssd_expirations_total", "SSD chunks dropped by ssd_ttl", C,
                       {{{}, static_cast<double>(s.ssd.expirations)}}));
    f.push_back(Family("kvtier_ssd_write_errors_total",
                       "Failed SSD write attempts, payload or index (e.g. disk full); a "
                       "write-back chunk is tried again until it is written, and each failed "
                       "try counts",
                       C,
                       {{{}, static_cast<double>(s.ssd.write_errors)}}));
    f.push_back(Family("kvtier_ssd_payload_bytes", "Payload bytes of the chunks on SSD", G,
                       {{{}, static_cast<double>(s.ssd.payload_bytes)}}));
    f.push_back(Family("kvtier_ssd_disk_bytes",
                       "Bytes in SSD payload files, dead bytes not yet reclaimed included", G,
                       {{{}, static_cast<double>(s.ssd.disk_bytes)}}));
    f.push_back(Family("kvtier_ssd_limit_bytes",
                       "The capacity the SSD tier keeps to: ssd_capacity, or less while the "
                       "file system holding it has no room for that much",
                       G, {{{}, static_cast<double>(s.ssd.limit_bytes)}}));
    f.push_back(Family("kvtier_ssd_written_bytes_total",
                       "Bytes written to SSD payload files (puts and garbage collection)", C,
                       {{{}, static_cast<double>(s.ssd.bytes_written)}}));
    f.push_back(Family("kvtier_ssd_gc_bytes_total",
                       "Bytes garbage collection moved to reclaim partly dead payload files", C,
                       {{{}, static_cast<double>(s.ssd.gc_bytes)}}));
    f.push_back(Family("kvtier_ssd_lost_at_start_total",
                       "Chunks dropped at start-up because their payload file was missing or short",
                       C, {{{}, static_cast<double>(s.ssd.lost_at_start)}}));
    f.push_back(Family("kvtier_ssd_index_repairs_total",
                       "Start-ups that found the SSD tier's RocksDB index corrupt and repaired it "
                       "(its unreadable rows' chunks dropped); this run: 0 or 1",
                       C, {{{}, static_cast<double>(s.ssd.index_repairs)}}));
  }
  return f;
}

}  // namespace kvtier
