// Tests of the caching-allocator model (sim/caching_allocator.h): hand-worked alloc/free
// sequences, each citing the rule of PyTorch's c10/cuda/CUDACachingAllocator.cpp (torch 2.4)
// it checks, with the expected numbers worked out by hand in the comments. Segment layouts are
// written [start, end) in MiB from the segment's start.
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "input_error_of.h"
#include "peftplan/common/error.h"
#include "peftplan/sim/ops.h"
#include "peftplan/sim/caching_allocator.h"
#include "peftplan/sim/verify.h"

namespace peftplan::sim {
namespace {

using ::testing::HasSubstr;

constexpr std::uint64_t kKiB = 1024;
constexpr std::uint64_t kMiB = 1024 * 1024;

using peftplan::testing::input_error_of;

AllocatorConfig with_capacity(std::uint64_t capacity_bytes) {
  AllocatorConfig c;
  c.capacity_bytes = capacity_bytes;
  return c;
}

AllocatorConfig with_max_split(std::uint64_t max_split_bytes, std::uint64_t capacity_bytes = UINT64_MAX) {
  AllocatorConfig c;
  c.max_split_size_bytes = max_split_bytes;
  c.capacity_bytes = capacity_bytes;
  return c;
}

AllocatorConfig expandable(std::uint64_t capacity_bytes = UINT64_MAX) {
  AllocatorConfig c;
  c.expandable_segments = true;
  c.capacity_bytes = capacity_bytes;
  return c;
}

// --- sizes ---------------------------------------------------------------------------------

TEST(CachingAllocatorSizes, RoundSize) {
  // round_size: below kMinBlockSize (512) -> 512, else the next multiple of 512.
  EXPECT_EQ(caching_allocator::round_size(0), 512u);
  EXPECT_EQ(caching_allocator::round_size(1), 512u);
  EXPECT_EQ(caching_allocator::round_size(512), 512u);
  EXPECT_EQ(caching_allocator::round_size(513), 1024u);
  EXPECT_EQ(caching_allocator::round_size(kMiB + 1), kMiB + 512);
}

TEST(CachingAllocatorSizes, AllocationSize) {
  // get_allocation_size: <= kSmallSize (1 MiB) -> kSmallBuffer (2 MiB); < kMinLargeAlloc
  // (10 MiB) -> kLargeBuffer (20 MiB); otherwise rounded up to kRoundLarge (2 MiB).
  EXPECT_EQ(caching_allocator::allocation_size(512), 2 * kMiB);
  EXPECT_EQ(caching_allocator::allocation_size(kMiB), 2 * kMiB);
  EXPECT_EQ(caching_allocator::allocation_size(kMiB + 512), 20 * kMiB);
  EXPECT_EQ(caching_allocator::allocation_size(10 * kMiB - 512), 20 * kMiB);
  EXPECT_EQ(caching_allocator::allocation_size(10 * kMiB), 10 * kMiB);  // not < 10 MiB
  EXPECT_EQ(caching_allocator::allocation_size(10 * kMiB + 512), 12 * kMiB);
  EXPECT_EQ(caching_allocator::allocation_size(11 * kMiB), 12 * kMiB);
}

TEST(CachingAllocator, RoundsRequestsTo512Bytes) {
  // round_size through malloc; allocated_bytes counts block->size (alloc_found_block).
  CachingAllocatorModel m(AllocatorConfig{});
  auto a = m.malloc(1);  // 512 B block in a new 2 MiB small segment
  ASSERT_TRUE(a);
  EXPECT_EQ(m.stats().allocated_bytes.current, 512u);
  EXPECT_EQ(m.stats().requested_bytes.current, 1u);
  auto b = m.malloc(513);  // 1024 B, split from the same segment: 512 + 1024 = 1536
  ASSERT_TRUE(b);
  EXPECT_EQ(m.stats().allocated_bytes.current, 1536u);
  EXPECT_EQ(m.stats().requested_bytes.current, 514u);  // 1 + 513
  EXPECT_EQ(m.stats().reserved_bytes.current, 2 * kMiB);
  EXPECT_EQ(m.stats().segments.current, 1u);
  // NativeCachingAllocator::allocate: 0 bytes -> null pointer, no block, nothing reserved.
  auto z = m.malloc(0);
  ASSERT_TRUE(z);
  EXPECT_EQ(z->address, 0u);
  EXPECT_EQ(m.stats().allocations.current, 2u);
  EXPECT_EQ(m.stats().allocated_bytes.current, 1536u);
  EXPECT_EQ(m.stats().num_malloc_calls, 3u);
  m.free(*z);  // free(nullptr) is a no-op
  EXPECT_EQ(m.stats().allocations.current, 2u);
}

TEST(CachingAllocator, SegmentSizePerPool) {
  // get_pool + get_allocation_size, one request per fresh allocator; reserved = the segment.
  struct Case {
    std::uint64_t request, reserved, allocated;
  };
  const Case cases[] = {
      // 1 MiB is the largest small request: a 2 MiB segment, split (small pool, 1 MiB >= 512 left).
      {kMiB, 2 * kMiB, kMiB},
      // 1 MiB + 1 -> 1 MiB + 512, large pool, < 10 MiB: a 20 MiB segment, split (19 MiB - 512 > 1 MiB).
      {kMiB + 1, 20 * kMiB, kMiB + 512},
      // 10 MiB - 512 is still < kMinLargeAlloc: 20 MiB.
      {10 * kMiB - 512, 20 * kMiB, 10 * kMiB - 512},
      // 10 MiB exactly is not < kMinLargeAlloc: its own 10 MiB segment, nothing left over.
      {10 * kMiB, 10 * kMiB, 10 * kMiB},
      // 10 MiB + 1 -> 10 MiB + 512 -> a 12 MiB segment, split (2 MiB - 512 > 1 MiB left).
      {10 * kMiB + 1, 12 * kMiB, 10 * kMiB + 512},
      // 11 MiB -> a 12 MiB segment; 1 MiB left is not > kSmallSize, so should_split says no and
      // the whole 12 MiB block is handed out: allocated_bytes counts 12 MiB for 11 MiB asked.
      {11 * kMiB, 12 * kMiB, 12 * kMiB},
  };
  for (const Case& c : cases) {
    CachingAllocatorModel m(AllocatorConfig{});
    ASSERT_TRUE(m.malloc(c.request)) << c.request;
    EXPECT_EQ(m.stats().reserved_bytes.current, c.reserved) << c.request;
    EXPECT_EQ(m.stats().allocated_bytes.current, c.allocated) << c.request;
    EXPECT_EQ(m.stats().segments.current, 1u) << c.request;
    EXPECT_EQ(m.stats().num_device_alloc, 1u) << c.request;
  }
}

// --- splitting and merging -----------------------------------------------------------------

TEST(CachingAllocator, SmallRequestsShareASegmentAndMergeBack) {
  // should_split (small pool: remainder >= kMinBlockSize) and free_block/try_merge_blocks.
  CachingAllocatorModel m(AllocatorConfig{});
  auto a = m.malloc(256 * kKiB);  // new 2 MiB segment: a [0, 0.25), free [0.25, 2)
  auto b = m.malloc(256 * kKiB);  // best fit is that 1.75 MiB block: b [0.25, 0.5), free [0.5, 2)
  ASSERT_TRUE(a && b);
  EXPECT_EQ(m.stats().reserved_bytes.current, 2 * kMiB);
  EXPECT_EQ(m.stats().segments.current, 1u);
  EXPECT_EQ(m.stats().num_device_alloc, 1u);
  EXPECT_EQ(m.stats().allocated_bytes.current, 512 * kKiB);
  // inactive_split_bytes: +1.75 MiB when a split the fresh segment, -0.25 MiB when b took the
  // front of the already split remainder: 1.5 MiB in one block.
  EXPECT_EQ(m.stats().inactive_split_bytes.current, 1536 * kKiB);
  EXPECT_EQ(m.stats().inactive_split.current, 1u);
  // free a: b is live, so no merge; a is a second inactive split block: 2 blocks, 1.75 MiB.
  m.free(*a);
  EXPECT_EQ(m.stats().inactive_split.current, 2u);
  EXPECT_EQ(m.stats().inactive_split_bytes.current, 1792 * kKiB);
  // free b: merges with a before it and the 1.5 MiB after it into the whole 2 MiB segment,
  // which is no longer split: 2 - 2 = 0 blocks, 1.75 - 0.25 - 1.5 = 0 MiB.
  m.free(*b);
  EXPECT_EQ(m.stats().inactive_split.current, 0u);
  EXPECT_EQ(m.stats().inactive_split_bytes.current, 0u);
  EXPECT_EQ(m.stats().allocated_bytes.current, 0u);
  EXPECT_EQ(m.stats().reserved_bytes.current, 2 * kMiB);  // cached, not returned
}

TEST(CachingAllocator, LargeBlockNotSplitWhenAtMostOneMiBRemains) {
  // should_split (large pool): split only if the remainder is > kSmallSize (1 MiB).
  CachingAllocatorModel m(AllocatorConfig{});
  auto a = m.malloc(9 * kMiB);   // 20 MiB segment: a [0, 9), free [9, 20) (11 MiB > 1 MiB left)
  auto b = m.malloc(10 * kMiB);  // best fit: the 11 MiB block; 1 MiB left is not > 1 MiB
  ASSERT_TRUE(a && b);
  // b holds the whole 11 MiB block: allocated = 9 + 11 = 20 MiB, requested = 9 + 10 = 19 MiB.
  EXPECT_EQ(m.stats().allocated_bytes.current, 20 * kMiB);
  EXPECT_EQ(m.stats().requested_bytes.current, 19 * kMiB);
  EXPECT_EQ(m.stats().reserved_bytes.current, 20 * kMiB);
  EXPECT_EQ(m.stats().segments.current, 1u);
  // The 11 MiB free piece existed between the two requests, then was taken whole.
  EXPECT_EQ(m.stats().inactive_split_bytes.peak, 11 * kMiB);
  EXPECT_EQ(m.stats().inactive_split_bytes.current, 0u);
}

TEST(CachingAllocator, ARecordedBlockWaitsForItsEvents) {
  // free() of a block with stream_uses: allocated bytes drop at once, but insert_events keeps the
  // block out of the pool (and unmerged) until process_events sees its events complete;
  // release_cached_blocks synchronises on every event first (synchronize_and_free_events).
  CachingAllocatorModel m(AllocatorConfig{});
  auto a = m.malloc(30 * kMiB, 1);
  ASSERT_TRUE(a);
  m.free_recorded(*a);
  EXPECT_EQ(m.stats().allocated_bytes.current, 0u);
  EXPECT_EQ(m.recorded_pending(), 1u);
  auto b = m.malloc(30 * kMiB, 1);  // the first block is not free yet: a second segment
  ASSERT_TRUE(b);
  EXPECT_NE(b->address, a->address);
  EXPECT_EQ(m.stats().reserved_bytes.current, 60 * kMiB);
  m.release_oldest_recorded();
  m.free(*b);
  auto c = m.malloc(30 * kMiB, 1);  // best fit: the lower of the two cached 30 MiB blocks
  ASSERT_TRUE(c);
  EXPECT_EQ(c->address, a->address);
  EXPECT_EQ(m.stats().num_device_alloc, 2u);
  EXPECT_THROW(m.free_recorded(*b), InternalError);  // b is cached, not live
  m.free_recorded(*c);
  m.empty_cache();  // waits for c's events, then frees both segments
  EXPECT_EQ(m.recorded_pending(), 0u);
  EXPECT_EQ(m.stats().reserved_bytes.current, 0u);
}

TEST(CachingAllocator, FreedSegmentIsReused) {
  // free_block returns the block to the pool; get_free_block finds it again.
  CachingAllocatorModel m(AllocatorConfig{});
  auto a = m.malloc(8 * kMiB);  // 20 MiB segment: a [0, 8), free [8, 20)
  ASSERT_TRUE(a);
  m.free(*a);  // merges back into one free 20 MiB block; the segment stays reserved
  EXPECT_EQ(m.stats().reserved_bytes.current, 20 * kMiB);
  EXPECT_EQ(m.stats().allocated_bytes.current, 0u);
  auto b = m.malloc(8 * kMiB);  // best fit: that 20 MiB block, no cudaMalloc
  ASSERT_TRUE(b);
  EXPECT_EQ(b->address, a->address);
  EXPECT_EQ(m.stats().num_device_alloc, 1u);
  EXPECT_EQ(m.stats().segments.peak, 1u);
  EXPECT_EQ(m.stats().reserved_bytes.peak, 20 * kMiB);
  EXPECT_EQ(m.stats().allocated_bytes.current, 8 * kMiB);
}

TEST(CachingAllocator, BlocksAreReusedOnlyByTheirStream) {
  // get_free_block searches with the request's stream (BlockComparatorSize orders by stream
  // first and the search stops at another stream's blocks).
  CachingAllocatorModel m(AllocatorConfig{});
  auto a = m.malloc(kMiB, 1);  // 2 MiB small segment on stream 1
  ASSERT_TRUE(a);
  m.free(*a);                  // cached on stream 1
  auto b = m.malloc(kMiB, 0);  // stream 0 cannot use it: a second 2 MiB segment
  ASSERT_TRUE(b);
  EXPECT_EQ(m.stats().reserved_bytes.current, 4 * kMiB);
  EXPECT_EQ(m.stats().segments.current, 2u);
  auto c = m.malloc(kMiB, 1);  // stream 1 gets its cached block back
  ASSERT_TRUE(c);
  EXPECT_EQ(c->address, a->address);
  EXPECT_EQ(m.stats().reserved_bytes.current, 4 * kMiB);
  EXPECT_EQ(m.stats().num_device_alloc, 2u);
}

TEST(CachingAllocator, FreeBlocksDoNotMergeAcrossSegments) {
  // try_merge_blocks only joins prev/next inside one segment, so free space in two segments
  // cannot serve one larger request.
  CachingAllocatorModel m(AllocatorConfig{});
  auto a = m.malloc(6 * kMiB);   // S1 (20 MiB): a [0, 6), free [6, 20)
  auto b = m.malloc(14 * kMiB);  // best fit: S1's 14 MiB block exactly, no remainder
  auto c = m.malloc(6 * kMiB);   // S2 (20 MiB): c [0, 6), free [6, 20)
  ASSERT_TRUE(a && b && c);
  m.free(*b);  // S1: a [0, 6), free [6, 20); 28 MiB free in two 14 MiB pieces
  EXPECT_EQ(m.stats().inactive_split_bytes.current, 28 * kMiB);
  EXPECT_EQ(m.stats().inactive_split.current, 2u);
  // 24 MiB (>= 10 MiB: rounded to 2 MiB, 24 MiB) fits neither piece: S3 of 24 MiB.
  auto d = m.malloc(24 * kMiB);
  ASSERT_TRUE(d);
  // allocated peak: a + c + d = 6 + 6 + 24 = 36 MiB (before: a + b + c = 26 MiB);
  // reserved peak: 20 + 20 + 24 = 64 MiB.
  EXPECT_EQ(m.stats().allocated_bytes.peak, 36 * kMiB);
  EXPECT_EQ(m.stats().reserved_bytes.peak, 64 * kMiB);
  EXPECT_EQ(m.stats().segments.current, 3u);
}

TEST(CachingAllocator, ExpandableSegmentGrowsInsteadOfFragmenting) {
  // The same sequence with expandable_segments:True: one segment per pool and stream grows by
  // 20 MiB pages (find_expandable_block: kLargeBuffer pages in the large pool; map_block), and
  // should_split splits any remainder >= 512 B.
  CachingAllocatorModel m(expandable());
  auto a = m.malloc(6 * kMiB);   // page 1 [0, 20): a [0, 6), free [6, 20)
  auto b = m.malloc(14 * kMiB);  // free [6, 20) exactly
  auto c = m.malloc(6 * kMiB);   // nothing free: page 2 [20, 40): c [20, 26), free [26, 40)
  ASSERT_TRUE(a && b && c);
  m.free(*b);  // free [6, 20) and [26, 40): 14 MiB each, no merge (a, c live)
  // d = 24 MiB: no 24 MiB free block; find_expandable_block starts at the free [26, 40) before
  // the unmapped rest; map 24 - 14 = 10 MiB -> one page [40, 60); merged [26, 60) = 34 MiB;
  // d [26, 50), free [50, 60).
  auto d = m.malloc(24 * kMiB);
  ASSERT_TRUE(d);
  EXPECT_EQ(m.stats().allocated_bytes.peak, 36 * kMiB);
  EXPECT_EQ(m.stats().reserved_bytes.peak, 60 * kMiB);  // 3 pages, not 64 MiB
  EXPECT_EQ(m.stats().num_device_alloc, 3u);            // three page mappings
  EXPECT_EQ(m.stats().segments.current, 0u);            // PyTorch's `segment` counts cudaMallocs
  EXPECT_EQ(m.stats().expandable_segments.current, 1u);
}

// --- expandable segments -------------------------------------------------------------------

TEST(CachingAllocator, ExpandableLargePoolReservesWhole20MiBPages) {
  // alloc_block with expandable segments maps the rounded request size (not
  // get_allocation_size's) in pages of kLargeBuffer = 20 MiB (find_expandable_block), and
  // pages stay mapped after free until release_cached_blocks unmaps them (unmap_block).
  CachingAllocatorModel m(expandable());
  auto a = m.malloc(3 * kMiB);  // maps 1 page: [0, 20); a [0, 3), free [3, 20)
  ASSERT_TRUE(a);
  EXPECT_EQ(m.stats().reserved_bytes.current, 20 * kMiB);
  auto b = m.malloc(3 * kMiB);  // from the free 17 MiB: b [3, 6), free [6, 20)
  ASSERT_TRUE(b);
  EXPECT_EQ(m.stats().reserved_bytes.current, 20 * kMiB);
  // 30 MiB: free [6, 20) is 14 MiB; map 30 - 14 = 16 MiB -> one page [20, 40);
  // merged [6, 40) = 34 MiB: c [6, 36), free [36, 40). Reserved 2 pages = 40 MiB
  // (without expandable segments: 20 MiB + a 30 MiB segment = 50 MiB).
  auto c = m.malloc(30 * kMiB);
  ASSERT_TRUE(c);
  EXPECT_EQ(m.stats().reserved_bytes.current, 40 * kMiB);
  EXPECT_EQ(m.stats().allocated_bytes.current, 36 * kMiB);
  EXPECT_EQ(m.stats().num_device_alloc, 2u);
  m.free(*a);
  m.free(*b);
  m.free(*c);  // one free mapped block [0, 40); pages stay mapped
  EXPECT_EQ(m.stats().reserved_bytes.current, 40 * kMiB);
  m.empty_cache();  // unmaps both pages; the segment is empty again and released
  EXPECT_EQ(m.stats().reserved_bytes.current, 0u);
  EXPECT_EQ(m.stats().reserved_bytes.peak, 40 * kMiB);
  EXPECT_EQ(m.stats().expandable_segments.current, 0u);
  EXPECT_EQ(m.stats().num_device_free, 1u);
}

TEST(CachingAllocator, ExpandableSmallPoolUses2MiBPages) {
  // find_expandable_block: pages of kSmallBuffer = 2 MiB in the small pool.
  CachingAllocatorModel m(expandable());
  auto a = m.malloc(kMiB);        // page [0, 2): a [0, 1), free [1, 2)
  auto b = m.malloc(kMiB);        // free [1, 2) exactly
  ASSERT_TRUE(a && b);
  EXPECT_EQ(m.stats().reserved_bytes.current, 2 * kMiB);
  auto c = m.malloc(512 * kKiB);  // nothing free; b is live before the unmapped rest: page [2, 4)
  ASSERT_TRUE(c);
  EXPECT_EQ(m.stats().reserved_bytes.current, 4 * kMiB);
  EXPECT_EQ(m.stats().num_device_alloc, 2u);
}

TEST(CachingAllocator, ExpandableOutOfMemoryUnmapsFreePagesAndRetries) {
  // malloc -> alloc_block fails (map would pass the capacity) -> release_cached_blocks unmaps
  // the free pages of every stream's segment -> the retry maps them for the new request.
  CachingAllocatorModel m(expandable(40 * kMiB));
  auto a = m.malloc(30 * kMiB, 0);  // stream 0: 2 pages [0, 40); a [0, 30), free [30, 40)
  ASSERT_TRUE(a);
  m.free(*a);  // one free block [0, 40), still mapped: reserved 40 MiB = the capacity
  // Stream 1 needs its own segment; mapping one 20 MiB page fails (40 + 20 > 40). The flush
  // unmaps stream 0's 40 MiB and drops that segment; the retry maps one page for stream 1.
  auto b = m.malloc(3 * kMiB, 1);
  ASSERT_TRUE(b);
  EXPECT_EQ(m.stats().num_alloc_retries, 1u);
  EXPECT_EQ(m.stats().reserved_bytes.current, 20 * kMiB);
  EXPECT_EQ(m.stats().reserved_bytes.peak, 40 * kMiB);
  EXPECT_EQ(m.stats().expandable_segments.current, 1u);
  EXPECT_EQ(m.stats().expandable_segments.peak, 2u);
  EXPECT_EQ(m.stats().num_ooms, 0u);
}

// --- running out of memory -----------------------------------------------------------------

TEST(CachingAllocator, FreesCachedSegmentsAndRetries) {
  // malloc: alloc_block fails -> release_cached_blocks -> alloc_block(isRetry) succeeds.
  CachingAllocatorModel m(with_capacity(40 * kMiB));
  auto a = m.malloc(16 * kMiB, 0);  // its own 16 MiB segment
  ASSERT_TRUE(a);
  m.free(*a);  // cached: reserved 16 MiB
  // 30 MiB: the cached 16 MiB block is too small; a new 30 MiB segment needs 16 + 30 = 46 >
  // 40 MiB. Without max_split_size_mb release_available_cached_blocks does nothing, so the
  // cache is flushed (16 MiB freed) and the retry gets 30 MiB.
  auto b = m.malloc(30 * kMiB, 0);
  ASSERT_TRUE(b);
  EXPECT_EQ(m.stats().num_alloc_retries, 1u);
  EXPECT_EQ(m.stats().reserved_bytes.current, 30 * kMiB);
  EXPECT_EQ(m.stats().reserved_bytes.peak, 30 * kMiB);
  EXPECT_EQ(m.stats().segments.current, 1u);
  EXPECT_EQ(m.stats().num_device_alloc, 2u);
  EXPECT_EQ(m.stats().num_device_free, 1u);
  EXPECT_EQ(m.stats().num_ooms, 0u);
  EXPECT_FALSE(m.stats().first_oom);
}

TEST(CachingAllocator, OutOfMemoryIsAResult) {
  // The same, then a request that cannot fit even after the flush: 30 MiB live (b holds its
  // whole segment), 12 MiB more would make 42 > 40 MiB; the flush finds nothing to free, the
  // retry fails and malloc reports out of memory (PyTorch: OutOfMemoryError).
  CachingAllocatorModel m(with_capacity(40 * kMiB));
  auto a = m.malloc(16 * kMiB);  // request 0
  ASSERT_TRUE(a);
  m.free(*a);
  ASSERT_TRUE(m.malloc(30 * kMiB));  // request 1, after one flush
  auto c = m.malloc(12 * kMiB);      // request 2
  EXPECT_FALSE(c);
  EXPECT_EQ(m.stats().num_ooms, 1u);
  EXPECT_EQ(m.stats().num_alloc_retries, 2u);  // one flush per failed cudaMalloc
  ASSERT_TRUE(m.stats().first_oom);
  EXPECT_EQ(m.stats().first_oom->request, 2u);
  EXPECT_EQ(m.stats().first_oom->bytes, 12 * kMiB);
  EXPECT_EQ(m.stats().reserved_bytes.current, 30 * kMiB);
  EXPECT_EQ(m.stats().allocated_bytes.current, 30 * kMiB);
  // allocate(): 1 EB or more is refused outright.
  EXPECT_FALSE(m.malloc(1ULL << 60));
  EXPECT_EQ(m.stats().num_ooms, 2u);
  EXPECT_EQ(m.stats().first_oom->request, 2u);
}

TEST(CachingAllocator, FlushKeepsSegmentsThatAreStillInUse) {
  // release_blocks frees only cached blocks that are whole segments (!prev && !next): a free
  // piece of a segment with a live block cannot be returned, so the request fails.
  CachingAllocatorModel m(with_capacity(40 * kMiB));
  auto a = m.malloc(2 * kMiB);   // 20 MiB segment: a [0, 2), free [2, 20)
  auto b = m.malloc(16 * kMiB);  // from the free 18 MiB: b [2, 18), free [18, 20)
  ASSERT_TRUE(a && b);
  m.free(*b);  // free [2, 20) = 18 MiB, but a keeps the segment split
  // 22 MiB: no free block that large; a 22 MiB segment needs 20 + 22 = 42 > 40; the flush
  // cannot free the split segment: out of memory with 18 MiB free in the cache.
  EXPECT_FALSE(m.malloc(22 * kMiB));
  EXPECT_EQ(m.stats().reserved_bytes.current, 20 * kMiB);
  EXPECT_EQ(m.stats().inactive_split_bytes.current, 18 * kMiB);
  EXPECT_EQ(m.stats().num_device_free, 0u);
  EXPECT_EQ(m.stats().num_ooms, 1u);
}

// --- max_split_size_mb ---------------------------------------------------------------------

TEST(CachingAllocator, OversizeBlocksAreNotGivenToSmallerRequests) {
  // get_free_block: "Do not return an oversized block for a large request" — a cached block
  // >= max_split_size is refused to a request < max_split_size.
  {
    CachingAllocatorModel m(with_max_split(32 * kMiB));
    auto x = m.malloc(40 * kMiB);  // 40 MiB segment, >= 32 MiB: not split (should_split)
    ASSERT_TRUE(x);
    m.free(*x);
    ASSERT_TRUE(m.malloc(24 * kMiB));  // refused the 40 MiB block: a new 24 MiB segment
    EXPECT_EQ(m.stats().reserved_bytes.current, 64 * kMiB);
    EXPECT_EQ(m.stats().segments.current, 2u);
    EXPECT_EQ(m.stats().allocated_bytes.current, 24 * kMiB);
  }
  {
    // Default (unlimited): the 40 MiB block is reused and split (16 MiB > 1 MiB left).
    CachingAllocatorModel m(AllocatorConfig{});
    auto x = m.malloc(40 * kMiB);
    ASSERT_TRUE(x);
    m.free(*x);
    ASSERT_TRUE(m.malloc(24 * kMiB));
    EXPECT_EQ(m.stats().reserved_bytes.current, 40 * kMiB);
    EXPECT_EQ(m.stats().segments.current, 1u);
    EXPECT_EQ(m.stats().allocated_bytes.current, 24 * kMiB);
  }
}

TEST(CachingAllocator, OversizeBlocksServeRequestsLessThan20MiBSmaller) {
  // get_free_block: "Allow oversized block size to be rounded up but within a limit" — an
  // oversize request takes a cached block only if block < request + kLargeBuffer (20 MiB),
  // and takes it whole (should_split: no split at or above max_split_size).
  CachingAllocatorModel m(with_max_split(32 * kMiB));
  auto x = m.malloc(60 * kMiB);
  ASSERT_TRUE(x);
  m.free(*x);
  auto y = m.malloc(41 * kMiB);  // 60 < 41 + 20 = 61: reuse, whole
  ASSERT_TRUE(y);
  EXPECT_EQ(y->address, x->address);
  EXPECT_EQ(m.stats().allocated_bytes.current, 60 * kMiB);
  EXPECT_EQ(m.stats().requested_bytes.current, 41 * kMiB);
  EXPECT_EQ(m.stats().reserved_bytes.current, 60 * kMiB);
  m.free(*y);
  ASSERT_TRUE(m.malloc(40 * kMiB));  // 60 >= 40 + 20: refused, a new 40 MiB segment
  EXPECT_EQ(m.stats().reserved_bytes.current, 100 * kMiB);
  EXPECT_EQ(m.stats().segments.current, 2u);
}

TEST(CachingAllocator, MaxSplitFreesOneOversizeBlockBeforeFlushing) {
  // release_available_cached_blocks: with max_split_size set, a failed cudaMalloc first frees
  // the smallest cached oversize block of at least max(request, max_split_size), without a
  // full flush: the cached small segment survives and num_alloc_retries stays 0.
  CachingAllocatorModel m(with_max_split(32 * kMiB, 90 * kMiB));
  auto s = m.malloc(kMiB);  // small pool: 2 MiB segment
  ASSERT_TRUE(s);
  m.free(*s);
  auto x = m.malloc(60 * kMiB);  // reserved 62 MiB
  ASSERT_TRUE(x);
  m.free(*x);
  // 35 MiB: the cached 60 MiB is refused (60 >= 35 + 20); a new segment of 36 MiB (35 rounded
  // up to 2 MiB) needs 62 + 36 = 98 > 90; release the 60 MiB block (the smallest cached block
  // >= max(35, 32)); 2 + 36 = 38 fits.
  ASSERT_TRUE(m.malloc(35 * kMiB));
  EXPECT_EQ(m.stats().reserved_bytes.current, 38 * kMiB);
  EXPECT_EQ(m.stats().allocated_bytes.current, 36 * kMiB);  // >= max_split_size: not split
  EXPECT_EQ(m.stats().segments.current, 2u);
  EXPECT_EQ(m.stats().num_alloc_retries, 0u);
  EXPECT_EQ(m.stats().num_device_free, 1u);
}

TEST(CachingAllocator, MaxSplitFreesOversizeBlocksLargestFirst) {
  // release_available_cached_blocks, no single block large enough: free oversize blocks from
  // the largest down until at least max(request, max_split_size) bytes are freed.
  CachingAllocatorModel m(with_max_split(32 * kMiB, 100 * kMiB));
  auto s = m.malloc(kMiB);  // 2 MiB small segment, cached
  ASSERT_TRUE(s);
  m.free(*s);
  auto x = m.malloc(40 * kMiB);
  auto y = m.malloc(44 * kMiB);  // reserved 2 + 40 + 44 = 86 MiB
  ASSERT_TRUE(x && y);
  m.free(*x);
  m.free(*y);
  // 50 MiB: no cached block >= 50; 86 + 50 > 100. Free 44 (44 < 50), then 40 (84 >= 50);
  // reserved 2, and 2 + 50 = 52 fits.
  ASSERT_TRUE(m.malloc(50 * kMiB));
  EXPECT_EQ(m.stats().reserved_bytes.current, 52 * kMiB);
  EXPECT_EQ(m.stats().num_device_free, 2u);
  EXPECT_EQ(m.stats().num_alloc_retries, 0u);
  EXPECT_EQ(m.stats().segments.current, 2u);
}

// --- PYTORCH_CUDA_ALLOC_CONF ---------------------------------------------------------------

TEST(AllocatorConfigParse, GoodStrings) {
  // CUDAAllocatorConfig::parseArgs / parseMaxSplitSize: key:value pairs, comma separated,
  // spaces ignored, max_split_size_mb in MiB.
  const std::uint64_t capacity = 80ULL << 30;
  AllocatorConfig d = AllocatorConfig::parse("", capacity);
  EXPECT_FALSE(d.expandable_segments);
  EXPECT_FALSE(d.max_split_size_bytes);
  EXPECT_EQ(d.capacity_bytes, capacity);

  EXPECT_TRUE(AllocatorConfig::parse("expandable_segments:True", capacity).expandable_segments);

  AllocatorConfig both = AllocatorConfig::parse("expandable_segments:False,max_split_size_mb:256", capacity);
  EXPECT_FALSE(both.expandable_segments);
  ASSERT_TRUE(both.max_split_size_bytes);
  EXPECT_EQ(*both.max_split_size_bytes, 268435456u);  // 256 * 1048576

  AllocatorConfig spaced = AllocatorConfig::parse(" max_split_size_mb : 21 ,", capacity);
  ASSERT_TRUE(spaced.max_split_size_bytes);
  EXPECT_EQ(*spaced.max_split_size_bytes, 22020096u);  // 21 * 1048576, the smallest allowed
}

TEST(AllocatorConfigParse, BadStringsNameTheKey) {
  const std::uint64_t capacity = 80ULL << 30;
  EXPECT_EQ(input_error_of([&] { AllocatorConfig::parse("foo:1", capacity); }),
            "PYTORCH_CUDA_ALLOC_CONF: foo is not a PyTorch caching-allocator option (this model "
            "reads expandable_segments and max_split_size_mb)");
  EXPECT_THAT(input_error_of([&] { AllocatorConfig::parse("expandable_segments:True,garbage_collection_threshold:0.6", capacity); }),
              HasSubstr("garbage_collection_threshold is a PyTorch allocator option this model does not simulate"));
  EXPECT_THAT(input_error_of([&] { AllocatorConfig::parse("roundup_power2_divisions:4", capacity); }),
              HasSubstr("roundup_power2_divisions"));
  // parseMaxSplitSize: must be > kLargeBuffer / 1 MiB = 20.
  EXPECT_EQ(input_error_of([&] { AllocatorConfig::parse("max_split_size_mb:20", capacity); }),
            "PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb must be a whole number of MiB greater than "
            "20, got \"20\"");
  EXPECT_THAT(input_error_of([&] { AllocatorConfig::parse("max_split_size_mb:lots", capacity); }),
              HasSubstr("max_split_size_mb"));
  // parseArgs: exactly True or False.
  EXPECT_EQ(input_error_of([&] { AllocatorConfig::parse("expandable_segments:true", capacity); }),
            "PYTORCH_CUDA_ALLOC_CONF: expandable_segments must be True or False, got \"true\"");
  EXPECT_THAT(input_error_of([&] { AllocatorConfig::parse("expandable_segments", capacity); }),
              HasSubstr("expandable_segments needs a value"));
  EXPECT_THAT(input_error_of([&] { AllocatorConfig::parse(",expandable_segments:True", capacity); }),
              HasSubstr("empty option"));
}

// --- misuse and peaks ----------------------------------------------------------------------

TEST(CachingAllocator, FreeOfANonLiveBlockIsABug) {
  CachingAllocatorModel m(AllocatorConfig{});
  auto a = m.malloc(kMiB);
  ASSERT_TRUE(a);
  m.free(*a);
  EXPECT_THROW(m.free(*a), InternalError);               // double free
  EXPECT_THROW(m.free(BlockId{12345}), InternalError);   // never allocated
  AllocatorConfig bad;
  bad.max_split_size_bytes = 20 * kMiB;  // parseMaxSplitSize never allows <= 20 MiB
  EXPECT_THROW(
      {
        CachingAllocatorModel model(bad);
        (void)model;
      },
      InternalError);
}

TEST(CachingAllocator, ResetPeakStats) {
  // resetPeakStats: peak = current.
  CachingAllocatorModel m(AllocatorConfig{});
  auto a = m.malloc(12 * kMiB);  // 12 MiB segment
  auto b = m.malloc(12 * kMiB);  // another: allocated 24 MiB, reserved 24 MiB
  ASSERT_TRUE(a && b);
  m.free(*a);
  m.reset_peak_stats();
  EXPECT_EQ(m.stats().allocated_bytes.peak, 12 * kMiB);
  EXPECT_EQ(m.stats().reserved_bytes.peak, 24 * kMiB);
  EXPECT_EQ(m.stats().allocations.peak, 1u);
}

TEST(CachingAllocator, RandomSequencesKeepTheBooksStraight) {
  // Invariants over seeded random alloc/free sequences on three streams, in both modes and
  // with a tight capacity: requested_bytes is the sum of live requests; allocated never
  // exceeds reserved nor reserved the capacity; every block is at least its 512-rounded
  // request; freeing everything and emptying the cache gives every segment back.
  for (const bool expand : {false, true}) {
    AllocatorConfig cfg;
    cfg.expandable_segments = expand;
    cfg.capacity_bytes = 600 * kMiB;
    CachingAllocatorModel m(cfg);
    std::mt19937_64 rng(20240601);
    std::vector<std::pair<BlockId, std::uint64_t>> live;
    std::uint64_t live_requested = 0;
    for (int step = 0; step < 4000; ++step) {
      if (live.empty() || rng() % 3 != 0) {
        // sizes from 1 B to 48 MiB, skewed small
        const std::uint64_t bytes = 1 + rng() % (rng() % 4 == 0 ? 48 * kMiB : 2 * kMiB);
        const auto before = m.stats().allocated_bytes.current;
        auto id = m.malloc(bytes, static_cast<int>(rng() % 3));
        if (id) {
          EXPECT_GE(m.stats().allocated_bytes.current - before, caching_allocator::round_size(bytes));
          live.emplace_back(*id, bytes);
          live_requested += bytes;
        }
      } else {
        const std::size_t i = rng() % live.size();
        m.free(live[i].first);
        live_requested -= live[i].second;
        live[i] = live.back();
        live.pop_back();
      }
      ASSERT_EQ(m.stats().requested_bytes.current, live_requested);
      ASSERT_LE(m.stats().allocated_bytes.current, m.stats().reserved_bytes.current);
      ASSERT_LE(m.stats().reserved_bytes.current, cfg.capacity_bytes);
    }
    EXPECT_GT(m.stats().num_alloc_retries, 0u) << "the capacity should have been reached";
    for (const auto& [id, bytes] : live) m.free(id);
    m.empty_cache();
    EXPECT_EQ(m.stats().allocated_bytes.current, 0u);
    EXPECT_EQ(m.stats().reserved_bytes.current, 0u);
    EXPECT_EQ(m.stats().segments.current, 0u);
    EXPECT_EQ(m.stats().expandable_segments.current, 0u);
    EXPECT_EQ(m.stats().inactive_split_bytes.current, 0u);
  }
}

}  // namespace
}  // namespace peftplan::sim

