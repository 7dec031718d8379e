/* loadmesh HTTP/1 fingerprint probe: a TC classifier on the configured interfaces.
 *
 * It never changes a packet and always returns PASS (TC_ACT_UNSPEC). Per TCP segment to or
 * from a serving port it follows HTTP/1 framing (heads, Content-Length bodies, chunked
 * bodies) by TCP sequence number, so keep-alive and pipelined requests are counted once
 * each and retransmissions not at all. Parsing goes in steps of one unit of work each (a
 * head, a window of body scan, a run of chunk lines): the entry program parses L2-L4 and
 * runs a segment's first step, and further steps run in tail-called programs that call
 * themselves while the segment holds more, so each program stays small enough for the
 * verifier. See docs/probes.md.
 *
 * BCC 0.26 here inlines every function (BPF-to-BPF calls fail to load), hence
 * __always_inline and tail calls rather than subprograms. The loader compiles this file
 * followed by tcpstats.bpf.c as one text: BCC generates tracepoint argument structs only
 * for its main source, so the tracepoints cannot come in through an #include.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/tcp.h>
#include "loadmesh.h"

#if !defined(LM_INFLIGHT_ENTRIES) || !defined(LM_FP_ENTRIES) || !defined(LM_HIST_ENTRIES) || \
    !defined(LM_MODEL_ENTRIES) || !defined(LM_PORT_ENTRIES) || !defined(LM_SCAN_LIMIT) ||   \
    !defined(LM_HIST_SUB_BITS) || !defined(LM_HIST_MAX_EXP)
#error "probes/loader.py passes map sizes, the scan limit and the histogram layout with -D"
#endif

/* What every TC program returns: TC_ACT_UNSPEC lets the classifier chain go on to the next
 * filter (TC_ACT_OK would end it and skip, say, a CNI's filter behind ours). */
#define PASS TC_ACT_UNSPEC

#define STEP_REQ 0
#define STEP_RESP 1
#define WMASK (LM_WIN - 1)
#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
#define LOWER 0x2020202020202020ULL /* OR-ing it lower-cases ASCII letters */

#define C4(a, b, c, d) ((__u32)(a) | (__u32)(b) << 8 | (__u32)(c) << 16 | (__u32)(d) << 24)
#define C8(a, b, c, d, e, f, g, h) ((__u64)C4(a, b, c, d) | (__u64)C4(e, f, g, h) << 32)
#define LOW7 0x00ffffffffffffffULL
#define KEY7 C8('"', 'm', 'o', 'd', 'e', 'l', '"', 0)
#define HTTP7 C8('H', 'T', 'T', 'P', '/', '1', '.', 0)
/* A volatile load, so clang does not forward the last store and the verifier sees a map
 * value (an unknown scalar) rather than a constant: see lm_ctx.cur. */
#define LOAD(x) (*(volatile typeof(x) *)&(x))

/* ---- maps: every one bounded; the sizes' reasons are in docs/probes.md ---- */

/* Serving ports as a 65536-bit bitmap: testing a port is one array lookup the JIT inlines,
 * cheaper than a hash lookup on every packet of the interface. User space flips bits to
 * change the port list without a recompile. Bounded by the port space (8 KiB). */
BPF_ARRAY(serving_ports, u64, 1024);

/* HTTP state per connection. LRU, so connections that vanish without FIN or RST are
 * evicted by newer ones instead of filling the map; one entry per live connection. */
BPF_TABLE("lru_hash", struct lm_flow, struct lm_flow_state, inflight, LM_INFLIGHT_ENTRIES);

/* Per flow, model and status: count and latency. Per-CPU so the hot path needs no atomics.
 * Preallocated (entries x 32 B x CPUs): allocating on use measured 40 ns slower per
 * response. User space deletes idle entries, so the size bounds recently active flows. */
BPF_F_TABLE("percpu_hash", struct lm_fp_key, struct lm_fp_val, fingerprints, LM_FP_ENTRIES, 0);

/* Latency histograms per model, serving port and status: only touched buckets exist, so
 * the size bounds models x ports x statuses x buckets in use (a model's latencies span a
 * few powers of two).
 * Preallocated for the same reason as fingerprints (entries x 8 B x CPUs). */
BPF_F_TABLE("percpu_hash", struct lm_hist_key, u64, histograms, LM_HIST_ENTRIES, 0);

/* model_id -> name, written once per model; bounded by the models a host serves. */
BPF_HASH(models, u64, struct lm_model_name, LM_MODEL_ENTRIES);

/* Model ids known to be in `models`, per CPU and direct-mapped by the id's low bits: spares
 * the hash lookup for a known name, nearly always. A collision only costs that lookup. */
#define NAMED_SLOTS 64
BPF_PERCPU_ARRAY(named, u64, NAMED_SLOTS);

/* LM_ERR_* counters. */
BPF_PERCPU_ARRAY(errors, u64, LM_ERR_COUNT);

/* TCP events per serving port (tracepoints below); bounded by the number of ports. */
BPF_F_TABLE("percpu_hash", u32, struct lm_port_stats, port_stats, LM_PORT_ENTRIES, 0);

/* Context handed from one tail-called step to the next, plus buffers too big for the
 * 512-byte stack. Per-CPU: a TC program runs to completion on its CPU with bottom halves
 * off, so nothing else on that CPU uses it meanwhile. */
struct lm_ctx {
    struct lm_flow flow;
    __u64 now; /* bpf_ktime_get_ns() of the segment, 0 until seg_time() reads it */
    __u32 seq;  /* TCP sequence number of payload byte 0 */
    __u32 poff; /* payload offset in the skb */
    __u32 len;  /* payload bytes */
    __u32 pos;  /* first payload byte the remaining steps look at */
    /* Always 0. Loop cursors are XOR-ed with it: the verifier sees a value loaded from a map
     * as unknown, so cursors stay unknown scalars, the states of successive iterations
     * converge and get pruned instead of being explored path by path with exact offsets
     * (which blew the 1M-instruction verification limit). A register XOR costs less than
     * keeping the cursor in memory, the other way to hide it. */
    __u32 zero;
    /* Results and bounds that leave loops go through these fields for the same reason. */
    __u32 cur;
    __u32 cl_at;
    __u32 lim;
    __u32 n;
    __u32 stop;
    __u32 hlen;
    __u32 line;  /* parse_head: where the window's last line starts */
    __u64 vhash; /* parse_value's state: FNV-1a of the value so far */
    __u32 vlen;  /* value bytes hashed */
    __u8 vphase; /* PV_* */
    __u8 chunked;
    __u8 steps;
    __u8 fin;
    __u8 rst;
    /* A request head longer than a window goes on in the next step at c->pos (hcont), with
     * what the windows before found: Content-Length (hhas, hclen), Transfer-Encoding. */
    __u8 hcont;
    __u8 hhas;
    __u8 hchunked;
    __u32 hclen;
    __u8 pad[4];
};

