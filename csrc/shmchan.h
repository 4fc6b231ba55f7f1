/* shmchan.h -- the C core's public interface, as seen by the Python layer.
 *
 * This file is read verbatim by cffi's cdef() (see csrc/build_ffi.py), so it
 * holds only declarations cffi can parse: no include guards, no includes, no
 * macros other than integer #defines. C sources include it through core.h.
 *
 * Ownership of work: the C core does everything that touches the segment;
 * the Python layer owns system calls on named objects (shm_open, semaphores),
 * liveness decisions (psutil) and serialization. Every function returns one
 * of the SHM_* status codes below; Python maps them to exceptions in one table.
 */

/* --- status codes (0 = success, <0 = failure, >0 = "not now") ------------ */
#define SHM_OK            0
#define SHM_EMPTY         1   /* nothing to hand out right now                */
#define SHM_FULL          2   /* not enough free space right now              */
#define SHM_STALLED       3   /* blocked behind a claim whose owner must be checked */
#define SHM_CLOSED        4   /* shut down (and, for the receiver, drained)   */
#define SHM_STALE         5   /* handle no longer current: release is a no-op */
#define SHM_BUSY          6   /* receiver owned by another live process       */
#define SHM_REMOVED       7   /* the channel was removed (unlinked): sends refused */
#define SHM_AGAIN         8   /* recv: nothing yet, records that arrived during the
                                 call wait to be looked at: call again at once */
#define SHM_LOST          9   /* a handle in transit was taken back, or adopted elsewhere */
#define SHM_E_TOO_LARGE  -1
#define SHM_E_TOO_MANY_KEYS -2
#define SHM_E_CORRUPT    -3
#define SHM_E_LAYOUT     -4
#define SHM_E_INVALID    -5
#define SHM_E_NOMEM      -6
#define SHM_E_SYS        -7   /* errno is set */

/* --- enumerations ------------------------------------------------------- */
#define SHM_ORDER_FIFO   0
#define SHM_ORDER_EAGER  1

#define SHM_PAYLOAD_RAW     0   /* bytes travel as they are               */
#define SHM_PAYLOAD_PICKLE  1   /* pickle protocol 5                       */

#define SHM_CFG_RAW_ONLY    1   /* serializer="raw": refuse pickled payloads */
#define SHM_CFG_DURABLE     2   /* file-backed: records carry a CRC-32C (crc32c.c) */
#define SHM_CFG_TEMPORARY   4   /* removed when its last user exits (shmchan/temporary.py) */

#define SHM_MAX_KEYS_LIMIT  64
#define SHM_LAYOUT_VERSION  19

/* --- configuration, fixed at create time -------------------------------- */
typedef struct {
    uint64_t capacity;      /* bytes of messages the channel holds at most       */
    uint32_t max_keys;      /* 0..SHM_MAX_KEYS_LIMIT distinct keys per message   */
    uint32_t max_messages;  /* scheduler window: messages ingested at once       */
    uint32_t order;         /* SHM_ORDER_*                                      */
    uint32_t max_attempts;  /* 0 = unlimited redeliveries                       */
    uint64_t lease_ns;      /* 0 = no lease                                      */
    uint32_t flags;         /* SHM_CFG_*                                         */
    uint32_t max_producers; /* producer registry slots                          */
    uint64_t handover_ns;   /* a pickled handle's time to be adopted (handles.c) */
} shm_config;

/* --- what the receiver hands out ---------------------------------------
 * Every field is a uint64_t, in this order, so Python can read a batch of them as
 * one flat list (ffi.unpack) instead of field by field. */
#define SHM_MSG_WORDS 12
typedef struct {
    uint64_t slot;          /* message table index   } the handle's identity  */
    uint64_t gen;           /* slot generation       }                         */
    uint64_t seq;
    uint64_t attempt;
    uint64_t kind;          /* SHM_PAYLOAD_*                                   */
    uint64_t data_off;      /* payload offset from the mapping's base          */
    uint64_t data_len;
    uint64_t keys_off;      /* encoded key blob offset from the mapping's base */
    uint64_t keys_len;
    uint64_t nkeys;
    uint64_t pos;           /* record position: changes if the consumer moves it    */
    uint64_t word;          /* the slot's state word this description is valid for  */
} shm_msg;

