// The one-launch all-reduce: y <- the sum over ranks of every rank's y, in
// place, in ONE kernel whose flags and sequence numbers live on the device —
// so the same launch, captured into a CUDA graph and replayed, is the next
// call. ONE source, compiled by nvcc for the GPU (allreduce.cu,
// allreduce_multimem.cu) and by the host compiler for the fake
// (fake/fake_allreduce.cc), which runs every thread's phases itself.
//
// What a call does (rank r of N; y: this rank's partial sum, E accesses of
// kBytes; docs/gpu-internals.md §7 has the protocol and its argument):
//
//   one-shot, p2p        push y into slot r of every peer's area; release one
//                        flag per peer; acquire every peer's; y = the N
//                        partials summed in rank order (f32, rounded once)
//   one-shot, multicast  copy y into the own area; release; acquire; y =
//                        multimem.ld_reduce of every rank's area
//   two-shot, p2p        push slice q of y into rank q's slot r; release;
//                        acquire; reduce the own slice r, write it to y and
//                        push it into every peer's result area; release;
//                        acquire; copy the other slices from the result area
//   two-shot, multicast  copy y into the own area; release; acquire;
//                        ld_reduce the own slice r and multimem.st it into
//                        every rank's result area; release; acquire; copy
//
// Device-side state (per rank, in its flag words, made zero once): for each
// block, the sequence number of its last call (the blocks of every launch are
// the same kBlocks, so they stay in step); a flag per (round, block, writer)
// that the writer sets to (signature << 32 | sequence) with st.release.sys;
// and a word that says a launch gave up. A call is sequence number s =
// counter + 1 on every rank (every rank makes the same calls in the same
// order); its data sit in the area's half s % 2. Why the halves suffice: a
// rank writes a peer's half h in call s + 2 only after its own call s + 1
// acquired that peer's round-0 flag of call s + 1, which the peer releases
// only in its kernel of call s + 1, after its kernel of call s — the last
// reader of half h — completed (PTX ISA, "Memory Consistency Model", §8.9.4,
// API synchronization: the completion of a task in a stream synchronizes with
// the start of the next). Flags are never reset: a wait is satisfied by a
// sequence number at or past its own (the cyclic comparison of 32-bit
// numbers), and a peer can be at most one call ahead.
//
// Ordering, each claim from the PTX ISA's memory consistency model
// (https://docs.nvidia.com/cuda/parallel-thread-execution/#memory-consistency-model):
//  * data before flag: every thread's stores of a block precede a
//    bar.sync, which synchronizes with the bar.sync of the signalling thread
//    (§8.9.4, item 2), whose st.release.sys follows in program order; base
//    causality order is transitive ("the cumulativity of synchronizing
//    operations", §8.9.5), so the stores precede the release, which
//    synchronizes with the peer's ld.acquire.sys that reads its value
//    (§8.9.4, item 4); the acquiring thread's bar.sync then orders it before
//    every thread of its block that reads the data;
//  * aliases: a peer's area is reached through a mapping of its own (CUDA
//    IPC across processes) and a multicast object through its multicast
//    address, aliases of the memory its owner reads; causality order between
//    accesses through aliases needs an alias proxy fence on the path
//    (§8.9.5, proxy-preserved base causality order): fence.proxy.alias after
//    the stores and after the acquire;
//  * earlier work: y, written by the GEMM before the kernel on the same
//    stream, is visible to the kernel (§8.9.4, API synchronization, item 1).
//
// No wait is unbounded: a flag not reached `timeout_ns` (the GPU's
// %globaltimer) after a thread began waiting is recorded in the fault record
// (page-locked host memory the watchdog reads) and the launch gives up, and
// so does every later launch on this rank (the broken word), at once: the
// kernel always ends; its results are then garbage. A flag at this call's
// sequence number whose signature differs (another call on that rank, or
// another access width: ranks disagree) is recorded the same way.
//
// A rank that gave up must not hand garbage on, nor break the "at most one
// call ahead" argument above (it no longer waits, so it may run ahead): a block
// that gave up, and every block of every later launch on that rank, writes
// nothing into any peer (no push, no multimem.st, no copy peers reduce) and
// releases its flags with the signature kBrokenSignature instead of the
// call's. A peer whose wait reads such a flag at or past its sequence number
// records kPeerBroken and gives up in turn: every rank's watchdog reports, and
// no healthy rank reads data of a rank that gave up.
//
// What only a GPU has is a call on `ops` (kernel_body.h's seam, plus):
//   LoadAcquireSys / StoreReleaseSys   ld.acquire.sys / st.release.sys, 64-bit
//   StoreRelaxedSys                    st.relaxed.sys, 32-bit
//   Claim                              atomicCAS(word, 0, 1) == 0
//   GlobalNs                           %globaltimer
// The GPU runs the phases with a __syncthreads() after each (a phase that
// waits is re-run until it is done); the fake runs each phase for every thread
// of a block before the block's next phase.
#pragma once

