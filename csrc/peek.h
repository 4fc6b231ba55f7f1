/* peek.h -- the receiver's look at the record at a ring position: is it there, whole,
 * and what does its body say.
 *
 * A record's owner word says whether pos is still the tail (EMPTY) or claimed; its meta
 * word (length and REC_* state) says whether it is being written, committed or to be
 * skipped (ring.c has the producers' side of the protocol). A committed record's body
 * fields must describe exactly the bytes its length covers (rec_size, plus a send's time
 * footer or an exchange's gate trailer); the fields are read once, into a shm_body, and
 * whoever uses those values rather than reading the record again uses values bounded by
 * its length, whatever a producer writes there since.
 *
 * Inline: every record a receiver takes in goes through it, a batch receive's run
 * (batchin.c) once per message; ring.c's ring_peek and ring_validate_body are the
 * out-of-line entries for everyone else.
 */
#ifndef SHMCHAN_PEEK_H
#define SHMCHAN_PEEK_H
#include "core.h"

/* A committed record's body fields as read and validated once. */
typedef struct {
    uint32_t kind, nkeys, keys_len;
    uint64_t data_len;
} shm_body;

/* A length read from the segment is usable only if it is a whole number of words and
 * the record plus the next header fit in the ring. */
static inline int len_ok(shm_chan *c, uint64_t len) {
    return len >= REC_HDR && (len & 7u) == 0 && len <= c->cap - REC_HDR;
}

int ring_body_trailer_ok(shm_record *r, uint64_t body, uint64_t len); /* ring.c */

/* A committed record's body, of length len, describes exactly its bytes: its fields are
 * read once, into *b. */
static inline __attribute__((always_inline)) int body_read(shm_chan *c, shm_record *r,
                                                           uint64_t len, shm_body *b) {
    if (len < REC_BODY) return SHM_E_CORRUPT;
    b->kind = r->kind;
    b->nkeys = r->nkeys;
    b->keys_len = r->keys_len;
    b->data_len = r->data_len;
    if (!rec_fields_ok(c, b->kind, b->nkeys, b->keys_len, b->data_len, len)) return SHM_E_CORRUPT;
    uint64_t body = rec_size(b->nkeys, b->keys_len, b->data_len);
    if (LIKELY(body == len)) return SHM_OK;
    return ring_body_trailer_ok(r, body, len);
}

/* Look at the record at pos:
 *   SHM_OK       committed: *rec and *len are set, the body is validated (*b)
 *   SHM_EMPTY    pos is the tail
 *   SHM_STALLED  claimed or being written: *stall names the claimant
 *   SHM_CLOSED   a record to skip (*len set): discarded or cancelled
 *   SHM_E_CORRUPT */
static inline __attribute__((always_inline)) int peek_record(shm_chan *c, uint64_t pos,
                                                             shm_record **rec, uint64_t *len,
                                                             shm_stall *stall, shm_body *b) {
    shm_record *r = rec_at(c, pos);
    /* acquire: pairs with prepare_successor (EMPTY) and the claimant's CAS (ring.c). */
    uint64_t owner = LOAD_ACQUIRE(&r->owner);
    if (owner == OWNER_EMPTY(pos)) return SHM_EMPTY;
    if (OWNER_IS_EMPTY(owner) || owner == 0) return SHM_E_CORRUPT;
    /* acquire: pairs with the release stores of meta in fill() / repair / discard. */
    uint64_t meta = LOAD_ACQUIRE(&r->meta);
    uint32_t st = META_STATE(meta);
    if (st == REC_CLAIMED || st == REC_WRITING || st == REC_GATED) {
        stall->pos = pos;
        stall->owner = OWNER_TOKEN(owner);
        return SHM_STALLED;
    }
    uint64_t l = META_LEN(meta);
    if (!len_ok(c, l)) return SHM_E_CORRUPT;
    *len = l;
    *rec = r;
    if (st == REC_DISCARDED || st == REC_CANCELLED || st == REC_SKIP) return SHM_CLOSED;
    if (st != REC_COMMITTED) return SHM_E_CORRUPT;
    int rc = body_read(c, r, l, b);
    /* A record recovered from a durable channel's file may be torn (crc32c.c). */
    if (rc == SHM_OK && pos < c->verify_below && !rec_checksum_ok(c, r, l)) rc = SHM_E_CORRUPT;
    return rc;
}

/* Describe the message of record r at pos, held in slot s (generation gen, state word
 * `word`), from its checked body fields *b: the offsets of its keys and data. The one
 * description both hand-outs give (handles.c fill, batchin.c run_hand_out). */
static inline __attribute__((always_inline)) void
msg_describe(shm_msg *m, shm_chan *c, shm_record *r, uint64_t pos, uint32_t s, uint32_t gen,
             uint64_t seq, uint32_t attempt, const shm_body *b, uint64_t word) {
    /* past the hashes and links */
    uint64_t body = (uint64_t)((uint8_t *)r - c->base) + REC_BODY + 16u * b->nkeys;
    m->slot = s;
    m->gen = gen;
    m->seq = seq;
    m->attempt = attempt;
    m->kind = b->kind;
    m->nkeys = b->nkeys;
    m->keys_off = body;
    m->keys_len = b->keys_len;
    m->data_off = body + align8(b->keys_len);
    m->data_len = b->data_len;
    m->pos = pos;
    m->word = word;
}

#endif
