// Redis Cluster's key-to-slot mapping: CRC16 (XMODEM) of the key, or of its hash tag
// (the bytes between the first '{' and the next '}', when that is not empty), modulo
// 16384. The same function the servers use, so a command goes straight to the node
// that owns its key.
#ifndef KVTIER_STORAGE_REDIS_HASH_SLOT_H_
#define KVTIER_STORAGE_REDIS_HASH_SLOT_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace kvtier {

inline constexpr int kRedisClusterSlots = 16384;

// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), as Redis Cluster uses.
uint16_t RedisCrc16(absl::string_view bytes);

// The cluster slot that owns `key`, in [0, kRedisClusterSlots).
int RedisHashSlot(absl::string_view key);

}  // namespace kvtier

#endif  // KVTIER_STORAGE_REDIS_HASH_SLOT_H_