struct lm_scratch {
    struct lm_ctx c;
    struct lm_flow_state fresh;
    struct lm_model_name name;
    __u8 win[LM_WIN + 16]; /* +16: 8-byte reads at masked offsets stay inside the value */
};
BPF_PERCPU_ARRAY(scratch, struct lm_scratch, 1);

BPF_PROG_ARRAY(lm_steps, 2);

/* ---- small helpers ---- */

static __always_inline void err(u32 idx) {
    u64 *v = errors.lookup(&idx);
    if (v)
        *v += 1;
}

static __always_inline void err_add(u32 idx, u64 n) {
    u64 *v = errors.lookup(&idx);
    if (v)
        *v += n;
}

static __always_inline int serving(u16 port) {
    u32 k = port >> 6;
    u64 *w = serving_ports.lookup(&k);
    return w && ((*w >> (port & 63)) & 1);
}

static __always_inline u64 rd64(const u8 *w, u32 off) {
    return *(const u64 *)(w + (off & WMASK));
}

static __always_inline u8 rd8(const u8 *w, u32 off) {
    return w[off & WMASK];
}

/* Index (0-7) of the lowest byte flagged (bit 7 of a byte) by a has-zero-byte mask,
 * branch-free: isolating the lowest flag gives 256^k << 7, and multiplying 256^k by bytes
 * 7,6,..,0 brings byte k's value, k, to the top. Branches here would hand the verifier
 * eight constant offsets per word, each a separate state to explore. */
static __always_inline u32 first_flagged(u64 t) {
    u64 l = (t & (~t + 1)) >> 7;
    return (u32)((l * 0x0001020304050607ULL) >> 56);
}

/* The segment's time, read on first use: only heads need it, and the clock costs about as
 * much as the flow lookup. */
static __always_inline u64 seg_time(struct lm_ctx *c) {
    if (!c->now)
        c->now = bpf_ktime_get_ns();
    return c->now;
}

/* Has-zero-byte test of w ^ byte*ONES: nonzero when w holds that byte. */
static __always_inline u64 has_byte(u64 w, u64 pattern) {
    u64 x = w ^ pattern;
    return (x - ONES) & ~x & HIGHS;
}

/* Copies payload bytes [pos, min(end, pos + LM_WIN)) into the window; returns how many. */
static __always_inline u32 load_win(struct __sk_buff *skb, struct lm_scratch *s, u32 pos,
                                    u32 end) {
    if (pos >= end)
        return 0;
    u64 n = end - pos;
    if (n > LM_WIN)
        n = LM_WIN;
    /* clang may test a copy of n and pass the original: restate the range [1, LM_WIN] on
     * the register that goes to the helper */
    asm volatile("" : "+r"(n));
    n = ((n - 1) & WMASK) + 1;
    if (bpf_skb_load_bytes(skb, s->c.poff + pos, s->win, n) < 0)
        return 0;
    return n;
}

/* First 8 payload bytes at pos, or 0 when fewer remain: the quick test before parsing. */
static __always_inline u64 peek8(struct __sk_buff *skb, struct lm_ctx *c, u32 pos) {
    u64 w = 0;
    if (pos + 8 > c->len)
        return 0;
    if (bpf_skb_load_bytes(skb, c->poff + pos, &w, 8) < 0)
        return 0;
    return w;
}

/* 0: not a request line; 1: a request; 2: a HEAD request (its response has no body). */
static __always_inline int method_kind(u64 w) {
    u32 lo = (u32)w;
    u8 fifth = (u8)(w >> 32);
    if (lo == C4('P', 'O', 'S', 'T') && fifth == ' ')
        return 1;
    if (lo == C4('G', 'E', 'T', ' ') || lo == C4('P', 'U', 'T', ' '))
        return 1;
    if (lo == C4('H', 'E', 'A', 'D') && fifth == ' ')
        return 2;
    if (lo == C4('D', 'E', 'L', 'E') || lo == C4('P', 'A', 'T', 'C') ||
        lo == C4('O', 'P', 'T', 'I'))
        return 1;
    return 0;
}

static __always_inline int is_status_line(u64 w) {
    u8 minor = (u8)(w >> 56);
    return (w & LOW7) == HTTP7 && (minor == '0' || minor == '1');
}

/* ---- HTTP head parsing ---- */

struct head {
    u32 len;     /* bytes up to and including the empty line; 0: not inside the window */
    u32 clen;    /* Content-Length */
    u8 has_clen;
    u8 chunked;  /* Transfer-Encoding present (chunked is the only one HTTP/1.1 frames) */
};

/* Walks the header lines of the head at win[0..n) a word at a time: a line end is found
 * with a has-zero-byte test on 8 bytes, and only line starts are compared with header
 * names. Content-Length digits are parsed after the walk to keep the loop small. */
static __always_inline void parse_head(struct lm_scratch *s, u32 n, struct head *h) {
    const u8 *w = s->win;
    struct lm_ctx *c = &s->c;
    c->cl_at = 0;
    c->hlen = 0;
    c->chunked = 0;
    c->line = 0;
    u32 zero = LOAD(c->zero);
    u32 p = zero;
    n ^= zero;
    for (int i = 0; i < LM_WIN / 8 + 40; i++) {
        if (p >= n)
            break;
        u64 t = has_byte(rd64(w, p), 0x0a0a0a0a0a0a0a0aULL);
        if (!t) {
            p = (p + 8) ^ zero;
            continue;
        }
        u32 l = (p + first_flagged(t) + 1) ^ zero; /* start of the next line */
        if (l > n)
            break;
        p = l;
        c->line = l;
        if (l + 2 <= n && rd8(w, l) == '\r' && rd8(w, l + 1) == '\n') {
            c->hlen = l + 2;
            break;
        }
        u8 first = rd8(w, l) | 0x20;
        if (l + 18 > n || (first != 'c' && first != 't'))
            continue;
        u64 a = rd64(w, l) | LOWER;
        u64 b = rd64(w, l + 8) | LOWER;
        if (a == C8('c', 'o', 'n', 't', 'e', 'n', 't', '-') &&
            (b & LOW7) == C8('l', 'e', 'n', 'g', 't', 'h', ':', 0))
            c->cl_at = l + 15;
        else if (a == C8('t', 'r', 'a', 'n', 's', 'f', 'e', 'r') &&
                 b == C8('-', 'e', 'n', 'c', 'o', 'd', 'i', 'n'))
            c->chunked = 1;
    }
    /* results through the scratch, so exits from every iteration look alike after */
    h->len = LOAD(c->hlen);
    h->chunked = LOAD(c->chunked);
    u32 d = LOAD(c->cl_at);
    if (!h->len || !d)
        return;
    for (int i = 0; i < 4; i++)
        if (rd8(w, d) == ' ')
            d++;
    u64 v = 0;
    int digits = 0;
    int ended = 0;
    for (int i = 0; i < 10; i++) {
        if (d + i >= n)
            break;
        u8 ch = rd8(w, d + i);
        if (ch < '0' || ch > '9') {
            ended = 1;
            break;
        }
        v = v * 10 + (ch - '0');
        digits++;
    }
    if (digits && ended && v <= 0x7fffffff) {
        h->clen = v;
        h->has_clen = 1;
    }
}

