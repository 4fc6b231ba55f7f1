/* budget.c -- the tables' share of the ring: at most a tenth of the committed ring.
 *
 * The receiver's tables (the message table and its ready heap, the key nodes, the key
 * table: core.h) are committed per message taken in and per key in use; the ring is
 * committed per byte used (commit.c). A small record (64 bytes of payload and a key:
 * about 150 ring bytes) costs its tables about 250-350 bytes once taken in, so if the
 * receiver took in whatever it could, the tables would soon outweigh the ring. The
 * budget bounds what the receiver takes in *ahead of need*, and leaves the rest where it
 * lies, in the ring:
 *
 * Invariant B: the receiver raises a table mark (commit_slots, commit_nodes,
 * commit_keys) only if, after the raise, the tables' committed bytes (budget_bytes: each
 * table's committed entries, rounded up to whole pages, as the file holds them) are at
 * most a tenth of ring_committed -- or if the raise makes room for a message needed now:
 * one the receiver takes in while no message is ready (sched.c sched_has_room sets
 * c->tables_need then), which is the next message a recv can get. Parking never raises a
 * mark past the budget (sched.c sched_park_room).
 *
 * What it bounds and what it does not:
 *   - ready ahead: the receiver takes in up to READY_AHEAD ready messages before anyone
 *     asks (window.c); past the budget it stops at the first that would need a mark
 *     raised, as if the window were full. The first recv that finds nothing ready takes
 *     the next message in regardless (tables_need), so a recv never waits for a message
 *     that is free to go.
 *   - parked keys: a record parked behind a held or waiting key (window.c) costs no slot,
 *     but each key it brings that is new to the key table costs an entry. Parking past the
 *     budget stops the scan there, whether or not a message is ready, until keys leave the
 *     table or the ring commits more (a release and every commit wake the receiver); the
 *     records behind it stay in the ring, costing the tables nothing. While none is ready,
 *     the look-ahead (lookahead.c) searches them, in the receiver's own heap memory, for a
 *     message that may go (messages on free keys never wait for messages on other keys)
 *     and takes that one in: the cost of the handle it becomes, below. So a backlog whose
 *     messages each bring a new key holds the tables to a tenth of the ring at any fill.
 *     Parking keeps room in the key table's size for one message of max_keys new keys, so
 *     that taking in that message does not double the table. One exemption (sched.c
 *     sched_park_room): once messages taken in by the look-ahead lie past the stopped scan
 *     and the ring is more than half used (or a sender was refused), parking goes past
 *     the budget: their ring space is reclaimed only once the scan has passed them, and
 *     a sender must not wait for a held key while there is space in aggregate. The
 *     tables then hold key entries for the backlog (about 100 bytes a message), as long
 *     as it lasts: the cost of free traffic flowing past a held key's new-key backlog
 *     for more than half a ring. Records that bring no new key
 *     (a backlog on one hot key) cost nothing and are never stopped, so a free-key message
 *     behind them is seen and handed out at O(keys) cost; past the look-ahead's reach
 *     (lookahead.c: 65,536 records) a free-key message waits for the scan.
 *   - live handles: a handle is its slot, and the receiver does not refuse a recv for its
 *     budget. A consumer that holds H handles at once has made the tables hold H messages
 *     (the exemption above): slot 144 + ready entry 16 + a node 24 per key + two to four
 *     key entries of 48 per key (the table is kept at most half full), about 230 to 380
 *     bytes a handle with one key, so the tables may then pass a tenth of the ring by the
 *     cost of those H messages (1,000 handles of 64-byte messages: 29 % of a 1 MiB ring;
 *     5,000: 168 %); the marks keep that high-water mark (slots are never given back:
 *     their generations make stale handles harmless).
 *   - delayed messages: a record whose delay has not run out is not needed before then,
 *     so the scan takes it in only within the budget (window.c decide), whether or not a
 *     message is ready; past the budget it stays in the ring, and the look-ahead counts it
 *     and makes the receiver look again when it falls due (lookahead.c). A backlog of
 *     messages all delayed far ahead, on distinct keys, so stays within a tenth of the
 *     ring (30,000 of them: 10.0 % of a 5 MiB ring; before, about 290 bytes a message,
 *     169 %). Once due, such a message is needed like any other. A nack's delay applies to
 *     a message already taken in: it keeps its slot.
 *   - the first chunks committed at create (commit_create) are a floor: in a ring smaller
 *     than about ten times them (a capacity under about 640 KiB) they alone are more than
 *     a tenth.
 * A drained ring that gives memory back (commit.c commit_give_back) gives back the node
 * and key tables' growth with it, so after a burst of parked keys the share is small
 * again; the message table keeps its memory (slot generations), so after a give-back
 * the tables may pass a tenth of the ring by the slots committed before it (at most a
 * tenth of the ring as it was, plus the handles held at once).
 *
 * Layer 1 beside commit.c: reads header marks only, calls nothing above. */
#include "core.h"

static uint64_t pages(uint64_t n) { return (n + SHM_PAGE - 1) & ~(uint64_t)(SHM_PAGE - 1); }

/* Bytes the file holds for tables of these many committed entries. */
uint64_t budget_bytes(uint64_t slots, uint64_t nodes, uint64_t keys) {
    return pages(slots * sizeof(shm_slot)) + pages(slots * sizeof(shm_ready)) +
           pages(nodes * sizeof(shm_node)) + pages(keys * sizeof(shm_key));
}

/* The tables' committed bytes now, by the receiver's marks (clamped to the tables). */
uint64_t budget_tables_now(shm_chan *c) {
    shm_header *h = c->hdr;
    /* relaxed: the receiver's own marks (it is the only writer) */
    uint64_t s = LOAD_RELAXED(&h->slots_committed), n = LOAD_RELAXED(&h->nodes_committed);
    uint64_t k = LOAD_RELAXED(&h->keys_committed);
    if (s > c->cfg.max_messages + 1u) s = c->cfg.max_messages + 1u;
    if (n > c->max_nodes) n = c->max_nodes;
    if (k > c->keytab_max) k = c->keytab_max;
    return budget_bytes(s, n, k);
}

/* May the tables hold `bytes` (their committed bytes after a raise)? Invariant B. */
int budget_allows(shm_chan *c, uint64_t bytes) {
    shm_header *h = c->hdr;
    if (c->tables_need || LOAD_RELAXED(&h->commit_all)) return 1;
    /* acquire: pairs with commit_ring's raise (any producer); a stale, lower value only
     * refuses a raise the next poll allows */
    uint64_t ring = LOAD_ACQUIRE(&h->ring_committed);
    return bytes <= ring / 10;
}

