/* ring.c -- the intake ring: any number of processes append records, one reads them.
 *
 * Borrowed ideas: the Linux BPF ring buffer (kernel/bpf/ringbuf.c) for variable-length
 * records with a small header and free-running positions; Jiffy (Adas & Friedman, 2020)
 * for appending without a lock; the Michael-Scott queue for "the tail is wherever the
 * chain of records ends, and any process can find it". What neither has, and a ring
 * shared by processes that may be SIGKILLed needs, is a claim that names its claimant
 * at the very instruction that makes it. Here the claim *is* writing the claimant's
 * identity: a compare-and-swap of the record's owner word.
 *
 * Record header (see core.h for the full layout):
 *
 *     owner  EMPTY(p) = p | 1      while position p is the tail: free to claim
 *            token << 1            once claimed: pid and start time of the claimant
 *     meta   (length << 8) | state 0 (CLAIMED) until the claimant publishes a length
 *     seq    the sequence number a message at p gets, pre-written by the predecessor
 *
 * Invariant T: exactly one position, the tail, holds EMPTY(tail) in its owner word,
 * with meta = 0 and seq set, and [tail, tail + REC_HDR) lies inside free space.
 *
 * Producer, to append n bytes (send_one below):
 *   1. walk: from tail_hint, jump record to record by their published lengths until an
 *      owner word reads EMPTY(pos). A record still in CLAIMED has no length yet: wait
 *      (its claimant is a few instructions from publishing) or, if the claimant is
 *      dead, repair it (below).
 *   2. space: pos + n + REC_HDR <= head + capacity (room for the record and for the
 *      next tail's header). head only grows, so a stale head is merely conservative.
 *      If an island (a record pinned by a view, which head passed: islands.c) lies in
 *      [pos, pos + n + REC_HDR), pos is claimed for a SKIP record over it instead (steps
 *      3-5 with that length and state, the seq passed on unchanged), and the walk goes
 *      on from the island's end.
 *   3. claim: CAS owner EMPTY(pos) -> token << 1. EMPTY(pos) encodes the full 64-bit
 *      position, so a walker holding a stale position from an earlier lap cannot
 *      match (no ABA), and the winner is recorded in the same instruction.
 *   4. write the record's fixed fields (kind, nkeys, lengths) and its key hashes; prepare
 *      the successor: meta = 0, seq = seq + 1 at pos + n, then owner EMPTY(pos + n)
 *      (release). Only the claimant writes there: nobody can reach pos + n before 5.
 *   5. publish the length: meta = (n, WRITING) (release). Walkers may now pass, and the
 *      receiver may read the fixed fields and hashes (not the key blob or payload).
 *   6. write the body (keys, payload), then meta = (n, COMMITTED) (release).
 *
 * Consumer: reads records in position order from scan_pos; stops at EMPTY. A record in
 * CLAIMED stops it (a few instructions from WRITING, or its claimant died: reported as a
 * stall naming its claimant, so the Python layer can check that process's liveness). A
 * record in WRITING does not (Jiffy's "move past an unfinished slot"): its keys are known,
 * so the receiver puts it in its keys' lines as a placeholder (window.c) -- under fifo,
 * later messages on those keys wait behind it -- and goes on; it is handed out once
 * committed, and dropped from the lines if its producer dies (discard_dead). So a
 * producer frozen mid-send (SIGSTOP, a debugger) holds up only messages on its keys.
 *
 * A producer killed at any instruction leaves one of:
 *   - nothing (before 3), or a claim whose owner word names it;
 *   - CLAIMED (between 3 and 5): anyone may take the claim over by CAS owner dead -> self,
 *     turning it into a REC_HDR-sized DISCARDED record that passes seq on unchanged
 *     (repair_claim). No walker could have passed it, so the length is ours to choose;
 *     the dead claimant checked room for at least REC_BODY + REC_HDR bytes, enough for
 *     the discard record and the next tail's header.
 *   - WRITING (between 5 and 6): the length and keys are known; the receiver, which holds
 *     it as a placeholder, marks it DISCARDED once the claimant is found dead
 *     (discard_dead) and drops it from its keys' lines.
 *   - COMMITTED: the message is whole and is delivered.
 * A message is thus visible whole or not at all; a send that returned is committed.
 *
 * Groups (send_group below, for shm_send_many): a run of small records from one batch is
 * claimed with one CAS of the tail's owner word for all of their bytes (steps 1-3 with
 * the group's total). Inside the claimed range, before publishing record i's length,
 * its producer writes the header of record i + 1 as a claim of its own -- owner = our
 * token, meta = 0 (CLAIMED), seq = seq + 1 -- and after the last record the next tail
 * (EMPTY), so that whoever passes record i finds a claim naming us, exactly as if we
 * had won record i + 1's CAS. Steps 4-5 run for every record first (fixed fields, key
 * blob and hashes, successor, WRITING), then step 6 for each in order (payload,
 * COMMITTED): each
 * record is CLAIMED only for a few stores, as after a single claim, so a frozen
 * producer holds up only the messages on its keys (at most GROUP_COUNT placeholders).
 * Killed inside a group, the producer leaves committed records whole, WRITING ones
 * (discarded once it is found dead), at most one CLAIMED record naming it (repaired as
 * above: a discard record, whose successor header the repairer writes), and beyond it
 * bytes no walker can reach. Order is that of the batch; one CAS, one hint raise and one
 * shutdown check per group instead of per record.
 *
 * Gated records (an exchange's publish, exchange.c): step 6 ends in GATED instead of
 * COMMITTED, with a gate trailer naming a transaction word in the exchange's segment.
 * The consumer treats GATED like WRITING (a stall naming the claimant). The publisher
 * later settles the record (ring_gate_settle: CAS GATED -> COMMITTED or CANCELLED);
 * if it died first, the receiver settles it from the transaction word
 * (shm_gate_read, then shm_gate_resolve: COMMITTED or DISCARDED).
 *
 * The consumer frees space by advancing head over records it has finished (DONE,
 * DISCARDED, CANCELLED, SKIP), in order, with a release store that producers pair with
 * their acquire load in step 2. Head also passes an island: a record in flight pinned
 * by a zero-copy view, which stays where it is (islands.c); producers step over its
 * bytes (step 2) until its message is finished.
 *
 * Rewind (ring_rewind). Positions only grow, so a ring that is never full walks through
 * all of its bytes: a 1 GiB channel carrying a trickle touches a fresh page every few
 * dozen messages (a page fault in every process that writes or reads it, and cold cache
 * lines), where a small one recycles the same warm pages. So when the receiver finds
 * the ring empty (a poll with nothing to do, or a release that lets head catch up:
 * nothing unread, nothing in flight before the tail, head = scan_pos = tail) and the
 * tail lies at least REWIND_AT into its lap (or three quarters into the ring's committed
 * part, or a sender found the filesystem full: commit.c), it claims the tail itself
 * for a SKIP record reaching to the lap's end (steps 3-5, as a producer would, the seq
 * passed on unchanged) and moves scan_pos, ingest_pos and head past it. The next record
 * starts at offset 0 again: the working set of a channel whose receiver keeps up stays
 * about REWIND_AT (core.h: 4 MiB, at most half the ring), whatever its capacity; the
 * first RING_WARM bytes of it every attachment maps when it attaches (segment.c).
 * Nothing is lost: the skip holds no message
 * and covers only bytes every process is done with (head had passed them, and islands in
 * the way rule a rewind out), and free space is the same before and after (head and tail
 * move together). A producer that lost the claim to the receiver walks over the SKIP like
 * any record. Receiver killed mid-rewind: after its claim and before publishing the SKIP,
 * a CLAIMED record naming a dead claimant, repaired like a producer's (shm_repair_claim:
 * a discard record; the receiver checked room for one); after publishing it, a finished
 * record that the next receiver's rebuild passes from head (rebuild.c), whatever of
 * scan_pos, ingest_pos and head it had moved.
 */
#include <errno.h>
#include <sched.h>

#include "core.h"
#include "hash.h"
#include "peek.h"

#define WALK_SPINS 2000u /* spins waiting for a claimant to publish its length */

void ring_init(shm_chan *c) {
    shm_record *r = rec_at(c, 0);
    r->meta = 0;
    r->seq = 1;
    r->owner = OWNER_EMPTY(0);
    c->hdr->tail_hint = 0;
    c->hdr->head = 0;
    c->hdr->ingest_pos = 0;
    c->hdr->scan_pos = 0;
}