/* Copies a head at `at` and parses it: first `hint` bytes (the flow's last head length plus
 * slack), all of a window only when the head goes on past them. Returns the bytes copied. */
static __always_inline u32 load_head(struct __sk_buff *skb, struct lm_scratch *s, u32 at,
                                     u32 hint, struct head *h) {
    struct lm_ctx *c = &s->c;
    u32 lim = hint ? hint : LM_HEAD_WIN;
    u32 n = 0;
#pragma clang loop unroll(disable)
    for (int attempt = 0; attempt < 2; attempt++) {
        n = load_win(skb, s, at, at + lim < c->len ? at + lim : c->len);
        if (!n)
            return 0;
        parse_head(s, n, h);
        if (h->len || n >= c->len - at || lim >= LM_WIN)
            break;
        lim = LM_WIN;
        h->clen = 0;
        h->has_clen = 0;
        h->chunked = 0;
    }
    return n;
}

/* ---- finding "model" (and status lines) ---- */

struct found {
    int at;   /* window index of the key's opening quote, or -1 */
    u32 stop; /* first key start not examined (when not found) */
};

/* Looks for a 7-byte token (key7) starting in win[a..lim). Candidates are the bytes equal
 * to one of its bytes (`byte`, `back` bytes into the token), found 8 at a time with a
 * has-zero-byte test, then checked as one masked 8-byte compare. For "model" the byte is
 * the 'm' (rarer in JSON than '"'), for a status line the 'H' of "HTTP/1.". final: no
 * byte follows win[n-1] in this segment, so a token cut by the window end is not worth a
 * reload. Loop bounds go through the scratch so the verifier walks the loop once, not once
 * per range the callers' paths give them. */
static __always_inline struct found find_key(struct lm_scratch *s, u32 a, u32 lim, u32 n,
                                             int final, u64 byte, u64 key7, u32 back) {
    const u8 *w = s->win;
    struct lm_ctx *c = &s->c;
    c->lim = lim + back; /* candidates at or past it start no token before lim */
    c->n = n;
    c->stop = ~0U; /* stays so only when the loop runs out of iterations */
    c->cur = a + back;
    for (int i = 0; i < LM_WIN / 8 + 24; i++) {
        u32 p = LOAD(c->cur);
        if (p >= LOAD(c->lim)) {
            c->stop = lim;
            break;
        }
        u64 t = has_byte(rd64(w, p), byte * ONES);
        if (!t) {
            c->cur = p + 8;
            continue;
        }
        u32 q = p + first_flagged(t);
        if (q >= LOAD(c->lim)) {
            c->stop = lim;
            break;
        }
        if (q - back + 7 > LOAD(c->n)) {
            /* a token cut by the window end: resume from it, unless nothing follows */
            c->stop = final ? lim : q - back;
            break;
        }
        if ((rd64(w, q - back) & LOW7) == key7) {
            struct found f = {.at = q - back, .stop = q - back};
            return f;
        }
        c->cur = q + 1;
    }
    struct found f = {.at = -1, .stop = LOAD(c->stop)};
    if (f.stop == ~0U)
        f.stop = LOAD(c->cur) - back;
    return f;
}

enum { VAL_FOUND, VAL_INVALID, VAL_TOO_LONG, VAL_CUT };

static __always_inline int json_space(u8 ch) {
    return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\n';
}

/* Position after up to 4 JSON spaces from v; through the scratch so every count of spaces
 * leaves the verifier with the same state. */
static __always_inline u32 skip_space(struct lm_scratch *s, u32 v, u32 n) {
    s->c.cur = v;
    for (int i = 0; i < 4; i++) {
        u32 p = LOAD(s->c.cur);
        if (p >= n || !json_space(rd8(s->win, p)))
            break;
        s->c.cur = p + 1;
    }
    return LOAD(s->c.cur);
}

/* Where parse_value is in `"model" : "value"`; kept across segments in carry_phase. */
#define PV_KEY 0   /* after the key: spaces, then ':' */
#define PV_COLON 1 /* after ':': spaces, then the opening quote */
#define PV_VALUE 2 /* inside the value: c->vlen bytes hashed into c->vhash */

/* Parses `: "value"` from win[v], in phase c->vphase, and hashes the value with FNV-1a 64;
 * leaves its length in s->name.len and its window offset in s->c.cur. On VAL_CUT the
 * c->vphase, c->vhash and c->vlen it leaves let the next segment go on. Escapes are hashed
 * as written (model names carry none). */
static __always_inline int parse_value(struct lm_scratch *s, u32 v, u32 n, u64 *id) {
    const u8 *w = s->win;
    struct lm_ctx *c = &s->c;
    /* through the scratch: the paths that lead here must look alike */
    c->n = n;
    c->cur = v;
    v = LOAD(c->cur);
    n = LOAD(c->n);
    if (c->vphase == PV_KEY) {
        v = skip_space(s, v, n);
        if (v >= n)
            return VAL_CUT;
        if (rd8(w, v) != ':')
            return VAL_INVALID;
        c->vphase = PV_COLON;
        v++;
    }
    if (c->vphase == PV_COLON) {
        v = skip_space(s, v, n);
        if (v >= n)
            return VAL_CUT;
        if (rd8(w, v) != '"')
            return VAL_INVALID;
        c->vphase = PV_VALUE;
        c->vhash = FNV_OFFSET;
        c->vlen = 0;
        v++;
    }
    u64 h = c->vhash;
    u32 done = c->vlen;
    if (done > LM_NAME_MAX)
        return VAL_TOO_LONG;
    /* one bound per byte, as for a value that starts here: the window's end or the byte
     * past the longest name, whichever comes first */
    u32 stop = v + (LM_NAME_MAX - done) + 1;
    c->lim = stop < n ? stop : n;
    c->stop = 0;
    for (u32 i = 0; i <= LM_NAME_MAX + 1; i++) {
        if (v + i >= LOAD(c->lim)) {
            c->stop = i;
            break;
        }
        u8 ch = rd8(w, v + i);
        if (ch == '"') {
            s->name.len = i;
            c->cur = v; /* where the value starts, for set_model */
            *id = h;
            return VAL_FOUND;
        }
        h = (h ^ ch) * FNV_PRIME;
    }
    u32 seen = LOAD(c->stop);
    if (v + seen < n)
        return VAL_TOO_LONG;
    c->vhash = h;
    c->vlen = done + seen;
    return VAL_CUT;
}

