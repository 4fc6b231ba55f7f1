/* core.h -- the segment's layout and the helpers every mechanism shares.
 *
 * One channel is one shared segment:
 *
 *   offset 0            shm_header        identity, configuration, positions, counters
 *   producers_off       shm_producer[]    registry of sending processes (stats, space waits)
 *   slots_off           shm_slot[]        message table: one entry per message the consumer
 *                                         has taken in (waiting, ready, in flight); a handle
 *                                         is (slot index, slot generation)
 *   nodes_off           shm_node[]        one node per (message, distinct key): the key lines
 *   keytab_off          shm_key[]         open-addressing table: key hash -> its line
 *   heap_off            shm_ready[]       ready messages, a binary min-heap by seq (those that
 *                                         became ready in seq order wait on the lane instead,
 *                                         a list through the message table: lane.h)
 *   ring_off            ring bytes        the intake ring (ring.c), mapped twice in a row so a
 *                                         record that wraps is still contiguous in memory
 *
 * The file is sized for all of that but sparse: each region is backed by memory only as
 * far as its committed mark in the header, which grows with use (commit.c). Nothing
 * touches a page above a mark: on a full filesystem that would be a SIGBUS.
 *
 * Every region starts on a page boundary. Offsets and sizes are recomputed from the
 * configuration in each process and compared with what the header says; nothing is
 * taken from the segment on trust. Positions are free-running 64-bit byte counters
 * (they never wrap in practice: 2^64 bytes); the physical offset is pos % capacity.
 *
 * Who writes what:
 *   producers  -- ring claims and records, their own registry entry, tail_hint
 *   consumer   -- everything under "consumer state" below, the message table's
 *                 non-inflight transitions, node and key tables, head
 *   holders    -- an in-flight slot's state word (release / nack by CAS), its holder
 *                 word and hand-over deadline (pickling, adoption), its lease deadline,
 *                 and the release stack
 * Cross-process words are accessed only with the atomics below; each use names its
 * ordering and the access it pairs with.
 *
 * Layers, lowest first: a file calls into its own layer and the layers below it only,
 * except for the back-edges listed after.
 *   0  pause.c hash.c crc32c.c   tests' pause points; the key hash; checksums
 *      hold.c                    pause and resume (operators' holds on a channel or key)
 *   1  commit.c budget.c         committing memory to the regions as they grow; the
 *                                tables' budget (a tenth of the committed ring)
 *   2  ring.c                    the intake ring: claims, commits, head, rewinds
 *   3  sched.c lane.h            the key table and the key lines, the ready heap and lane
 *   4  window.c                  taking records in from the ring; parked records
 *      lookahead.c               taking a free message in past a stopped scan
 *   5  islands.c                 records pinned behind head
 *   6  compact.c                 sliding long-lived records forward
 *   7  handles.c                 the receiver's poll, handles, releases, hand-over
 *   8  recovery.c rebuild.c      upkeep after deaths; the rebuild after the receiver's
 *   9  segment.c inspect.c exchange.c   opening and attaching; the operators' view;
 *                                exchanges
 *      overflow.c                the overflow file's shared words (its offsets, the
 *                                overflowing flag that ring.c and handles.c read)
 * Back-edges, kept because each is a part of one mechanism that lives in the lower
 * file's protocol, not a helper that could move down:
 *   ring -> islands   (island_skip, island_find, island_remove): the ring's free-space
 *                     count and head advance must step over pinned records
 *   ring -> window    (window_is_writing, window_discard): repairing a dead producer's
 *                     claim drops the receiver's placeholder for that record
 *   sched -> window   (window_link, window_wake_push, window_check): a message taken in
 *                     joins the window's seq list, a freed key wakes its parked records
 *   handles -> rebuild (recovery_rebuild): taking the receiver's seat rebuilds first
 *                     when the previous receiver died inside an operation
 */
#ifndef SHMCHAN_CORE_H
#define SHMCHAN_CORE_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <pthread.h>
#include <time.h>

#include "shmchan.h"
#include "rxlock.h"

#define SHM_MAGIC 0x314e414843485353ull /* "SSHCHAN1" little-endian */
#define SHM_PAGE 4096u
#define SHM_CACHELINE 64

#define NIL 0u /* index 0 of the slot and node tables is never used: 0 means "none" */
#define SHM_WAKE_KEYS 256u /* freed keys remembered between polls (window.c) */
#define SHM_WRITING_MAX 64u /* unfinished records the receiver looks past (window.c) */

/* ---- atomics: thin names so each call site reads as its ordering ---------------- */
#define LOAD_RELAXED(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define LOAD_ACQUIRE(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define LOAD_SEQCST(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE_RELAXED(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define STORE_RELEASE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define STORE_SEQCST(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
#define CAS_SEQCST(p, expp, v) \
    __atomic_compare_exchange_n((p), (expp), (v), 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)
