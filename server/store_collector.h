// StoreCollector: the tiered store's Prometheus metrics, declared here and nowhere else.
// They are read from TieredStore::GetStats() at scrape time, so the storage hot paths
// keep their own atomics and never touch prometheus-cpp.
//   kvtier_tier_capacity_bytes{tier}, kvtier_tier_used_bytes{tier}, kvtier_tier_chunks{tier}
//   kvtier_tier_pinned_bytes{tier="ram"}
//   kvtier_tier_hits_total{tier}, kvtier_tier_misses_total{tier}
//   kvtier_tier_bytes_in_total{tier}, kvtier_tier_bytes_out_total{tier}
//   kvtier_tier_evictions_total{tier}, kvtier_ssd_expirations_total
//   kvtier_promotions_total, kvtier_demotions_total, kvtier_demotion_failures_total
//   kvtier_checksum_failures_total{source="ssd"|"ram"}, kvtier_put_checksum_mismatches_total,
//   kvtier_ssd_write_errors_total
//   kvtier_writeback_queue_depth, kvtier_writeback_dirty_bytes,
//   kvtier_writeback_max_dirty_bytes, kvtier_writeback_backlog_waits_total, kvtier_namespaces
//   kvtier_up, kvtier_build_info{version,write_mode}
//
// Thread-safety: Collect() may run on any thread, concurrently with the store.
#ifndef KVTIER_SERVER_STORE_COLLECTOR_H_
#define KVTIER_SERVER_STORE_COLLECTOR_H_

#include <string>
#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include "storage/tiered_store.h"

namespace kvtier {

class StoreCollector final : public prometheus::Collectable {
 public:
  // `store` must outlive this object.
  StoreCollector(const TieredStore* store, std::string version);
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const TieredStore* const store_;
  const std::string version_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_STORE_COLLECTOR_H_