// replay_caching_allocator over a step program: setup once, the step twice; a block freed on one
// stream is not reused by a request on another (CUDACachingAllocator.cpp get_free_block keys the
// pools on the stream), so a gather buffer on FSDP's unshard stream does not fit into a cached
// compute block of the same size.
namespace {
peftplan::sim::Program replay_program(peftplan::sim::Stream second) {
  using namespace peftplan::sim;
  Program p;
  const std::int32_t w = p.add_buffer("weights", MemCategory::base_weights, 40u << 20);
  const std::int32_t a = p.add_buffer("act", MemCategory::activations, 30u << 20);
  const std::int32_t g = p.add_buffer("gathered", MemCategory::gathered_weights, 30u << 20);
  auto op = [&](OpKind k, std::int32_t b, Phase ph, Stream s = Stream::compute) {
    Op o;
    o.kind = k;
    o.buffer = b;
    o.phase = ph;
    o.stream = s;
    p.add_op(o);
  };
  op(OpKind::alloc, w, Phase::setup);
  op(OpKind::alloc, a, Phase::forward);
  op(OpKind::free, a, Phase::forward);
  op(OpKind::alloc, g, Phase::backward, second);
  op(OpKind::free, g, Phase::backward, second);
  return p;
}
}  // namespace

TEST(AllocatorReplay, BlocksAreCachedPerStream) {
  using namespace peftplan::sim;
  const AllocatorConfig cfg = AllocatorConfig::parse("", 1ull << 40);
  // One stream: the 30 MiB block of `act` serves `gathered`, in both steps.
  const AllocatorReplay same = replay_caching_allocator(replay_program(Stream::compute), cfg);
  EXPECT_EQ(same.reserved_peak_bytes, (40u << 20) + (30u << 20));
  EXPECT_EQ(same.allocated_peak_bytes, (40u << 20) + (30u << 20));
  // Two streams: each keeps its own 30 MiB segment.
  const AllocatorReplay two = replay_caching_allocator(replay_program(Stream::comm), cfg);
  EXPECT_EQ(two.reserved_peak_bytes, (40u << 20) + 2 * (30u << 20));
  EXPECT_EQ(two.allocated_peak_bytes, (40u << 20) + (30u << 20));
  EXPECT_FALSE(two.oom.has_value());
  // Room for the weights and one segment only: the second stream's request frees the cache and
  // retries (release_cached_blocks), and fits.
  const AllocatorReplay tight = replay_caching_allocator(replay_program(Stream::comm), AllocatorConfig::parse("", (40u << 20) + (30u << 20)));
  EXPECT_FALSE(tight.oom.has_value());
  EXPECT_GE(tight.num_alloc_retries, 1u);
  EXPECT_EQ(tight.reserved_peak_bytes, (40u << 20) + (30u << 20));
}