#include <cstdint>

#include "core/allreduce_layout.h"
#include "cuda/kernels/kernel_body.h"

namespace jo::cuda::kernel::ar {

// Every launch: kBlocks blocks of kThreads threads (core/allreduce_layout.h:
// the per-block sequence counters stay in step only if every launch has the
// same blocks; a block waits for the same block of its peers, so the blocks
// must be co-resident: the launcher refuses a GPU with fewer SMs).
inline constexpr int kThreads = allreduce::kThreads;
inline constexpr int kBlocks = allreduce::kBlocks;
inline constexpr int kMaxRanks = allreduce::kMaxRanks;

enum class Algorithm : int32_t { kOneShot = 0, kTwoShot = 1 };

// A rank's state words (uint32), from its flag base: the flags, 64-bit each,
// [round 0, 1][block][writer]; then the counters [block]; then the broken word.
JO_KERNEL_FN constexpr int64_t FlagWord(int32_t nranks, int32_t round, int32_t block,
                                        int32_t writer) {
  return 2 * ((static_cast<int64_t>(round) * kBlocks + block) * nranks + writer);
}
JO_KERNEL_FN constexpr int64_t CounterWord(int32_t nranks) { return FlagWord(nranks, 2, 0, 0); }
JO_KERNEL_FN constexpr int64_t BrokenWord(int32_t nranks) { return CounterWord(nranks) + kBlocks; }
static_assert(BrokenWord(2) + 1 == allreduce::StateWords(2), "state words: one layout");

// Why a launch gave up (page-locked host memory; `code` is written last).
enum class FaultCode : uint32_t { kNone = 0, kTimedOut = 1, kDisagree = 2, kPeerBroken = 3 };

// The signature a rank that gave up releases its flags with (a call's signature is never
// this, nor 0: allreduce_launch.cc FlagSignature).
inline constexpr uint32_t kBrokenSignature = 0xFFFFFFFFu;
struct Fault {
  uint32_t code;
  uint32_t round, block, writer;
  uint32_t seq, seen;                  // the sequence number waited for; the flag's
  uint32_t signature, seen_signature;  // this call's; the flag's
};

// Where the data of a call lie in one half of an area (bytes from its start).
// p2p: slot j (rank j's push) at j * slot_bytes, the result (two-shot) at
// nranks * slot_bytes; multicast: the rank's own copy of y at 0, the result at
// slot_bytes.
struct Args {
  int32_t nranks = 0, rank = 0;
  Algorithm algorithm = Algorithm::kOneShot;
  int64_t accesses = 0;  // y's length in accesses
  void* y = nullptr;
  char* area[kMaxRanks] = {};  // half 0 of every rank's area as this GPU addresses it
  char* mc = nullptr;          // multicast: half 0 of the multicast address
  int64_t area_bytes = 0;      // one half (half 1 follows)
  int64_t slot_bytes = 0;
  uint32_t* state[kMaxRanks] = {};  // every rank's state words as this GPU addresses them
  Fault* fault = nullptr;
  uint32_t signature = 0;
  int64_t timeout_ns = 0;
};

// Slice q of E accesses among N ranks: [E q / N, E (q + 1) / N).
JO_KERNEL_FN int64_t SliceBegin(int64_t accesses, int32_t nranks, int32_t q) {
  return accesses * q / nranks;
}

struct BlockShared {
  uint32_t seq;   // this call's sequence number
  uint32_t half;  // seq % 2
  uint32_t skip;  // a launch on this rank gave up before: no waits, nothing sent
  // Thread w's wait (of writer w) in this launch gave up; each written by its own thread only,
  // read after a barrier (no two threads write one word).
  uint32_t gave_up[kMaxRanks];
};

struct ThreadState {
  int64_t waiting_since = -1;  // %globaltimer when this thread's wait began (-1: not waiting)
};

JO_KERNEL_FN uint64_t Pack(uint32_t seq, uint32_t signature) {
  return (static_cast<uint64_t>(signature) << 32) | seq;
}

template <Elem kElem, int kAccessBytes, bool kMulticast>
struct AllReduceBody {
  static constexpr int kBytes = kAccessBytes;
  static constexpr int kLanes = kBytes / ElemBytes(kElem);
  static_assert(kBytes >= ElemBytes(kElem), "an access holds whole elements");
  static_assert(!kMulticast || kBytes >= 4, "multimem moves whole 32-bit words");
  enum Phase : int {
    kStart = 0,  // the sequence number
    kScatter,    // y out: pushed to the peers (p2p) or copied into the own area (multicast)
    kSignal0,    // release: round 0
    kWait0,      // acquire: round 0
    kReduce,     // the sum (two-shot: the own slice, sent on)
    kSignal1,    // two-shot: release round 1
    kWait1,      // two-shot: acquire round 1
    kGather,     // two-shot: the other slices into y
    kEnd,        // the block's counter
    kPhases
  };