/* Write the next tail's header at pos, whose record is s, and publish it (step 4). A
 * claimant that holds its record's address finds s past it without a division: the
 * ring is mapped twice in a row, so a record and the header after it are contiguous
 * bytes whatever their position in the lap (segment.c). */
static inline void successor_at(shm_record *s, uint64_t pos, uint64_t seq) {
    STORE_RELAXED(&s->meta, 0);
    STORE_RELAXED(&s->seq, seq);
    /* release: a walker or claimant that reads EMPTY(pos) with its acquire load (walk)
     * or CAS (claim) also sees meta = 0 and the seq above. */
    STORE_RELEASE(&s->owner, OWNER_EMPTY(pos));
}

/* Write the next tail's header at pos and publish it (step 4). Inlined: a call would
 * cost more than its three stores. */
__attribute__((always_inline)) static inline void prepare_successor(shm_chan *c, uint64_t pos, uint64_t seq) {
    successor_at(rec_at(c, pos), pos, seq);
}

/* Raise tail_hint to at least pos. A hint may lag, never run ahead of the tail. */
static void hint_raise(shm_chan *c, uint64_t pos) {
    uint64_t cur = LOAD_RELAXED(&c->hdr->tail_hint);
    while (cur < pos) {
        /* release: pairs with the acquire load of tail_hint in claim(), so a walker
         * starting at pos sees the owner word published before it (prepare_successor). */
        if (__atomic_compare_exchange_n(&c->hdr->tail_hint, &cur, pos, 1, __ATOMIC_RELEASE,
                                        __ATOMIC_RELAXED))
            break;
    }
}

void ring_hint_raise(shm_chan *c, uint64_t pos) { hint_raise(c, pos); }

/* Steps 1-3. On SHM_OK *pos_out is ours and *seq_out is the message's sequence number. */
static int claim(shm_chan *c, uint64_t n, uint64_t *pos_out, uint64_t *seq_out, shm_stall *stall) {
    shm_header *h = c->hdr;
    const uint64_t mine = OWNER_CLAIM(c->token);
    /* acquire: pairs with the release CAS in hint_raise. */
    uint64_t pos = LOAD_ACQUIRE(&h->tail_hint);
    /* acquire: pairs with the release stores of cached_head below (another thread of
     * this process may have stored it), so the islands published before the head that
     * thread acquired are visible to us too (see the island comment further down). */
    uint64_t head = LOAD_ACQUIRE(&c->cached_head);
    uint64_t hops = 0;
    uint32_t spins = 0, restarts = 0;
    int stale = 0;

    for (;;) {
        if (UNLIKELY(stale || pos < head || pos - head > c->cap || hops > c->cap / REC_HDR)) {
            /* A correct chain is found again within a few restarts; garbage never is. */
            if (++restarts > 64) return SHM_E_CORRUPT;
            /* Stale: the bytes under pos may have been reused. Restart from fresh
             * positions; both are record boundaries at the time they are read. */
            /* acquire: pairs with the consumer's release store of head (ring_advance_head). */
            head = LOAD_ACQUIRE(&h->head);
            STORE_RELEASE(&c->cached_head, head); /* pairs with the acquire load above */
            uint64_t hint = LOAD_ACQUIRE(&h->tail_hint); /* pairs with hint_raise */
            pos = hint > head ? hint : head;
            hops = 0;
            stale = 0;
        }
        shm_record *r = rec_at(c, pos);
        /* acquire: pairs with prepare_successor's release store (EMPTY) and with a
         * claimant's CAS (token), so meta and seq read below are at least as new. */
        uint64_t owner = LOAD_ACQUIRE(&r->owner);
        if (owner == OWNER_EMPTY(pos)) {
            /* An island in the way is stepped over (islands.c). The ones that can be
             * were published before the head we acquired: the room check below uses
             * that head, and a fresher head is looked at with the islands read again. */
            uint64_t first = 0;
            uint64_t skip = island_skip(c, pos, pos + n + REC_HDR, &first);
            if (UNLIKELY(skip) && first < pos + REC_HDR) return SHM_E_CORRUPT; /* tail on an island */
            uint64_t need = (skip ? skip : pos + n) + REC_HDR;
            /* Memory behind what we are about to claim, before we claim it (commit.c): a
             * claim that could not be filled would hold up the ring. acquire: pairs with
             * the release raise in commit_ring. */
            uint64_t cm = LOAD_ACQUIRE(&h->ring_committed);
            if (UNLIKELY(cm < c->cap) && ring_need(c, pos, need) > cm) {
                int crc = commit_ring(c, pos, need);
                if (crc == SHM_AGAIN) continue; /* the mark moved under us: look again */
                if (crc) return crc;
            }
            if (need > head + c->limit) {
                uint64_t fresh = LOAD_ACQUIRE(&h->head); /* pairs with ring_advance_head */
                STORE_RELEASE(&c->cached_head, fresh); /* pairs with the acquire load above */
                if (fresh == head) {
                    /* A rewind's SKIP at head (one that ends at a lap's end) is passed by
                     * the receiver a few instructions after it is published (ring_rewind):
                     * give it those before calling the ring full. Only a receiver
                     * preempted right there makes a message larger than the rest of the
                     * lap see Full (timeout=0) or wait for the next wake-up. acquire:
                     * pairs with ring_rewind's release store of meta. */
                    uint64_t hm = LOAD_ACQUIRE(&rec_at(c, head)->meta);
                    if (++spins < WALK_SPINS && META_STATE(hm) == REC_SKIP &&
                        (head + META_LEN(hm)) % c->cap == 0) {
                        CPU_RELAX();
                        continue;
                    }
                    /* relaxed: a hint to the receiver (compact.c reads it relaxed and
                     * pairs with nothing); its next poll looks for space to compact */
                    FETCH_ADD_RELAXED(&h->refusals, 1);
                    return SHM_FULL;
                }
                head = fresh; /* we may be stale, or fit now: look again */
                continue;
            }
            /* seq_cst: the claim. Pairs with other claimants' CAS on the same word and
             * with the release in prepare_successor (the EMPTY we expect). It is also
             * ordered before the shutdown check in send_one. */
            if (CAS_SEQCST(&r->owner, &owner, mine)) {
                uint64_t seq = LOAD_RELAXED(&r->seq); /* ordered by the CAS's acquire */
                if (UNLIKELY(skip)) { /* a SKIP record over the island; claim again after it */
                    if (!len_ok(c, skip - pos)) return SHM_E_CORRUPT; /* an island table gone bad */
                    prepare_successor(c, skip, seq); /* the seq passes on unchanged */
                    /* release: pairs with walkers' and ring_peek's acquire load of meta. */
                    STORE_RELEASE(&r->meta, META(skip - pos, REC_SKIP));
                    hint_raise(c, skip);
                    pos = skip;
                    hops++;
                    spins = 0;
                    continue;
                }
                *pos_out = pos;
                *seq_out = seq;
                return SHM_OK;
            }
            continue; /* lost the race: owner now holds the winner; look again */
        }
        if (OWNER_IS_EMPTY(owner)) { /* an EMPTY marker of another position: stale walk */
            stale = 1;
            continue;
        }
        /* acquire: pairs with the claimant's release store of its length (steps 5, 6). */
        uint64_t meta = LOAD_ACQUIRE(&r->meta);
        if (META_STATE(meta) == REC_CLAIMED) {
            if (++spins < WALK_SPINS) {
                CPU_RELAX();
                continue;
            }
            stall->pos = pos;
            stall->owner = OWNER_TOKEN(owner);
            return SHM_STALLED;
        }
        uint64_t len = META_LEN(meta);
        if (!len_ok(c, len)) { /* garbage under a stale position */
            stale = 1;
            continue;
        }
        pos += len;
        hops++;
        spins = 0;
    }
}

/* memcpy of a key blob, most of which are a few bytes: copied with two overlapping
 * loads and stores (which read and write only [src, src + n)), a call only past 16. */
static inline void copy_small(uint8_t *dst, const uint8_t *src, uint64_t n) {
    if (n >= 8 && n <= 16) {
        uint64_t a, z;
        memcpy(&a, src, 8);
        memcpy(&z, src + n - 8, 8);
        memcpy(dst, &a, 8);
        memcpy(dst + n - 8, &z, 8);
    } else if (n >= 4 && n < 8) {
        uint32_t a, z;
        memcpy(&a, src, 4);
        memcpy(&z, src + n - 4, 4);
        memcpy(dst, &a, 4);
        memcpy(dst + n - 4, &z, 4);
    } else if (n > 0 && n < 4) {
        uint8_t a = src[0], m = src[n / 2], z = src[n - 1];
        dst[0] = a;
        dst[n / 2] = m;
        dst[n - 1] = z;
    } else if (n > 16) {
        memcpy(dst, src, n);
    }
}

