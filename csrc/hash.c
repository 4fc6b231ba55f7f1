/* hash.c -- the out-of-line copy of the key hash (hash.h), for callers off the send path
 * and for the Python side (shm_hash_key). */
#include "core.h"
#include "hash.h"

uint64_t hash_bytes(const uint8_t *p, uint64_t n) { return hash_key_bytes(p, n); }

uint64_t shm_hash_key(const uint8_t *enc, uint32_t len) { return hash_key_bytes(enc, len); }