/* Bytes of a "model" key at the start of the window (1-6) whose first part ended the
 * previous segment: `tail` holds that segment's last 7 searched bytes, oldest in the low
 * byte. 0 when the two do not join into the key. At most one split point can match: each
 * puts a different key byte last in `tail`. */
static __always_inline u32 bridged_key(struct lm_scratch *s, u64 tail, u32 n) {
    u64 head = rd64(s->win, 0);
    s->c.cur = 0;
#pragma unroll
    for (u32 j = 1; j < 7; j++) {
        u64 in_tail = (1ULL << (8 * (7 - j))) - 1, in_head = (1ULL << (8 * j)) - 1;
        if (j <= n && (tail >> (8 * j)) == (KEY7 & in_tail) &&
            (head & in_head) == (KEY7 >> (8 * (7 - j))))
            s->c.cur = j;
    }
    return LOAD(s->c.cur);
}

/* ---- request queue of a connection ---- */

static __always_inline void push_request(struct lm_flow_state *st, u64 now, int is_head) {
    if (st->overflow || st->tail - st->head >= LM_PIPE_DEPTH) {
        if (!st->overflow)
            st->overflow_ns = now;
        st->overflow++;
        err(LM_ERR_PIPE_OVERFLOW);
        return;
    }
    u32 slot = st->tail & (LM_PIPE_DEPTH - 1);
    st->ring[slot].start_ns = now;
    st->ring[slot].model_id = 0;
    if (is_head)
        st->head_mask |= 1 << slot;
    else
        st->head_mask &= ~(1 << slot);
    st->tail++;
}

/* The newest request gets the model; one that overflowed the ring keeps model 0. The
 * name goes to `models` once, copied from the packet (the window holds payload from wbase);
 * a value that began in an earlier segment (name_here 0) leaves that to a later request. */
static __always_inline void set_model(struct __sk_buff *skb, struct lm_scratch *s,
                                      struct lm_flow_state *st, u64 id, u32 wbase,
                                      int name_here) {
    if (!st->overflow && st->tail != st->head)
        st->ring[(st->tail - 1) & (LM_PIPE_DEPTH - 1)].model_id = id;
    if (!name_here)
        return;
    u32 slot = id & (NAMED_SLOTS - 1);
    u64 *seen = named.lookup(&slot);
    if (!seen || *seen == id)
        return;
    *seen = id;
    if (models.lookup(&id))
        return;
    u64 len = s->name.len;
    asm volatile("" : "+r"(len)); /* restate the range on the register the helper gets */
    len = ((len - 1) & (LM_NAME_MAX - 1)) + 1;
    if (s->name.len &&
        bpf_skb_load_bytes(skb, s->c.poff + wbase + LOAD(s->c.cur), s->name.name, len) < 0)
        return;
    if (models.insert(&id, &s->name) != 0 && models.lookup(&id) == 0)
        err(LM_ERR_MODELS_FULL);
}

/* ---- latency histogram bucket: the same arithmetic as probes/buckets.py ---- */

static __always_inline u32 lm_bucket(u64 v) {
    if (v >= (1ULL << LM_HIST_MAX_EXP))
        v = (1ULL << LM_HIST_MAX_EXP) - 1;
    if (v < (1ULL << LM_HIST_SUB_BITS))
        return (u32)v;
    /* floor(log2 v) by binary search: __builtin_clzll crashes this clang */
    u32 e = 0;
    u64 x = v;
    if (x >> 32) { x >>= 32; e += 32; }
    if (x >> 16) { x >>= 16; e += 16; }
    if (x >> 8) { x >>= 8; e += 8; }
    if (x >> 4) { x >>= 4; e += 4; }
    if (x >> 2) { x >>= 2; e += 2; }
    if (x >> 1) { e += 1; }
    u32 shift = e - LM_HIST_SUB_BITS;
    return ((shift + 1) << LM_HIST_SUB_BITS) + (u32)((v >> shift) - (1ULL << LM_HIST_SUB_BITS));
}

static __always_inline void record(struct lm_ctx *c, u64 model, u16 status, u64 lat) {
    struct lm_fp_key k = {};
    __builtin_memcpy(&k.flow, &c->flow, sizeof(k.flow));
    k.model_id = model;
    k.status = status;
    struct lm_fp_val *v = fingerprints.lookup(&k);
    if (!v) {
        struct lm_fp_val zero = {};
        fingerprints.update(&k, &zero);
        v = fingerprints.lookup(&k);
    }
    if (v) {
        v->count += 1;
        v->lat_sum_ns += lat;
        if (lat > v->lat_max_ns)
            v->lat_max_ns = lat;
        v->last_ns = c->now;
    } else {
        err(LM_ERR_FP_FULL);
    }
    struct lm_hist_key hk = {.model_id = model, .status = status, .bucket = lm_bucket(lat),
                             .port = c->flow.server_port};
    u64 *hv = histograms.lookup(&hk);
    if (!hv) {
        u64 zero = 0;
        histograms.update(&hk, &zero);
        hv = histograms.lookup(&hk);
    }
    if (hv)
        *hv += 1;
    else
        err(LM_ERR_HIST_FULL);
}

/* ---- connection end ---- */

static __always_inline void close_flow(struct lm_ctx *c, struct lm_flow_state *st, int from_client) {
    if (!c->rst) {
        st->flags |= from_client ? LM_F_FIN_CLIENT : LM_F_FIN_SERVER;
        if ((st->flags & (LM_F_FIN_CLIENT | LM_F_FIN_SERVER)) !=
            (LM_F_FIN_CLIENT | LM_F_FIN_SERVER))
            return;
    }
    u64 pending = (u64)(st->tail - st->head) + st->overflow;
    if (pending)
        err_add(LM_ERR_ABANDONED, pending);
    inflight.delete(&c->flow);
}

