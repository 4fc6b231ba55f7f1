/* hold.c -- pause and resume: an operator's hold on a whole channel or on single keys.
 *
 * The state lives in the header (so any process may pause a channel another process
 * receives from, a new receiver finds it, and a durable channel's file keeps it):
 *
 *   header.hold       bit 0        HOLD_CHANNEL: the receiver hands out nothing
 *                     bits 63..1   entries of hold_keys[] claimed, as an upper bound
 *   hold_keys[i]      .hash        a paused key's hash, 0 = free
 *                     .len, .blob  the key's framed encoding, for display only
 *
 * Writers are any processes, at any time, and may be killed at any instruction, so no
 * lock: every change is one atomic read-modify-write of one word.
 *
 *   pause_key(h):   if an entry already holds h: done (pausing twice is one pause).
 *                   hold += 2 (the count first), then CAS a free entry 0 -> h, then
 *                   write len and blob. No free entry: hold -= 2, SHM_FULL.
 *   resume_key(h):  CAS every entry h -> 0, then hold -= 2 per entry cleared.
 *   pause / resume: fetch-or / fetch-and of HOLD_CHANNEL.
 *
 * Invariant: hold >> 1 >= entries in use, since the count rises before a claim and falls
 * after a clear. A process killed between the two steps leaves the count too high,
 * which only sends the scheduler down its slower path (a search that finds nothing
 * paused); never too low, so the fast path "hold == 0: nothing paused" is exact. Two
 * processes pausing one key at once may claim two entries for it; resume clears all.
 * A reader of blob may see it torn while an entry is reused: it re-reads the hash after
 * copying and drops a blob whose entry changed meanwhile (display only).
 *
 * The receiver reads the state at its poll (sched.c's sched_pop_ready asks
 * hold_blocks for each candidate): a pause takes effect at the next poll; a message
 * already handed out stays out and may be released. Resume wakes the receiver from the
 * Python side (a post of its semaphore, which also wakes an asyncio receiver).
 *
 * Key order: a ready message holds its keys already (order="fifo": it is first in each
 * of its keys' lines; order="eager": key.held names it), so while it is held back by a
 * paused key nothing behind it on any of its keys can pass either -- the messages behind
 * wait, parked, as behind a message in flight -- while messages on other keys flow.
 */
#include "core.h"

#define HOLD_ONE (1ull << HOLD_KEYS_SHIFT)

int shm_pause(shm_chan *c, int paused) {
    /* seq_cst: pairs with the receiver's acquire load in hold_any (core.h); the resume
     * side is then followed by a post of the receiver's semaphore (Python). */
    if (paused)
        __atomic_fetch_or(&c->hdr->hold, HOLD_CHANNEL, __ATOMIC_SEQ_CST);
    else
        __atomic_fetch_and(&c->hdr->hold, ~HOLD_CHANNEL, __ATOMIC_SEQ_CST);
    return SHM_OK;
}

int shm_pause_key(shm_chan *c, uint64_t hash, const char *blob, uint32_t len) {
    if (hash == 0) hash = 1; /* 0 marks a free entry: fold it (only adds waiting) */
    shm_hold_key *t = c->hdr->hold_keys;
    for (uint32_t i = 0; i < SHM_HOLD_KEYS; i++) /* acquire: pairs with the claiming CAS */
        if (LOAD_ACQUIRE(&t[i].hash) == hash) return SHM_OK;
    /* seq_cst: the count rises before the entry is claimed (the invariant above) */
    FETCH_ADD_SEQCST(&c->hdr->hold, HOLD_ONE);
    for (uint32_t i = 0; i < SHM_HOLD_KEYS; i++) {
        uint64_t free_word = 0;
        /* seq_cst: claims the entry; pairs with the receiver's acquire in hold_blocks
         * and with other claimants' and clearers' CAS */
        if (!CAS_SEQCST(&t[i].hash, &free_word, hash)) continue;
        uint32_t n = len <= SHM_HOLD_KEY_BYTES ? len : 0;
        memcpy(t[i].blob, blob, n);
        STORE_RELEASE(&t[i].len, n); /* pairs with the acquire in shm_hold_read */
        return SHM_OK;
    }
    __atomic_fetch_sub(&c->hdr->hold, HOLD_ONE, __ATOMIC_SEQ_CST); /* nothing claimed */
    return SHM_FULL;
}