/* Write the body of a claimed record and commit it (steps 4-6). */
static void fill(shm_chan *c, uint64_t pos, uint64_t n, uint64_t seq, uint32_t kind,
                 const uint8_t *data, uint64_t len, const uint8_t *keys, uint32_t keys_len,
                 uint32_t nkeys, const uint64_t *hashes, const shm_gate *gate,
                 const uint64_t *times) {
    shm_record *r = rec_at(c, pos);
    /* step 4: the placeholder part, complete before WRITING is published */
    r->kind = kind;
    r->nkeys = nkeys;
    r->data_len = len;
    r->keys_len = keys_len;
    r->slot = 0;
    if (nkeys == 1) r->hashes[0] = hashes[0]; /* the common case, without a memcpy call */
    else memcpy(r->hashes, hashes, 8u * nkeys);
    successor_at((shm_record *)((uint8_t *)r + n), pos + n, seq + 1);
    /* release: pairs with walkers' acquire load of meta in claim() (whoever sees our length
     * also sees EMPTY(pos + n)) and with the receiver's acquire load in ring_peek (a
     * WRITING record's fixed fields and key hashes are complete when seen: window.c). */
    STORE_RELEASE(&r->meta, META(n, REC_WRITING));
    test_pause(SHM_PAUSE_SEND_WRITTEN);
    hint_raise(c, pos + n);

    uint8_t *p = (uint8_t *)r + REC_BODY + 16u * nkeys; /* past hashes and links */
    copy_small(p, keys, keys_len);
    p += align8(keys_len);
    if (len) memcpy(p, data, len);
    uint32_t final = REC_COMMITTED;
    if (gate) { /* the trailer: the name, then the footer in the record's last bytes */
        p += align8(len);
        memcpy(p, gate->name, gate->name_len);
        shm_gate_footer f = {gate->uid, gate->slot, gate->gen, gate->name_len, GATE_MAGIC};
        memcpy((uint8_t *)r + n - GATE_FOOTER, &f, sizeof f);
        final = REC_GATED;
    }
    r->flags = 0;
    if (UNLIKELY(times != NULL)) { /* its due and expiry times (timers.c) */
        timers_write_footer(r, n, times[0], times[1]);
        r->flags = REC_F_TIMES;
    }
    r->crc = (c->cfg.flags & SHM_CFG_DURABLE) ? rec_checksum(r, n) : 0; /* trailer included */
    /* release: pairs with the consumer's acquire load in ring_peek (and shm_gate_read):
     * a COMMITTED or GATED record's body is complete when seen. */
    STORE_RELEASE(&r->meta, META(n, final));
}

static uint64_t gate_size(const shm_gate *gate) {
    return gate ? align8(gate->name_len) + GATE_FOOTER : 0;
}

/* A durable record's checksum (crc32c.c): its length, and everything the producer wrote
 * after the header words except what the consumer writes (`slot`, the parking `links`) --
 * seq, kind, counts, hashes, key blob, payload and padding. Position-free, so a record
 * moved by compact.c keeps it. The caller has checked len against the record's counts. */
uint32_t rec_checksum(const shm_record *r, uint64_t len) {
    uint64_t hashes = 8u * (uint64_t)r->nkeys, skip = REC_BODY + 2u * hashes;
    uint32_t crc = crc32c(0, &len, sizeof len);
    crc = crc32c(crc, &r->seq, offsetof(shm_record, slot) - offsetof(shm_record, seq));
    crc = crc32c(crc, r->hashes, hashes);
    return len < skip ? crc : crc32c(crc, (const uint8_t *)r + skip, len - skip);
}

/* 1 if r (of validated length len) is intact: always, unless the channel is durable. */
int rec_checksum_ok(shm_chan *c, const shm_record *r, uint64_t len) {
    if (!(c->cfg.flags & SHM_CFG_DURABLE)) return 1;
    return len >= REC_BODY && r->crc == rec_checksum(r, len);
}

/* Compute the hashes of an encoded key blob: a sequence of (u16 little-endian length,
 * that many bytes). The blob comes from Python; it is still checked. out NULL: only
 * check it. */
static int key_hashes_any(const uint8_t *keys, uint32_t keys_len, uint32_t nkeys, uint64_t *out) {
    uint32_t off = 0;
    for (uint32_t i = 0; i < nkeys; i++) {
        if (keys_len - off < 2) return SHM_E_INVALID;
        uint32_t kl = (uint32_t)keys[off] | ((uint32_t)keys[off + 1] << 8);
        off += 2;
        if (keys_len - off < kl) return SHM_E_INVALID;
        if (out) out[i] = hash_key_bytes(keys + off, kl);
        off += kl;
    }
    return off == keys_len ? SHM_OK : SHM_E_INVALID;
}

/* key_hashes_any, with the common case of one key inline at each call. */
static inline int key_hashes(const uint8_t *keys, uint32_t keys_len, uint32_t nkeys,
                             uint64_t *out) {
    if (nkeys == 1) {
        if (keys_len < 2 || ((uint32_t)keys[0] | ((uint32_t)keys[1] << 8)) != keys_len - 2)
            return SHM_E_INVALID;
        if (out) out[0] = hash_key_bytes(keys + 2, keys_len - 2);
        return SHM_OK;
    }
    return key_hashes_any(keys, keys_len, nkeys, out);
}

static inline int check_message(shm_chan *c, uint32_t kind, uint64_t len, uint32_t keys_len,
                                uint32_t nkeys, uint64_t *n_out) {
    if (kind > SHM_PAYLOAD_PICKLE) return SHM_E_INVALID;
    if (kind != SHM_PAYLOAD_RAW && (c->cfg.flags & SHM_CFG_RAW_ONLY)) return SHM_E_INVALID;
    if (nkeys > c->cfg.max_keys) return SHM_E_TOO_MANY_KEYS;
    if (len > c->limit || keys_len > c->limit) return SHM_E_TOO_LARGE;
    uint64_t n = rec_size(nkeys, keys_len, len);
    if (n + REC_HDR > c->limit) return SHM_E_TOO_LARGE;
    *n_out = n;
    return SHM_OK;
}

/* The figures behind a MessageTooLarge: the record a message needs and the most the
 * channel takes (the capacity less one record header). Returns check_message's status. */
int shm_message_size(shm_chan *c, uint32_t kind, uint64_t len, uint32_t keys_len,
                     uint32_t nkeys, uint64_t *record, uint64_t *limit) {
    *record = rec_size(nkeys > SHM_MAX_KEYS_LIMIT ? SHM_MAX_KEYS_LIMIT : nkeys, keys_len, len);
    *limit = c->limit - REC_HDR;
    uint64_t n;
    return check_message(c, kind, len, keys_len, nkeys, &n);
}

/* Producer-side wake-up check after commits (the eventcount's signal side). */
static void wake_receiver(shm_chan *c, int *wake) {
    /* seq_cst fence: pairs with the receiver's seq_cst store of rx_sleeping = 1 before
     * it re-checks the ring (recv in handles.c): either it sees our commit, or we see
     * it asleep. */
    FENCE_SEQCST();
    if (LOAD_RELAXED(&c->hdr->rx_sleeping)) {
        uint32_t one = 1;
        /* Only one waker posts per sleep: the CAS winner. */
        if (CAS_SEQCST(&c->hdr->rx_sleeping, &one, 0)) *wake |= 1;
    }
}