/* --- why a call stalled (SHM_STALLED) ----------------------------------- */
typedef struct {
    uint64_t pos;           /* ring position of the stuck claim    */
    uint64_t owner;         /* the claimant's token (pid + start)  */
} shm_stall;

typedef struct {
    uint64_t capacity;
    uint64_t used_bytes;
    uint64_t queued;        /* accepted, not yet handed out              */
    uint64_t inflight;      /* live handles                              */
    uint64_t held_keys;
    uint64_t dead_letters;
    uint64_t sent;
    uint64_t delivered;
    uint64_t released;
    uint64_t redelivered;
    uint64_t discarded;
    uint64_t window;        /* messages in the scheduler window          */
    uint64_t segment_size;
    uint32_t shutdown;
    uint32_t order;
    uint32_t max_keys;
    uint32_t max_messages;
    uint32_t max_attempts;
    uint32_t max_producers;
    uint64_t lease_ns;
    uint32_t flags;
    uint32_t layout_version;
    uint64_t receiver;      /* token of the receiver, 0 = none           */
    uint64_t committed_bytes; /* bytes of the segment backed by memory (commit.c) */
    uint64_t table_bytes;     /* of which the receiver's tables (budget.c)            */
    uint64_t ring_committed;  /* of which the ring (commit.c)                         */
} shm_stats;

typedef struct shm_chan shm_chan;   /* one process's attachment (opaque) */

/* --- the gate of a record published through an exchange (ring.c, exchange.c) --- */
#define SHM_GATE_NAME_MAX 208
typedef struct {
    uint64_t uid;           /* the exchange segment's identity             */
    uint32_t slot;          /* its transaction slot ...                    */
    uint32_t gen;           /* ... and that slot's generation              */
    uint32_t name_len;
    char name[SHM_GATE_NAME_MAX]; /* the exchange's name (not terminated)  */
} shm_gate;

/* --- segment ------------------------------------------------------------ */
int  shm_layout_size(const shm_config *cfg, uint64_t *total_out);
int  shm_attach(int fd, int create, const shm_config *cfg, uint64_t token, shm_chan **out);
void shm_detach(shm_chan *c);
uint8_t *shm_base(shm_chan *c);
int  shm_sync(shm_chan *c);
uint64_t shm_mapped_size(shm_chan *c);
int  shm_read_config(shm_chan *c, shm_config *out);
/* identity (segment.c): the random id and create time stored at creation */
int  shm_identity(shm_chan *c, uint64_t *chan_id, uint64_t *created_ns);
int  shm_read_identity(int fd, uint64_t *chan_id);
/* removal: mark a segment removed (sends refused), through an attachment or an fd */
int  shm_mark_removed(shm_chan *c);
int  shm_mark_removed_fd(int fd, uint64_t expect_id);
int  shm_removed(shm_chan *c);

/* --- checksums (crc32c.c) ------------------------------------------------ */
int  shm_crc32c(const char *data, uint64_t n, int hw, uint32_t *out);

/* --- keys --------------------------------------------------------------- */
uint64_t shm_hash_key(const uint8_t *enc, uint32_t len);

/* --- producers ---------------------------------------------------------- */
int  shm_set_identity(shm_chan *c, uint64_t token);
int  shm_producer_attach(shm_chan *c);
int  shm_producer_detach(shm_chan *c);
int  shm_producer_slot_owner(shm_chan *c, uint32_t i, uint64_t *owner);
int  shm_producer_reap(shm_chan *c, uint32_t i, uint64_t dead_owner);
int  shm_send(shm_chan *c, uint32_t kind, const char *data, uint64_t len,
              const char *keys, uint32_t keys_len, uint32_t nkeys,
              uint64_t *seq_out, shm_stall *stall, int *wake);
/* n messages packed back to back: payload i is data_lens[i] bytes of `data` after the
 * previous ones (data_total in all), likewise its key blob in `keys`. Resumes at *done. */
