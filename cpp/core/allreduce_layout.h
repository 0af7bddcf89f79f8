// Where the one-launch all-reduce (docs/gpu-internals.md §7; the kernel:
// cpp/cuda/kernels/allreduce_body.h) keeps a call's data: one source for the
// builders (which refuse a call that does not fit), the CUDA executor (which
// lays the data out), the kernel and Python's plan (_host.allreduce_fits).
//
// Each rank of a clique that runs these kernels has one fixed area of two
// halves of kAreaBytes (a call uses half seq % 2 of its device-side sequence
// number) and its state words. Fixed, never grown: a captured call keeps its
// addresses for as long as the executable lives. The area is the clique's
// last "generation"-like allocation kind that is never replaced
// (cuda/clique/cuda_clique.h KernelArea).
//
// A call moves y, `bytes` long, in accesses of `access` bytes (16, 4 or 2);
// within a half, p2p: slot j (what rank j pushes: all of y for one-shot, its
// slice of the receiving rank for two-shot) at j * slot, the result (two-shot)
// at nranks * slot; multicast: the rank's own copy of y at 0, the result
// (two-shot) at slot.
#pragma once

#include <cstdint>

namespace jo::allreduce {

// Blocks of every launch (the per-block sequence counters stay in step only if
// every launch has the same blocks) and threads per block.
inline constexpr int kBlocks = 32;
inline constexpr int kThreads = 256;
// Ranks a clique may have for these kernels (one signalling thread per peer).
inline constexpr int kMaxRanks = 16;
// One half of a rank's data area.
inline constexpr int64_t kAreaBytes = int64_t{8} << 20;
// Slots start 256 bytes apart (any access width divides).
inline constexpr int64_t kSlotAlign = 256;

// A rank's state words (uint32): the flags, 64-bit each, [round 0, 1][block][writer]; the
// counters [block]; the broken word.
constexpr int64_t StateWords(int32_t nranks) {
  return 2 * 2 * int64_t{kBlocks} * nranks + kBlocks + 1;
}

constexpr int64_t RoundUp(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// The slot stride of a call (0: it does not fit one half of the area).
constexpr int64_t SlotBytes(bool multicast, bool two_shot, int32_t nranks, int64_t bytes,
                            int64_t access) {
  const int64_t accesses = bytes / access;
  const int64_t per_slot = two_shot && !multicast ? (accesses + nranks - 1) / nranks : accesses;
  const int64_t slot = RoundUp(per_slot * access, kSlotAlign);
  const int64_t slots = multicast ? 1 : nranks;
  const int64_t used = slots * slot + (two_shot ? bytes : 0);
  return used <= kAreaBytes ? slot : 0;
}

// Whether a call of `bytes` (any access width: the slot rounding covers the widest) fits.
constexpr bool Fits(bool multicast, bool two_shot, int32_t nranks, int64_t bytes) {
  return nranks >= 1 && nranks <= kMaxRanks && bytes > 0 &&
         SlotBytes(multicast, two_shot, nranks, RoundUp(bytes, 16), 16) > 0;
}

}  // namespace jo::allreduce