static int send_one(shm_chan *c, uint32_t kind, const uint8_t *data, uint64_t len,
                    const uint8_t *keys, uint32_t keys_len, uint32_t nkeys, uint64_t *seq_out,
                    shm_stall *stall, const shm_gate *gate, uint64_t *pos_out,
                    const uint64_t *times) {
    uint64_t n, pos = 0, seq = 0; /* set by claim() when it succeeds */
    uint64_t hashes[SHM_MAX_KEYS_LIMIT];
    if (gate && gate->name_len > SHM_GATE_NAME_MAX) return SHM_E_INVALID;
    /* the trailer is 8-aligned: the record is the body's size plus gate_size */
    if (gate && times) return SHM_E_INVALID; /* one footer per record */
    int rc = check_message(c, kind, len + gate_size(gate) + (times ? TIME_FOOTER : 0), keys_len,
                           nkeys, &n);
    if (rc) return rc;
    rc = key_hashes(keys, keys_len, nkeys, hashes);
    if (rc) return rc;
    uint32_t down = LOAD_ACQUIRE(&c->hdr->shutdown); /* pairs with shm_shutdown */
    if (UNLIKELY(down) && !c->ovf_drainer)
        return down & SHUTDOWN_REMOVED ? SHM_REMOVED : SHM_CLOSED;
    /* acquire: pairs with shm_ovf_finish's store (overflow.c): while the overflow file
     * holds messages, sends go behind them, except the drainer's, which take them back */
    if (UNLIKELY(LOAD_ACQUIRE(&c->hdr->overflowing)) && !c->ovf_drainer) return SHM_FULL;
    rc = claim(c, n, &pos, &seq, stall);
    if (rc) return rc;
    /* seq_cst: after our claim (seq_cst CAS). Pairs with shm_shutdown's seq_cst store:
     * a receiver that saw shutdown and then an EMPTY tail cannot miss a claim that did
     * not see shutdown. */
    down = LOAD_SEQCST(&c->hdr->shutdown);
    if (UNLIKELY(down) && !c->ovf_drainer) {
        shm_record *r = rec_at(c, pos);
        prepare_successor(c, pos + n, seq);
        STORE_RELEASE(&r->meta, META(n, REC_CANCELLED)); /* pairs with ring_peek */
        hint_raise(c, pos + n);
        return down & SHUTDOWN_REMOVED ? SHM_REMOVED : SHM_CLOSED;
    }
    fill(c, pos, n, seq, kind, data, len, keys, keys_len, nkeys, hashes, gate, times);
    if (!gate) { /* a gated record counts as sent once its publisher commits it */
        shm_producer *p = &c->producers[c->producer - 1];
        STORE_RELAXED(&p->sent, p->sent + 1); /* single writer: the registry entry's owner */
    }
    *seq_out = seq;
    if (pos_out) *pos_out = pos;
    return SHM_OK;
}

/* Append a record that stays GATED until ring_gate_settle (exchange.c's publish). */
int ring_send_gated(shm_chan *c, uint32_t kind, const uint8_t *data, uint64_t len,
                    const uint8_t *keys, uint32_t keys_len, uint32_t nkeys, const shm_gate *gate,
                    uint64_t *pos_out, uint64_t *seq_out, shm_stall *stall) {
    if (UNLIKELY(c->producer == 0)) return SHM_E_INVALID;
    return send_one(c, kind, data, len, keys, keys_len, nkeys, seq_out, stall, gate, pos_out,
                    NULL);
}

/* CAS the GATED record at pos, claimed by owner_token, to final_state. SHM_STALE if it is
 * not (or no longer) that. *wake |= 1 when the receiver should be posted. */
int ring_gate_settle(shm_chan *c, uint64_t pos, uint64_t owner_token, uint32_t final_state,
                     int *wake) {
    shm_record *r = rec_at(c, pos);
    /* acquire: pairs with the claim CAS; the owner of a GATED record never changes. */
    if (LOAD_ACQUIRE(&r->owner) != OWNER_CLAIM(owner_token)) return SHM_STALE;
    uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with fill's release of GATED */
    if (META_STATE(meta) != REC_GATED) return SHM_STALE;
    /* seq_cst: one settler wins (the publisher, or the receiver once it is dead); pairs
     * with the consumer's acquire load of meta in ring_peek. */
    if (!CAS_SEQCST(&r->meta, &meta, META(META_LEN(meta), final_state))) return SHM_STALE;
    if (final_state == REC_COMMITTED && c->producer && owner_token == c->token) {
        shm_producer *p = &c->producers[c->producer - 1];
        STORE_RELAXED(&p->sent, p->sent + 1); /* single writer: the registry entry's owner */
    }
    wake_receiver(c, wake);
    return SHM_OK;
}

/* The gate of the GATED record at pos claimed by dead_owner (any process may read it). */
int shm_gate_read(shm_chan *c, uint64_t pos, uint64_t dead_owner, shm_gate *out) {
    shm_record *r = rec_at(c, pos);
    if (LOAD_ACQUIRE(&r->owner) != OWNER_CLAIM(dead_owner)) return SHM_STALE; /* pairs with claim */
    uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with fill's release of GATED */
    uint64_t len = META_LEN(meta);
    if (META_STATE(meta) != REC_GATED) return SHM_STALE;
    if (!len_ok(c, len) || ring_validate_body(c, r, len) != SHM_OK) return SHM_E_CORRUPT;
    shm_gate_footer f;
    uint64_t body = rec_size(r->nkeys, r->keys_len, r->data_len);
    if (len - body < GATE_FOOTER) return SHM_E_CORRUPT; /* a plain body: no gate */
    memcpy(&f, (uint8_t *)r + len - GATE_FOOTER, sizeof f);
    out->uid = f.uid;
    out->slot = f.slot;
    out->gen = f.gen;
    out->name_len = f.name_len; /* checked by ring_validate_body */
    memcpy(out->name, (uint8_t *)r + body, f.name_len);
    /* acquire fence, then re-read: the record was not settled (and reused) meanwhile */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (LOAD_RELAXED(&r->meta) != meta || LOAD_RELAXED(&r->owner) != OWNER_CLAIM(dead_owner))
        return SHM_STALE;
    return SHM_OK;
}

/* Receiver: settle a dead publisher's GATED record at pos as its transaction decided. Under
 * rx_mu, so head cannot pass pos meanwhile: the record we checked is the one we settle. */
int shm_gate_resolve(shm_chan *c, uint64_t pos, uint64_t dead_owner, int commit) {
    if (!c->is_rx) return SHM_E_INVALID;
    rx_lock(&c->rx_mu);
    int rc = SHM_STALE, wake = 0;
    if (pos >= c->hdr->head && pos - c->hdr->head < c->cap)
        rc = ring_gate_settle(c, pos, dead_owner, commit ? REC_COMMITTED : REC_DISCARDED, &wake);
    rx_unlock(&c->rx_mu);
    return rc;
}

int shm_send(shm_chan *c, uint32_t kind, const char *data, uint64_t len, const char *keys,
             uint32_t keys_len, uint32_t nkeys, uint64_t *seq_out, shm_stall *stall, int *wake) {
    *wake = 0;
    if (UNLIKELY(c->producer == 0)) return SHM_E_INVALID;
    int rc = send_one(c, kind, (const uint8_t *)data, len, (const uint8_t *)keys, keys_len, nkeys,
                      seq_out, stall, NULL, NULL, NULL);
    if (rc == SHM_OK) wake_receiver(c, wake);
    return rc;
}

/* shm_send with a due and an expiry time (timers.c), off the plain send's path. */
int shm_send_timed(shm_chan *c, uint32_t kind, const char *data, uint64_t len, const char *keys,
                   uint32_t keys_len, uint32_t nkeys, uint64_t due_ns, uint64_t expire_ns,
                   uint64_t *seq_out, shm_stall *stall, int *wake) {
    *wake = 0;
    if (UNLIKELY(c->producer == 0)) return SHM_E_INVALID;
    uint64_t times[2] = {due_ns, expire_ns};
    int rc = send_one(c, kind, (const uint8_t *)data, len, (const uint8_t *)keys, keys_len, nkeys,
                      seq_out, stall, NULL, NULL, times);
    if (rc == SHM_OK) wake_receiver(c, wake);
    return rc;
}

/* Records of at most GROUP_RECORD bytes are sent in groups of at most GROUP_BYTES (and a
 * quarter of the capacity, so that a group fits whenever a quarter of the ring is free):
 * large enough that the claim's cost is spread thin, small enough that another producer
 * waits behind a group for a few microseconds at most. */
#define GROUP_RECORD 1024u
#define GROUP_BYTES (32u << 10)
#define GROUP_COUNT 32u /* unfinished records one frozen producer leaves: half SHM_WRITING_MAX */

/* Turn [pos, pos + len) of our claim into one CANCELLED record (nothing in it was
 * published), passing seq on. */
static void cancel_range(shm_chan *c, uint64_t pos, uint64_t len, uint64_t seq) {
    prepare_successor(c, pos + len, seq);
    STORE_RELEASE(&rec_at(c, pos)->meta, META(len, REC_CANCELLED)); /* pairs with ring_peek */
    hint_raise(c, pos + len);
}

/* A payload into a record: lengths up to 64 bytes (the common message) with a few
 * overlapping 16-byte loads and stores that read and write only [src, src + n), the rest
 * with a memcpy call, which would cost more than the copy for small ones. */