int  shm_send_many(shm_chan *c, uint32_t n, const uint32_t *kinds,
                   const char *data, uint64_t data_total, const uint64_t *data_lens,
                   const char *keys, uint64_t keys_total, const uint32_t *keys_lens,
                   const uint32_t *nkeys, uint64_t *seqs_out, uint32_t *done,
                   shm_stall *stall, int *wake);
int  shm_message_size(shm_chan *c, uint32_t kind, uint64_t len, uint32_t keys_len,
                      uint32_t nkeys, uint64_t *record, uint64_t *limit);
int  shm_repair_claim(shm_chan *c, uint64_t pos, uint64_t dead_owner);
int  shm_space_wait(shm_chan *c, int arm, int *wake);
/* a sender woken for space and refused again: 1 = pass the wake-up on (ring.c, rule 4) */
int  shm_space_refused(shm_chan *c, uint64_t *passed_at);
/* senders counted as waiting for space now (a snapshot: the receiver's upkeep reaps dead
 * producers while it is non-zero) */
uint32_t shm_space_waiters(shm_chan *c);
/* errno of this process's last failed commit (ENOSPC, ...), 0 if its last one succeeded:
 * a send's SHM_FULL was then for lack of memory, not of ring space (commit.c) */
int  shm_space_short(shm_chan *c);
int  shm_shutdown(shm_chan *c);

/* --- receiver ----------------------------------------------------------- */
int  shm_rx_owner(shm_chan *c, uint64_t *owner);
int  shm_rx_acquire(shm_chan *c, uint64_t expect_owner);
int  shm_rx_release_ownership(shm_chan *c);
int  shm_recv(shm_chan *c, shm_msg *out, uint32_t max, uint32_t *got,
              int arm_sleep, shm_stall *stall, uint32_t *wake_sender);
int  shm_discard_dead(shm_chan *c, uint64_t pos, uint64_t dead_owner);
/* A gated record at pos whose publisher (dead_owner) died: read its gate, then settle it
 * (commit = 1: deliver, 0: discard) once the exchange's transaction word decided. */
int  shm_gate_read(shm_chan *c, uint64_t pos, uint64_t dead_owner, shm_gate *out);
int  shm_gate_resolve(shm_chan *c, uint64_t pos, uint64_t dead_owner, int commit);
int  shm_writing_list(shm_chan *c, uint64_t *pos, uint64_t *owner, uint32_t max, uint32_t *n);
int  shm_rx_spin(shm_chan *c, uint32_t spins);

/* --- handles (any process) ---------------------------------------------- */
/* returns a status code; on success also wake-up requests: bit 8 = post the
 * receiver's semaphore, bit 9 = wake one sender waiting for space (ring.c) */
int  shm_release(shm_chan *c, uint32_t slot, uint32_t gen, int nack);
int  shm_release_many(shm_chan *c, const uint32_t *slots, const uint32_t *gens,
                      uint32_t n, int *wake);
/* shm_release_many for the messages msgs[0..n) describe (their slot and gen): a batch's */
int  shm_release_msgs(shm_chan *c, const shm_msg *msgs, uint32_t n, int *wake);
int  shm_handle_info(shm_chan *c, uint32_t slot, uint32_t gen, shm_msg *out);
int  shm_handle_view(shm_chan *c, uint32_t slot, uint32_t gen, shm_msg *out);
int  shm_unmoved(shm_chan *c, uint32_t slot, uint64_t word, uint64_t pos);
/* shm_unmoved for msgs[0..n): the index of the first that moved, or n (handles.c) */
uint32_t shm_unmoved_many(shm_chan *c, const shm_msg *msgs, uint32_t n);
int  shm_handle_send(shm_chan *c, uint32_t slot, uint32_t gen);
int  shm_handle_adopt(shm_chan *c, uint32_t slot, uint32_t gen, uint64_t token);
/* the two above for a batch, in one call: status[i] per handle (handles.c) */
int  shm_handle_send_many(shm_chan *c, const uint32_t *slots, const uint32_t *gens,
                          uint32_t n, int32_t *status);
