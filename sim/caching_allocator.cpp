// The caching-allocator model (see caching_allocator.h).
// Every rule cites the function or constant of PyTorch's c10/cuda/CUDACachingAllocator.cpp
// (DeviceCachingAllocator unless said otherwise) it follows, or c10/cuda/CUDAAllocatorConfig.cpp
// for the option parsing. The behaviour was read from two stored versions of that file that
// bracket torch 2.4.1: pytorch/pytorch@001074d2 (a little after 2.4) and a 2.3/2.4-era copy;
// every function modelled here reads the same in both. Names follow PyTorch's so that each
// piece can be checked against its original; the code is our own.
#include "peftplan/sim/caching_allocator.h"

#include <algorithm>
#include <charconv>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/sim/ops.h"

namespace peftplan::sim {
namespace caching_allocator {

std::uint64_t round_size(std::uint64_t bytes) {
  // round_size: below kMinBlockSize -> kMinBlockSize, otherwise the next multiple of it.
  // (Its roundup_power2_divisions branch is off by default and not modelled.)
  if (bytes < kMinBlockSize) return kMinBlockSize;
  return kMinBlockSize * (bytes / kMinBlockSize + (bytes % kMinBlockSize != 0 ? 1 : 0));
}

std::uint64_t allocation_size(std::uint64_t rounded_bytes) {
  // get_allocation_size: small requests share a 2 MiB segment; requests below kMinLargeAlloc
  // (strictly: 10 MiB itself is rounded, not given 20 MiB) share a 20 MiB one; larger requests
  // get their own segment rounded up to 2 MiB.
  if (rounded_bytes <= kSmallSize) return kSmallBuffer;
  if (rounded_bytes < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * (rounded_bytes / kRoundLarge + (rounded_bytes % kRoundLarge != 0 ? 1 : 0));
}

}  // namespace caching_allocator

using namespace caching_allocator;

namespace {

constexpr std::uint64_t kMiB = 1ULL << 20;

// NativeCachingAllocator::allocate refuses 1 EB (2^60 bytes) and more up front with
// OutOfMemoryError, before the device allocator sees the request.
constexpr std::uint64_t kMaxRequestBytes = 1ULL << 60;

// Modelled addresses start here, so that 0 stays the null pointer of a 0-byte request.
constexpr std::uint64_t kFirstAddress = 1ULL << 32;

// Address space of one expandable segment, in pages. ExpandableSegment reserves 1 1/8 of the
// GPU's total memory; we reserve 2^22 pages (8 TiB in the small pool, 80 TiB in the large),
// more than any GPU holds, so that, as in practice with PyTorch, one expandable segment per
// pool and stream always has room to grow.
constexpr std::uint64_t kExpandablePages = 1ULL << 22;

void increase(AllocatorStat& s, std::uint64_t amount) {  // increase_stat
  s.current += amount;
  s.peak = std::max(s.peak, s.current);
}

void decrease(AllocatorStat& s, std::uint64_t amount) {  // decrease_stat
  PEFTPLAN_CHECK_MSG(s.current >= amount, "allocator stat would go negative ({} - {})", s.current,
                     amount);
  s.current -= amount;
}

void apply(AllocatorStat& s, std::int64_t change) {
  if (change > 0) increase(s, static_cast<std::uint64_t>(change));
  if (change < 0) decrease(s, static_cast<std::uint64_t>(-change));
}

std::uint64_t round_up(std::uint64_t x, std::uint64_t to) { return (x + to - 1) / to * to; }

}  // namespace

// --- PYTORCH_CUDA_ALLOC_CONF ----------------------------------------------------------------

AllocatorConfig AllocatorConfig::parse(std::string_view alloc_conf, std::uint64_t capacity) {
  constexpr std::string_view kWhere = "PYTORCH_CUDA_ALLOC_CONF";
  constexpr std::string_view kModelled = "(this model reads expandable_segments and max_split_size_mb)";
  AllocatorConfig config;
  config.capacity_bytes = capacity;

  // CUDAAllocatorConfig::lexArgs drops every space; options are separated by commas and a
  // single trailing comma is accepted by parseArgs.
  std::string text;
  for (char ch : alloc_conf)
    if (ch != ' ') text.push_back(ch);
  std::vector<std::string_view> items;
  std::string_view rest = text;
  while (true) {
    const auto comma = rest.find(',');
    items.push_back(rest.substr(0, comma));
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  if (items.back().empty()) items.pop_back();

  for (std::string_view item : items) {
    if (item.empty())
      throw input_error(kWhere, "", "has an empty option (a leading or doubled comma)",
                        fmt::format("\"{}\"", alloc_conf));
    const auto colon = item.find(':');
    if (colon == std::string_view::npos)
      throw input_error(kWhere, item, "needs a value, written key:value");
    const std::string_view key = item.substr(0, colon);
    const std::string_view value = item.substr(colon + 1);

    if (key == "expandable_segments") {
      // CUDAAllocatorConfig::parseArgs: exactly "True" or "False".
      if (value != "True" && value != "False")
        throw input_error(kWhere, key, "must be True or False", fmt::format("\"{}\"", value));
      config.expandable_segments = value == "True";
    } else if (key == "max_split_size_mb") {
      // CUDAAllocatorConfig::parseMaxSplitSize: an int (stoi) greater than kLargeBuffer / 1 MiB
      // = 20, in MiB. We take digits only, up to stoi's INT_MAX.
      std::uint64_t mb = 0;
      const char* first = value.data();
      const char* last = value.data() + value.size();
      const auto [end, ec] = std::from_chars(first, last, mb);
      if (value.empty() || ec != std::errc() || end != last || mb <= kLargeBuffer / kMiB ||
          mb > 2147483647ULL)
        throw input_error(kWhere, key, "must be a whole number of MiB greater than 20",
                          fmt::format("\"{}\"", value));
      config.max_split_size_bytes = mb * kMiB;
    } else if (key == "backend" || key == "garbage_collection_threshold" ||
               key == "roundup_power2_divisions" || key == "release_lock_on_cudamalloc" ||
               key == "release_lock_on_hipmalloc" || key == "pinned_use_cuda_host_register" ||
               key == "pinned_use_hip_host_register" || key == "pinned_num_register_threads") {
      // The other options CUDAAllocatorConfig::parseArgs knows in 2.4.
      throw input_error(kWhere, key,
                        fmt::format("is a PyTorch allocator option this model does not simulate {}",
                                    kModelled));
    } else {
      // parseArgs: "Unrecognized CachingAllocator option".
      throw input_error(kWhere, key,
                        fmt::format("is not a PyTorch caching-allocator option {}", kModelled));
    }
  }
  return config;
}

// --- the allocator -------------------------------------------------------------------------

CachingAllocatorModel::CachingAllocatorModel(AllocatorConfig cfg)
    : config_(cfg), next_address_(kFirstAddress) {
  // parseMaxSplitSize never yields kLargeBuffer or less; release_available_cached_blocks relies
  // on it (every cached block of at least max_split_size is then a whole segment).
  PEFTPLAN_CHECK_MSG(!config_.max_split_size_bytes || *config_.max_split_size_bytes > kLargeBuffer,
                     "max_split_size_bytes must exceed 20 MiB, got {}", *config_.max_split_size_bytes);
}

std::uint64_t CachingAllocatorModel::max_split() const {
  // CUDAAllocatorConfig::max_split_size(): SIZE_MAX unless max_split_size_mb is set.
  return config_.max_split_size_bytes.value_or(std::numeric_limits<std::uint64_t>::max());
}

std::uint32_t CachingAllocatorModel::new_block(const Block& b) {
  if (unused_.empty()) {
    blocks_.push_back(b);
    return static_cast<std::uint32_t>(blocks_.size() - 1);
  }
  const std::uint32_t slot = unused_.back();
  unused_.pop_back();
  blocks_[slot] = b;
  return slot;
}

std::uint32_t CachingAllocatorModel::insert_after(std::uint32_t at, Block b) {
  b.prev = at;
  b.next = blocks_[at].next;
  const std::uint32_t slot = new_block(b);  // may move the slab: no references held across it
  blocks_[at].next = slot;
  if (b.next != kNone) blocks_[b.next].prev = slot;
  return slot;
}

void CachingAllocatorModel::drop_block(std::uint32_t b) {
  const Block& x = blocks_[b];
  if (x.prev != kNone) blocks_[x.prev].next = x.next;
  if (x.next != kNone) blocks_[x.next].prev = x.prev;
  blocks_[b] = Block{};
  unused_.push_back(b);
}

std::uint32_t CachingAllocatorModel::live_block(BlockId id, std::string_view what) const {
  const bool live = id.address != 0 && id.slot < blocks_.size() && blocks_[id.slot].address == id.address &&
                    blocks_[id.slot].allocated && !blocks_[id.slot].recorded;
  PEFTPLAN_CHECK_MSG(live, "{} of block {:#x}, which is not a live allocation", what, id.address);
  return id.slot;
}

void CachingAllocatorModel::insert_free(std::uint32_t b) {  // BlockPool::insert_into_blocks
  const Block& x = blocks_[b];
  const bool inserted = pool_for(x.small).free_blocks.insert(FreeKey{x.stream, x.size, x.address, b});
  PEFTPLAN_CHECK(inserted);
}

void CachingAllocatorModel::erase_free(std::uint32_t b) {
  const Block& x = blocks_[b];
  const auto erased = pool_for(x.small).free_blocks.erase(FreeKey{x.stream, x.size, x.address, b});
  PEFTPLAN_CHECK(erased == 1);
}

std::uint32_t CachingAllocatorModel::try_merge(std::uint32_t dst, bool with_prev, std::uint64_t& subsumed) {
  // try_merge_blocks: a neighbour in the same segment (never across segments) that is free and
  // mapped alike is absorbed. dst itself is in no set while this runs.
  subsumed = 0;
  const std::uint32_t src = with_prev ? blocks_[dst].prev : blocks_[dst].next;
  if (src == kNone || blocks_[src].allocated || blocks_[src].mapped != blocks_[dst].mapped) return dst;
  Block& s = blocks_[src];
  if (s.mapped) {
    erase_free(src);
  } else {
    const auto erased = pool_for(s.small).unmapped.erase(UnmappedKey{s.stream, s.address, src});
    PEFTPLAN_CHECK(erased == 1);
  }
  subsumed = s.size;
  if (with_prev) {  // [src dst]: the merged block starts at src
    s.size += blocks_[dst].size;
    drop_block(dst);
    return src;
  }
  blocks_[dst].size += s.size;  // [dst src]
  drop_block(src);
  return dst;
}

std::uint32_t CachingAllocatorModel::new_segment(std::uint64_t size, std::uint64_t page_bytes,
                                                 std::uint64_t align) {
  const std::uint64_t base = round_up(next_address_, align);
  next_address_ = base + size;
  segments_.push_back(Segment{base, size, page_bytes});
  return static_cast<std::uint32_t>(segments_.size() - 1);
}

std::optional<std::uint32_t> CachingAllocatorModel::get_free_block(std::uint64_t size, int stream,
                                                                   bool small) {
  // get_free_block: best fit, the smallest cached block of at least `size` in the request's
  // pool and on its stream (BlockComparatorSize orders by stream, size, address).
  Pool& p = pool_for(small);
  auto it = p.free_blocks.lower_bound(FreeKey{stream, size, 0, 0});
  if (it == p.free_blocks.end() || it->stream != stream) return std::nullopt;

  if (config_.expandable_segments) {
    // With expandable segments a block followed by unmapped address space counts as the size
    // it could grow to, so a larger hole in the middle of a segment is preferred to the
    // growing end. (The branch for blocks left over from expandable_segments being switched
    // off mid-run does not arise: the option is fixed for a model's life.)
    auto expandable_size = [&](const FreeKey& k) {
      const std::uint32_t n = blocks_[k.slot].next;
      return k.size + (n != kNone && !blocks_[n].mapped ? blocks_[n].size : 0);
    };
    for (auto next = std::next(it);
         next != p.free_blocks.end() && next->stream == stream &&
         expandable_size(*next) < expandable_size(*it);
         ++next)
      it = next;
  }

  // max_split_size: an oversize block (>= max_split_size) is never given to a request below
  // max_split_size, and serves an oversize request only if it is less than kLargeBuffer
  // (20 MiB) larger. (PyTorch's header comment says "within 1MB"; the code uses kLargeBuffer.)
  const std::uint64_t ms = max_split();
  if (size < ms && it->size >= ms) return std::nullopt;
  if (size >= ms && it->size >= size + kLargeBuffer) return std::nullopt;
  const std::uint32_t slot = it->slot;
  p.free_blocks.erase(it);
  return slot;
}

std::optional<std::uint32_t> CachingAllocatorModel::alloc_block(std::uint64_t size,
                                                                std::uint64_t alloc_size,
                                                                int stream, bool small,
                                                                bool is_retry) {
  // alloc_block: the retry after release_cached_blocks counts in num_alloc_retries.
  if (is_retry) ++stats_.num_alloc_retries;
  // With expandable segments the request's own (rounded) size is mapped, not alloc_size.
  if (config_.expandable_segments) return try_allocate_expandable_block(size, stream, small);
  // cudaMalloc(alloc_size) fails when it would take reserved memory past the capacity (the
  // same test alloc_block makes against set_per_process_memory_fraction's maximum).
  if (alloc_size > config_.capacity_bytes - stats_.reserved_bytes.current) return std::nullopt;
  const std::uint32_t id = new_segment(alloc_size, 0, kRoundLarge);
  Block b;
  b.address = segments_[id].base;
  b.size = alloc_size;
  b.segment = id;
  b.stream = stream;
  b.small = small;
  const std::uint32_t slot = new_block(b);
  increase(stats_.segments, 1);
  increase(stats_.reserved_bytes, alloc_size);
  ++stats_.num_device_alloc;
  return slot;  // like PyTorch's new block, not in the free set
}

bool CachingAllocatorModel::release_available_cached_blocks(std::uint64_t size, int stream,
                                                            bool small) {
  // release_available_cached_blocks, tried only when max_split_size_mb is set: free the
  // smallest cached oversize block on this stream of at least max(size, max_split_size); if
  // there is none, free oversize blocks from the largest down until that many bytes are freed
  // (they stay freed even when that falls short). With expandable segments nothing is freed
  // here: torch 2.4.1 would reach release_block's assert that the block is not expandable, and
  // PyTorch #134338 (after 2.4) made this path skip expandable blocks, which leaves none.
  if (!config_.max_split_size_bytes || config_.expandable_segments) return false;
  Pool& p = pool_for(small);
  const std::uint64_t ms = max_split();
  const std::uint64_t key = std::max(size, ms);
  auto it = p.free_blocks.lower_bound(FreeKey{stream, key, 0, 0});
  if (it != p.free_blocks.end() && it->stream == stream) {
    release_block(it->slot);
    return true;
  }
  if (it == p.free_blocks.begin()) return false;
  std::uint64_t released = 0;
  --it;
  while (released < key && it->size >= ms && it->stream == stream) {
    const std::uint32_t slot = it->slot;
    released += it->size;
    const bool first = it == p.free_blocks.begin();
    if (!first) --it;
    release_block(slot);
    if (first) break;
  }
  return released >= key;
}

void CachingAllocatorModel::release_block(std::uint32_t b) {
  // release_block: cudaFree of a whole cached segment.
  PEFTPLAN_CHECK(blocks_[b].address != 0 && !blocks_[b].allocated && !is_split(b) && !is_expandable(b));
  erase_free(b);
  decrease(stats_.segments, 1);
  decrease(stats_.reserved_bytes, blocks_[b].size);
  ++stats_.num_device_free;
  drop_block(b);
}

void CachingAllocatorModel::release_cached_blocks() {
  // release_cached_blocks: synchronize_and_free_events first (every recorded block waits for its
  // events and returns to the cache), then every pool, large first, every stream.
  while (!recorded_.empty()) release_oldest_recorded();
  release_blocks(false);
  release_blocks(true);
}

void CachingAllocatorModel::release_blocks(bool small) {
  // release_blocks: cudaFree every cached block that is a whole segment; in expandable
  // segments unmap the whole pages of every free block, and drop a segment left with no pages.
  std::vector<std::uint32_t> whole;
  std::vector<std::uint32_t> to_unmap;
  for (const FreeKey& k : pool_for(small).free_blocks) {
    if (is_expandable(k.slot))
      to_unmap.push_back(k.slot);
    else if (!is_split(k.slot))
      whole.push_back(k.slot);
  }
  for (std::uint32_t b : whole) release_block(b);
  for (std::uint32_t b : to_unmap) {
    const auto unmapped = unmap_block(b);
    if (unmapped && !is_split(*unmapped)) release_expandable_segment(*unmapped);
  }
}

std::optional<std::uint32_t> CachingAllocatorModel::unmap_block(std::uint32_t b) {
  // unmap_block with ExpandableSegment::unmap: only pages lying wholly inside the free block
  // are unmapped; the partial pages before and after stay mapped as free blocks.
  const Block x = blocks_[b];
  const Segment& seg = segments_[x.segment];
  const std::uint64_t page = seg.page_bytes;
  const std::uint64_t begin = seg.base + round_up(x.address - seg.base, page);
  const std::uint64_t end = seg.base + (x.address + x.size - seg.base) / page * page;
  if (begin >= end) return std::nullopt;
  erase_free(b);

  Block hole = x;
  hole.address = begin;
  hole.size = end - begin;
  hole.mapped = false;
  std::uint32_t at = b;  // the hole's slot
  if (begin > x.address) {
    blocks_[b].size = begin - x.address;
    insert_free(b);
    at = insert_after(b, hole);
  } else {
    blocks_[b] = hole;  // keeps b's links
  }
  if (x.address + x.size > end) {
    Block after = x;
    after.address = end;
    after.size = x.address + x.size - end;
    insert_free(insert_after(at, after));
  }
  std::uint64_t subsumed = 0;
  std::uint32_t merged = try_merge(at, true, subsumed);
  merged = try_merge(merged, false, subsumed);
  pool_for(x.small).unmapped.insert(UnmappedKey{x.stream, blocks_[merged].address, merged});
  decrease(stats_.reserved_bytes, end - begin);
  ++stats_.num_device_free;
  return merged;
}

void CachingAllocatorModel::release_expandable_segment(std::uint32_t b) {
  // release_expandable_segment: the segment is one unmapped range again; drop it.
  const Block& x = blocks_[b];
  PEFTPLAN_CHECK(x.address != 0 && !x.mapped && !is_split(b));
  const auto erased = pool_for(x.small).unmapped.erase(UnmappedKey{x.stream, x.address, b});
  PEFTPLAN_CHECK(erased == 1);
  decrease(stats_.expandable_segments, 1);
  drop_block(b);
}

std::optional<std::uint32_t> CachingAllocatorModel::try_allocate_expandable_block(std::uint64_t size,
                                                                                  int stream,
                                                                                  bool small) {
  // try_allocate_expandable_block: map pages onto the candidate (or after it) until one free
  // block of at least `size` exists. If a mapping fails, the pages mapped so far stay mapped.
  std::uint32_t candidate = find_expandable_block(size, stream, small);
  if (!blocks_[candidate].mapped) {
    const auto mapped = map_block(candidate, std::min(blocks_[candidate].size, size));
    if (!mapped) return std::nullopt;
    candidate = *mapped;
  }
  while (blocks_[candidate].size < size) {
    const std::uint32_t next = blocks_[candidate].next;
    PEFTPLAN_CHECK(next != kNone && !blocks_[next].mapped);
    const std::uint64_t remaining = size - blocks_[candidate].size;
    const auto mapped = map_block(next, std::min(remaining, blocks_[next].size));
    if (!mapped) return std::nullopt;
    candidate = *mapped;
  }
  erase_free(candidate);
  return candidate;
}

std::uint32_t CachingAllocatorModel::find_expandable_block(std::uint64_t size, int stream, bool small) {
  // find_expandable_block: the lowest-addressed unmapped range on this stream that, together
  // with a free block just before it and the free or unmapped blocks after, has room for
  // `size`; failing that, a new expandable segment (pages of kSmallBuffer in the small pool,
  // kLargeBuffer in the large: 2 MiB and 20 MiB, as the Note [Expandable Segments] says).
  Pool& p = pool_for(small);
  for (auto u = p.unmapped.lower_bound(UnmappedKey{stream, 0, 0});
       u != p.unmapped.end() && u->stream == stream; ++u) {
    std::uint32_t c = u->slot;
    const std::uint32_t before = blocks_[c].prev;
    if (before != kNone && !blocks_[before].allocated) c = before;
    std::uint64_t room = 0;  // has_available_address_space
    for (std::uint32_t b = c; room < size && b != kNone && !blocks_[b].allocated; b = blocks_[b].next)
      room += blocks_[b].size;
    if (room >= size) return c;
  }
  const std::uint64_t page = small ? kSmallBuffer : kLargeBuffer;
  const std::uint32_t id = new_segment(page * kExpandablePages, page, page);
  Block b;
  b.address = segments_[id].base;
  b.size = page * kExpandablePages;
  b.segment = id;
  b.stream = stream;
  b.small = small;
  b.mapped = false;
  const std::uint32_t slot = new_block(b);
  p.unmapped.insert(UnmappedKey{stream, b.address, slot});
  increase(stats_.expandable_segments, 1);
  return slot;
}

std::optional<std::uint32_t> CachingAllocatorModel::map_block(std::uint32_t b, std::uint64_t bytes) {
  // map_block with ExpandableSegment::map: whole pages from the start of the unmapped range,
  // all or nothing; the new pages join the free block before them, if any.
  const Block x = blocks_[b];
  const std::uint64_t page = segments_[x.segment].page_bytes;
  PEFTPLAN_CHECK(!x.mapped && bytes > 0 && bytes <= x.size);
  const std::uint64_t mapped = round_up(bytes, page);
  if (mapped > config_.capacity_bytes - stats_.reserved_bytes.current) return std::nullopt;
  Pool& p = pool_for(x.small);
  p.unmapped.erase(UnmappedKey{x.stream, x.address, b});
  if (mapped < x.size) {
    Block tail = x;
    tail.address = x.address + mapped;
    tail.size = x.size - mapped;
    blocks_[b].size = mapped;
    const std::uint32_t t = insert_after(b, tail);
    p.unmapped.insert(UnmappedKey{x.stream, tail.address, t});
  }
  blocks_[b].mapped = true;
  std::uint64_t subsumed = 0;
  std::uint32_t merged = try_merge(b, true, subsumed);
  merged = try_merge(merged, false, subsumed);
  insert_free(merged);
  increase(stats_.reserved_bytes, mapped);
  ++stats_.num_device_alloc;
  return merged;
}

bool CachingAllocatorModel::should_split(std::uint32_t b, std::uint64_t size) const {
  // should_split: in the small pool (and everywhere with expandable segments) any remainder of
  // at least kMinBlockSize is split off; in the large pool only a remainder of more than
  // kSmallSize, and only for a request below max_split_size.
  const std::uint64_t remaining = blocks_[b].size - size;
  if (blocks_[b].small || config_.expandable_segments) return remaining >= kMinBlockSize;
  return size < max_split() && remaining > kSmallSize;
}

void CachingAllocatorModel::alloc_found_block(std::uint32_t b, std::uint64_t size, std::uint64_t bytes,
                                              bool split) {
  // alloc_found_block: the request takes the front of the block; a split-off remainder goes
  // back to the free set. inactive_split counts free pieces of partly used cudaMalloc
  // segments (expandable segments are left out of it, as in PyTorch).
  const bool counted = !is_expandable(b);
  const bool already_split = is_split(b);
  if (split) {
    Block remainder = blocks_[b];
    remainder.address += size;
    remainder.size -= size;
    blocks_[b].size = size;
    insert_free(insert_after(b, remainder));
    if (counted && already_split) {
      decrease(stats_.inactive_split_bytes, size);
    } else if (counted) {
      increase(stats_.inactive_split_bytes, remainder.size);
      increase(stats_.inactive_split, 1);
    }
  } else if (counted && already_split) {
    decrease(stats_.inactive_split_bytes, blocks_[b].size);
    decrease(stats_.inactive_split, 1);
  }
  Block& x = blocks_[b];
  x.allocated = true;
  x.requested_bytes = bytes;
  // allocated_bytes counts block->size: the rounded size, or the whole block when the
  // remainder was too small to split off.
  increase(stats_.allocations, 1);
  increase(stats_.allocated_bytes, x.size);
  increase(stats_.requested_bytes, bytes);
}

void CachingAllocatorModel::free_block(std::uint32_t b) {
  // free_block: merge with free neighbours of the same segment, back into the free set.
  const bool counted = !is_expandable(b);
  const std::uint64_t requested = blocks_[b].requested_bytes;
  blocks_[b].allocated = false;
  blocks_[b].requested_bytes = 0;
  std::int64_t net_blocks = 0;
  std::int64_t net_bytes = 0;
  std::uint64_t subsumed = 0;
  std::uint32_t merged = try_merge(b, true, subsumed);
  if (subsumed > 0) {
    net_blocks -= 1;
    net_bytes -= static_cast<std::int64_t>(subsumed);
  }
  merged = try_merge(merged, false, subsumed);
  if (subsumed > 0) {
    net_blocks -= 1;
    net_bytes -= static_cast<std::int64_t>(subsumed);
  }
  insert_free(merged);
  if (is_split(merged)) {
    net_blocks += 1;
    net_bytes += static_cast<std::int64_t>(blocks_[merged].size);
  }
  if (counted) {
    apply(stats_.inactive_split, net_blocks);
    apply(stats_.inactive_split_bytes, net_bytes);
  }
  decrease(stats_.requested_bytes, requested);
}

std::optional<BlockId> CachingAllocatorModel::malloc(std::uint64_t bytes, int stream) {
  const std::uint64_t request = stats_.num_malloc_calls++;
  // NativeCachingAllocator::allocate: a 0-byte request gets a null pointer, no block.
  if (bytes == 0) return BlockId{};
  auto out_of_memory = [&]() -> std::optional<BlockId> {
    ++stats_.num_ooms;
    if (!stats_.first_oom) stats_.first_oom = OomEvent{request, bytes, stream};
    return std::nullopt;
  };
  if (bytes >= kMaxRequestBytes) return out_of_memory();

  // malloc: round, choose the pool (get_pool: <= kSmallSize is small) and the segment size.
  const std::uint64_t size = round_size(bytes);
  const bool small = size <= kSmallSize;
  const std::uint64_t alloc_size = allocation_size(size);
  // A cached block first; else a new segment; else free enough oversize cached blocks and try
  // again; else free every cached segment (release_cached_blocks) and retry once. (The
  // free-memory callbacks and garbage collection in between do nothing in a default process.)
  std::optional<std::uint32_t> found = get_free_block(size, stream, small);
  if (!found) {
    found = alloc_block(size, alloc_size, stream, small, false);
    if (!found && release_available_cached_blocks(size, stream, small))
      found = alloc_block(size, alloc_size, stream, small, false);
    if (!found) {
      release_cached_blocks();
      found = alloc_block(size, alloc_size, stream, small, true);
    }
  }
  if (!found) return out_of_memory();
  alloc_found_block(*found, size, bytes, should_split(*found, size));
  return BlockId{blocks_[*found].address, *found};
}

void CachingAllocatorModel::free(BlockId id) {
  // NativeCachingAllocator::free: a null pointer is ignored.
  if (id.address == 0) return;
  const std::uint32_t b = live_block(id, "free");
  // DeviceCachingAllocator::free: allocated bytes drop by the block's size.
  decrease(stats_.allocations, 1);
  decrease(stats_.allocated_bytes, blocks_[b].size);
  free_block(b);
}

void CachingAllocatorModel::free_recorded(BlockId id) {
  const std::uint32_t b = live_block(id, "recorded free");
  Block& x = blocks_[b];
  // DeviceCachingAllocator::free: the stats drop before insert_events defers the block.
  decrease(stats_.allocations, 1);
  decrease(stats_.allocated_bytes, x.size);
  decrease(stats_.requested_bytes, x.requested_bytes);
  x.requested_bytes = 0;
  x.recorded = true;
  recorded_.push_back(b);
}

void CachingAllocatorModel::release_oldest_recorded() {
  PEFTPLAN_CHECK(!recorded_.empty());
  const std::uint32_t b = recorded_.front();
  recorded_.pop_front();
  blocks_[b].recorded = false;
  free_block(b);  // process_events: its last event completed
}

void CachingAllocatorModel::empty_cache() {
  release_cached_blocks();  // emptyCache
}

void CachingAllocatorModel::reset_peak_stats() {
  // resetPeakStats: peak = current for every stat.
  for (AllocatorStat* s : {&stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.requested_bytes,
                           &stats_.inactive_split_bytes, &stats_.inactive_split, &stats_.allocations,
                           &stats_.segments, &stats_.expandable_segments})
    s->peak = s->current;
}

AllocatorReplay replay_caching_allocator(const Program& program, const AllocatorConfig& config, int steps) {
  CachingAllocatorModel model(config);
  AllocatorReplay r;
  const std::size_t nb = program.buffers.size();
  // A buffer's live block, or (Buffer::pieces) one block per piece allocated so far.
  std::vector<std::optional<BlockId>> live(nb);
  std::vector<std::vector<std::optional<BlockId>>> live_pieces(nb);
  std::vector<char> active(nb, 0);  // a pieces buffer between its alloc and free ops
  // Each buffer's outermost parent and its byte offset there, for the pieces a view touches.
  std::vector<std::int32_t> root(nb);
  std::vector<std::uint64_t> root_offset(nb, 0);
  bool any_pieces = false;
  for (std::size_t b = 0; b < nb; ++b) {
    std::int32_t at = static_cast<std::int32_t>(b);
    std::uint64_t off = 0;
    while (program.buffers[static_cast<std::size_t>(at)].view_of >= 0) {
      off += program.buffers[static_cast<std::size_t>(at)].offset;
      at = program.buffers[static_cast<std::size_t>(at)].view_of;
    }
    root[b] = at;
    root_offset[b] = off;
    any_pieces |= !program.buffers[b].pieces.empty();
  }
  auto note_oom = [&](std::size_t op, bool ok) {
    if (!ok && !r.oom) {
      r.oom = model.stats().first_oom;
      r.oom_op = static_cast<std::int32_t>(op);
    }
  };
  auto free_pieces = [&](std::size_t b) {
    for (auto& piece : live_pieces[b])
      if (piece) model.free(*piece);
    live_pieces[b].clear();
    active[b] = 0;
  };
  // An op touched bytes [lo, lo + n) of buffer `id`: the pieces of its root there that are not
  // allocated yet are, in order, on the op's stream.
  auto touch = [&](std::size_t op_index, const Op& op, std::int32_t id) {
    if (id < 0) return;
    const auto rb = static_cast<std::size_t>(root[static_cast<std::size_t>(id)]);
    const Buffer& rbuf = program.buffers[rb];
    if (rbuf.pieces.empty() || !active[rb] || on_host(rbuf.category)) return;
    const std::uint64_t lo = root_offset[static_cast<std::size_t>(id)];
    const std::uint64_t hi = lo + program.buffers[static_cast<std::size_t>(id)].bytes;
    auto& blocks = live_pieces[rb];
    blocks.resize(rbuf.pieces.size());
    std::uint64_t at = 0;
    for (std::size_t k = 0; k < rbuf.pieces.size() && at < hi; at += rbuf.pieces[k], ++k) {
      if (blocks[k] || at + rbuf.pieces[k] <= lo) continue;
      blocks[k] = model.malloc(rbuf.pieces[k], static_cast<int>(op.stream));
      note_oom(op_index, blocks[k].has_value());
    }
  };
  // The ops the replay acts on, in program order, listed once for the setup and once for a step:
  // allocs and frees of device buffers, and where buffers come in pieces every op that may touch
  // one.
  std::vector<std::uint32_t> setup_ops, step_ops;
  for (std::size_t i = 0; i < program.ops.size(); ++i) {
    const Op& op = program.ops[i];
    bool acts = any_pieces;
    if (op.kind == OpKind::alloc || op.kind == OpKind::free) {
      const Buffer& buf = program.buffers[static_cast<std::size_t>(op.buffer)];
      acts = !on_host(buf.category) && buf.view_of < 0;
    }
    if (acts) (op.phase == Phase::setup ? setup_ops : step_ops).push_back(static_cast<std::uint32_t>(i));
  }
  auto run = [&](const std::vector<std::uint32_t>& order) {
    for (const std::uint32_t i : order) {
      const Op& op = program.ops[i];
      if (op.kind != OpKind::alloc && op.kind != OpKind::free) {
        touch(i, op, op.buffer);
        touch(i, op, op.buffer_out);
        touch(i, op, op.buffer_in);
        if (op.kind == OpKind::compute)
          for (std::int64_t a : ops::slot_ids(program, op)) touch(i, op, static_cast<std::int32_t>(a));
        continue;
      }
      const auto b = static_cast<std::size_t>(op.buffer);
      const Buffer& buf = program.buffers[b];
      if (!buf.pieces.empty()) {  // its pieces come with their first use
        if (op.kind == OpKind::alloc) {
          if (active[b]) free_pieces(b);  // left live by the previous step
          active[b] = 1;
        } else {
          free_pieces(b);
        }
        continue;
      }
      if (op.kind == OpKind::alloc) {
        if (live[b]) model.free(*live[b]);  // left live by the previous step
        live[b] = model.malloc(buf.bytes, static_cast<int>(op.stream));
        note_oom(i, live[b].has_value());
      } else if (live[b]) {
        if (buf.reuse_after_next_recorded_free) {  // its block waits for the GPU
          model.free_recorded(*live[b]);
          if (model.recorded_pending() > 1) model.release_oldest_recorded();
        } else {
          model.free(*live[b]);
        }
        live[b].reset();
      }
    }
  };
  run(setup_ops);
  for (int s = 0; s < steps; ++s) run(step_ops);
  r.allocated_peak_bytes = model.stats().allocated_bytes.peak;
  r.reserved_peak_bytes = model.stats().reserved_bytes.peak;
  r.num_alloc_retries = model.stats().num_alloc_retries;
  return r;
}

}  // namespace peftplan::sim