static inline void copy_payload(uint8_t *dst, const uint8_t *src, uint64_t n) {
    if (n > 64 || n < 16) {
        if (n > 64) memcpy(dst, src, n);
        else copy_small(dst, src, n);
        return;
    }
    uint8_t a[16], b[16], y[16], z[16];
    memcpy(a, src, 16);
    memcpy(z, src + n - 16, 16);
    if (n > 32) {
        memcpy(b, src + 16, 16);
        memcpy(y, src + n - 32, 16);
        memcpy(dst + 16, b, 16);
        memcpy(dst + n - 32, y, 16);
    }
    memcpy(dst, a, 16);
    memcpy(dst + n - 16, z, 16);
}

/* A record's fixed fields after the header words (kind and nkeys, data_len, keys_len and
 * slot), written as three 8-byte stores. */
_Static_assert(offsetof(shm_record, nkeys) == offsetof(shm_record, kind) + 4 &&
                   offsetof(shm_record, slot) == offsetof(shm_record, keys_len) + 4 &&
                   offsetof(shm_record, flags) == offsetof(shm_record, crc) + 4,
               "put_fixed and send_group write these pairs as one word");
static inline void put_fixed(shm_record *r, uint32_t kind, uint32_t nkeys, uint64_t data_len,
                             uint32_t keys_len) {
    uint32_t kn[2] = {kind, nkeys}, ks[2] = {keys_len, 0}; /* slot = 0 */
    memcpy(&r->kind, kn, 8);
    r->data_len = data_len;
    memcpy(&r->keys_len, ks, 8);
}

/* Send k messages of the caller's arrays (checked by check_message: each record at most
 * GROUP_RECORD bytes, total bytes in all; sizes[i] = rec_size of message i) as one group
 * (see the top of this file). *sent: how many went (SHM_OK: all k), their seqs in
 * seqs_out. */
static int send_group(shm_chan *c, uint32_t k, uint64_t total, const uint64_t *sizes,
                      const uint32_t *kinds, const uint8_t *data, const uint64_t *lens,
                      const uint8_t *keys, const uint32_t *klens, const uint32_t *nkeys,
                      uint64_t *seqs_out, uint32_t *sent, shm_stall *stall) {
    uint64_t pos = 0, seq = 0;
    *sent = 0;
    if (UNLIKELY(k > GROUP_COUNT)) return SHM_E_INVALID; /* at most GROUP_COUNT placeholders */
    uint32_t down = LOAD_ACQUIRE(&c->hdr->shutdown); /* pairs with shm_shutdown */
    if (UNLIKELY(down) && !c->ovf_drainer)
        return down & SHUTDOWN_REMOVED ? SHM_REMOVED : SHM_CLOSED;
    /* acquire: pairs with shm_ovf_finish's store (overflow.c), as in send_one: while the
     * overflow file holds messages, a group goes behind them too */
    if (UNLIKELY(LOAD_ACQUIRE(&c->hdr->overflowing)) && !c->ovf_drainer) return SHM_FULL;
    int rc = claim(c, total, &pos, &seq, stall);
    if (rc) return rc;
    /* seq_cst: after our claim, as in send_one (pairs with shm_shutdown's store). */
    down = LOAD_SEQCST(&c->hdr->shutdown);
    if (UNLIKELY(down) && !c->ovf_drainer) {
        cancel_range(c, pos, total, seq);
        return down & SHUTDOWN_REMOVED ? SHM_REMOVED : SHM_CLOSED;
    }
    const uint64_t mine = OWNER_CLAIM(c->token);
    const int durable = (c->cfg.flags & SHM_CFG_DURABLE) != 0;
    shm_producer *p = &c->producers[c->producer - 1];
    const uint64_t end = pos + total;
    /* The group's bytes from its first record's address: contiguous through the ring's
     * second mapping (see successor_at), so no record needs a division to be found. */
    uint8_t *const base = ring_at(c, pos);
    /* Pass 1: each record's fixed part, key blob and hashes, its successor's header, then
     * its length (WRITING). Every record is CLAIMED for a few stores only, as after a single
     * send's CAS: a producer frozen (SIGSTOP) inside a group holds up only the messages
     * on its keys, never the whole channel. */
    uint64_t off = 0, s = seq;
    const uint8_t *kp = keys;
    uint32_t m = 0; /* records published WRITING */
    for (; m < k; m++) {
        shm_record *r = (shm_record *)(base + off);
        const uint64_t n = sizes[m];
        const uint32_t kl = klens[m], nk = nkeys[m];
        uint8_t *kb = (uint8_t *)r + REC_BODY + 16u * nk; /* past hashes and links */
        int bad;
        if (nk == 1) { /* the common case: its blob is (length, key); hashed from our copy */
            bad = kl < 2 || ((uint32_t)kp[0] | ((uint32_t)kp[1] << 8)) != kl - 2;
            if (!bad) {
                copy_small(kb, kp, kl);
                /* the rest of the record and the next header follow the copy */
                r->hashes[0] = hash_key_padded(kb + 2, kl - 2);
            }
        } else {
            bad = key_hashes(kp, kl, nk, r->hashes) != SHM_OK;
            if (!bad) copy_small(kb, kp, kl);
        }
        if (UNLIKELY(bad)) {
            /* a blob that changed since it was checked: the rest of the group goes out
             * as one cancelled record; the records before it are finished below */
            cancel_range(c, pos + off, total - off, s);
            break;
        }
        put_fixed(r, kinds[m], nk, lens[m], kl);
        shm_record *nx = (shm_record *)(base + off + n);
        if (m + 1 < k) { /* the next record: a claim of ours, as if won by CAS */
            /* relaxed: published by the release store of our meta just below, which
             * whoever reaches it has acquired (walkers in claim, ring_peek). */
            STORE_RELAXED(&nx->owner, mine);
            STORE_RELAXED(&nx->meta, 0);
            STORE_RELAXED(&nx->seq, s + 1);
        } else {
            successor_at(nx, pos + off + n, s + 1); /* the next tail */
        }
        /* release: pairs with walkers' acquire load of meta in claim() and ring_peek's:
         * the successor's header, the fixed fields and the hashes are complete when seen. */
        STORE_RELEASE(&r->meta, META(n, REC_WRITING));
        off += n;
        s++;
        kp += kl;
    }
    if (m == k) hint_raise(c, end); /* other producers may claim behind the group now */
    /* Pass 2: the payloads, each record COMMITTED in order. */
    off = 0;
    const uint64_t sent0 = p->sent; /* single writer: the registry entry's owner */
    for (uint32_t i = 0; i < m; i++) {
        shm_record *r = (shm_record *)(base + off);
        const uint64_t n = sizes[i], len = lens[i];
        const uint32_t kl = klens[i];
        uint8_t *b = (uint8_t *)r + REC_BODY + 16u * nkeys[i]; /* the key blob, copied in pass 1 */
        copy_payload(b + align8(kl), data, len);
        /* crc and flags (groups carry no time footer: timers.c) as one store */
        uint32_t cf[2] = {0, 0};
        if (UNLIKELY(durable)) cf[0] = rec_checksum(r, n);
        memcpy(&r->crc, cf, 8);
        /* release: pairs with ring_peek's acquire load: the body is complete when seen */
        STORE_RELEASE(&r->meta, META(n, REC_COMMITTED));
        STORE_RELAXED(&p->sent, sent0 + i + 1); /* relaxed: a statistic (shm_stats_read) */
        if (UNLIKELY(i == 0)) test_pause(SHM_PAUSE_SEND_GROUP); /* the rest are WRITING */
        seqs_out[i] = seq + i;
        off += n;
        data += len;
    }
    *sent = m;
    return m == k ? SHM_OK : SHM_E_INVALID;
}