#define CAS_ACQREL(p, expp, v) \
    __atomic_compare_exchange_n((p), (expp), (v), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
#define FETCH_ADD_RELAXED(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)
#define FETCH_ADD_SEQCST(p, v) __atomic_fetch_add((p), (v), __ATOMIC_SEQ_CST)
#define EXCHANGE_ACQREL(p, v) __atomic_exchange_n((p), (v), __ATOMIC_ACQ_REL)
#define FENCE_SEQCST() __atomic_thread_fence(__ATOMIC_SEQ_CST)

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* A compare-and-swap of two adjacent 64-bit words at a 16-byte aligned address (lo at the
 * lower address): both words must match for either to change. A full barrier (seq_cst),
 * like CAS_SEQCST. Used where a step must hold for one generation of a slot and change
 * another word of it (the hand-over and extend steps in handles.c). Other code reads and
 * writes those words one at a time with the 8-byte atomics above: on x86-64 and AArch64 a
 * locked 16-byte access and an 8-byte one to the same line are ordered by the line's
 * coherence order, which is all these uses need. */
static inline int cas_pair(uint64_t *lo, uint64_t exp_lo, uint64_t exp_hi, uint64_t new_lo,
                           uint64_t new_hi) {
#if defined(__x86_64__)
    unsigned char ok;
    __asm__ __volatile__("lock cmpxchg16b %1\n\tsete %0"
                         : "=q"(ok), "+m"(*(volatile unsigned __int128 *)lo), "+a"(exp_lo),
                           "+d"(exp_hi)
                         : "b"(new_lo), "c"(new_hi)
                         : "memory", "cc");
    return ok;
#else
    unsigned __int128 e = ((unsigned __int128)exp_hi << 64) | exp_lo;
    unsigned __int128 n = ((unsigned __int128)new_hi << 64) | new_lo;
    return __sync_bool_compare_and_swap((unsigned __int128 *)lo, e, n);
#endif
}

/* ---- process identity ---------------------------------------------------------------
 * A token is (pid << 40) | start_ticks, made by shmchan/liveness.py: the pid plus the
 * process start time in clock ticks since boot, which together never repeat. Tokens are
 * non-zero and below 2^63, so a ring owner word can carry one shifted left by one with
 * bit 0 clear (see ring.c). */
#define TOKEN_MAX (1ull << 63)
#define HOLDER_REVOKED 1ull /* a slot's holder word after revocation: never a token (>= 1 << 40) */
/* A slot's holder word while the handle is in transit (pickled, not yet adopted): the
 * token of the process that pickled it with this bit set (handles.c, hand-over). */
#define HOLDER_TRANSIT (1ull << 63)

/* ---- islands: records pinned by a zero-copy view that head has passed (islands.c) ---- */
#define SHM_ISLANDS 32u
typedef struct {
    uint64_t end; /* position just past the record; 0 = free entry (the entry's seqlock word) */
    uint64_t len; /* the record's length                                                    */
} shm_island;

/* ---- paused keys (hold.c) ------------------------------------------------------------ */
typedef struct {
    uint64_t hash;   /* the paused key's hash; 0 = free entry (CAS to claim, CAS to free)  */
    uint32_t len;    /* bytes of blob[] written (display only: the key's framed encoding) */
    uint32_t pad;
    uint8_t blob[SHM_HOLD_KEY_BYTES];
} shm_hold_key;
#define HOLD_CHANNEL 1ull   /* header.hold: the whole channel is paused              */
#define HOLD_KEYS_SHIFT 1   /* header.hold: entries claimed, in the bits above bit 0   */

/* ---- the header --------------------------------------------------------------------- */
typedef struct {
    /* -- written once by the creator, before the segment is published -- */
    uint64_t magic;          /* SHM_MAGIC, stored last at create (release) */
    uint32_t layout_version; /* SHM_LAYOUT_VERSION */
    uint32_t header_bytes;   /* sizeof(shm_header) */
    shm_config cfg;
    uint64_t producers_off, slots_off, nodes_off, keytab_off, ring_off, heap_off;
    uint32_t max_nodes;   /* node table entries (index 0 unused) */
    uint32_t keytab_size; /* key table entries (any count: see key_home) */
    uint64_t segment_size;
    uint64_t boot_id; /* hash of the boot the tokens below belong to (recovery.c) */
    uint64_t chan_id;    /* random, non-zero, drawn at create: which channel this is, so an
                          * attachment can tell whether its name still means this segment */
    uint64_t created_ns; /* CLOCK_REALTIME at create (for people reading `stat`)       */

    /* -- committed memory (commit.c): what of the sparse file is backed -- */
    _Alignas(SHM_CACHELINE) uint64_t ring_committed; /* ring bytes [0, n) backed: raised by
                          * whoever committed them (CAS to the maximum), never lowered */
    uint32_t ring_short; /* 1 once a claim found the filesystem full; the receiver then
                          * rewinds an empty ring early, so the committed part is reused */
    uint32_t commit_all; /* 1: the filesystem cannot allocate by range, so everything
                          * was allocated at create (commit.c) */
    /* receiver-written (commit.c, sched.c): table entries [0, n) backed */
    uint32_t slots_committed; /* slots, and ready heap entries as many              */
    uint32_t nodes_committed;
    uint32_t keys_committed;  /* key table entries                                  */
    uint32_t keys_active;     /* the key table's size in use (sched.c key_grow)      */

    /* -- producers: where the tail probably is (a hint; the ring is the truth) -- */
    _Alignas(SHM_CACHELINE) uint64_t tail_hint;

    /* -- consumer -> producers: everything before head is free to reuse -- */
    _Alignas(SHM_CACHELINE) uint64_t head;

    /* -- wake-up words (the eventcount: handles.c, ring.c) -- */
    _Alignas(SHM_CACHELINE) uint32_t rx_sleeping; /* 1 while the receiver may block on its semaphore */
    uint32_t shutdown; /* SHUTDOWN_* bits, only ever set (fetch-or): sends are refused once
                        * either is set; the receiver drains, then reports CLOSED */
    uint32_t overflowing; /* 1 while sends go to the overflow file instead of the ring
                           * (overflow.c): send_one refuses them FULL; the receiver does
                           * not report CLOSED while it is set */
    _Alignas(SHM_CACHELINE) uint32_t space_waiters; /* senders blocked (or about to block) on space */
    uint32_t refusals; /* claims that found the ring full, ever, wrapping: a hint to the
                        * receiver that a look for space to compact is wanted (compact.c) */

    /* -- futex words of the asyncio waiters (wake.c): + 1 per wake-up request of their
     *    side while async_waiters > 0; a waiter waits for its word to change -- */
    _Alignas(SHM_CACHELINE) uint32_t rx_wake_seq; /* the receiver's side (wraps)           */
    uint32_t tx_wake_seq;   /* the senders' side (wraps)                                  */
    uint32_t async_waiters; /* asyncio waits under way, all processes; a waiter killed
                             * while counted leaves it high: a futex call per request */
    uint32_t pad_wake;

    /* -- holders -> consumer: released slots, a push-only stack (handles.c) -- */
    _Alignas(SHM_CACHELINE) uint64_t release_stack; /* slot index of the top, NIL = empty */

    /* -- who is the receiver: a token, 0 = nobody (handles.c) -- */
    _Alignas(SHM_CACHELINE) uint64_t receiver;

    /* -- islands (islands.c): written by the receiver, read by producers -- */
    _Alignas(SHM_CACHELINE) uint32_t island_count; /* entries in use: 0 lets claims skip the table */
    uint32_t pad_islands;
    uint64_t island_bytes; /* receiver-only: bytes of the islands (stats)                */
    uint64_t skip_bytes;   /* receiver-only: bytes of SKIP records in [head, scan_pos)     */
    shm_island islands[SHM_ISLANDS];

    /* -- consumer state: written only by the receiver process -- */
    _Alignas(SHM_CACHELINE) uint64_t ingest_pos; /* first record not yet taken in (window.c) */
    uint64_t scan_pos;   /* first record not yet looked at; >= ingest_pos (window.c) */
    uint32_t newest, oldest; /* slots in order of taking in, via slot.newer / slot.older */
    uint64_t skipped;    /* records parked in key chains, out of the window (window.c) */
    uint32_t dirty;      /* 1 while a consumer operation is half done */
    uint32_t rewinds;    /* rewinds done, ever, wrapping (ring.c ring_rewind; for tests) */
    uint64_t version;    /* seqlock word for readers in other processes (inspect.c):
                          * odd while the receiver changes its tables (rx_begin/rx_end) */
    uint32_t free_slots; /* free list of message table slots (via slot.next) */
    uint32_t free_nodes; /* free list of nodes (via node.next) */
    uint32_t fresh_slots; /* slots from here on were never used: taken when the free list
                           * is empty, so a new channel writes no table (sched.c) */
    uint32_t fresh_nodes; /* the same for nodes */
    uint32_t ready_count; /* messages free to hand out: heap_count on the min-heap by seq
                           * at heap_off, lane_count on the ready lane (lane.h) */
    uint32_t handed_out; /* slots out of the consumer's hands, via slot.out_next (handles.c) */
    uint32_t window;     /* slots in use */
    uint32_t nodes_used;
    uint64_t queued_in_window; /* waiting or ready */
    uint64_t inflight;
    uint64_t held_keys;
    uint64_t dead_letters;
    uint64_t ingested; /* messages taken into the window, ever */
    uint64_t delivered, released, redelivered, discarded;
    uint32_t skip_keys;   /* key table entries with a parked chain (window.c) */
    uint32_t wake_n;      /* keys in wake_keys[] (window.c) */
    uint32_t wake_overflow; /* 1: more keys were freed than wake_keys holds */
    uint32_t pad3;
    uint64_t wake_keys[SHM_WAKE_KEYS]; /* hashes of keys whose parked chain may move */
    uint32_t writing_n;   /* placeholders in writing[] (window.c) */
    uint32_t pad4;
    uint64_t writing[SHM_WRITING_MAX]; /* positions of records looked at while WRITING */
    /* -- timers (timers.c): receiver-written; other processes read them as hints -- */
    uint32_t timed;         /* ready messages with a due or expiry time: 0 = no timer check */
    uint32_t delayed_count; /* messages on the delayed list (off the ready heap)           */
    uint32_t delayed_head;  /* the delayed list, via slot.next, NIL = empty                 */
    uint32_t pad_timers;
    uint64_t next_due;      /* earliest due or expiry on the delayed list, CLOCK_REALTIME ns */
    uint64_t expired;       /* messages dead-lettered for their ttl, ever                   */
    /* -- dead-letter routing (deadroute.c): any process writes, the receiver reads -- */
    uint32_t dlx_word;      /* (version << 16) | name length; odd version while written     */
    uint32_t pad_dlx;
    char dlx_name[SHM_GATE_NAME_MAX]; /* the exchange dead letters are published to          */
    /* -- the ready lane (lane.h) beside the ready heap (sched.c): receiver-written -- */
    uint32_t lane_head;  /* lowest-seq slot on the lane, via slot.next; NIL = empty          */
    uint32_t lane_tail;  /* highest-seq slot on the lane                                     */
    uint32_t lane_count; /* slots on the lane                                                */
    uint32_t heap_count; /* entries of the ready heap; ready_count = heap_count + lane_count */

    /* -- pause state (hold.c): written by any process, read by the receiver's scheduler -- */
    _Alignas(SHM_CACHELINE) uint64_t hold; /* HOLD_CHANNEL | claimed paused-key entries
                          * (an upper bound) << HOLD_KEYS_SHIFT; 0 = nothing paused */
    shm_hold_key hold_keys[SHM_HOLD_KEYS];

    /* -- overflow to disk (overflow.c): file offsets and counts of the overflow file -- */
    _Alignas(SHM_CACHELINE) uint64_t ovf_limit; /* bytes on disk at most (creator, once)    */
    uint32_t ovf_dir_len;  /* bytes of ovf_dir; 0 = no overflow. Stored last by its creator */
    uint32_t ovf_pad;
    uint64_t ovf_tail;     /* past the last whole record: appenders, under the file's lock  */
    uint64_t ovf_head;     /* the first record not yet taken back into the ring: the drainer */
    uint64_t ovf_appended; /* messages appended, ever: appenders, under the file's lock     */
    uint64_t ovf_drained;  /* messages taken back into the ring, ever: the drainer          */
    uint64_t ovf_skipped;  /* records found corrupt and skipped, ever: the drainer          */
    char ovf_dir[SHM_OVF_DIR_MAX]; /* the overflow directory, not NUL-terminated          */
} shm_header;

/* header.shutdown bits */
#define SHUTDOWN_CLOSED 1u  /* shutdown() was called                                  */
#define SHUTDOWN_REMOVED 2u /* the channel's name was unlinked (shmchan.unlink): a send
                             * now would be lost to every future receiver */

/* ---- producer registry ---------------------------------------------------------------- */
typedef struct {
    uint64_t owner;   /* token of the registered process, 0 = free (CAS to claim)          */
    uint64_t sent;    /* messages committed through this entry; only its owner adds to it, */
                      /* and it is never reset, so stats sum every entry that ever existed */
    uint32_t waiting; /* threads of the owner counted in space_waiters (ring.c): raised     */
                      /* before space_waiters, lowered after it; a reaper takes it out     */
    uint32_t pad[11];
} shm_producer;

/* ---- message table ---------------------------------------------------------------------
 * state word layout:  bits 63..32  generation (bumped when the slot is freed)
 *                     bits  7..0   SLOT_* below
 * Only the SLOT_INFLIGHT state is shared: a holder moves it to RELEASED or NACKED with a
 * CAS on the whole word, so a stale handle (older generation) can never match. */
enum {
    SLOT_FREE = 0,
    SLOT_WAITING = 1,  /* taken in, behind other messages in a key line      */
    SLOT_READY = 2,    /* on the ready heap                                  */
    SLOT_INFLIGHT = 3, /* handed out                                         */
    SLOT_RELEASED = 4, /* holder is done; consumer has not yet freed it      */
    SLOT_NACKED = 5,   /* holder gave it back; consumer will redeliver       */
    SLOT_DEAD = 6,     /* out of attempts: a dead letter                     */
    SLOT_DISCARD = 7,  /* a dead letter someone dropped; consumer will free it */
};
#define SLOT_STATE(w) ((uint32_t)((w)&0xffu))
#define SLOT_GEN(w) ((uint32_t)((w) >> 32))
#define SLOT_WORD(gen, st) (((uint64_t)(gen) << 32) | (uint64_t)(st))

typedef struct {
    /* state and holder are one 16-byte aligned pair: the hand-over steps change holder
     * with a cas_pair over both, so a step for an older generation matches nothing. */
    uint64_t state;    /* see above                                              */
    uint64_t holder;   /* token of the holding process while in flight           */
    uint64_t seq;
    uint64_t pos;      /* ring position of the message's record                  */
    /* deadline and lease_gen are a pair too (shm_handle_extend's cas_pair). */
    uint64_t deadline; /* lease end, CLOCK_MONOTONIC ns; 0 = none               */
    uint64_t lease_gen; /* the generation deadline belongs to (hand_out sets it) */
    uint64_t handover; /* while holder has HOLDER_TRANSIT: adopt before this     */
                       /* (CLOCK_MONOTONIC ns), or the handle is taken back      */
    uint32_t first_node; /* the message's key nodes, chained by node.sibling     */
    uint32_t next;     /* the free list; the delayed list while delayed (timers.c); the
                        * ready lane while on it (lane.h) */
    uint32_t rel_next; /* release stack link, written by the releasing process   */
    uint32_t attempt;  /* deliveries so far                                      */
    uint16_t nkeys;    /* distinct key hashes (nodes)                            */
    uint16_t pending;  /* fifo: lines in which this message is not yet first     */
    uint32_t seen;     /* maintenance: generation + 1 when last found RELEASED    */
    uint32_t pin;      /* PIN_*: may the consumer move this message's record?     */
    uint32_t newer, older; /* the window's messages in order of taking in (window.c) */
    uint32_t out_next, out_prev; /* the handed-out list while INFLIGHT ... DISCARD (handles.c) */
    uint32_t lost_gen; /* 1 + generation last taken back in transit (0: none): late adopters of it */
                       /* get SHM_LOST rather than a silent no-op (recovery.c)       */
    uint64_t handed_ns; /* when it was last handed out, coarse CLOCK_MONOTONIC ns (inspect.c) */
    /* timers (timers.c); the two times are CLOCK_REALTIME ns, 0 = none, and non-zero
     * only while the message is ready or delayed: a message without times never
     * touches these fields */
    uint64_t due_ns;     /* not handed out before this (a delayed send or nack)          */
    uint64_t expire_ns;  /* a dead letter ("expired") if not handed out by this (ttl)    */
    uint64_t nack_delay; /* holder-written before its nack CAS: (generation << 32) | ms  */
    uint32_t dead_reason; /* SHM_DEAD_* of a DEAD or DISCARD slot                         */
    uint32_t pad_timers;
} __attribute__((aligned(16))) shm_slot;
_Static_assert(offsetof(shm_slot, state) == 0 && offsetof(shm_slot, holder) == 8 &&
                   offsetof(shm_slot, deadline) % 16 == 0 &&
                   offsetof(shm_slot, lease_gen) == offsetof(shm_slot, deadline) + 8 &&
                   sizeof(shm_slot) % 16 == 0,
               "cas_pair needs (state, holder) and (deadline, lease_gen) 16-byte aligned");

/* slot.pin: a holder that takes a zero-copy view pins the record where it is (CAS
 * FREE -> VIEWED); the consumer moves an in-flight record only after CAS FREE -> MOVING,
 * and sets it back to FREE when done (compact.c). */
enum { PIN_FREE = 0, PIN_VIEWED = 1, PIN_MOVING = 2 };

/* ---- key lines ------------------------------------------------------------------------ */
typedef struct {
    uint64_t hash;     /* the key's 64-bit hash                                      */
    uint32_t slot;     /* the message this node belongs to                          */
    uint32_t next;     /* next node in the key's line (or the node free list)       */
    uint32_t sibling;  /* next key node of the same message                         */
    uint32_t prev;     /* previous node in the key's line (fifo): O(1) removal at the tail */
} shm_node;

typedef struct {
    uint64_t hash;
    uint32_t head, tail; /* the key's line of nodes (messages taken in), NIL = none     */
    uint32_t held;       /* eager order: slot holding the key, NIL = free               */
    uint32_t skipped;    /* parked records in this key's chain (window.c)             */
    uint32_t count;      /* nodes in the line: kept so that a line's depth is O(1) (inspect.c) */
    uint64_t skip_head;  /* ring position of the first parked record; valid if skipped */
    uint64_t skip_tail;  /* ring position of the last one; each links to the next      */
} shm_key;

/* ---- ring records ---------------------------------------------------------------------
 * See ring.c for the protocol. Byte layout of a record at position p:
 *    0  owner   u64   EMPTY(p) while p is the tail, then the claimant's token << 1
 *    8  meta    u64   (length << 8) | REC_* state; 0 until the claimant publishes it
 *   16  seq     u64   written by the predecessor before publishing EMPTY(p)
 *   24  kind    u32   SHM_PAYLOAD_*          } the body: written by the claimant
 *   28  nkeys   u32                          } between WRITING and COMMITTED
 *   32  data_len u64
 *   40  keys_len u32, slot u32  (slot: written by the consumer when it takes the record in)
 *   48  crc     u32            durable channels: CRC-32C of the record (rec_checksum), else 0
 *   52  flags   u32            REC_F_* hints (a time footer follows the payload: timers.c)
 *   56  hashes  u64[nkeys]
 *       links   u64[nkeys]  consumer-written: while the record is parked (window.c),
 *               links[i] is the position of the next parked record in the chain of the
 *               key hashes[i] (for the first i of each distinct hash only)
 *       key blob  keys_len bytes, padded to 8
 *       payload   data_len bytes, padded to 8
 */
enum {
    REC_CLAIMED = 0,   /* owner set, length not yet published               */
    REC_WRITING = 1,   /* length published, successor ready, body being written */
    REC_COMMITTED = 2, /* whole and visible                                 */
    REC_DISCARDED = 3, /* its producer died before committing; skip it      */
    REC_DONE = 4,      /* consumed and released: its bytes may be reused    */
    REC_CANCELLED = 5, /* claimed by a send that then saw shutdown          */
    REC_GATED = 6,     /* whole, but waits on a transaction of an exchange: it ends
                          COMMITTED or DISCARDED/CANCELLED (ring.c, exchange.c) */
    REC_SKIP = 7,      /* steps over an island's bytes (islands.c): never holds data */
};
#define REC_HDR 24u   /* owner + meta + seq: the part a successor pre-writes */
#define REC_BODY 56u  /* fixed part of a committed record                   */
#define META(len, st) (((uint64_t)(len) << 8) | (uint64_t)(st))
#define META_LEN(m) ((m) >> 8)
#define META_STATE(m) ((uint32_t)((m)&0xffu))
#define OWNER_EMPTY(pos) ((pos) | 1u)
#define OWNER_CLAIM(token) ((token) << 1)
#define OWNER_TOKEN(w) ((w) >> 1)
#define OWNER_IS_EMPTY(w) (((w)&1u) != 0)

/* A gated record (REC_GATED, written by an exchange's publish) ends with a gate trailer
 * after its payload, which stays there once it is committed:
 *       exchange name   name_len bytes, padded to 8
 *       footer          u64 uid, u32 txn slot, u32 txn gen, u32 name_len, u32 GATE_MAGIC
 * The footer is the record's last 24 bytes; ring_validate_body accepts a record whose
 * length is its body's plus a well-formed trailer. */
#define GATE_MAGIC 0x45544147u /* "GATE" */
#define GATE_FOOTER 24u
typedef struct {
    uint64_t uid;
    uint32_t slot, gen, name_len, magic;
} shm_gate_footer;

typedef struct {
    uint64_t owner;
    uint64_t meta;
    uint64_t seq;
    uint32_t kind;
    uint32_t nkeys;
    uint64_t data_len;
    uint32_t keys_len;
    uint32_t slot; /* the message table slot holding this message (consumer-written) */
    uint32_t crc;  /* durable channels: rec_checksum() at commit (crc32c.c); else 0 */
    uint32_t flags; /* REC_F_*: hints, each confirmed by what it points to before use */
    uint64_t hashes[];
} shm_record;
#define REC_F_TIMES 1u /* ends in a time footer (timers.c): the receiver looks for it */

/* ---- one process's attachment --------------------------------------------------------- */
typedef struct shm_lookahead shm_lookahead; /* lookahead.c: receiver-private */
/* ---- ready heap entry (sched.c) ---------------------------------------------------------
 * The seq is a copy of the slot's, so that sifting compares neighbours in this array
 * instead of reaching into the message table at random. */
typedef struct {
    uint64_t seq;  /* == slots[slot].seq (shm_check_scheduler verifies it) */
    uint32_t slot;
    uint32_t pad;
} shm_ready;

struct shm_chan {
    uint8_t *base;      /* start of the mapping                                       */
    uint64_t map_len;   /* meta + 2 * capacity                                        */
    shm_header *hdr;
    shm_producer *producers;
    shm_slot *slots;
    shm_node *nodes;
    shm_key *keys;
    shm_ready *heap;    /* ready messages (sched.c)                                   */
    uint8_t *ring;      /* ring_off from base, 2 * capacity bytes of address space    */
    shm_config cfg;     /* validated local copy: never re-read from the segment       */
    uint64_t cap;       /* ring size: the capacity rounded up to whole pages          */
    uint64_t cap_mask;  /* cap - 1 when cap is a power of two (positions are masked
                         * instead of divided: ring_at), else 0                     */
    uint64_t limit;     /* the capacity: bytes the ring may hold at once (cfg.capacity) */
    uint32_t max_nodes;
    uint32_t keytab_size; /* receiver: the key table's size in use (header.keys_active);
                           * other processes read the header's (keytab_view_size)      */
    uint32_t keytab_max;  /* the key table's region: the most it may grow to          */
    int fd;               /* the segment's file, for committing ranges (commit.c)     */
    int short_errno;      /* this process's last commit failure (0: the last succeeded) */
    uint64_t shrink_since, shrink_pos; /* receiver: the ring empty at shrink_pos since (commit.c) */
    uint64_t token;     /* this process's identity                                    */
    uint32_t producer;  /* registry index + 1 while registered, 0 otherwise          */
    int is_rx;          /* this attachment holds the receiver                         */
    uint64_t cached_head; /* producers: last head seen, refreshed only when short    */
    /* Receiver-only work avoidance, process-local and reset by shm_rx_acquire, so a
     * receiver's first polls do the full work. Each skip is also bounded in time
     * (RECHECK_NS): whatever event it failed to foresee, the work is done again soon. */
    uint64_t done_count;  /* records this receiver marked done                         */
    uint64_t compact_retry_at; /* done_count a failed compaction waits for (compact.c) */
    uint64_t compact_watch_end; /* ... or for the record here to finish              */
    uint64_t compact_fail_ns;   /* ... or for RECHECK_NS after this failure            */
    int compact_watch_hit;
    void *compact_buf;      /* receiver: the look's entries and the slide's parked-record
                             * positions, grown to what a window needs (compact.c) */
    uint32_t compact_cap;   /* entries compact_buf holds                               */
    uint32_t refusals_seen;     /* header.refusals at the receiver's last look (compact.c) */
    uint64_t head_still;  /* head where ring_advance_head last stopped, while nothing that
                           * could let it go further has happened since (ring.c); NO_POS:
                           * unknown, look */
    uint64_t verify_below; /* durable: records before this ring position were there when
                            * this receiver took its seat (recovered): their checksums are
                            * checked when taken in and when handed out (crc32c.c) */
    rx_lock_t rx_mu;    /* process-local: one thread at a time in consumer code (rxlock.h) */
    int tables_need;    /* receiver: the table commits under way make room for a message
                         * needed now, which the tables' budget lets pass (budget.c) */
    uint64_t punch_at;  /* receiver: table pages given back are punched from then on ... */
    uint64_t punch_from[2], punch_end[2]; /* ... these file ranges (nodes, keys): commit.c */
    int ovf_drainer;       /* this attachment takes overflowed messages back into the ring:
                            * its sends pass the overflowing and shutdown checks (overflow.c) */
    shm_lookahead *lookahead; /* receiver: its look past a stopped scan, heap memory of
                            * this process, NULL until first used (lookahead.c) */
    uint64_t ahead_due;    /* receiver: CLOCK_REALTIME ns when a delayed record left in the
                            * ring past the budget falls due, 0 = none (lookahead.c) */
    uint64_t keys_freed;   /* receiver: messages whose keys went free without a release (a
                            * dead letter, a discarded placeholder), ever: lookahead.c */
};

/* The longest a receiver skips work it judged useless (window.c, compact.c). */
#define RECHECK_NS 50000000ull /* 50 ms */

/* A cheap clock for those bounds: no TSC read, a few ms of resolution. */
static inline uint64_t coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The receiver's seqlock writer side (inspect.c reads): every change to the scheduler's
 * tables happens between rx_begin and rx_end, under rx_mu. dirty says "half done" to a
 * successor receiver; version says "changed while you read" to inspectors. A receiver
 * killed in between leaves version odd: readers then give up after a bounded number of
 * tries and report their reading as partial; the next receiver makes it even again. */
static inline void rx_begin(shm_chan *c) {
    STORE_RELAXED(&c->hdr->dirty, 1);
    STORE_RELAXED(&c->hdr->version, LOAD_RELAXED(&c->hdr->version) | 1u);
    /* release fence: the odd version is visible before any table write below; pairs with
     * the acquire fence in inspect.c's view_ok(). */
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void rx_end(shm_chan *c) {
    /* release: the table writes above are visible before the even version; pairs with the
     * acquire load in inspect.c's view_begin(). */
    STORE_RELEASE(&c->hdr->version, (LOAD_RELAXED(&c->hdr->version) | 1u) + 1u);
}

/* A position's bytes. A 64-bit division costs tens of cycles and a message takes about
 * ten of them: a power-of-two ring (the default capacities) masks instead. */
static inline uint64_t ring_pos_off(const shm_chan *c, uint64_t pos) {
    return LIKELY(c->cap_mask) ? pos & c->cap_mask : pos % c->cap;
}
static inline uint8_t *ring_at(shm_chan *c, uint64_t pos) { return c->ring + ring_pos_off(c, pos); }
static inline shm_record *rec_at(shm_chan *c, uint64_t pos) { return (shm_record *)ring_at(c, pos); }

/* An empty ring this far into its lap starts again at offset 0 (ring_rewind, ring.c):
 * half a small ring, 4 MiB at most. Near enough that a trickle keeps using the same few
 * MiB of pages; far enough that producers keeping the ring busy are rarely sent back
 * to its start. */
#define REWIND_AT(c) ((c)->cap / 2 < (4u << 20) ? (c)->cap / 2 : (uint64_t)(4u << 20))
/* The ring's first RING_WARM bytes, which every attachment maps at once (segment.c):
 * 80 pages, tens of microseconds at attach. A channel's first 2,500 or so small messages,
 * and those of every lap after a rewind, then take no page fault in the sender or the
 * receiver. A fault costs microseconds on a virtual machine, and a trickle would
 * otherwise take one every few dozen messages in each process, in its latency. */
#define RING_WARM(c) ((c)->cap < (320u << 10) ? (c)->cap : (uint64_t)(320u << 10))
/* The key table is open addressing with linear probing over keytab_size entries, sized
 * exactly (not to a power of two, which doubled a large channel's table): a hash's home
 * entry is its high 32 bits scaled to the size (multiply-shift), and a probe wraps at the
 * end. The hash's high bits are as well mixed as its low ones (hash.c's finalizer). */
static inline uint32_t key_home_in(uint32_t size, uint64_t hash) {
    return (uint32_t)(((hash >> 32) * (uint64_t)size) >> 32);
}
static inline uint32_t key_home(const shm_chan *c, uint64_t hash) {
    return key_home_in(c->keytab_size, hash);
}
static inline uint32_t key_next(const shm_chan *c, uint32_t i) {
    return i + 1 >= c->keytab_size ? 0 : i + 1;
}
/* Slots and nodes that may ever have been used: indexes below these marks (scans of the
 * tables stop there: a slot or node past it is all zeros). Clamped to the table, since
 * the marks are read from shared memory. */
static inline uint32_t slots_touched(const shm_chan *c, shm_header *h) {
    /* relaxed: only the receiver moves the marks (STORE_RELAXED in sched.c); a scan by
     * another process is a snapshot anyway. A slot is in use only after the mark passed
     * it, and its state is published after that (ready_push's release store). */
    uint32_t f = LOAD_RELAXED(&h->fresh_slots);
    return f >= 1 && f <= c->cfg.max_messages ? f : c->cfg.max_messages + 1;
}
static inline uint32_t nodes_touched(const shm_chan *c, shm_header *h) {
    uint32_t f = LOAD_RELAXED(&h->fresh_nodes); /* as in slots_touched */
    return f >= 1 && f <= c->max_nodes ? f : c->max_nodes;
}
static inline uint64_t align8(uint64_t n) { return (n + 7u) & ~(uint64_t)7u; }

/* record size for a message body (header, hashes, keys and payload, each 8-aligned) */
static inline uint64_t rec_size(uint32_t nkeys, uint32_t keys_len, uint64_t data_len) {
    return REC_BODY + 16u * (uint64_t)nkeys + align8(keys_len) + align8(data_len);
}

/* A committed record's body fields, each read once by the caller, for a record of length
 * len: a payload kind this channel accepts (serializer="raw" promises nothing is ever
 * unpickled, so a pickled record there is forged), no more keys than configured, and
 * lengths no longer than the record (so rec_size cannot overflow). */
static inline int rec_fields_ok(const shm_chan *c, uint32_t kind, uint32_t nkeys,
                                uint32_t keys_len, uint64_t data_len, uint64_t len) {
    if (kind > SHM_PAYLOAD_PICKLE || nkeys > c->cfg.max_keys) return 0;
    if (kind != SHM_PAYLOAD_RAW && (c->cfg.flags & SHM_CFG_RAW_ONLY)) return 0;
    return keys_len <= len && data_len <= len;
}

/* Is r's i-th hash the first of its value? A message counts each distinct hash once, so
 * it never waits behind itself (keys are few: a quadratic check is the cheapest). */
static inline int rec_first_of_hash(const shm_record *r, uint32_t i) {
    for (uint32_t j = 0; j < i; j++)
        if (r->hashes[j] == r->hashes[i]) return 0;
    return 1;
}

/* the record's chain links (after its hashes) */
static inline uint64_t *rec_links(shm_record *r, uint32_t nkeys) { return r->hashes + nkeys; }

/* ---- functions shared between files ---------------------------------------------------- */
/* commit.c */
#define KEYTAB_MIN 512u /* the key table's first size (entries): 24 KiB */
#define KEYTAB_FLOOR 16u /* the smallest size (a test's first size: shm_test_keytab_first) */
uint32_t keytab_first(void);
int commit_create(shm_chan *c, uint64_t ring_off, uint64_t producers_end);
int commit_ring(shm_chan *c, uint64_t pos, uint64_t end);
int commit_slots(shm_chan *c, uint32_t n);
int commit_nodes(shm_chan *c, uint32_t n);
int commit_keys(shm_chan *c, uint32_t n);
int commit_adopt(shm_chan *c);
uint64_t commit_give_back_due(shm_chan *c, uint64_t pos);
void commit_give_back(shm_chan *c, uint64_t keep);
uint64_t commit_bytes(shm_chan *c);
uint32_t keytab_view_size(shm_chan *c);
/* The ring's first committed bytes, which must cover [pos, end) (end - pos < cap): a
 * prefix of the ring is committed, so a run that wraps needs all of it. */
static inline uint64_t ring_need(const shm_chan *c, uint64_t pos, uint64_t end) {
    uint64_t off = ring_pos_off(c, pos);
    return off + (end - pos) > c->cap ? c->cap : off + (end - pos);
}
/* budget.c */
uint64_t budget_bytes(uint64_t slots, uint64_t nodes, uint64_t keys);
uint64_t budget_tables_now(shm_chan *c);
int budget_allows(shm_chan *c, uint64_t bytes);
/* ring.c */
void ring_init(shm_chan *c);
int ring_peek(shm_chan *c, uint64_t pos, shm_record **rec, uint64_t *len, shm_stall *stall);
/* Raise tail_hint to at least pos, a record boundary at most the tail (a finished dead
 * writer's record end: recovery.c). */
void ring_hint_raise(shm_chan *c, uint64_t pos);
int ring_validate_body(shm_chan *c, shm_record *r, uint64_t len);
void ring_mark_done(shm_chan *c, uint64_t pos);
int ring_send_gated(shm_chan *c, uint32_t kind, const uint8_t *data, uint64_t len,
                    const uint8_t *keys, uint32_t keys_len, uint32_t nkeys, const shm_gate *gate,
                    uint64_t *pos_out, uint64_t *seq_out, shm_stall *stall);
int ring_gate_settle(shm_chan *c, uint64_t pos, uint64_t owner_token, uint32_t final_state,
                     int *wake);
int ring_advance_head(shm_chan *c);
int ring_advance_head_past(shm_chan *c, uint64_t end); /* a release run's records: handles.c */
/* ring_mark_done's step for one record of a run of releases (handles.c), whose caller
 * counts done_count and forgets head_still once for the run: the record's state only,
 * when no island is kept (then ring_mark_done must look for one; returns 0). *len: the
 * record's length as its header says. */
static inline int ring_mark_done_plain(shm_chan *c, uint64_t pos, uint64_t *len) {
    if (LOAD_RELAXED(&c->hdr->island_count) != 0) return 0; /* receiver-written: its own */
    if (pos == c->compact_watch_end) c->compact_watch_hit = 1; /* as in ring_mark_done */
    shm_record *r = rec_at(c, pos);
    uint64_t meta = LOAD_RELAXED(&r->meta);
    /* release: as in ring_mark_done (pairs with claim()'s acquire load; orders our reads
     * of the body before any reuse via head). */
    STORE_RELEASE(&r->meta, META(META_LEN(meta), REC_DONE));
    *len = META_LEN(meta);
    return 1;
}
#define HEAD_UNKNOWN UINT64_MAX /* head_still: look (see ring_head_may_move) */
/* May ring_advance_head move head now? No if head is where the last advance left it and
 * nothing has happened since that could let it go further: ring_mark_done, island_add and
 * walk_ingest passing a finished record set head_still to HEAD_UNKNOWN (ring.c). */
static inline int ring_head_may_move(shm_chan *c) { return c->hdr->head != c->head_still; }
static inline void ring_head_unknown(shm_chan *c) { c->head_still = HEAD_UNKNOWN; }
int ring_rewind_look(shm_chan *c);
/* An empty ring far into its lap starts again at offset 0 (ring.c). Not empty -- the
 * common case after a release -- is decided here, without a call. */
static inline int ring_rewind(shm_chan *c) {
    shm_header *h = c->hdr;
    uint64_t pos = h->scan_pos; /* receiver-owned fields */
    if (h->head != pos || h->ingest_pos != pos) return 0;
    return ring_rewind_look(c);
}
int ring_give_back(shm_chan *c);
int space_wake_due(shm_chan *c, int idle);
uint32_t space_count_sub(uint32_t *w, uint32_t n);
void space_unwait_entry(shm_chan *c, shm_producer *p);
/* sched.c */
int sched_take_in(shm_chan *c, shm_record *r, uint64_t pos, uint32_t *slot_out);
int sched_release(shm_chan *c, uint32_t s);
int sched_release_many(shm_chan *c, const uint32_t *slots, uint32_t n, uint32_t *done);
int sched_requeue(shm_chan *c, uint32_t s);
uint32_t sched_pop_ready(shm_chan *c);
int sched_has_ready(shm_chan *c);
int sched_park_room(shm_chan *c, uint32_t n);
int sched_unpop(shm_chan *c, uint32_t s);
int sched_has_room(shm_chan *c, uint32_t nkeys);
#define SCHED_ROOM_UNKNOWN UINT32_MAX /* sched_take_in_free's *room_left before the first */
#define SCHED_ROOM_UNCOUNTED (UINT32_MAX - 1u) /* after the first, not counted yet */
int sched_take_in_free(shm_chan *c, shm_record *r, uint64_t pos, uint32_t nkeys,
                       uint32_t *room_left, uint32_t *slot_out); /* batchin.c */
int sched_tables_needed(shm_chan *c);
int sched_has_room_ahead(shm_chan *c, uint32_t nkeys);
int sched_relink(shm_chan *c, uint32_t s, shm_record *r);
void sched_init(shm_chan *c);
/* window.c */
int window_ingest(shm_chan *c, shm_stall *stall, int *stalled, int *moved);
int window_admit(shm_chan *c, shm_record *r, uint64_t pos);
int window_walk(shm_chan *c);
int window_taken(shm_chan *c, shm_record *r, uint64_t pos);
int window_free_to_go(shm_chan *c, shm_record *r); /* decide() says take it in */
int window_has_work(shm_chan *c);
int window_is_writing(shm_chan *c, uint64_t pos);
int window_discard(shm_chan *c, shm_record *r, uint64_t pos);
int window_check(shm_chan *c, uint32_t *what);
int window_parked_movable(shm_chan *c, uint64_t pos);
int window_moved(shm_chan *c, const uint64_t *from, const uint64_t *to, uint32_t n,
                 uint64_t *hashes, uint64_t room);
void window_wake_push(shm_chan *c, uint64_t hash);
/* s joins the newest end of the window's age list (receiver only, under rx_mu). Inline:
 * every take-in links one, a batch receive's run once per message. */
static inline void window_link(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    c->slots[s].newer = NIL;
    c->slots[s].older = h->newest;
    if (h->newest >= 1 && h->newest <= c->cfg.max_messages) c->slots[h->newest].newer = s;
    else h->oldest = s;
    h->newest = s;
}
/* s leaves the window's age list (links checked: one out of range is left alone).
 * Inline: every finished message goes through it, a run's release once per message. */
static inline void window_unlink(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    uint32_t m = c->cfg.max_messages;
    uint32_t newer = c->slots[s].newer, older = c->slots[s].older;
    if (newer >= 1 && newer <= m) c->slots[newer].older = older;
    else if (h->newest == s) h->newest = older >= 1 && older <= m ? older : NIL;
    if (older >= 1 && older <= m) c->slots[older].newer = newer;
    else if (h->oldest == s) h->oldest = newer >= 1 && newer <= m ? newer : NIL;
    c->slots[s].newer = c->slots[s].older = NIL;
}
/* sched.c (for window.c) */
shm_key *sched_key_find(shm_chan *c, uint64_t hash);
shm_key *sched_key_get(shm_chan *c, uint64_t hash);
void sched_key_tidy(shm_chan *c, shm_key *k);
int sched_key_room(shm_chan *c, uint32_t n);
int sched_keys_reset(shm_chan *c);
/* lookahead.c */
int lookahead_run(shm_chan *c, int *moved);
int lookahead_has_work(shm_chan *c);
int lookahead_done_at(shm_chan *c, uint64_t pos, uint64_t *len);
uint64_t lookahead_not_due(shm_record *r, uint64_t len);
int lookahead_ahead_of_scan(shm_chan *c);
void lookahead_reset(shm_chan *c);
void lookahead_free(shm_chan *c);
/* compact.c */
int compact_look(shm_chan *c);
void compact_free(shm_chan *c);
/* Compaction can only win space inside [head, scan_pos), and below a sixteenth of the
 * ring that is too little to be worth it: the common case, decided here without a call
 * (receiver-owned fields only). 1: space was freed; 0: none; SHM_E_CORRUPT: space was
 * freed but the parked records' chains could be neither repaired nor rebuilt -- the
 * header is dirty, and the caller must leave it so and report the error. */
static inline int compact(shm_chan *c) {
    uint64_t head = c->hdr->head, stop = c->hdr->scan_pos;
    if (head >= stop || stop - head < c->limit / 16) return 0;
    return compact_look(c);
}
/* islands.c */
uint64_t island_skip(shm_chan *c, uint64_t a, uint64_t b, uint64_t *first_out);
int island_lookup(shm_chan *c, uint64_t pos);
/* The entry holding the island at pos, or -1. Without a call while there is none: head's
 * walk and every finished record ask. relaxed: receiver-written, its own writes. */
static inline int island_find(shm_chan *c, uint64_t pos) {
    return LOAD_RELAXED(&c->hdr->island_count) == 0 ? -1 : island_lookup(c, pos);
}
int island_add(shm_chan *c, uint64_t pos, uint64_t len);
void island_remove(shm_chan *c, int i);
int island_make_at_head(shm_chan *c, uint64_t head, int viewed);
int island_rebuild(shm_chan *c, const uint64_t *kept_pos, uint32_t nkept);
/* hold.c */
/* Is anything paused? One load: the scheduler's fast path when nothing is. */
static inline int hold_any(shm_chan *c) {
    /* acquire: pairs with the seq_cst read-modify-writes of header.hold in hold.c */
    return LOAD_ACQUIRE(&c->hdr->hold) != 0;
}
int hold_channel(shm_chan *c);
int hold_blocks(shm_chan *c, uint32_t s);
int hold_record(shm_chan *c, const shm_record *r);
uint64_t hold_record_key(shm_chan *c, const shm_record *r);
int hold_key_paused(shm_chan *c, uint64_t hash);
/* pause.c */
/* A test's pause point (shmchan.h SHM_PAUSE_*): one load, inline, unless armed. */
extern int shm_pause_point;
void test_pause_armed(int point);
static inline void test_pause(int point) {
    /* relaxed: a stale read only delays a test's pause to the next call; the CAS in
     * test_pause_armed decides (pairs with shm_test_pause_at's release store). */
    if (UNLIKELY(__atomic_load_n(&shm_pause_point, __ATOMIC_RELAXED) == point))
        test_pause_armed(point);
}
/* handles.c */
int msg_fill(shm_chan *c, uint32_t s, uint32_t gen, shm_msg *m);
int handles_drain(shm_chan *c);
int handles_finish(shm_chan *c, uint32_t s);
int handles_rx_asleep(shm_chan *c); /* a release in the receiver's process: wake its recv? */
void slot_free(shm_chan *c, uint32_t s);
void handles_push(shm_chan *c, uint32_t s);
int handed_out_next(shm_chan *c, uint32_t s, uint32_t *next);
/* s joins the front of the handed-out list (receiver only, under rx_mu). Inline: every
 * hand-out links one, a batch receive's run once per message. */
static inline void handles_out_link(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    shm_slot *sl = &c->slots[s];
    sl->out_prev = NIL;
    sl->out_next = h->handed_out;
    if (h->handed_out != NIL && h->handed_out <= c->cfg.max_messages)
        c->slots[h->handed_out].out_prev = s;
    h->handed_out = s;
}
/* Slot s (generation gen), its message just described, goes INFLIGHT for this receiver:
 * stamped, given its lease deadline (0: none), counted and linked as handed out. The one
 * hand-out step of the poll (handles.c hand_out) and of a batch receive's run (batchin.c
 * run_hand_out). Receiver only, under rx_mu. */
static inline void handles_mark_inflight(shm_chan *c, uint32_t s, uint32_t gen, uint64_t now,
                                         uint64_t deadline) {
    shm_header *h = c->hdr;
    shm_slot *sl = &c->slots[s];
    sl->attempt++;
    sl->holder = c->token;
    sl->handed_ns = now;
    sl->handover = 0;
    /* lease_gen before deadline: a late extend for an older generation (its cas_pair
     * expects that generation in lease_gen) either lands before these two stores, and
     * the deadline store overwrites it, or fails. The release store orders the two. */
    STORE_RELAXED(&sl->lease_gen, (uint64_t)gen);
    STORE_RELEASE(&sl->deadline, deadline);
    STORE_RELAXED(&sl->pin, PIN_FREE); /* a former holder's views ended with its handle */
    /* release: a holder that sees INFLIGHT (its CAS, or shm_handle_info's acquire) sees
     * holder, pos, seq and attempt above. */
    STORE_RELEASE(&sl->state, SLOT_WORD(gen, SLOT_INFLIGHT));
    h->queued_in_window--;
    h->inflight++;
    h->held_keys += sl->nkeys;
    h->delivered++;
    if (sl->attempt > 1) h->redelivered++;
    handles_out_link(c, s);
}
/* batchin.c */
int batchin_run(shm_chan *c, shm_msg *out, uint32_t max, uint32_t *got, uint64_t *now,
                int *moved);
/* rebuild.c */
int recovery_rebuild(shm_chan *c);
/* timers.c */
#define TIME_MAGIC 0x454d4954u /* "TIME" */
#define TIME_FOOTER 24u
int timers_trailer_ok(const shm_record *r, uint64_t body, uint64_t len);
void timers_write_footer(shm_record *r, uint64_t n, uint64_t due_ns, uint64_t expire_ns);
void timers_take_in(shm_chan *c, uint32_t s, shm_record *r);
int timers_gate(shm_chan *c, uint32_t s);
int timers_sweep(shm_chan *c);
void timers_requeued(shm_chan *c, uint32_t s, uint32_t gen);
void timers_reset(shm_chan *c);
/* handles.c (for timers.c): a message not handed out becomes a dead letter */
int handles_dead_letter(shm_chan *c, uint32_t s, uint32_t reason);
/* hash.c */
uint64_t hash_bytes(const uint8_t *p, uint64_t n);
/* crc32c.c */
uint32_t crc32c(uint32_t crc, const void *data, uint64_t n);
/* ring.c: a durable record's checksum, and whether it matches (1) */
uint32_t rec_checksum(const shm_record *r, uint64_t len);
int rec_checksum_ok(shm_chan *c, const shm_record *r, uint64_t len);

#endif
