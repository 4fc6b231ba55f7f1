/* crc32c.c -- CRC-32C (Castagnoli), the checksum of a durable channel's records.
 *
 * A file-backed channel's records carry a CRC-32C of their body, written by the producer
 * before it commits the record (ring.c) and checked by a receiver on the records it
 * recovers (ring_peek, hand_out): a power loss can leave a file whose 4 KiB pages come
 * from different moments, so a record whose header says COMMITTED may hold another
 * moment's bytes. CRC-32C because x86-64 computes it in hardware (SSE4.2's crc32
 * instruction, 8 bytes per instruction) and it catches every burst error up to 32 bits.
 *
 * The instruction is used only if the CPU has it (cpuid, checked once at first use);
 * otherwise a byte-at-a-time table (the reflected polynomial 0x82F63B78) gives the same
 * values. Both are the standard CRC-32C: initial value and final xor 0xFFFFFFFF.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include "core.h"

#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static uint32_t table[256];
static int have_hw;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        table[i] = c;
    }
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_hw = __builtin_cpu_supports("sse4.2");
#endif
}

static uint32_t crc_table(uint32_t crc, const uint8_t *p, uint64_t n) {
    while (n--) crc = table[(crc ^ *p++) & 0xffu] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p,
                                                          uint64_t n) {
    uint64_t c = crc;
    for (; n && ((uintptr_t)p & 7u); n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    for (; n; n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}
#endif

/* Continue a CRC-32C over n more bytes; start with crc32c(0, ...). */
uint32_t crc32c(uint32_t crc, const void *data, uint64_t n) {
    pthread_once(&once, crc_init);
    crc = ~crc;
#if defined(__x86_64__)
    if (have_hw) return ~crc_hw(crc, data, n);
#endif
    return ~crc_table(crc, data, n);
}

/* For tests: the CRC-32C of a buffer by the hardware path (hw = 1, if there is one) or
 * the table (hw = 0). SHM_E_INVALID if asked for hardware this CPU lacks. */
int shm_crc32c(const char *data, uint64_t n, int hw, uint32_t *out) {
    pthread_once(&once, crc_init);
    if (!hw) {
        *out = ~crc_table(~0u, (const uint8_t *)data, n);
        return SHM_OK;
    }
#if defined(__x86_64__)
    if (have_hw) {
        *out = ~crc_hw(~0u, (const uint8_t *)data, n);
        return SHM_OK;
    }
#endif
    return SHM_E_INVALID;
}