int shm_send_many(shm_chan *c, uint32_t n, const uint32_t *kinds, const char *data,
                  uint64_t data_total, const uint64_t *data_lens, const char *keys,
                  uint64_t keys_total, const uint32_t *keys_lens, const uint32_t *nkeys,
                  uint64_t *seqs_out, uint32_t *done, shm_stall *stall, int *wake) {
    *wake = 0;
    if (UNLIKELY(c->producer == 0)) return SHM_E_INVALID;
    uint64_t doff = 0, koff = 0;
    uint32_t i = 0;
    const int checked = *done == 0; /* every message passed check_message below */
    if (checked) {
        /* All or nothing for bad input: every message is checked before the first one is
         * sent, so a batch with one oversize or malformed message sends none of it. doff
         * and koff stay within their totals, so each bound is one subtraction. */
        uint64_t rec;
        for (uint32_t j = 0; j < n; j++) {
            const uint64_t dl = data_lens[j];
            const uint32_t kl = keys_lens[j];
            if (dl > data_total - doff || kl > keys_total - koff) return SHM_E_INVALID;
            int bad = check_message(c, kinds[j], dl, kl, nkeys[j], &rec);
            if (!bad) bad = key_hashes((const uint8_t *)keys + koff, kl, nkeys[j], NULL);
            if (bad) return bad;
            doff += dl;
            koff += kl;
        }
        doff = koff = 0;
    }
    for (; i < *done && i < n; i++) { /* skip what an earlier call already sent */
        doff += data_lens[i];
        koff += keys_lens[i];
    }
    int rc = SHM_OK;
    while (i < n) {
        if (data_lens[i] > data_total - doff || doff > data_total || keys_lens[i] > keys_total - koff ||
            koff > keys_total) {
            rc = SHM_E_INVALID;
            break;
        }
        /* a group: the small records from i on, as many as GROUP_BYTES allow */
        uint64_t cap = c->limit / 4 < GROUP_BYTES ? c->limit / 4 : GROUP_BYTES;
        uint64_t total = 0, d = doff, kk = koff, rec;
        uint64_t sizes[GROUP_COUNT]; /* each record's size, for send_group */
        uint32_t g = 0;
        const uint32_t gmax = n - i < GROUP_COUNT ? n - i : GROUP_COUNT;
        if (checked) { /* every message's bounds and record size were checked above */
            for (; g < gmax; g++) {
                rec = rec_size(nkeys[i + g], keys_lens[i + g], data_lens[i + g]);
                if (rec > GROUP_RECORD || total + rec > cap) break;
                sizes[g] = rec;
                total += rec;
                d += data_lens[i + g];
                kk += keys_lens[i + g];
            }
        } else {
            for (; g < gmax; g++) {
                if (d > data_total || data_lens[i + g] > data_total - d || kk > keys_total ||
                    keys_lens[i + g] > keys_total - kk ||
                    check_message(c, kinds[i + g], data_lens[i + g], keys_lens[i + g],
                                  nkeys[i + g], &rec) != SHM_OK ||
                    rec > GROUP_RECORD || total + rec > cap)
                    break;
                sizes[g] = rec;
                total += rec;
                d += data_lens[i + g];
                kk += keys_lens[i + g];
            }
        }
        if (g > 1) {
            uint32_t sent;
            rc = send_group(c, g, total, sizes, kinds + i, (const uint8_t *)data + doff, data_lens + i,
                            (const uint8_t *)keys + koff, keys_lens + i, nkeys + i,
                            seqs_out + i, &sent, stall);
            if (sent == g) { /* the whole group: its bytes were summed above */
                i += g;
                doff = d;
                koff = kk;
            } else {
                for (uint32_t j = 0; j < sent; j++, i++) {
                    doff += data_lens[i];
                    koff += keys_lens[i];
                }
            }
            if (rc == SHM_OK) continue;
            if (rc != SHM_FULL || sent) break;
            /* no room for the group: one message, if it fits, is progress */
        }
        rc = send_one(c, kinds[i], (const uint8_t *)data + doff, data_lens[i],
                      (const uint8_t *)keys + koff, keys_lens[i], nkeys[i], &seqs_out[i], stall,
                      NULL, NULL, NULL);
        if (rc) break;
        doff += data_lens[i];
        koff += keys_lens[i];
        i++;
    }
    if (i > *done) wake_receiver(c, wake);
    *done = i;
    return rc;
}

/* Take over a dead producer's CLAIMED record at pos and turn it into a discard record. */
int shm_repair_claim(shm_chan *c, uint64_t pos, uint64_t dead_owner) {
    shm_record *r = rec_at(c, pos);
    uint64_t expect = OWNER_CLAIM(dead_owner);
    /* acquire: pairs with the claimant's release of meta; we must not repair a record
     * whose length is already published. */
    if (META_STATE(LOAD_ACQUIRE(&r->meta)) != REC_CLAIMED) return SHM_STALE;
    /* The claimant may have been about to step over an island (islands.c): the discard
     * record then reaches past it too, so that the next header lands in free space. The
     * islands that can be in the way were made before head passed them: acquire a head
     * at least as new as the claimant's (pairs with ring_advance_head's release store).
     * The skip can only be shorter than the claimant's, whose room it checked. */
    (void)LOAD_ACQUIRE(&c->hdr->head);
    uint64_t first = 0;
    uint64_t skip = island_skip(c, pos, pos + 2u * REC_HDR, &first);
    if (skip && first < pos + REC_HDR) return SHM_E_CORRUPT; /* a claim on an island */
    uint64_t len = skip ? skip - pos : REC_HDR;
    if (!len_ok(c, len)) return SHM_E_CORRUPT;
    /* seq_cst: elects one repairer; pairs with the same CAS in other repairers. A
     * repairer that dies after it is itself repaired by the next one. */
    if (!CAS_SEQCST(&r->owner, &expect, OWNER_CLAIM(c->token))) return SHM_STALE;
    if (META_STATE(LOAD_ACQUIRE(&r->meta)) != REC_CLAIMED) return SHM_STALE;
    uint64_t seq = LOAD_RELAXED(&r->seq);
    prepare_successor(c, pos + len, seq); /* seq unused: passes on unchanged */
    /* release: pairs with walkers' and ring_peek's acquire load of meta. */
    STORE_RELEASE(&r->meta, META(len, skip ? REC_SKIP : REC_DISCARDED));
    hint_raise(c, pos + len);
    return SHM_OK;
}

/* Receiver, when a poll found nothing to do or head caught up with the scan: rewind an
 * empty ring to the start of its next lap (see the top of this file). 1 if it did. */
int ring_rewind_look(shm_chan *c) {
    shm_header *h = c->hdr;
    uint64_t pos = h->scan_pos; /* receiver-owned fields */
    /* Not empty: ring_rewind (core.h) says so first; no division, no shared line read. */
    if (h->head != pos || h->ingest_pos != pos) return 0;
    uint64_t off = ring_pos_off(c, pos);
    if (off == 0) return 0; /* at the lap's start already */
    /* Early, before REWIND_AT, where the ring's committed part (commit.c) ends soon: an
     * empty ring then starts again at offset 0 rather than take more memory, and a sender
     * that found the filesystem full (ring_short, a hint: relaxed) goes on at once.
     * acquire: pairs with commit_ring's release raise (a mere bound here). */
    uint64_t cm = LOAD_ACQUIRE(&h->ring_committed);
    int early = LOAD_RELAXED(&h->ring_short) || (cm < c->cap && off >= cm - cm / 4);
    if ((off < REWIND_AT(c) && !early) || h->writing_n) return 0;
    uint64_t end = pos + (c->cap - off);
    if (end + REC_HDR > pos + c->limit || !len_ok(c, end - pos)) return 0; /* room, as claim() */
    uint64_t first = 0;
    if (island_skip(c, pos, end + REC_HDR, &first)) return 0; /* a view pins bytes there */
    shm_record *r = rec_at(c, pos);
    uint64_t owner = OWNER_EMPTY(pos);
    /* relaxed: only a hint (a producer's claim there means the ring is not empty); the
     * CAS below decides */
    if (LOAD_RELAXED(&r->owner) != owner) return 0;
    /* seq_cst: the claim, as in claim(): pairs with producers' CAS on the same word and
     * with prepare_successor's release of EMPTY(pos). Losing it means a producer was
     * quicker: the ring is not empty any more. */
    if (!CAS_SEQCST(&r->owner, &owner, OWNER_CLAIM(c->token))) return 0;
    uint64_t seq = LOAD_RELAXED(&r->seq); /* ordered by the CAS's acquire */
    prepare_successor(c, end, seq);       /* the seq passes on unchanged */
    /* release: pairs with walkers' acquire load of meta in claim() and ring_peek's. */
    STORE_RELEASE(&r->meta, META(end - pos, REC_SKIP));
    hint_raise(c, end);
    /* The skip is finished as soon as it is written: the receiver takes it in and passes
     * it at once (nothing of it is counted: skip_bytes covers [head, scan_pos), empty). */
    h->scan_pos = end;
    h->ingest_pos = end;
    /* release: pairs with producers' acquire load of head in claim(), as in
     * ring_advance_head. Free space is unchanged: tail and head both moved by end - pos. */
    STORE_RELEASE(&h->head, end);
    h->rewinds++; /* receiver-owned, like the positions above */
    if (early) STORE_RELAXED(&h->ring_short, 0); /* as above: a hint */
    return 1;
}