// Buffer::pieces: a buffer PyTorch allocates as several tensors is replayed piece by piece, each
// piece at the first op that touches it. Lazily created optimizer states (a setup buffer whose
// pieces torch.optim creates at the first step(), torch/optim/adamw.py _init_group) land in the
// activation segment the first step freed, so the second step's activation needs a segment of
// its own: the fragmentation behind the published full fine-tuning row A1.
namespace {
struct ReplayBuilder {
  peftplan::sim::Program p;
  void op(peftplan::sim::OpKind k, std::int32_t b, peftplan::sim::Phase ph,
          peftplan::sim::Stream s = peftplan::sim::Stream::compute) {
    peftplan::sim::Op o;
    o.kind = k;
    o.buffer = b;
    o.phase = ph;
    o.stream = s;
    p.add_op(o);
  }
  void touch(std::int32_t b, peftplan::sim::Phase ph) {
    peftplan::sim::Op o;
    o.kind = peftplan::sim::OpKind::compute;
    o.phase = ph;
    peftplan::sim::ops::emit(p, o, peftplan::sim::ops::Accumulate{.in = b});
    p.add_op(o);
  }
};

peftplan::sim::Program lazy_states_program(bool pieces) {
  using namespace peftplan::sim;
  ReplayBuilder r;
  const std::int32_t w = r.p.add_buffer("weights", MemCategory::base_weights, 40 * kMiB);
  const std::int32_t st = r.p.add_buffer("optimizer.states", MemCategory::optimizer_states, 48 * kMiB);
  if (pieces) r.p.buffers[static_cast<std::size_t>(st)].pieces = {24 * kMiB, 24 * kMiB};
  const std::int32_t a = r.p.add_buffer("act", MemCategory::activations, 64 * kMiB);
  r.op(OpKind::alloc, w, Phase::setup);
  r.op(OpKind::alloc, st, Phase::setup);
  r.op(OpKind::alloc, a, Phase::forward);
  r.touch(a, Phase::forward);
  r.op(OpKind::free, a, Phase::backward);
  r.touch(st, Phase::optimizer);
  return r.p;
}
}  // namespace