int  shm_handle_adopt_many(shm_chan *c, const uint32_t *slots, const uint32_t *gens,
                           uint32_t n, uint64_t token, shm_msg *out, int32_t *status);
int  shm_handle_extend(shm_chan *c, uint32_t slot, uint32_t gen, uint64_t deadline_ns);

/* --- test pause points (tests only) ------------------------------------------
 * Arm one point in this process: the next thread to reach it writes one byte to
 * notify_fd and blocks until it reads one byte from wait_fd; then the point is
 * disarmed. Unarmed (always, outside tests) a point costs one load. */
#define SHM_PAUSE_HANDOVER_SEND   1   /* hand-over marking, after its first state check */
#define SHM_PAUSE_HANDOVER_ADOPT  2   /* adoption, after its first state check          */
#define SHM_PAUSE_EXTEND          3   /* extend, after its first state check            */
#define SHM_PAUSE_PRODUCER_REAP   4   /* a producer's reap, after marking its entry       */
#define SHM_PAUSE_INGEST_WAKE     5   /* a poll, between its writing and wake passes      */
#define SHM_PAUSE_EXCH_GATED      6   /* a publish to 2+ channels, its first copy gated   */
#define SHM_PAUSE_EXCH_SETTLED    7   /* a committed publish, its first copy settled      */
#define SHM_PAUSE_RING_COMMIT     8   /* a ring commit, after its fallocate, before the mark */
#define SHM_PAUSE_KEY_GROW        9   /* the key table's growth, half rehashed             */
#define SHM_PAUSE_GIVE_BACK      10   /* a give-back of ring memory, holding the tail      */
#define SHM_PAUSE_SEND_GROUP     11   /* a send_many group, its record 1 claimed, unpublished */
#define SHM_PAUSE_RUN_TAKEN      12   /* a batch receive's run: 2nd message taken, not out */
#define SHM_PAUSE_RELEASE_RUN    13   /* the receiver's release of many, half its messages marked released */
#define SHM_PAUSE_SEND_WRITTEN   14   /* a send, its length published, the tail hint not yet raised */
#define SHM_PAUSE_RELEASE_KEYS   15   /* the release of many, a chunk's keys passed on, no record done */
#define SHM_PAUSE_RELEASE_DONE   16   /* the release of many, mid-chunk: a record done, its slot not free */
#define SHM_PAUSE_RECV_TAKEN     17   /* a single recv: its message taken in, not out       */
#define SHM_PAUSE_RELEASE_ONE    18   /* a single release: its record done, its slot not free */
int  shm_test_pause_at(int point, int notify_fd, int wait_fd);
/* Tests only: the next compaction in this process that moves parked records fails as
 * if its memory were refused before it moved anything (RESERVE: it does not slide), or
 * as if a parked record's chain could not be repaired after (CHAINS). 0 disarms.
 * Returns what was armed before: 0 once a slide has used it. */
#define SHM_TEST_COMPACT_RESERVE  1
#define SHM_TEST_COMPACT_CHAINS   2
int  shm_test_compact_fail(int what);
/* Tests only: key tables of channels this process creates from now on start at this many
 * entries (a power of two from 16 to the default 512; 0 = the default), so that their
 * growth is exercised by small tests. */
int  shm_test_keytab_first(uint32_t entries);
/* Tests only: receivers in this process park records on at most this many keys that
 * have nothing but parked records (0 = no such bound: a quarter of the key table), so
 * that small tests meet a scan stopped for room and the look-ahead past it. */
int  shm_test_park_keys(uint32_t keys);
/* Tests only: `threads` threads of this process each take the receiver's process-local
 * lock `rounds` times and add one to a count under it (rxlock.c); *count is the total,
 * threads * rounds if the lock kept them apart. */
int  shm_test_rx_lock(shm_chan *c, uint32_t threads, uint32_t rounds, uint64_t *count);

/* --- recovery (recovery.c) ------------------------------------------------ */
int  shm_holders(shm_chan *c, uint64_t *tokens, uint32_t max, uint32_t *n, uint64_t now_ns,
                 uint32_t *expired);