/* Receiver, from a poll with nothing to do: an empty ring idle for a while gives back
 * the committed memory past what a lap from its tail needs (commit.c). The receiver holds
 * the tail meanwhile: it claims it for a REC_HDR-sized SKIP, as ring_rewind does for a
 * longer one, and publishes it when the memory is given back. 1 if it did. */
int ring_give_back(shm_chan *c) {
    shm_header *h = c->hdr;
    uint64_t pos = h->scan_pos; /* receiver-owned fields */
    if (h->head != pos || h->ingest_pos != pos || h->writing_n ||
        LOAD_RELAXED(&h->island_count)) /* relaxed: receiver-written */
        return 0;
    uint64_t keep = commit_give_back_due(c, pos);
    if (keep == 0) return 0;
    shm_record *r = rec_at(c, pos);
    uint64_t owner = OWNER_EMPTY(pos);
    if (LOAD_RELAXED(&r->owner) != owner) return 0; /* a hint, as in ring_rewind */
    /* seq_cst: the claim, as in ring_rewind */
    if (!CAS_SEQCST(&r->owner, &owner, OWNER_CLAIM(c->token))) return 0;
    uint64_t seq = LOAD_RELAXED(&r->seq); /* ordered by the CAS's acquire */
    commit_give_back(c, keep);
    test_pause(SHM_PAUSE_GIVE_BACK);
    prepare_successor(c, pos + REC_HDR, seq); /* the seq passes on unchanged */
    /* release: the lowered mark and our claim's end are visible to whoever acquires the
     * successor's EMPTY or this meta (claim(), ring_peek) */
    STORE_RELEASE(&r->meta, META(REC_HDR, REC_SKIP));
    hint_raise(c, pos + REC_HDR);
    h->scan_pos = h->ingest_pos = pos + REC_HDR; /* finished at once, as in ring_rewind */
    STORE_RELEASE(&h->head, pos + REC_HDR);      /* pairs with claim()'s acquire of head */
    return 1;
}

/* The part of a committed record's body past rec_size (peek.h body_read). */
int ring_body_trailer_ok(shm_record *r, uint64_t body, uint64_t len) {
    if (timers_trailer_ok(r, body, len)) return SHM_OK; /* a send's times (timers.c) */
    /* else it must end in a gate trailer (see core.h) */
    if (body > len || len - body < GATE_FOOTER) return SHM_E_CORRUPT;
    shm_gate_footer f;
    memcpy(&f, (uint8_t *)r + len - GATE_FOOTER, sizeof f);
    if (f.magic != GATE_MAGIC || f.name_len > SHM_GATE_NAME_MAX ||
        body + align8(f.name_len) + GATE_FOOTER != len)
        return SHM_E_CORRUPT;
    return SHM_OK;
}

/* Consumer side: look at the record at pos (peek.h). */
int ring_peek(shm_chan *c, uint64_t pos, shm_record **rec, uint64_t *len, shm_stall *stall) {
    shm_body b;
    return peek_record(c, pos, rec, len, stall, &b);
}

/* A committed record's body must describe exactly the bytes its length covers. */
int ring_validate_body(shm_chan *c, shm_record *r, uint64_t len) {
    shm_body b;
    return body_read(c, r, len, &b);
}

/* The consumer is done with the record at pos: head may pass it. */
void ring_mark_done(shm_chan *c, uint64_t pos) {
    c->done_count++;
    ring_head_unknown(c); /* head may pass it now */
    if (pos == c->compact_watch_end) c->compact_watch_hit = 1; /* compact.c may try again */
    int island = island_find(c, pos);
    if (UNLIKELY(island >= 0)) {
        /* the ring flowed around it (islands.c): its bytes go back to the producers */
        island_remove(c, island);
        if (pos < c->hdr->head) return; /* head passed it: nobody walks to it any more */
    }
    shm_record *r = rec_at(c, pos);
    uint64_t meta = LOAD_RELAXED(&r->meta);
    /* release: pairs with producers' acquire load in claim(), which only reads the length
     * (unchanged); and orders our reads of the body before any later reuse via head. */
    STORE_RELEASE(&r->meta, META(META_LEN(meta), REC_DONE));
}

/* Move head over finished records. Returns 1 if it moved.
 *
 * Where it stops, it stays until something changes below ingest_pos: head stops either at
 * ingest_pos or at a record taken in and not finished (everything before ingest_pos is
 * one or the other). It can go further only once a record there finishes (ring_mark_done),
 * becomes an island (island_add), or ingest_pos passes a finished record (walk_ingest);
 * each of these forgets head_still, and so does a new receiver (shm_rx_acquire). Whatever
 * else moves head (a rewind, a give-back, a compaction) moves it away from head_still. So
 * the receiver's poll skips the walk while ring_head_may_move says no (core.h): a
 * receiver keeping up with its releases called this twice per message, the second time
 * for nothing. Process-local state: a receiver killed leaves nothing to repair. */
__attribute__((always_inline)) static inline int advance_head_from(shm_chan *c, uint64_t head) {
    shm_header *h = c->hdr;
    uint64_t start = h->head, stop = h->ingest_pos;
    while (head < stop) {
        shm_record *r = rec_at(c, head);
        uint64_t meta = LOAD_RELAXED(&r->meta); /* consumer-owned by now */
        uint32_t st = META_STATE(meta);
        /* an island stays where it is, and head passes it (islands.c) */
        if (st != REC_DONE && st != REC_DISCARDED && st != REC_CANCELLED && st != REC_SKIP &&
            (st != REC_COMMITTED || island_find(c, head) < 0))
            break;
        uint64_t len = META_LEN(meta);
        if (!len_ok(c, len) || len > stop - head) break; /* corrupt: never move past it */
        if (st == REC_SKIP) h->skip_bytes = h->skip_bytes >= len ? h->skip_bytes - len : 0;
        head += len;
    }
    c->head_still = head;
    if (head == start) return 0;
    /* release: pairs with producers' acquire load of head in claim(); everything we read
     * from the freed records happened before they may be overwritten. */
    STORE_RELEASE(&h->head, head);
    return 1;
}

int ring_advance_head(shm_chan *c) { return advance_head_from(c, c->hdr->head); }

/* ring_advance_head for a caller that has itself just marked done every record of
 * [head, end), each of a length len_ok accepts, the next starting where the last ended (a
 * release run: handles.c): head's walk starts at end rather than looking at each of them
 * again. An end the walk could not have reached (not past head, or past ingest_pos) is
 * ignored: the walk starts at head. */
int ring_advance_head_past(shm_chan *c, uint64_t end) {
    shm_header *h = c->hdr;
    return advance_head_from(c, end > h->head && end <= h->ingest_pos ? end : h->head);
}

/* Consumer: a record in WRITING whose producer is dead becomes DISCARDED. */
int shm_discard_dead(shm_chan *c, uint64_t pos, uint64_t dead_owner) {
    if (!c->is_rx) return SHM_E_INVALID;
    rx_lock(&c->rx_mu);
    int rc = SHM_STALE;
    shm_record *r = rec_at(c, pos);
    int placeholder = window_is_writing(c, pos);
    if ((pos == c->hdr->scan_pos || placeholder) && /* not a stale position */
        LOAD_ACQUIRE(&r->owner) == OWNER_CLAIM(dead_owner)) {
        uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with the claimant's release */
        if (META_STATE(meta) == REC_WRITING && len_ok(c, META_LEN(meta))) {
            rx_begin(c);
            /* A placeholder leaves the receiver's lines first: a finished record must
             * never be in a chain (head or compaction could pass it). */
            rc = placeholder ? window_discard(c, r, pos) : SHM_OK;
            /* release: pairs with ring_peek's acquire load (we read it again next poll). */
            if (rc == SHM_OK) STORE_RELEASE(&r->meta, META(META_LEN(meta), REC_DISCARDED));
            /* Its producer died between publishing the length and raising the tail hint
             * (fill), so the hint may still name this record. Once it is finished, head
             * and compaction may pass it and rewrite its bytes; a walk started there would
             * read garbage, and restart there again while nobody raises the hint. Raise
             * it past the record, as a claim's repairer does: its end is a record boundary
             * (the producer wrote the successor's header before the length), and at most
             * the tail. */
            if (rc == SHM_OK) hint_raise(c, pos + META_LEN(meta));
            if (rc != SHM_E_CORRUPT) STORE_RELAXED(&c->hdr->dirty, 0);
            rx_end(c);
        }
    }
    rx_unlock(&c->rx_mu);
    return rc;
}