  template <class Ops>
  JO_KERNEL_FN static bool Run(int phase, Ops& ops, const Args& a, BlockShared& sh, ThreadState& ts,
                               const Thread& t) {
    const bool two = a.algorithm == Algorithm::kTwoShot;
    switch (phase) {
      case kStart:
        if (t.thread == 0) {
          sh.seq =
              ops.template Load<4>(a.state[a.rank] + CounterWord(a.nranks) + t.block_x).word[0] + 1;
          sh.half = sh.seq & 1u;
          sh.skip = ops.template Load<4>(a.state[a.rank] + BrokenWord(a.nranks)).word[0];
          for (int32_t w = 0; w < kMaxRanks; ++w) sh.gave_up[w] = 0;
        }
        return true;
      case kScatter:
        if (sh.skip != 0) return true;  // gave up before: nothing to peers
        Scatter(ops, a, sh, t);
        ops.FenceProxyAlias();
        return true;
      case kSignal0:
        Signal(ops, a, sh, t, 0);
        return true;
      case kWait0:
        return Wait(ops, a, sh, ts, t, 0);
      case kReduce:
        if (Broken(a, sh)) return true;  // nothing to peers; y is garbage anyway
        Reduce(ops, a, sh, t);
        if (two) ops.FenceProxyAlias();
        return true;
      case kSignal1:
        if (two) Signal(ops, a, sh, t, 1);
        return true;
      case kWait1:
        return !two || Wait(ops, a, sh, ts, t, 1);
      case kGather:
        if (two && !Broken(a, sh)) Gather(ops, a, sh, t);
        return true;
      case kEnd:
        if (t.thread == 0) {
          Vec<4> v{};
          v.word[0] = sh.seq;
          ops.template Store<4>(a.state[a.rank] + CounterWord(a.nranks) + t.block_x, v);
        }
        return true;
      default:
        return true;
    }
  }

 private:
  JO_KERNEL_FN static int64_t First(const Thread& t) {
    return static_cast<int64_t>(t.block_x) * t.threads + t.thread;
  }
  JO_KERNEL_FN static int64_t Step(const Thread& t) {
    return static_cast<int64_t>(t.grid_x) * t.threads;
  }
  JO_KERNEL_FN static char* At(char* base, int64_t access) { return base + access * kBytes; }
  JO_KERNEL_FN static char* Half(const Args& a, char* base, const BlockShared& sh) {
    return base + static_cast<int64_t>(sh.half) * a.area_bytes;
  }
  // This block gave up: in an earlier launch on this rank, or in a wait of this one (read in a
  // phase after the waits' barrier).
  JO_KERNEL_FN static bool Broken(const Args& a, const BlockShared& sh) {
    if (sh.skip != 0) return true;
    for (int32_t w = 0; w < a.nranks; ++w)
      if (sh.gave_up[w] != 0) return true;
    return false;
  }