int  shm_revoke(shm_chan *c, const uint64_t *dead, uint32_t ndead, uint64_t now_ns,
                uint32_t *revoked);
int  shm_dead_list(shm_chan *c, uint32_t start, shm_msg *out, uint32_t max, uint32_t *n,
                   uint32_t *next);
int  shm_dead_discard(shm_chan *c, uint32_t slot, uint32_t gen, int *wake);
int  shm_boot_check(shm_chan *c, uint64_t boot_id);

/* --- pause and resume (hold.c): any process ------------------------------- */
#define SHM_HOLD_KEYS       64  /* keys paused at once, per channel                   */
#define SHM_HOLD_KEY_BYTES  48  /* bytes of a paused key's encoding kept for display  */
int  shm_pause(shm_chan *c, int paused);
int  shm_pause_key(shm_chan *c, uint64_t hash, const char *blob, uint32_t len);
int  shm_resume_key(shm_chan *c, uint64_t hash, uint32_t *cleared);
/* *paused: the channel's flag; entries i < *n: hashes[i], the key's framed encoding
 * (blob[i * SHM_HOLD_KEY_BYTES ...], lens[i] bytes: 0 if unknown or too long) */
int  shm_hold_read(shm_chan *c, uint32_t *paused, uint64_t *hashes, uint8_t *blobs,
                   uint32_t *lens, uint32_t *n);
/* The configuration's flags of the segment open on fd, and its receiver's token as a
 * hint (SHM_EMPTY: not initialized yet). */
int  shm_read_flags_fd(int fd, uint32_t *flags, uint64_t *receiver);

/* --- inspection --------------------------------------------------------- */
int  shm_stats_read(shm_chan *c, shm_stats *out);

/* --- timers (timers.c): delays and time-to-live ---------------------------
 * Times are CLOCK_REALTIME nanoseconds (0 = none), so that a durable channel's file
 * keeps meaning them across a reboot. */
#define SHM_DEAD_ATTEMPTS   0   /* a dead letter's reason: out of attempts      */
#define SHM_DEAD_EXPIRED    1   /* ... not handed out within its ttl            */
#define SHM_NACK_DELAY_MAX_MS 4294967295u /* the longest nack delay, in ms      */
typedef struct {
    uint64_t delayed;       /* messages held back until their due time          */
    uint64_t expired;       /* messages dead-lettered for their ttl, ever       */
    uint64_t next_due;      /* earliest due or expiry among the delayed, 0 = none */
} shm_timer_stats;
/* send with a due time and/or an expiry time: like shm_send otherwise */
int  shm_send_timed(shm_chan *c, uint32_t kind, const char *data, uint64_t len,
                    const char *keys, uint32_t keys_len, uint32_t nkeys, uint64_t due_ns,
                    uint64_t expire_ns, uint64_t *seq_out, shm_stall *stall, int *wake);
/* a holder about to nack (shm_release, nack = 1) records the nack's delay first */
int  shm_nack_delay(shm_chan *c, uint32_t slot, uint32_t gen, uint32_t delay_ms);
int  shm_timer_stats_read(shm_chan *c, shm_timer_stats *out);
/* a slot's timers and dead-letter reason (any process; a snapshot) */
int  shm_slot_timers(shm_chan *c, uint32_t slot, uint64_t *due_ns, uint64_t *expire_ns,
                     uint32_t *dead_reason);
/* seconds until the receiver must look at the delayed list again; < 0: nothing delayed */
double shm_timers_wait(shm_chan *c);

/* --- dead-letter routing (deadroute.c): the exchange dead letters go to ----
 * name_len 0 clears it. get: SHM_OK with *name_len (0: none), SHM_BUSY if a writer was
 * mid-way on every try. */
int  shm_dead_route_set(shm_chan *c, const char *name, uint32_t name_len);
int  shm_dead_route_get(shm_chan *c, char *name, uint32_t *name_len);
/* --- overflow to disk (overflow.c) --------------------------------------------
 * The shared half of shmchan/overflow.py: the file's offsets and counts live in the
 * segment's header; the file itself is written and read by the Python layer. */
