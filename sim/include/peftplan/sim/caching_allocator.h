// A model of PyTorch's CUDA caching allocator (torch 2.4.x, c10/cuda/CUDACachingAllocator.cpp,
// DeviceCachingAllocator), to be replayed over a step program's alloc/free sequence so that
// `reserved` (torch.cuda.max_memory_reserved) is computed from the same rules PyTorch applies:
// 512-byte rounding, small (<= 1 MiB) and large pools, 2 MiB / 20 MiB / rounded segments,
// best-fit reuse per stream, splitting and merging inside a segment, max_split_size_mb, the
// free-cached-segments-and-retry path on a failed cudaMalloc, and expandable segments.
// Each rule is cited beside its code in caching_allocator.cpp.
//
// Deliberately not modelled: CUDA graph private pools, recordStream / cross-stream events in the
// allocator itself (a block is reusable as soon as it is freed; the replay below defers the
// frees a program marks), roundup_power2_divisions, garbage_collection_threshold
// and set_per_process_memory_fraction (configurations naming them are rejected), free-memory
// callbacks, IPC, and memory outside the allocator (CUDA context, NCCL): `capacity_bytes` is what
// the allocator may reserve, not the GPU's size. replay_caching_allocator runs it over a step
// program (the planner's `reserved`).
#pragma once

#include <algorithm>
#include <compare>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>

#include "peftplan/sim/program.h"

namespace peftplan::sim {

// The allocator's size constants and its two size functions, as in CUDACachingAllocator.cpp.
namespace caching_allocator {
inline constexpr std::uint64_t kMinBlockSize = 512;           // every size rounds to 512 B
inline constexpr std::uint64_t kSmallSize = 1ULL << 20;       // largest small-pool request, 1 MiB
inline constexpr std::uint64_t kSmallBuffer = 2ULL << 20;     // small-pool segment, 2 MiB
inline constexpr std::uint64_t kLargeBuffer = 20ULL << 20;    // segment for 1-10 MiB, 20 MiB
inline constexpr std::uint64_t kMinLargeAlloc = 10ULL << 20;  // below this: a kLargeBuffer segment
inline constexpr std::uint64_t kRoundLarge = 2ULL << 20;      // larger segments: 2 MiB multiples

// Bytes the allocator hands out for a request of `bytes` (round_size): 0 -> 512, 513 -> 1024.
std::uint64_t round_size(std::uint64_t bytes);
// Bytes of the segment cudaMalloc'd for a rounded request (get_allocation_size).
std::uint64_t allocation_size(std::uint64_t rounded_bytes);
}  // namespace caching_allocator

struct AllocatorConfig {
  bool expandable_segments = false;  // expandable_segments:True
  // max_split_size_mb, in bytes; nullopt = unlimited (PyTorch's default, SIZE_MAX).
  std::optional<std::uint64_t> max_split_size_bytes;
  // Bytes the allocator may reserve in all (segments plus mapped pages); a cudaMalloc or page
  // mapping that would go beyond fails as cudaErrorMemoryAllocation would.
  std::uint64_t capacity_bytes = std::numeric_limits<std::uint64_t>::max();

  // A PYTORCH_CUDA_ALLOC_CONF string ("expandable_segments:True,max_split_size_mb:256"; "" =
  // defaults) and the capacity. Throws InputError naming the key for anything else.
  static AllocatorConfig parse(std::string_view alloc_conf, std::uint64_t capacity);
};

// A live allocation: its modelled device address, and the model's handle for the block (so that a
// free finds it without a search). address 0 is the null pointer PyTorch returns for a 0-byte
// request (no block, no memory); freeing it does nothing.
struct BlockId {
  std::uint64_t address = 0;
  std::uint32_t slot = 0;
  friend bool operator==(const BlockId&, const BlockId&) = default;
};

// One of PyTorch's memory_stats() counters: its value now and its peak since construction or
// reset_peak_stats().
struct AllocatorStat {
  std::uint64_t current = 0;
  std::uint64_t peak = 0;
};

// The first request that could not be served even after freeing the cache.
struct OomEvent {
  std::uint64_t request = 0;  // index of the malloc() call, counting from 0 (0-byte calls too)
  std::uint64_t bytes = 0;    // bytes asked for
  int stream = 0;
};

// Aggregate statistics (PyTorch's "*.all.*" entries of torch.cuda.memory_stats()).
struct AllocatorStats {
  AllocatorStat allocated_bytes;       // sum of live blocks' sizes (rounded, after any no-split
                                       // rounding up): memory_allocated / max_memory_allocated
  AllocatorStat reserved_bytes;        // segments plus mapped pages: memory_reserved /
                                       // max_memory_reserved
  AllocatorStat requested_bytes;       // sum of live requests as asked (requested_bytes)
  AllocatorStat inactive_split_bytes;  // free blocks inside partly used cudaMalloc segments
  AllocatorStat inactive_split;        // their number
  AllocatorStat allocations;           // live allocations
  AllocatorStat segments;              // live cudaMalloc segments (PyTorch's `segment`;
                                       // expandable segments are not counted there)
  AllocatorStat expandable_segments;   // live expandable segments (not a PyTorch counter)
  std::uint64_t num_malloc_calls = 0;  // malloc() calls, 0-byte ones included
  std::uint64_t num_device_alloc = 0;  // cudaMalloc calls plus page-mapping calls
  std::uint64_t num_device_free = 0;   // cudaFree calls plus page-unmapping calls
  std::uint64_t num_alloc_retries = 0;  // full cache flushes followed by a retry
  std::uint64_t num_ooms = 0;           // requests that failed after the retry
  std::optional<OomEvent> first_oom;
};

// The allocator of one device. malloc/free in program order; stats() at any point.
class CachingAllocatorModel {
 public:
  explicit CachingAllocatorModel(AllocatorConfig cfg);