TEST(AllocatorReplay, LazyStatePiecesFragmentTheActivationSegment) {
  using namespace peftplan::sim;
  const AllocatorConfig cfg = AllocatorConfig::parse("", 1ull << 40);
  // One 48 MiB state allocated at setup: weights 40 + states 48 + one 64 MiB activation segment
  // that both steps reuse.
  const AllocatorReplay flat = replay_caching_allocator(lazy_states_program(false), cfg);
  EXPECT_EQ(flat.reserved_peak_bytes, (40 + 48 + 64) * kMiB);
  // Two 24 MiB pieces at step 1's optimizer op: best fit is the freed 64 MiB activation block,
  // split (40 MiB, then 16 MiB remain: more than 1 MiB, should_split). Step 2's 64 MiB
  // activation finds only the 16 MiB remainder and takes a new segment: 40 + 64 + 64.
  const AllocatorReplay lazy = replay_caching_allocator(lazy_states_program(true), cfg);
  EXPECT_EQ(lazy.reserved_peak_bytes, (40 + 64 + 64) * kMiB);
  EXPECT_EQ(lazy.allocated_peak_bytes, (40 + 48 + 64) * kMiB);  // step 2, states live
  EXPECT_TRUE(verify(lazy_states_program(true)).empty());
}

// A piece is allocated when an op touches its bytes (here through a view), not when the buffer's
// alloc op runs: the second gradient lands in the activation block freed in between.
TEST(AllocatorReplay, PiecesAreAllocatedWhereFirstTouched) {
  using namespace peftplan::sim;
  ReplayBuilder r;
  const std::int32_t w = r.p.add_buffer("weights", MemCategory::base_weights, 40 * kMiB);
  const std::int32_t g = r.p.add_buffer("grad.flat", MemCategory::gradients, 60 * kMiB);
  r.p.buffers[static_cast<std::size_t>(g)].pieces = {30 * kMiB, 30 * kMiB};
  const std::int32_t g0 = r.p.add_view("grad.0", g, 0, 30 * kMiB);
  const std::int32_t g1 = r.p.add_view("grad.1", g, 30 * kMiB, 30 * kMiB);
  const std::int32_t a = r.p.add_buffer("act", MemCategory::activations, 50 * kMiB);
  r.op(OpKind::alloc, w, Phase::setup);
  r.op(OpKind::alloc, g, Phase::backward);
  r.touch(g0, Phase::backward);  // 30 MiB segment
  r.op(OpKind::alloc, a, Phase::backward);
  r.touch(a, Phase::backward);  // 50 MiB segment
  r.op(OpKind::free, a, Phase::backward);
  r.touch(g1, Phase::backward);  // the cached 50 MiB block, split 30 + 20
  r.op(OpKind::free, g, Phase::optimizer);
  ASSERT_TRUE(verify(r.p).empty());
  const AllocatorReplay rep = replay_caching_allocator(r.p, AllocatorConfig::parse("", 1ull << 40));
  EXPECT_EQ(rep.reserved_peak_bytes, (40 + 30 + 50) * kMiB);  // both pieces at once: 40 + 60 + 50
  EXPECT_EQ(rep.allocated_peak_bytes, (40 + 30 + 50) * kMiB);
}