int shm_resume_key(shm_chan *c, uint64_t hash, uint32_t *cleared) {
    if (hash == 0) hash = 1; /* as in shm_pause_key */
    shm_hold_key *t = c->hdr->hold_keys;
    *cleared = 0;
    for (uint32_t i = 0; i < SHM_HOLD_KEYS; i++) {
        uint64_t expect = hash;
        if (LOAD_RELAXED(&t[i].hash) != hash) continue; /* a hint: the CAS decides */
        /* the display copy goes first; should the CAS fail (another resume won, and the
         * entry was claimed again), a key shows as unknown: display only */
        STORE_RELAXED(&t[i].len, 0);
        /* seq_cst: pairs with the claiming CAS in shm_pause_key */
        if (CAS_SEQCST(&t[i].hash, &expect, 0)) {
            /* the count falls after the clear (the invariant above) */
            __atomic_fetch_sub(&c->hdr->hold, HOLD_ONE, __ATOMIC_SEQ_CST);
            (*cleared)++;
        }
    }
    return SHM_OK;
}

int shm_hold_read(shm_chan *c, uint32_t *paused, uint64_t *hashes, uint8_t *blobs,
                  uint32_t *lens, uint32_t *n) {
    *paused = (uint32_t)(LOAD_ACQUIRE(&c->hdr->hold) & HOLD_CHANNEL); /* as in hold_any */
    *n = 0;
    shm_hold_key *t = c->hdr->hold_keys;
    for (uint32_t i = 0; i < SHM_HOLD_KEYS; i++) {
        uint64_t h = LOAD_ACQUIRE(&t[i].hash); /* pairs with the claiming CAS */
        if (h == 0) continue;
        uint32_t len = LOAD_ACQUIRE(&t[i].len); /* pairs with shm_pause_key's release */
        if (len > SHM_HOLD_KEY_BYTES) len = 0;
        uint8_t *dst = blobs + (uint64_t)*n * SHM_HOLD_KEY_BYTES;
        memcpy(dst, t[i].blob, len);
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copy before the re-read below */
        if (LOAD_RELAXED(&t[i].hash) != h) len = 0; /* reused meanwhile: no display */
        hashes[*n] = h;
        lens[*n] = len;
        (*n)++;
    }
    return SHM_OK;
}

/* Receiver: is the whole channel paused? */
int hold_channel(shm_chan *c) { return (LOAD_ACQUIRE(&c->hdr->hold) & HOLD_CHANNEL) != 0; }

/* Receiver: may the ready message in slot s not be handed out now (the channel is
 * paused, or one of its keys is)? Called only when hold_any said something is paused.
 * Its hashes are read from its record, bounds-checked; a record that does not check
 * out is left to hand_out, which reports it. */
int hold_blocks(shm_chan *c, uint32_t s) {
    if (hold_channel(c)) return 1;
    shm_slot *sl = &c->slots[s];
    if (sl->nkeys == 0) return 0;
    return hold_record(c, rec_at(c, sl->pos));
}

/* Receiver: the hash (folded, never 0) of a paused key the record r carries, 0 if none.
 * (lookahead.c, before taking a record in ahead of the scan, remembers it: its resume
 * lets the look-ahead look again) */
uint64_t hold_record_key(shm_chan *c, const shm_record *r) {
    uint64_t ph[SHM_HOLD_KEYS];
    uint32_t np = 0;
    for (uint32_t i = 0; i < SHM_HOLD_KEYS; i++) {
        uint64_t h = LOAD_ACQUIRE(&c->hdr->hold_keys[i].hash); /* pairs with the claim */
        if (h) ph[np++] = h;
    }
    /* the record's hashes, r->nkeys of them (at most max_keys: checked) */
    uint32_t rn = r->nkeys;
    if (rn > c->cfg.max_keys) return 0;
    for (uint32_t k = 0; k < rn; k++) {
        uint64_t h = r->hashes[k] ? r->hashes[k] : 1; /* folded as in shm_pause_key */
        for (uint32_t j = 0; j < np; j++)
            if (ph[j] == h) return h;
    }
    return 0;
}

/* Receiver: does the record r carry a paused key? */
int hold_record(shm_chan *c, const shm_record *r) { return hold_record_key(c, r) != 0; }

/* Receiver: is the key with this (folded) hash paused? */
int hold_key_paused(shm_chan *c, uint64_t hash) {
    for (uint32_t i = 0; i < SHM_HOLD_KEYS; i++) /* acquire: pairs with the claiming CAS */
        if (LOAD_ACQUIRE(&c->hdr->hold_keys[i].hash) == hash) return 1;
    return 0;
}