#define SHM_OVF_DIR_MAX 1024
typedef struct {
    uint64_t limit;        /* bytes on disk at most                           */
    uint64_t head, tail;   /* file offsets: [head, tail) is not yet taken back */
    uint64_t appended, drained, skipped; /* messages, ever                    */
    uint32_t overflowing;  /* 1: sends go to the file                          */
    uint32_t dir_len;      /* 0: the channel has no overflow                   */
} shm_ovf_state;
int  shm_ovf_setup(shm_chan *c, const char *dir, uint32_t dir_len, uint64_t limit);
int  shm_ovf_read(shm_chan *c, shm_ovf_state *out, char *dir, uint32_t dir_cap);
int  shm_ovf_begin(shm_chan *c);
int  shm_ovf_published(shm_chan *c, uint64_t tail, uint64_t nmsgs);
int  shm_ovf_taken(shm_chan *c, uint64_t head, uint64_t nmsgs, uint64_t nskipped);
int  shm_ovf_finish(shm_chan *c);
int  shm_ovf_drainer(shm_chan *c);
int  shm_ovf_punch(int fd, uint64_t upto);
int  shm_ovf_crc(const char *head, uint64_t nhead, const char *blob, uint64_t nblob,
                 const char *data, uint64_t ndata, uint32_t *out);

/* --- the operators' view (inspect.c): read-only, from any process ---------
 * One record type for held messages, waiting lines and why-chains. Keys come back as
 * the message's encoded key blob (codec.py), copied into the caller's buffer, plus the
 * place (key_index) of the key an entry is about. */
#define SHM_VIEW_UNKNOWN    0   /* no such message: not sent yet, or dropped            */
#define SHM_VIEW_WAITING    1   /* taken in, behind another message on one of its keys  */
#define SHM_VIEW_READY      2   /* free to go: the next recv() hands it out             */
#define SHM_VIEW_INFLIGHT   3   /* handed out; `holder` holds it                        */
#define SHM_VIEW_DELIVERED  4   /* handed out and released                              */
#define SHM_VIEW_DEAD       5   /* a dead letter                                        */
#define SHM_VIEW_QUEUED     6   /* accepted, waiting outside the receiver's window      */
#define SHM_VIEW_DELAYED    7   /* first in its lines, held back until due_ns (timers.c) */
#define SHM_VIEW_TOP_MAX    4096 /* most lines shm_view_lines returns                  */
#define SHM_VIEW_WORDS      12
typedef struct {
    uint64_t seq;
    uint64_t state;         /* SHM_VIEW_*                                             */
    uint64_t holder;        /* token of the holding process while in flight, else 0   */
    uint64_t attempt;       /* deliveries so far                                      */
    uint64_t age_ns;        /* in flight: time since it was handed out (coarse clock) */
    uint64_t hash;          /* lines and chains: the key this entry is about          */
    uint64_t key_index;     /* that key's place in the blob (nkeys if not found)      */
    uint64_t nkeys;         /* the message's keys: an encoded blob of nkeys keys,     */
    uint64_t blob_off;      /*   blob_len bytes at blob_off in the caller's buffer    */
    uint64_t blob_len;
    uint64_t depth;         /* lines: messages with the key not yet handed out        */
    uint64_t due_ns;        /* delayed: not handed out before this, CLOCK_REALTIME ns */
} shm_view;

/* Every in-flight message (SHM_FULL: more than max, or the buffer is too small). */
int  shm_view_held(shm_chan *c, shm_view *out, uint32_t max, uint32_t *n,
                   uint8_t *blob, uint64_t blob_cap);
/* The `top` deepest lines, deepest first (out has room for top <= SHM_VIEW_TOP_MAX). */
int  shm_view_lines(shm_chan *c, uint32_t top, shm_view *out, uint32_t *n,
                    uint8_t *blob, uint64_t blob_cap, uint32_t *partial);