/* ---- senders waiting for space ----------------------------------------------------------
 * A sender that finds the ring full counts itself in space_waiters (shm_space_wait), checks
 * again, and sleeps on the senders' semaphore. Waking every waiter whenever head moves costs
 * a futex call per waiter per receive call, and most of them find too little room and sleep
 * again. So wake-ups are rationed (the Python layer and hotpath.c post the semaphore):
 *
 *   1. The consumer asks for a wake-up only when free space reaches SPACE_LOW_WATER (a
 *      quarter of the capacity), or when it is about to sleep with any room free (nothing
 *      else will free space soon: a sender must try now). At most one request per receive
 *      call or release.
 *   2. A request is one post, and only if no earlier post is still unconsumed (sem value 0):
 *      an unconsumed post already guarantees that some waiter will look again.
 *   3. The woken sender, when it stops waiting, passes the wake-up on to the next waiter if
 *      one is left and room remains (a baton): waiters wake one after another, each while
 *      there is room for it, instead of all at once.
 *   4. A woken sender refused again while at least SPACE_LOW_WATER is free (its message
 *      is large) passes the wake-up on as well if another waiter is counted, but only
 *      once per move of head (shm_space_refused): a waiter whose message fits must not
 *      sleep behind one whose message does not, and two that do not fit cannot wake each
 *      other for ever. The passer then naps briefly instead of sleeping on the semaphore,
 *      where it could take its own post back (the Python layer's SpaceWait). With less
 *      free, a refusal is mostly senders of like messages racing for the last room, which
 *      a pass would not help: the receiver's next request (1) wakes the next waiter.
 *
 * Every waiting thread counts, not every waiting process: threads of one process share its
 * registry entry, whose `waiting` is the number of them waiting (a counter, changed with
 * atomics: the calls run without the GIL), and each adds one to space_waiters. Had a
 * process counted once, the first of its threads to stop waiting would take the count to 0
 * and pass the wake-up on to nobody, leaving the others asleep until their next poll.
 *
 * No lost wake-up: a waiter counts itself (seq_cst add) before its last check of head, and
 * the consumer stores head before it loads the count (seq_cst fence), so either the check
 * sees the new head or the consumer sees the waiter. A waiter the consumer saw is then woken
 * by (1) once enough is free or the consumer idles, and a post that is not consumed stays
 * in the semaphore for the next waiter. Every wait is also bounded (the Python layer looks
 * again at least every 0.1 s), so even a waker killed mid-way costs a delay, not a hang.
 *
 * A waiter killed while counted: whoever reaps its registry entry (segment.c) takes the
 * entry's count out of space_waiters, so the consumer does not go on posting for nobody.
 * The two words cannot change together, so the order of the updates decides which way a
 * death between them errs: an entry's `waiting` is raised before space_waiters and lowered
 * after it, so it is never less than what the entry added, and a reaper can only take out
 * too much. Every decrement stops at 0 (count_sub), so too low a count heals once the live
 * waiters stop waiting (each of their decrements is then clipped), where too high a count
 * would never come down: too low costs a sender a poll's delay, too high a post per
 * receive call for good. */
#define SPACE_LOW_WATER(c) ((c)->limit / 4)
#define SPACE_MIN_RECORD (REC_BODY + REC_HDR) /* the smallest record a sender may wait for */

/* Bytes a sender could claim now (a lower bound of head, an upper bound of the tail; a
 * lagging tail hint overstates the room, which only makes a wake-up early). */
static uint64_t space_free(shm_chan *c) {
    uint64_t head = LOAD_ACQUIRE(&c->hdr->head);      /* pairs with ring_advance_head */
    uint64_t tail = LOAD_ACQUIRE(&c->hdr->tail_hint); /* pairs with hint_raise */
    if (tail < head) tail = head;
    uint64_t used = tail - head;
    return used >= c->limit ? 0 : c->limit - used;
}

/* Consumer, after it freed space (or, with idle, before it sleeps): should one waiting
 * sender be woken? The caller has issued the seq_cst fence after its store of head. */
int space_wake_due(shm_chan *c, int idle) {
    if (LOAD_RELAXED(&c->hdr->space_waiters) == 0) return 0; /* ordered by the fence */
    uint64_t room = space_free(c);
    return room >= SPACE_LOW_WATER(c) || (idle && room >= SPACE_MIN_RECORD);
}

/* *w -= n, stopping at 0 (see the top of this section); returns the new value. seq_cst:
 * on space_waiters it pairs, as the add in shm_space_wait does, with the consumer's fence
 * in space_wake_due's callers; on an entry's count with the reaper's acquire load
 * (space_unwait_entry). */
uint32_t space_count_sub(uint32_t *w, uint32_t n) {
    uint32_t cur = LOAD_RELAXED(w); /* only a first guess: the CAS checks it */
    for (;;) {
        uint32_t next = cur > n ? cur - n : 0;
        if (CAS_SEQCST(w, &cur, next)) return next;
    }
}

/* Take a registry entry's waiting count out of space_waiters: its owner is dead (reap) or
 * detaching. Subtract, then zero the entry: a reaper killed in between leaves the count in
 * the entry, and the next reaper takes it out again (too low, never too high: see above). */
void space_unwait_entry(shm_chan *c, shm_producer *p) {
    /* acquire: pairs with the owner's seq_cst add in shm_space_wait (its last count). */
    uint32_t n = LOAD_ACQUIRE(&p->waiting);
    if (n == 0) return;
    space_count_sub(&c->hdr->space_waiters, n);
    /* release: after the subtraction; pairs with the acquire load above in a later reaper. */
    STORE_RELEASE(&p->waiting, 0);
}

uint32_t shm_space_waiters(shm_chan *c) {
    return LOAD_RELAXED(&c->hdr->space_waiters); /* a snapshot: nothing is read after it */
}

/* arm = 1: count the calling thread as waiting. arm = 0: it no longer waits (a no-op if its
 * process's entry counts nobody); *wake = 1 asks the caller to wake the next waiting sender
 * (rule 3 above). Each arm of a thread must be followed by one disarm of the same thread
 * (the Python layer's `armed`). */
int shm_space_wait(shm_chan *c, int arm, int *wake) {
    *wake = 0;
    if (c->producer == 0) return SHM_E_INVALID;
    shm_producer *p = &c->producers[c->producer - 1];
    if (arm) {
        /* The entry first (see the top of this section). seq_cst: pairs with the reaper's
         * acquire load in space_unwait_entry. */
        FETCH_ADD_SEQCST(&p->waiting, 1);
        /* seq_cst: pairs with the consumer's fence between its store of head and its load
         * of space_waiters (space_wake_due): either it sees us waiting or our retry sees
         * its head. */
        FETCH_ADD_SEQCST(&c->hdr->space_waiters, 1);
    } else {
        /* relaxed: only the calling process changes its own entry while it lives (the
         * thread's own arm is what makes it non-zero) */
        if (LOAD_RELAXED(&p->waiting) == 0) return SHM_OK;
        /* space_waiters first, then the entry (see the top of this section). */
        uint32_t left = space_count_sub(&c->hdr->space_waiters, 1);
        space_count_sub(&p->waiting, 1);
        if (left > 0 && space_free(c) >= SPACE_MIN_RECORD) *wake = 1;
    }
    return SHM_OK;
}

/* Rule 4 above: the calling sender consumed a post and was refused again. Returns 1 if
 * it should pass the wake-up on: another waiter is counted, at least SPACE_LOW_WATER is
 * free, and head moved since *passed_at (the head of its last pass, UINT64_MAX before the
 * first), which then becomes head. */
int shm_space_refused(shm_chan *c, uint64_t *passed_at) {
    /* relaxed: a hint, pairs with nothing: a waiter it misses still looks periodically */
    if (LOAD_RELAXED(&c->hdr->space_waiters) < 2 || space_free(c) < SPACE_LOW_WATER(c)) return 0;
    uint64_t head = LOAD_ACQUIRE(&c->hdr->head); /* pairs with ring_advance_head */
    if (head == *passed_at) return 0;
    *passed_at = head;
    return 1;
}

int shm_shutdown(shm_chan *c) {
    /* seq_cst: pairs with the seq_cst load of shutdown after a claim in send_one, and with
     * the receiver's load before it declares the channel drained. */
    __atomic_fetch_or(&c->hdr->shutdown, SHUTDOWN_CLOSED, __ATOMIC_SEQ_CST);
    return SHM_OK;
}
