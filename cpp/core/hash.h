// Hashes that must come out the same in every process: a call site's id and
// where its entry sits in the shared site directory are computed from them.
#pragma once

#include <cstdint>

namespace jo {

// splitmix64's finalizer (https://prng.di.unimi.it/splitmix64.c): spreads
// every input bit over the whole output.
inline uint64_t Mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace jo
