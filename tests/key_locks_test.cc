#include "storage/key_locks.h"

#include "gtest/gtest.h"

namespace kvtier {
namespace {

ChunkId Id(uint64_t n) { return ChunkId{1, ChunkKey{n, n}}; }

// A promotion that noted the generation before a Delete does not insert after it.
TEST(KeyLocksTest, AnInsertNotedBeforeARemovalIsSkipped) {
  KeyLocks locks;
  const uint64_t noted = locks.Generation(Id(1));
  bool removed = false;
  locks.Removing(Id(1), [&] { removed = true; });
  EXPECT_TRUE(removed);
  bool inserted = false;
  EXPECT_FALSE(locks.InsertIfUnchanged(Id(1), noted, [&] { inserted = true; }));
  EXPECT_FALSE(inserted);
  EXPECT_TRUE(locks.InsertIfUnchanged(Id(1), locks.Generation(Id(1)), [&] { inserted = true; }));
  EXPECT_TRUE(inserted);
}

// During a Removing's far phase (the shared tier's delete), a promotion of the chunk
// that notes the generation then, having read the copy about to be deleted, does not
// insert, then or after; one of another chunk does. Work that must not be lost (a put's
// shared write) is not held back: it came after the Delete, as far as the chunk goes.
TEST(KeyLocksTest, NoPromotionOfAChunkInsertsDuringOrAfterItsFarPhase) {
  KeyLocks locks;
  uint64_t noted_in_far = 0;
  bool promoted_in_far = true, other_in_far = false, kept_in_far = false;
  locks.Removing(
      Id(1), [] {},
      [&] {
        noted_in_far = locks.Generation(Id(1));
        promoted_in_far = locks.InsertIfUnchanged(Id(1), noted_in_far, [] {});
        other_in_far = locks.InsertIfUnchanged(Id(2), locks.Generation(Id(2)), [] {});
        kept_in_far = locks.InsertIfUnchanged(Id(1), noted_in_far, [] {}, [] { return false; });
      });
  EXPECT_FALSE(promoted_in_far);
  EXPECT_TRUE(other_in_far);
  EXPECT_TRUE(kept_in_far);
  bool inserted = false;
  EXPECT_FALSE(locks.InsertIfUnchanged(Id(1), noted_in_far, [&] { inserted = true; }));
  EXPECT_FALSE(inserted);
  EXPECT_TRUE(locks.InsertIfUnchanged(Id(1), locks.Generation(Id(1)), [] {}));
}

// Two Removings of one chunk overlapping in their far phases: the chunk stays held until
// both have ended.
TEST(KeyLocksTest, OverlappingFarPhasesHoldTheChunkUntilBothEnd) {
  KeyLocks locks;
  bool inner_held = false, between_held = false;
  locks.Removing(
      Id(1), [] {},
      [&] {
        locks.Removing(Id(1), [] {}, [&] {
          inner_held = !locks.InsertIfUnchanged(Id(1), locks.Generation(Id(1)), [] {});
        });
        between_held = !locks.InsertIfUnchanged(Id(1), locks.Generation(Id(1)), [] {});
      });
  EXPECT_TRUE(inner_held);
  EXPECT_TRUE(between_held);
  EXPECT_TRUE(locks.InsertIfUnchanged(Id(1), locks.Generation(Id(1)), [] {}));
}

// A Clear's far phase (the shared tier's clear) holds back promotions of every chunk
// of its namespace, and those that noted the generation then stay out after; chunks of
// other namespaces and a put's shared write go ahead.
TEST(KeyLocksTest, NoPromotionOfANamespaceInsertsDuringOrAfterItsClearsFarPhase) {
  KeyLocks locks;
  const ChunkId other_ns{2, ChunkKey{5, 5}};
  bool removed = false, promoted_in_far = true, other_in_far = false, kept_in_far = false;
  uint64_t noted_in_far = 0;
  locks.RemovingAll(
      /*ns=*/1, [&] { removed = true; },
      [&] {
        noted_in_far = locks.Generation(Id(3));
        promoted_in_far = locks.InsertIfUnchanged(Id(3), noted_in_far, [] {});
        other_in_far = locks.InsertIfUnchanged(other_ns, locks.Generation(other_ns), [] {});
        kept_in_far = locks.InsertIfUnchanged(Id(3), noted_in_far, [] {}, [] { return false; });
      });
  EXPECT_TRUE(removed);
  EXPECT_FALSE(promoted_in_far);
  EXPECT_TRUE(other_in_far);
  EXPECT_TRUE(kept_in_far);
  EXPECT_FALSE(locks.InsertIfUnchanged(Id(3), noted_in_far, [] {}));
  EXPECT_TRUE(locks.InsertIfUnchanged(Id(3), locks.Generation(Id(3)), [] {}));
}

}  // namespace
}  // namespace kvtier