  // A block for `bytes` on `stream`, or nullopt when even freeing every cached segment leaves
  // no room (PyTorch would raise torch.cuda.OutOfMemoryError; here it is a result).
  std::optional<BlockId> malloc(std::uint64_t bytes, int stream = 0);
  // Returns a live block to the cache. Throws InternalError for an id that is not live.
  void free(BlockId id);
  // free() of a block another stream still uses (record_stream): the allocated and requested
  // bytes drop now, but the block stays out of the cache, unmerged, until its events complete
  // (DeviceCachingAllocator::free: insert_events when stream_uses is not empty).
  void free_recorded(BlockId id);
  // The oldest recorded block's events completed: it goes back to the cache (process_events).
  void release_oldest_recorded();
  std::size_t recorded_pending() const { return recorded_.size(); }
  // torch.cuda.empty_cache(): frees every cached segment that is entirely unused.
  void empty_cache();
  // torch.cuda.reset_peak_memory_stats(): every peak becomes its current value.
  void reset_peak_stats();

  const AllocatorStats& stats() const { return stats_; }
  const AllocatorConfig& config() const { return config_; }

 private:
  static constexpr std::uint32_t kNone = 0xffffffffu;
  // A block and its neighbours inside its segment (PyTorch's Block::prev / Block::next): blocks
  // tile their segment in address order. Blocks live in a slab and are named by their slot.
  struct Block {
    std::uint64_t address = 0;          // 0: the slot is unused
    std::uint64_t size = 0;             // bytes, a multiple of 512
    std::uint64_t requested_bytes = 0;  // what malloc() asked for, while allocated
    std::uint32_t segment = 0;          // owning segment
    std::uint32_t prev = kNone;         // the block before it in its segment
    std::uint32_t next = kNone;         // the block after it in its segment
    int stream = 0;
    bool small = false;      // small pool (blocks of requests <= 1 MiB)
    bool allocated = false;  // handed out by malloc()
    bool mapped = true;      // backed by physical pages (false: unmapped expandable range)
    bool recorded = false;   // freed, waiting for its stream events (still `allocated`, so
                             // that nothing merges with it or finds it)
  };
  struct Segment {
    std::uint64_t base = 0;
    std::uint64_t size = 0;        // cudaMalloc size, or the expandable address range
    std::uint64_t page_bytes = 0;  // expandable: the mapping granularity; 0 otherwise
  };
  struct FreeKey {  // cached free blocks in best-fit order: stream, then size, then address
    int stream = 0;
    std::uint64_t size = 0;
    std::uint64_t address = 0;
    std::uint32_t slot = 0;  // the block (addresses are unique, so it never decides the order)
    auto operator<=>(const FreeKey&) const = default;
  };
  struct UnmappedKey {  // unmapped ranges in address order per stream
    int stream = 0;
    std::uint64_t address = 0;
    std::uint32_t slot = 0;
    auto operator<=>(const UnmappedKey&) const = default;
  };
  // An ordered set in a sorted vector: a step program's pools hold tens of free blocks (40 at
  // most in a Llama-2-70B ZeRO-3 replay), where shifting a few hundred bytes beats a tree's node
  // allocation and pointer chasing. Erasing invalidates only the iterators at and after it.
  template <typename K>
  class FlatSet {
   public:
    using iterator = typename std::vector<K>::iterator;
    iterator begin() { return v_.begin(); }
    iterator end() { return v_.end(); }
    std::size_t size() const { return v_.size(); }
    iterator lower_bound(const K& k) { return std::lower_bound(v_.begin(), v_.end(), k); }
    bool insert(const K& k) {
      const auto it = lower_bound(k);
      if (it != v_.end() && *it == k) return false;
      v_.insert(it, k);
      return true;
    }
    std::size_t erase(const K& k) {
      const auto it = lower_bound(k);
      if (it == v_.end() || !(*it == k)) return 0;
      v_.erase(it);
      return 1;
    }
    iterator erase(iterator it) { return v_.erase(it); }