static __always_inline int finish(struct lm_ctx *c, struct lm_flow_state *st, int from_client) {
    if (c->fin || c->rst)
        close_flow(c, st, from_client);
    return PASS;
}

/* ---- request direction ---- */

#define CARRIES (LM_F_KEY_CARRY | LM_F_VAL_CARRY)

static __always_inline void lose_req(struct lm_flow_state *st) {
    if (st->flags & LM_F_VAL_CARRY)
        err(LM_ERR_MODEL_LOST);
    st->flags &= ~(LM_F_REQ_FRAMED | LM_F_AWAIT_MODEL | LM_F_TAIL_SCAN | CARRIES);
}

/* In the tail scan, moves c->pos past the body bytes before its last LM_SCAN_LIMIT. */
static __always_inline void tail_skip(struct lm_ctx *c, struct lm_flow_state *st) {
    s32 from = (s32)(st->req_next - LM_SCAN_LIMIT - c->seq);
    if (from > (s32)c->pos) {
        c->pos = from < (s32)c->len ? (u32)from : c->len;
        st->flags &= ~CARRIES; /* what they carried does not continue here */
    }
}

/* The body's first LM_SCAN_LIMIT bytes held no "model". Clients that write the keys in the
 * order they were given put it after "messages" (openai-python does), so near the end of
 * a long body: when the end is known (Content-Length), its last LM_SCAN_LIMIT bytes are
 * searched too. Returns 0 when there is nothing left to search. */
static __always_inline int tail_scan(struct lm_ctx *c, struct lm_flow_state *st) {
    if ((st->flags & (LM_F_REQ_FRAMED | LM_F_TAIL_SCAN)) != LM_F_REQ_FRAMED)
        return 0;
    s32 left = (s32)(st->req_next - c->seq - c->pos); /* body bytes not searched yet */
    if (left <= 0)
        return 0;
    st->flags |= LM_F_TAIL_SCAN;
    st->scan_left = left < LM_SCAN_LIMIT ? (u32)left : LM_SCAN_LIMIT;
    tail_skip(c, st);
    return 1;
}

/* Does the rest of this segment hold more request work? */
static __always_inline int req_more(struct lm_ctx *c, struct lm_flow_state *st) {
    if (c->pos >= c->len)
        return 0;
    if (!(st->flags & LM_F_REQ_FRAMED))
        return (st->flags & LM_F_AWAIT_MODEL) != 0;
    s32 r = (s32)(st->req_next - c->seq);
    if ((st->flags & LM_F_AWAIT_MODEL) && r > (s32)c->pos)
        return 1;
    return r >= (s32)c->pos && r < (s32)c->len;
}

/* One window of the newest request's body scan: window holds payload bytes from wbase,
 * n of them; the scan looks at key starts from win[a] up to the body end. */
static __always_inline int model_scan(struct __sk_buff *skb, struct lm_scratch *s,
                                      struct lm_flow_state *st, u32 wbase, u32 a, u32 n,
                                      u32 end) {
    struct lm_ctx *c = &s->c;
    u32 lim = n;
    if (lim - a > st->scan_left)
        lim = a + st->scan_left;
    int final = wbase + n >= end;
    /* a carry is set only at the end of a window, so this window starts where it stopped */
    u16 carry = st->flags & CARRIES;
    st->flags &= ~CARRIES;
    struct found f = {.at = -1};
    s32 from = -1; /* where parse_value starts */
    c->vphase = PV_KEY;
    if (carry & LM_F_VAL_CARRY) {
        c->vphase = st->carry_phase;
        c->vhash = st->carry;
        c->vlen = st->carry_len;
        from = 0;
    } else if (carry && n >= 8) {
        u32 j = bridged_key(s, st->carry, n);
        if (j)
            from = j;
    }
    if (from < 0) {
        carry = 0;
        f = find_key(s, a, lim, n, final, 'm', KEY7, 1);
        if (f.at >= 0)
            from = f.at + 7;
    }
    if (from >= 0) {
        u64 id = 0;
        int r = parse_value(s, from, n, &id);
        if (r == VAL_CUT && !carry && !final && (f.at > (int)a || n < LM_WIN)) {
            /* the value runs past the window, and a window from the key holds more */
            st->scan_left -= f.at - a;
            c->pos = wbase + f.at;
            return 1;
        }
        c->pos = wbase + n;
        if (r == VAL_CUT) {
            /* cut by the segment's end (or, going on from a carry, the window's) */
            st->carry = c->vhash;
            st->carry_len = c->vlen;
            st->carry_phase = c->vphase;
            st->flags |= LM_F_VAL_CARRY;
            return req_more(c, st);
        }
        st->flags &= ~LM_F_AWAIT_MODEL;
        if (r == VAL_FOUND)
            set_model(skb, s, st, id, wbase, c->vlen == 0);
        else if (r == VAL_TOO_LONG)
            err(LM_ERR_MODEL_TOO_LONG);
        return req_more(c, st);
    }
    st->scan_left -= f.stop - a;
    c->pos = wbase + f.stop;
    if (st->scan_left == 0) {
        if (!tail_scan(c, st)) {
            st->flags &= ~LM_F_AWAIT_MODEL;
            err(LM_ERR_SCAN_GAVE_UP);
        }
    } else if ((st->flags & LM_F_REQ_FRAMED) && (s32)(st->req_next - c->seq) <= (s32)c->pos) {
        st->flags &= ~LM_F_AWAIT_MODEL; /* the body ended: it had no "model" */
    } else if (final && c->pos >= c->len && n >= 8) {
        /* the body goes on in the next segment: its start may finish a key begun here */
        st->carry = rd64(s->win, n - 8) >> 8;
        st->flags |= LM_F_KEY_CARRY;
    }
    return req_more(c, st);
}

/* Where the body scan of this step looks: the window holds payload bytes from wbase (n of
 * them), key starts from win[a], body up to payload offset end. */
struct scan {
    u32 wbase;
    u32 a;
    u32 n;
    u32 end;
};

/* A request head starts at payload offset `at` (kind 0: the framing says so, check it):
 * queue the request, learn its framing from the head and plan the scan of the body's first
 * bytes, which share the window. Returns 1 when the plan is to scan now. */