  template <class Ops>
  JO_KERNEL_FN static void Scatter(Ops& ops, const Args& a, const BlockShared& sh,
                                   const Thread& t) {
    char* const y = static_cast<char*>(a.y);
    if constexpr (kMulticast) {
      // Every slice (every slice is reduced), slice by slice as Reduce and Gather split them:
      // access i is copied, reduced and gathered by the same block on every rank. A block
      // acquires only its own index's flags and shares no bar.sync with the other blocks, so
      // another block's copy has no base causality path to this block's ld_reduce (PTX ISA,
      // "Memory Consistency Model", §8.9.5, causality order): it could read stale data.
      // One-shot is one slice.
      char* const own = Half(a, a.area[a.rank], sh);
      const int32_t slices = a.algorithm == Algorithm::kTwoShot ? a.nranks : 1;
      for (int32_t q = 0; q < slices; ++q) {
        const int64_t end = SliceBegin(a.accesses, slices, q + 1);
        for (int64_t i = SliceBegin(a.accesses, slices, q) + First(t); i < end; i += Step(t))
          ops.template Store<kBytes>(At(own, i), ops.template Load<kBytes>(At(y, i)));
      }
    } else if (a.algorithm == Algorithm::kOneShot) {
      for (int64_t i = First(t); i < a.accesses; i += Step(t)) {
        const Vec<kBytes> v = ops.template Load<kBytes>(At(y, i));
        for (int32_t k = 1; k < a.nranks; ++k) {  // ring order from r + 1: not all onto rank 0
          const int32_t j = (a.rank + k) % a.nranks;
          ops.template Store<kBytes>(At(Half(a, a.area[j], sh) + a.rank * a.slot_bytes, i), v);
        }
      }
    } else {
      for (int32_t k = 1; k < a.nranks; ++k) {
        const int32_t q = (a.rank + k) % a.nranks;
        const int64_t begin = SliceBegin(a.accesses, a.nranks, q);
        const int64_t end = SliceBegin(a.accesses, a.nranks, q + 1);
        char* const slot = Half(a, a.area[q], sh) + a.rank * a.slot_bytes;
        for (int64_t i = begin + First(t); i < end; i += Step(t))
          ops.template Store<kBytes>(At(slot, i - begin), ops.template Load<kBytes>(At(y, i)));
      }
    }
  }

  // Thread w < N (w != rank) releases this block's flag of `round` in rank w's state: with the
  // call's signature, or kBrokenSignature once this block gave up (its peers then give up too).
  template <class Ops>
  JO_KERNEL_FN static void Signal(Ops& ops, const Args& a, const BlockShared& sh, const Thread& t,
                                  int32_t round) {
    const int32_t w = static_cast<int32_t>(t.thread);
    if (w >= a.nranks || w == a.rank) return;
    uint32_t* flag =
        a.state[w] + FlagWord(a.nranks, round, static_cast<int32_t>(t.block_x), a.rank);
    const uint32_t signature = Broken(a, sh) ? kBrokenSignature : a.signature;
    ops.StoreReleaseSys(reinterpret_cast<uint64_t*>(flag), Pack(sh.seq, signature));
  }

  // Thread w < N (w != rank) acquires writer w's flag of `round` for this block: true once it is
  // at this call's sequence number or past it, or the launch gave up (then gave_up[w]).
  template <class Ops>
  JO_KERNEL_FN static bool Wait(Ops& ops, const Args& a, BlockShared& sh, ThreadState& ts,
                                const Thread& t, int32_t round) {
    const int32_t w = static_cast<int32_t>(t.thread);
    if (w >= a.nranks || w == a.rank || sh.skip != 0) return true;
    uint32_t* const own = a.state[a.rank];
    const int32_t block = static_cast<int32_t>(t.block_x);
    const uint64_t v = ops.LoadAcquireSys(
        reinterpret_cast<const uint64_t*>(own + FlagWord(a.nranks, round, block, w)));
    const uint32_t seen = static_cast<uint32_t>(v), seen_signature = static_cast<uint32_t>(v >> 32);
    if (static_cast<int32_t>(seen - sh.seq) >= 0) {
      ts.waiting_since = -1;
      if (seen_signature == kBrokenSignature) {  // the writer gave up: its data are garbage
        Give(ops, a, sh, FaultCode::kPeerBroken, round, block, w, seen, seen_signature);
        sh.gave_up[w] = 1;
        return true;
      }
      if (seen == sh.seq && seen_signature != a.signature) {
        Give(ops, a, sh, FaultCode::kDisagree, round, block, w, seen, seen_signature);
        sh.gave_up[w] = 1;
        return true;
      }
      ops.FenceProxyAlias();
      return true;
    }
    if (ops.template Load<4>(own + BrokenWord(a.nranks)).word[0] != 0) {
      ts.waiting_since = -1;  // another wait of this launch gave up: so does this one
      sh.gave_up[w] = 1;
      return true;
    }
    const int64_t now = ops.GlobalNs();
    if (ts.waiting_since < 0) {
      ts.waiting_since = now;
      return false;
    }
    if (now - ts.waiting_since <= a.timeout_ns) return false;
    Give(ops, a, sh, FaultCode::kTimedOut, round, block, w, seen, seen_signature);
    sh.gave_up[w] = 1;
    ts.waiting_since = -1;
    return true;
  }