   private:
    std::vector<K> v_;
  };
  struct Pool {
    FlatSet<FreeKey> free_blocks;   // BlockPool::blocks: cached free, mapped blocks
    FlatSet<UnmappedKey> unmapped;  // BlockPool::unmapped: expandable ranges without pages
  };

  Pool& pool_for(bool small) { return small ? small_ : large_; }
  std::uint64_t max_split() const;
  bool is_expandable(std::uint32_t b) const { return segments_[blocks_[b].segment].page_bytes != 0; }
  bool is_split(std::uint32_t b) const { return blocks_[b].prev != kNone || blocks_[b].next != kNone; }
  std::uint32_t new_block(const Block& b);
  std::uint32_t insert_after(std::uint32_t at, Block b);  // links b in right after `at`
  void drop_block(std::uint32_t b);                         // unlinks b and frees its slot
  std::uint32_t live_block(BlockId id, std::string_view what) const;
  void insert_free(std::uint32_t b);
  void erase_free(std::uint32_t b);
  std::uint32_t try_merge(std::uint32_t dst, bool with_prev, std::uint64_t& subsumed);

  std::optional<std::uint32_t> get_free_block(std::uint64_t size, int stream, bool small);
  std::optional<std::uint32_t> alloc_block(std::uint64_t size, std::uint64_t alloc_size, int stream,
                                           bool small, bool is_retry);
  bool release_available_cached_blocks(std::uint64_t size, int stream, bool small);
  void release_cached_blocks();
  void release_blocks(bool small);
  void release_block(std::uint32_t b);
  std::optional<std::uint32_t> unmap_block(std::uint32_t b);
  void release_expandable_segment(std::uint32_t b);
  std::optional<std::uint32_t> try_allocate_expandable_block(std::uint64_t size, int stream,
                                                             bool small);
  std::uint32_t find_expandable_block(std::uint64_t size, int stream, bool small);
  std::optional<std::uint32_t> map_block(std::uint32_t b, std::uint64_t bytes);
  bool should_split(std::uint32_t b, std::uint64_t size) const;
  void alloc_found_block(std::uint32_t b, std::uint64_t size, std::uint64_t bytes, bool split);
  void free_block(std::uint32_t b);
  std::uint32_t new_segment(std::uint64_t size, std::uint64_t page_bytes, std::uint64_t align);

  AllocatorConfig config_;
  AllocatorStats stats_;
  std::vector<Block> blocks_;           // the slab
  std::vector<std::uint32_t> unused_;   // its free slots
  Pool small_;
  Pool large_;
  std::vector<Segment> segments_;       // by id; a released segment's entry stays, unused
  std::deque<std::uint32_t> recorded_;  // freed blocks waiting for their events, oldest first
  std::uint64_t next_address_;          // where the next segment's address range starts
};

// A step program's device buffers replayed through the allocator: the setup buffers once, then
// the rest of the program `steps` times, so that the second step meets the cache the first left
// (the steady state a training loop runs in). A request is on its alloc op's stream (blocks are
// cached per stream); host buffers and views are skipped. A buffer with allocation pieces
// (Buffer::pieces) is allocated piece by piece, each at the first op that touches it, on that
// op's stream, and freed whole; a setup buffer's pieces, never freed, persist from the first
// step on. A buffer marked reuse_after_next_recorded_free goes back to the cache only at the next
// free of such a buffer (record_stream's deferred reuse).
struct AllocatorReplay {
  std::uint64_t allocated_peak_bytes = 0;  // the allocator's allocated_bytes peak (512-rounded)
  std::uint64_t reserved_peak_bytes = 0;   // max_memory_reserved
  std::uint64_t num_alloc_retries = 0;     // cache flushes that a failed segment forced
  std::optional<OomEvent> oom;             // the first request that failed after the flush
  std::int32_t oom_op = -1;                // its alloc op (a piece's: the op that first touched it)
};
AllocatorReplay replay_caching_allocator(const Program& program, const AllocatorConfig& config, int steps = 2);

}  // namespace peftplan::sim