// Buffer::reuse_after_next_recorded_free: FSDP1 frees each unit's gathered parameters after
// record_stream, and its rate limiter leaves one reshard unfinished when it issues the next
// all-gather (_limiter_utils.py _FreeEventQueue), so consecutive units' gathers need two blocks
// on the unshard stream, not one.
TEST(AllocatorReplay, ARecordedFreeIsReusedOnlyAfterTheNextOne) {
  using namespace peftplan::sim;
  auto program = [](bool recorded) {
    ReplayBuilder r;
    for (int u = 0; u < 3; ++u) {
      const std::int32_t g = r.p.add_buffer("unit.gathered", MemCategory::gathered_weights, 30 * kMiB);
      r.p.buffers[static_cast<std::size_t>(g)].reuse_after_next_recorded_free = recorded;
      r.op(OpKind::alloc, g, Phase::forward, Stream::comm);
      r.touch(g, Phase::forward);
      r.op(OpKind::free, g, Phase::forward);
    }
    return r.p;
  };
  const AllocatorConfig cfg = AllocatorConfig::parse("", 1ull << 40);
  EXPECT_EQ(replay_caching_allocator(program(false), cfg).reserved_peak_bytes, 30 * kMiB);
  const AllocatorReplay rec = replay_caching_allocator(program(true), cfg);
  EXPECT_EQ(rec.reserved_peak_bytes, 60 * kMiB);  // unit 2 reuses unit 0's block, and so on
  EXPECT_EQ(rec.allocated_peak_bytes, 30 * kMiB);  // allocated drops at the free, as in PyTorch
}