static __always_inline int req_head(struct __sk_buff *skb, struct lm_scratch *s,
                                    struct lm_flow_state *st, u32 at, int kind,
                                    struct scan *sc) {
    struct lm_ctx *c = &s->c;
    struct head h = {};
    int cont = c->hcont;
    u32 n = load_head(skb, s, at, cont ? LM_WIN : st->req_win, &h);
    if (!cont) {
        if (!kind && n >= 8)
            kind = method_kind(rd64(s->win, 0));
        if (!kind) {
            /* the framing pointed here, but no request starts here */
            err(LM_ERR_FRAMING_LOST);
            lose_req(st);
            return 0;
        }
        push_request(st, seg_time(c), kind == 2);
        st->flags &= ~(LM_F_AWAIT_MODEL | LM_F_TAIL_SCAN | CARRIES);
        st->scan_left = LM_SCAN_LIMIT;
        c->hhas = 0;
        c->hchunked = 0;
        if (h.len)
            st->req_win = h.len + LM_BODY_PEEK < LM_WIN ? h.len + LM_BODY_PEEK : LM_WIN;
    }
    c->hcont = 0;
    if (!h.has_clen && c->hhas) {
        h.has_clen = 1;
        h.clen = c->hclen;
    }
    h.chunked |= c->hchunked;
    u32 line = LOAD(c->line);
    if (!h.len && line > 1 && at + n < c->len) {
        /* The head goes on past the window (openai-python's are ~650 bytes): the next
         * step parses on from the line end before the last line, which the window may
         * have cut. Within this segment only: a head cut by a segment end is not framed. */
        c->hcont = 1;
        c->hhas = h.has_clen;
        c->hclen = h.clen;
        c->hchunked = h.chunked;
        c->pos = at + line - 1;
        st->req_win = LM_WIN;
        return 0;
    }
    u32 end = c->len;
    if (h.len && !h.chunked) {
        st->req_next = c->seq + at + h.len + h.clen;
        st->flags |= LM_F_REQ_FRAMED;
        if (at + h.len + h.clen < end)
            end = at + h.len + h.clen;
    } else {
        st->flags &= ~LM_F_REQ_FRAMED;
    }
    /* a body (or, without framing, anything after the head) may carry "model"; without the
     * head's end in view the scan starts at the head */
    c->pos = at + h.len;
    if (h.len && !h.chunked && h.clen == 0)
        return 0;
    st->flags |= LM_F_AWAIT_MODEL;
    if (n > end - at)
        n = end - at;
    if (h.len >= n)
        return 0;
    sc->wbase = at;
    sc->a = h.len;
    sc->n = n;
    sc->end = end;
    return 1;
}

/* One step in the request direction: a head (with the start of its body), or a window of
 * a body still awaiting its model. Heavy functions have a single call site each, so clang
 * inlines one copy and the verifier walks their loops once. */
static __always_inline int req_step(struct __sk_buff *skb, struct lm_scratch *s,
                                    struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    struct scan sc = {};
    int kind = 0, framed_head = 0;
    u32 at = 0;
    if (st->flags & LM_F_UPGRADED)
        return 0;
    if (c->hcont) {
        at = c->pos; /* the rest of a head the last step began */
        framed_head = 1;
    } else if (!(st->flags & LM_F_REQ_FRAMED)) {
        /* without framing a head is recognised only at the start of a segment */
        if (c->steps == 1 && c->pos == 0)
            kind = method_kind(peek8(skb, c, 0));
        if (!kind) {
            if (!(st->flags & LM_F_AWAIT_MODEL))
                return 0;
            sc.end = c->len;
        }
    } else {
        s32 r = (s32)(st->req_next - c->seq);
        if (st->flags & LM_F_TAIL_SCAN) {
            tail_skip(c, st);
            if (c->pos >= c->len)
                return 0;
        }
        if (st->flags & LM_F_AWAIT_MODEL) {
            if (r > (s32)c->pos)
                sc.end = r < (s32)c->len ? (u32)r : c->len;
            else
                st->flags &= ~LM_F_AWAIT_MODEL; /* the body ended: it had no "model" */
        }
        if (!sc.end) {
            if (r < (s32)c->pos || r >= (s32)c->len)
                return 0;
            at = r;
            framed_head = 1;
        }
    }
    if (kind || framed_head) {
        if (!req_head(skb, s, st, at, kind, &sc))
            return c->hcont || req_more(c, st);
    } else {
        sc.n = load_win(skb, s, c->pos, sc.end);
        if (!sc.n) {
            lose_req(st);
            return 0;
        }
        sc.wbase = c->pos;
    }
    return model_scan(skb, s, st, sc.wbase, sc.a, sc.n, sc.end);
}

/* A request-direction segment: the entry program runs its first step itself (saves a tail
 * call, ~30 ns, on the common one-step segment), lm_req the further ones. */
static __always_inline int req_segment(struct __sk_buff *skb, struct lm_scratch *s) {
    struct lm_ctx *c = &s->c;
    struct lm_flow_state *st = inflight.lookup(&c->flow);
    if (c->steps == 0) {
        if (!st) {
            if (!method_kind(peek8(skb, c, 0)))
                return PASS;
            __builtin_memset(&s->fresh, 0, sizeof(s->fresh));
            s->fresh.req_hwm = c->seq;
            inflight.update(&c->flow, &s->fresh);
            st = inflight.lookup(&c->flow);
            if (!st)
                return PASS;
        }
        s32 d = (s32)(st->req_hwm - c->seq);
        if (d >= (s32)c->len)
            return finish(c, st, 1); /* a retransmission of bytes already parsed */
        if (d > 0) {
            c->pos = d;
        } else if (d < 0 && (!(st->flags & LM_F_REQ_FRAMED) ||
                             (s32)(st->req_next - c->seq) < 0)) {
            lose_req(st); /* bytes never seen held what the framing needed */
        }
        st->req_hwm = c->seq + c->len;
    }
    if (!st)
        return PASS;
    if (c->steps >= LM_MAX_STEPS) {
        err(LM_ERR_STEPS_EXHAUSTED);
        lose_req(st);
        return finish(c, st, 1);
    }
    c->steps++;
    if (req_step(skb, s, st))
        lm_steps.call(skb, STEP_REQ);
    return finish(c, st, 1);
}

int lm_req(struct __sk_buff *skb) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    return s ? req_segment(skb, s) : PASS;
}

/* ---- response direction ---- */

static __always_inline void lose_resp(struct lm_flow_state *st) {
    st->flags &= ~(LM_F_RESP_FRAMED | LM_F_RESP_CHUNKED);
}

static __always_inline int resp_more(struct lm_ctx *c, struct lm_flow_state *st) {
    if (!(st->flags & LM_F_RESP_FRAMED))
        return 0;
    s32 r = (s32)(st->resp_next - c->seq);
    return r >= (s32)c->pos && r < (s32)c->len;
}

/* Length of the hex chunk size at win[0..n) and its value in *size; through the scratch
 * so the digit count is not a per-path constant for the verifier. */