  // The first thread of any launch on this rank to give up records why (later launches skip
  // their waits: they read the broken word at the start).
  template <class Ops>
  JO_KERNEL_FN static void Give(Ops& ops, const Args& a, const BlockShared& sh, FaultCode code,
                                int32_t round, int32_t block, int32_t writer, uint32_t seen,
                                uint32_t seen_signature) {
    if (!ops.Claim(a.state[a.rank] + BrokenWord(a.nranks))) return;
    Fault* f = a.fault;
    ops.StoreRelaxedSys(&f->round, static_cast<uint32_t>(round));
    ops.StoreRelaxedSys(&f->block, static_cast<uint32_t>(block));
    ops.StoreRelaxedSys(&f->writer, static_cast<uint32_t>(writer));
    ops.StoreRelaxedSys(&f->seq, sh.seq);
    ops.StoreRelaxedSys(&f->seen, seen);
    ops.StoreRelaxedSys(&f->signature, a.signature);
    ops.StoreRelaxedSys(&f->seen_signature, seen_signature);
    ops.FenceReleaseSys();  // the fields before the code, for whoever reads the code first
    ops.StoreRelaxedSys(&f->code, static_cast<uint32_t>(code));
  }

  // The rank-order sum of access i: the own partial (y) and the peers' slots at `slot_i`.
  template <class Ops>
  JO_KERNEL_FN static Vec<kBytes> Sum(Ops& ops, const Args& a, char* half, int64_t y_i,
                                      int64_t slot_i) {
    float acc[kLanes] = {};
    for (int32_t j = 0; j < a.nranks; ++j) {
      const Vec<kBytes> v = j == a.rank
                                ? ops.template Load<kBytes>(At(static_cast<char*>(a.y), y_i))
                                : ops.template Load<kBytes>(At(half + j * a.slot_bytes, slot_i));
      for (int l = 0; l < kLanes; ++l) acc[l] += ops.template ToFloat<kElem>(GetLane<kElem>(v, l));
    }
    Vec<kBytes> out{};  // 16-bit lanes are set into their word
    for (int l = 0; l < kLanes; ++l) SetLane<kElem>(&out, l, ops.template FromFloat<kElem>(acc[l]));
    return out;
  }

  template <class Ops>
  JO_KERNEL_FN static void Reduce(Ops& ops, const Args& a, const BlockShared& sh, const Thread& t) {
    char* const y = static_cast<char*>(a.y);
    const bool two = a.algorithm == Algorithm::kTwoShot;
    const int64_t begin = two ? SliceBegin(a.accesses, a.nranks, a.rank) : 0;
    const int64_t end = two ? SliceBegin(a.accesses, a.nranks, a.rank + 1) : a.accesses;
    if constexpr (kMulticast) {
      char* const mc = Half(a, a.mc, sh);
      for (int64_t i = begin + First(t); i < end; i += Step(t)) {
        const Vec<kBytes> v = ops.template MultimemLoadReduce<kElem, kBytes>(At(mc, i));
        ops.template Store<kBytes>(At(y, i), v);
        if (two) ops.template MultimemStore<kElem, kBytes>(At(mc + a.slot_bytes, i), v);
      }
    } else {
      char* const own = Half(a, a.area[a.rank], sh);
      for (int64_t i = begin + First(t); i < end; i += Step(t)) {
        const Vec<kBytes> v = Sum(ops, a, own, i, i - begin);
        ops.template Store<kBytes>(At(y, i), v);
        if (!two) continue;
        for (int32_t k = 1; k < a.nranks; ++k) {
          const int32_t q = (a.rank + k) % a.nranks;
          ops.template Store<kBytes>(At(Half(a, a.area[q], sh) + a.nranks * a.slot_bytes, i), v);
        }
      }
    }
  }

  // Two-shot: every other rank's reduced slice, from the own result area into y.
  template <class Ops>
  JO_KERNEL_FN static void Gather(Ops& ops, const Args& a, const BlockShared& sh, const Thread& t) {
    char* const y = static_cast<char*>(a.y);
    char* const result = Half(a, a.area[a.rank], sh) + (kMulticast ? 1 : a.nranks) * a.slot_bytes;
    for (int32_t k = 1; k < a.nranks; ++k) {
      const int32_t q = (a.rank + k) % a.nranks;
      const int64_t end = SliceBegin(a.accesses, a.nranks, q + 1);
      for (int64_t i = SliceBegin(a.accesses, a.nranks, q) + First(t); i < end; i += Step(t))
        ops.template Store<kBytes>(At(y, i), ops.template Load<kBytes>(At(result, i)));
    }
  }
};

}  // namespace jo::cuda::kernel::ar
