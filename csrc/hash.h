/* hash.h -- the stable 64-bit hash of an encoded key.
 *
 * Keys must hash identically in every process and every run (Python's hash() is
 * randomized per process), on any Linux machine, so the byte order is fixed: words
 * are read little-endian whatever the CPU. The construction is a multiply-rotate
 * over 8-byte words with a final hash_avalanche (the finalizer of MurmurHash3, which
 * flips each output bit with probability ~1/2 for any input bit). It is not a
 * cryptographic hash: a collision only serializes two keys (they share a line),
 * it never lets conflicting messages run together.
 *
 * The values are part of the segment's format (records carry their keys' hashes, and a
 * paused key is found by its hash): tests/test_keys.py pins some of them.
 *
 * Inline here so that the send path hashes a key without a call (a key is a few bytes:
 * the call would cost about as much as the hash); hash.c holds the out-of-line copy.
 */
#ifndef SHMCHAN_HASH_H
#define SHMCHAN_HASH_H
#include <stdint.h>
#include <string.h>

#define HASH_P1 0x9e3779b97f4a7c15ull
#define HASH_P2 0xc2b2ae3d27d4eb4full
#define HASH_P3 0x165667b19e3779f9ull

static inline uint64_t hash_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* Little-endian loads: one move each on a little-endian CPU, a byte swap elsewhere. */
static inline uint64_t hash_le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t hash_le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

/* The r (0..7) bytes at p as a little-endian number, read with at most three loads
 * instead of a byte at a time: two overlapping words (r >= 4) or the first, middle and
 * last byte (r < 4). Where the loads overlap they read the same bytes into the same
 * bit positions, so OR-ing them gives exactly sum(p[t] << 8t). */
static inline uint64_t hash_le_tail(const uint8_t *p, uint64_t r) {
    if (r >= 4) return hash_le32(p) | (hash_le32(p + r - 4) << (8 * (r - 4)));
    if (r == 0) return 0;
    return (uint64_t)p[0] | ((uint64_t)p[r / 2] << (8 * (r / 2))) |
           ((uint64_t)p[r - 1] << (8 * (r - 1)));
}

static inline uint64_t hash_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

/* The key hash of the n bytes at p. padded: at least 8 readable bytes follow the key (one
 * copied into a record: the rest of the record and the next header follow it), so its
 * tail is one load masked to its n % 8 bytes; the same value either way. A constant at
 * each call, so each caller compiles one tail. */
static inline __attribute__((always_inline)) uint64_t hash_key_with(const uint8_t *p,
                                                                    uint64_t n, int padded) {
    uint64_t h = HASH_P3 ^ (n * HASH_P1);
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) h = hash_rotl(h ^ (hash_le64(p + i) * HASH_P2), 31) * HASH_P1;
    uint64_t tail = padded ? hash_le64(p + i) & ((1ull << (8 * (n - i))) - 1) /* n - i < 8 */
                           : hash_le_tail(p + i, n - i);
    h = hash_rotl(h ^ (tail * HASH_P2), 27) * HASH_P1 + HASH_P3;
    return hash_avalanche(h);
}

static inline uint64_t hash_key_bytes(const uint8_t *p, uint64_t n) {
    return hash_key_with(p, n, 0);
}

/* hash_key_bytes(p, n) for a key followed by at least 8 readable bytes. */
static inline uint64_t hash_key_padded(const uint8_t *p, uint64_t n) {
    return hash_key_with(p, n, 1);
}
#endif