static __always_inline u32 hex_size(struct lm_scratch *s, u32 n, u64 *size) {
    u64 v = 0;
    s->c.cur = 0;
    for (int j = 0; j < 9; j++) {
        if (j >= n)
            break;
        u8 ch = s->win[j];
        u8 lo = ch | 0x20;
        if (ch >= '0' && ch <= '9')
            v = v * 16 + (ch - '0');
        else if (lo >= 'a' && lo <= 'f')
            v = v * 16 + (lo - 'a' + 10);
        else
            break;
        s->c.cur = j + 1;
    }
    *size = v;
    return LOAD(s->c.cur);
}

/* Follows chunk-size lines from resp_next while they are in this segment. Returns 1 when
 * a further step is needed (more chunk lines, or the next response head), else 0. */
static __always_inline int chunk_hops(struct __sk_buff *skb, struct lm_scratch *s,
                                      struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    for (int i = 0; i < LM_CHUNK_HOPS; i++) {
        s32 r = (s32)(st->resp_next - c->seq);
        if (r < (s32)c->pos || r >= (s32)c->len)
            return 0;
        u32 n = load_win(skb, s, r, r + 12 < c->len ? r + 12 : c->len);
        u64 size = 0;
        u32 j = hex_size(s, n, &size);
        /* a chunk-size line cut by the segment end, with extensions, or malformed */
        if (j == 0 || j + 2 > n || rd8(s->win, j) != '\r' || rd8(s->win, j + 1) != '\n' ||
            size > 0x7fffffff) {
            err(LM_ERR_FRAMING_LOST);
            lose_resp(st);
            return 0;
        }
        c->pos = r;
        if (size == 0) {
            /* last chunk and the empty line ending the (trailer-less) body */
            st->resp_next = c->seq + r + j + 4;
            st->flags &= ~LM_F_RESP_CHUNKED;
            return resp_more(c, st);
        }
        st->resp_next = c->seq + r + j + 2 + (u32)size + 2;
    }
    return resp_more(c, st);
}

static __always_inline int resp_head(struct __sk_buff *skb, struct lm_scratch *s,
                                     struct lm_flow_state *st, u32 at) {
    struct lm_ctx *c = &s->c;
    u32 n = load_win(skb, s, at, at + 16 < c->len ? at + 16 : c->len);
    const u8 *w = s->win;
    u8 d0 = rd8(w, 9), d1 = rd8(w, 10), d2 = rd8(w, 11);
    if (n < 13 || !is_status_line(rd64(w, 0)) || rd8(w, 8) != ' ' || d0 < '1' || d0 > '5' ||
        d1 < '0' || d1 > '9' || d2 < '0' || d2 > '9') {
        err(LM_ERR_FRAMING_LOST);
        lose_resp(st);
        return 0;
    }
    u16 status = (d0 - '0') * 100 + (d1 - '0') * 10 + (d2 - '0');
    int interim = status < 200 && status != 101; /* 100 Continue and friends */
    int head_req = 0;
    if (!interim) {
        if (st->tail != st->head) {
            u32 slot = st->head & (LM_PIPE_DEPTH - 1);
            head_req = (st->head_mask >> slot) & 1;
            record(c, st->ring[slot].model_id, status, seg_time(c) - st->ring[slot].start_ns);
            st->head++;
        } else if (st->overflow) {
            record(c, 0, status, seg_time(c) - st->overflow_ns);
            st->overflow--;
        } else {
            err(LM_ERR_RESP_NO_REQ);
        }
    }
    if (status == 101) {
        st->flags |= LM_F_UPGRADED;
        return 0;
    }
    if (!interim && st->tail == st->head && !st->overflow) {
        /* Nothing else is outstanding, so the next response starts in a later segment: a
         * client that does not pipeline sends its next request only once this answer has
         * arrived. This head's framing (and its chunks) need not be followed; should a
         * pipelined request come before the answer ends, resp_step searches the segments
         * for the next status line instead. Saves most of the work on each response. */
        lose_resp(st);
        return 0;
    }
    struct head h = {};
    load_head(skb, s, at, st->resp_win, &h);
    if (!h.len) {
        lose_resp(st);
        return 0;
    }
    st->resp_win = h.len + 16 < LM_WIN ? h.len + 16 : LM_WIN;
    u32 body = at + h.len;
    st->flags = (st->flags | LM_F_RESP_FRAMED) & ~LM_F_RESP_CHUNKED;
    if (interim || head_req || status == 204 || status == 304) {
        st->resp_next = c->seq + body;
    } else if (h.chunked) {
        st->resp_next = c->seq + body;
        st->flags |= LM_F_RESP_CHUNKED;
    } else if (h.has_clen) {
        st->resp_next = c->seq + body + h.clen;
    } else {
        lose_resp(st); /* delimited by the connection's close: nothing follows */
        return 0;
    }
    c->pos = body;
    return resp_more(c, st);
}

/* Unframed, with requests outstanding (a pipelining client, see resp_head): searches the
 * rest of the segment, a window per step, for a status line. Returns its offset, or -1
 * with c->pos moved past what was searched. */
static __always_inline int status_scan(struct __sk_buff *skb, struct lm_scratch *s) {
    struct lm_ctx *c = &s->c;
    u32 n = load_win(skb, s, c->pos, c->len);
    if (!n) {
        c->pos = c->len;
        return -1;
    }
    struct found f = find_key(s, 0, n, n, c->pos + n >= c->len, 'H', HTTP7, 0);
    if (f.at >= 0)
        return c->pos + f.at;
    c->pos += f.stop;
    return -1;
}

/* One step in the response direction: a run of chunk-size lines, a window of status line
 * search, or one response head; resp_head has a single call site, for the verifier. */
static __always_inline int resp_step(struct __sk_buff *skb, struct lm_scratch *s,
                                     struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    u32 at = 0;
    if (st->flags & LM_F_UPGRADED)
        return 0;
    if (!(st->flags & LM_F_RESP_FRAMED)) {
        /* a head is recognised at the start of a segment, and anywhere in it while a
         * pipelining client has requests outstanding */
        if (c->steps != 1 || c->pos != 0 || !is_status_line(peek8(skb, c, 0))) {
            if (st->tail == st->head && !st->overflow)
                return 0;
            int r = status_scan(skb, s);
            if (r < 0)
                return c->pos < c->len;
            at = r;
        }
    } else {
        if (st->flags & LM_F_RESP_CHUNKED)
            return chunk_hops(skb, s, st);
        s32 r = (s32)(st->resp_next - c->seq);
        if (r < (s32)c->pos || r >= (s32)c->len)
            return 0;
        at = r; /* resp_head checks that a status line starts there */
    }
    return resp_head(skb, s, st, at);
}