/* Message `seq` (*self) and, if it waits, the chain of what it waits on (out[0..n)). */
int  shm_view_why(shm_chan *c, uint64_t seq, shm_view *self, shm_view *out, uint32_t max,
                  uint32_t *n, uint8_t *blob, uint64_t blob_cap, uint32_t *partial);
/* Registered producers: their tokens and messages sent through each entry. */
int  shm_view_producers(shm_chan *c, uint64_t *tokens, uint64_t *sent, uint32_t max,
                        uint32_t *n);
int  shm_check_scheduler(shm_chan *c, uint32_t *what);
int  shm_layout_fact(const char *name, uint64_t *out);

/* --- exchanges (exchange.c): bindings in a segment of their own, all-or-nothing publish - */
#define EXCH_KIND_FANOUT    0
#define EXCH_KIND_DIRECT    1
#define EXCH_KIND_TOPIC     2
#define EXCH_LAYOUT_VERSION 2
#define EXCH_MAX_BINDINGS   1024
#define EXCH_MAX_TXNS       256
#define EXCH_PATTERN_MAX    256

typedef struct shm_exch shm_exch;   /* one process's attachment to an exchange (opaque) */

typedef struct {
    uint64_t uid;
    uint64_t version;       /* bumped by every binding change           */
    uint64_t published;     /* publish calls that went through           */
    uint64_t routed;        /* copies delivered into channels            */
    uint64_t unroutable;    /* publishes that matched no binding         */
    uint64_t writer;        /* token changing the bindings, 0 = none     */
    uint32_t kind;          /* EXCH_KIND_*                               */
    uint32_t max_bindings;
    uint32_t max_txns;
    uint32_t txns_busy;     /* transaction slots held right now          */
    uint32_t removed;       /* 1 once exch_retire ran: publishes refused */
    uint32_t txns_committed; /* held slots of committed publishes whose copies are not
                                all settled: a removed exchange is kept for them */
} shm_exch_info;

typedef struct {
    uint64_t count;         /* messages routed through this binding      */
    uint32_t index;         /* its entry in the table                    */
    uint32_t chan_len;
    uint32_t pat_len;
    char chan[SHM_GATE_NAME_MAX];
    char pat[EXCH_PATTERN_MAX];
} shm_binding;

uint64_t exch_segment_size(void);
uint64_t exch_txns_offset(void);
int  exch_attach(int fd, int create, uint32_t kind, const char *name, uint32_t name_len,
                 uint64_t uid, uint64_t token, shm_exch **out);
void exch_detach(shm_exch *x);
int  exch_set_identity(shm_exch *x, uint64_t token);
int  exch_info(shm_exch *x, shm_exch_info *out);
uint64_t exch_version(shm_exch *x);
int  exch_bind(shm_exch *x, const char *chan, uint32_t chan_len, const char *pat,
               uint32_t pat_len, uint64_t *holder);
int  exch_unbind(shm_exch *x, const char *chan, uint32_t chan_len, const char *pat,
                 uint32_t pat_len, uint64_t *holder);
int  exch_writer_reap(shm_exch *x, uint64_t dead);
int  exch_bindings(shm_exch *x, shm_binding *out, uint32_t max, uint32_t *n, uint64_t *version);
int  exch_note(shm_exch *x, const uint32_t *idx, uint32_t nb, uint64_t copies);
int  exch_publish(shm_exch *x, shm_chan **chans, uint32_t n, uint32_t kind, const char *data,
                  uint64_t len, const char *keys, uint32_t keys_len, uint32_t nkeys,
                  uint64_t *seqs_out, int *wake_out, uint32_t *failed, shm_stall *stall);
int  exch_txn_outcome(shm_exch *x, uint32_t slot, uint32_t gen, uint64_t dead_owner, int *commit);
int  exch_txn_settled(shm_exch *x, uint32_t slot, uint32_t gen);
int  exch_txn_owner(shm_exch *x, uint32_t i, uint64_t *owner);
int  exch_txn_word(shm_exch *x, uint32_t i, uint64_t *word);
int  exch_txn_reap(shm_exch *x, uint32_t i, uint64_t dead);
int  exch_retire(shm_exch *x);
int  exch_removed(shm_exch *x);
