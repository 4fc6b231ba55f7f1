/* hash.c -- the stable 64-bit hash of an encoded key.
 *
 * Keys must hash identically in every process and every run (Python's hash() is
 * randomized per process), on any Linux machine, so the byte order is fixed: words
 * are read little-endian whatever the CPU. The construction is a multiply-rotate
 * over 8-byte words with a final avalanche (the finalizer of MurmurHash3, which
 * flips each output bit with probability ~1/2 for any input bit). It is not a
 * cryptographic hash: a collision only serializes two keys (they share a line),
 * it never lets conflicting messages run together.
 */
#include "core.h"

#define P1 0x9e3779b97f4a7c15ull
#define P2 0xc2b2ae3d27d4eb4full
#define P3 0x165667b19e3779f9ull

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

uint64_t hash_bytes(const uint8_t *p, uint64_t n) {
    uint64_t h = P3 ^ (n * P1);
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) h = rotl(h ^ (load_le64(p + i) * P2), 31) * P1;
    uint64_t tail = 0;
    for (uint64_t j = n; j > i; j--) tail = (tail << 8) | p[j - 1];
    h = rotl(h ^ (tail * P2), 27) * P1 + P3;
    return avalanche(h);
}

uint64_t shm_hash_key(const uint8_t *enc, uint32_t len) { return hash_bytes(enc, len); }