/* A response-direction segment: like req_segment. */
static __always_inline int resp_segment(struct __sk_buff *skb, struct lm_scratch *s) {
    struct lm_ctx *c = &s->c;
    struct lm_flow_state *st = inflight.lookup(&c->flow);
    if (!st) {
        if (c->steps == 0 && is_status_line(peek8(skb, c, 0)))
            err(LM_ERR_RESP_NO_REQ);
        return PASS;
    }
    if (c->steps == 0) {
        if (!(st->flags & LM_F_RESP_SYNCED)) {
            if (!is_status_line(peek8(skb, c, 0)))
                return finish(c, st, 0);
            st->resp_hwm = c->seq;
            st->flags |= LM_F_RESP_SYNCED;
        }
        s32 d = (s32)(st->resp_hwm - c->seq);
        if (d >= (s32)c->len)
            return finish(c, st, 0);
        if (d > 0) {
            c->pos = d;
        } else if (d < 0 && (!(st->flags & LM_F_RESP_FRAMED) ||
                             (s32)(st->resp_next - c->seq) < 0)) {
            lose_resp(st);
        }
        st->resp_hwm = c->seq + c->len;
    }
    if (c->steps >= LM_MAX_STEPS) {
        err(LM_ERR_STEPS_EXHAUSTED);
        lose_resp(st);
        return finish(c, st, 0);
    }
    c->steps++;
    if (resp_step(skb, s, st))
        lm_steps.call(skb, STEP_RESP);
    return finish(c, st, 0);
}

int lm_resp(struct __sk_buff *skb) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    return s ? resp_segment(skb, s) : PASS;
}

/* ---- entry: L2-L4 and dispatch ---- */

/* Copies a header into *dst: straight from the skb's linear data, where the headers nearly
 * always are, else with bpf_skb_load_bytes (which also reads paged data, but costs a helper
 * call each time). Returns 0 on success. */
#define COPY_HDR(skb, off, dst)                                                              \
    ({                                                                                       \
        u8 *data_ = (u8 *)(long)(skb)->data;                                                 \
        u8 *at_ = data_ + (off);                                                             \
        int rc_ = 0;                                                                         \
        if (at_ + sizeof(*(dst)) <= (u8 *)(long)(skb)->data_end)                             \
            __builtin_memcpy((dst), at_, sizeof(*(dst)));                                    \
        else                                                                                 \
            rc_ = bpf_skb_load_bytes((skb), (off), (dst), sizeof(*(dst)));                   \
        rc_;                                                                                 \
    })

static __always_inline void mapped_v4(__u8 *dst, __be32 addr) {
    u32 *d = (u32 *)dst;
    d[0] = 0;
    d[1] = 0;
    d[2] = bpf_htonl(0xffff);
    d[3] = addr;
}

static __always_inline int entry(struct __sk_buff *skb, u32 l3) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    if (!s)
        return PASS;
    struct lm_ctx *c = &s->c;
    u32 l4, ip_end;
    __u8 src[16], dst[16];
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr ip;
        if (COPY_HDR(skb, l3, &ip) < 0)
            return PASS;
        if (ip.protocol != IPPROTO_TCP || (ip.frag_off & bpf_htons(0x3fff)))
            return PASS;
        if (ip.ihl < 5)
            return PASS;
        l4 = l3 + ip.ihl * 4;
        u32 tot = bpf_ntohs(ip.tot_len);
        ip_end = tot ? l3 + tot : skb->len; /* 0: a BIG TCP packet */
        mapped_v4(src, ip.saddr);
        mapped_v4(dst, ip.daddr);
    } else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (COPY_HDR(skb, l3, &ip6) < 0)
            return PASS;
        if (ip6.nexthdr != IPPROTO_TCP) /* extension headers before TCP: not followed */
            return PASS;
        l4 = l3 + sizeof(ip6);
        u32 plen = bpf_ntohs(ip6.payload_len);
        ip_end = plen ? l4 + plen : skb->len;
        __builtin_memcpy(src, &ip6.saddr, 16);
        __builtin_memcpy(dst, &ip6.daddr, 16);
    } else {
        return PASS;
    }
    struct tcphdr th;
    if (COPY_HDR(skb, l4, &th) < 0)
        return PASS;
    u16 sport = bpf_ntohs(th.source), dport = bpf_ntohs(th.dest);
    int dir;
    if (serving(dport))
        dir = STEP_REQ;
    else if (serving(sport))
        dir = STEP_RESP;
    else
        return PASS;

    struct lm_flow *f = &c->flow;
    if (dir == STEP_REQ) {
        __builtin_memcpy(f->client, src, 16);
        __builtin_memcpy(f->server, dst, 16);
        f->client_port = sport;
        f->server_port = dport;
    } else {
        __builtin_memcpy(f->client, dst, 16);
        __builtin_memcpy(f->server, src, 16);
        f->client_port = dport;
        f->server_port = sport;
    }
    f->proto = IPPROTO_TCP;
    f->pad[0] = f->pad[1] = f->pad[2] = 0;

    if (th.syn) {
        /* a new connection on this 5-tuple starts from a clean state */
        if (dir == STEP_REQ && !th.ack)
            inflight.delete(f);
        return PASS;
    }
    u32 poff = l4 + th.doff * 4;
    if (ip_end > skb->len)
        ip_end = skb->len;
    c->len = ip_end > poff ? ip_end - poff : 0;
    c->fin = th.fin;
    c->rst = th.rst;
    if (c->len == 0) {
        if (c->fin || c->rst) {
            struct lm_flow_state *st = inflight.lookup(f);
            if (st)
                close_flow(c, st, dir == STEP_REQ);
        }
        return PASS;
    }
    c->poff = poff;
    c->seq = bpf_ntohl(th.seq);
    c->pos = 0;
    c->steps = 0;
    c->hcont = 0;
    c->now = 0;
#ifdef LM_ENTRY_TAILCALL
    /* for verifiers that refuse the entry program with the first step inline (see loader) */
    lm_steps.call(skb, dir);
    return PASS;
#else
    return dir == STEP_REQ ? req_segment(skb, s) : resp_segment(skb, s);
#endif
}

/* Interfaces with an Ethernet header (Ethernet, veth, loopback). */
int lm_tc_eth(struct __sk_buff *skb) {
    return entry(skb, ETH_HLEN);
}

/* Interfaces whose packets start at the IP header (WireGuard, tun). */
int lm_tc_raw(struct __sk_buff *skb) {
    return entry(skb, 0);
}

