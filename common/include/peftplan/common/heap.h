// The heap policy of a process that plans many programs side by side (the explorer re-plans
// every strategy on each change, `recommend` and `sweep` plan thousands over the cores). A plan's
// program, timeline and allocator replay are a few MiB of vectors made and dropped per plan.
// glibc's malloc hands such blocks back to the kernel: a block above the mmap threshold is
// mmap'd and munmap'd on every plan, and a heap whose free top exceeds the trim threshold is
// trimmed (sbrk in the main arena, heap_trim in a thread's arena: glibc malloc/malloc.c and
// malloc/arena.c). The next plan then takes a page fault per 4 KiB page it touches again. Both
// thresholds start at 128 KiB and the mmap one only grows, per process, as mmap'd blocks are
// freed (to DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB on 64-bit): worker threads' arenas keep trimming.
// Measured (bench/bench_gui's re-plan of every strategy, 2 cores): 38% of the time in the kernel
// and about twice the single-threaded sum of the plans before, the sum's half after.
// keep_freed_heap_memory() fixes both thresholds (mallopt(3): setting one turns the dynamic
// adjustment off): blocks under 32 MiB come from the heap, and up to 128 MiB of freed memory
// per arena stays mapped for the next plan. Called first thing by main() of the binaries that
// plan in bulk; a library never calls it.
// Deliberately not here: any allocator of our own.
#pragma once

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace peftplan {

inline void keep_freed_heap_memory() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
#endif
}

}  // namespace peftplan
