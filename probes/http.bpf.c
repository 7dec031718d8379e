/* loadmesh HTTP/1 probe for LLM serving: a TC classifier on the configured interfaces.
 *
 * It never changes a packet and always returns PASS (TC_ACT_UNSPEC). Per TCP segment to or
 * from a serving port it follows HTTP/1 framing (heads, Content-Length bodies, chunked
 * bodies) by TCP sequence number, so keep-alive and pipelined requests are counted once
 * each and retransmissions not at all. Per request it measures, on the wire: time to the
 * answer's first byte, to a stream's first SSE data: event (first token), the gaps between
 * events (inter-token latency), to the answer's last byte; the tokens (data: events, or the
 * answer's "usage" object); the endpoint (the request path) and the model (the request
 * body's JSON "model"); and how the request ended. See docs/probes.md.
 *
 * Parsing goes in steps of one unit of work each (a head, a window of body search, a run
 * of chunk lines, an answer's end); each step is a tail call, so each program stays small
 * enough for the verifier. BCC 0.26 inlines every function (BPF-to-BPF calls fail to load),
 * hence __always_inline. Pure parsing lives in http_parse.h (an #include). What touches
 * maps is in the .bpf.c parts, which the loader joins into one text in this order, each
 * behind a #line naming its file: this one (the maps, the steps, small helpers),
 * http_record.bpf.c (what a request leaves in the maps), http_request.bpf.c,
 * http_response.bpf.c, http_sse.bpf.c, http_entry.bpf.c (the programs TC runs), then
 * tcpstats.bpf.c. One text, not #includes: BCC rewrites map calls (`m.lookup(&k)`) and
 * generates tracepoint argument structs only in its main source.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/tcp.h>
#include "loadmesh.h"
#include "http_parse.h"

#if !defined(LM_INFLIGHT_ENTRIES) || !defined(LM_FP_ENTRIES) || !defined(LM_ROWS) ||      \
    !defined(LM_MODEL_ENTRIES) || !defined(LM_PORT_ENTRIES) || !defined(LM_SCAN_LIMIT) || \
    !defined(LM_HIST_SUB_BITS) || !defined(LM_HIST_MAX_EXP) || !defined(LM_HIST_BUCKETS)
#error "probes/loader.py passes map sizes, the scan limit and the histogram layout with -D"
#endif

/* What every TC program returns: TC_ACT_UNSPEC lets the classifier chain go on to the next
 * filter (TC_ACT_OK would end it and skip, say, a CNI's filter behind ours). */
#define PASS TC_ACT_UNSPEC

/* The tail-called programs, indexes of lm_steps: each holds at most one long loop, which
 * the verifier walks iteration by iteration (BCC cannot give it bpf_loop callbacks). */
#define STEP_REQ 0   /* lm_req: a request head and the first body bytes in its window */
#define STEP_RESP 1  /* lm_resp: a response head, chunk lines, an answer's end */
#define STEP_SSE 2   /* lm_sse: a window of a streamed answer's events */
#define STEP_BODY 3  /* lm_body: a window of a request body's search for "model" */
#define STEP_CLOSE 4 /* lm_close: the connection ended */
#define STEP_USAGE 5 /* lm_usage: an answer's "usage" object */
#define STEP_NONE -1
#define AFTER_END 6 /* lm_ctx.uafter only: lm_usage ends the answer, then goes on */
#define NOWHERE 0xffffffffU
/* lm_ctx.kind: what a data: event is */
#define EV_TOKEN 0
#define EV_DONE 1
#define EV_ERROR 2 /* lm_ctx.aend: the answer does not end in this segment */

/* ---- maps: every one bounded; the sizes' reasons are in docs/probes.md ---- */

/* Serving ports as a 65536-bit bitmap: testing a port is one array lookup the JIT inlines,
 * cheaper than a hash lookup on every packet of the interface. User space flips bits to
 * change the port list without a recompile. Bounded by the port space (8 KiB). */
BPF_ARRAY(serving_ports, u64, 1024);

/* HTTP state per connection. LRU, so connections that vanish without FIN or RST are
 * evicted by newer ones instead of filling the map; one entry per live connection. */
BPF_TABLE("lru_hash", struct lm_flow, struct lm_flow_state, inflight, LM_INFLIGHT_ENTRIES);

/* Per flow, model and status: count and time to first byte. One copy for all CPUs (a GPU
 * host has 100-400): a flow's answers leave from one CPU at a time, so the atomic adds do
 * not contend, and the map's size does not grow with the CPUs. LRU: the kernel drops the
 * least recently answered rows when full, so nothing in user space reads it to expire
 * them; it is read only for a dump (`loadmesh dump`). */
BPF_TABLE("lru_hash", struct lm_fp_key, struct lm_fp_val, fingerprints, LM_FP_ENTRIES);

/* The model figures, one row per model, serving port, endpoint and status: outcomes,
 * usage and a latency histogram of each kind (struct lm_row). An answer resolves its row
 * once, at its head (row_index), and keeps the index in its connection's state, so its
 * samples and its end are array accesses the JIT inlines, not hash lookups (each of which
 * cost about 60 ns a request on wrk's traffic, cold caches and all: docs/probes.md).
 * One copy for all CPUs, counted with atomic adds: its size does not grow with the CPUs,
 * and user space reads it four times a second. A new row takes its index from
 * `free_rows`, which the loader fills with the indexes below LM_ROWS: no two CPUs get one
 * index, and none is lost when two make the same row at once (the slower puts its index
 * back). Rows are never freed (counters are cumulative). */
BPF_F_TABLE("hash", struct lm_row_key, u32, rows, LM_ROWS + LM_SPARE_ROWS, 0);
BPF_ARRAY(row_data, struct lm_row, LM_ROWS + LM_SPARE_ROWS);
BPF_QUEUE(free_rows, u32, LM_ROWS);
BPF_QUEUE(spare_rows, u32, LM_SPARE_ROWS); /* for model-less rows only: see new_row */

/* Rows this CPU resolved lately, direct-mapped by the key's bits: spares the `rows` lookup
 * at an answer's head, nearly always (a host serves a few models, endpoints and statuses).
 * A collision only costs that lookup. */
#define ROW_SLOT_BITS 6
#define ROW_SLOTS (1 << ROW_SLOT_BITS)
BPF_PERCPU_ARRAY(row_cache, struct lm_row_slot, ROW_SLOTS);

/* model_id -> name, written once per model; bounded by the models a host serves. */
BPF_HASH(models, u64, struct lm_model_name, LM_MODEL_ENTRIES);

/* Model ids known to be in `models`, per CPU and direct-mapped by the id's low bits: spares
 * the hash lookup for a known name, nearly always. A collision only costs that lookup. */
#define NAMED_SLOTS 64
BPF_PERCPU_ARRAY(named, u64, NAMED_SLOTS);

/* LM_ERR_* counters. */
BPF_PERCPU_ARRAY(errors, u64, LM_ERR_COUNT);

/* TCP events per serving port (tracepoints: tcpstats.bpf.c); bounded by the number of ports. */
BPF_F_TABLE("percpu_hash", u32, struct lm_port_stats, port_stats, LM_PORT_ENTRIES, 0);

BPF_PERCPU_ARRAY(scratch, struct lm_scratch, 1);

BPF_PROG_ARRAY(lm_steps, 6);

/* ---- small helpers ---- */

static __always_inline void err(u32 idx) {
    u64 *v = errors.lookup(&idx);
    if (v)
        *v += 1;
}

static __always_inline int serving(u16 port) {
    u32 k = port >> 6;
    u64 *w = serving_ports.lookup(&k);
    return w && ((*w >> (port & 63)) & 1);
}

/* The segment's time: the stamp it came with (stamped(), http_entry.bpf.c), else the
 * clock's, read on first use: only heads and events need it, and the clock costs about as
 * much as the flow lookup. */
static __always_inline u64 seg_time(struct lm_ctx *c) {
    if (!c->now)
        c->now = bpf_ktime_get_ns();
    return c->now;
}

/* Copies payload bytes [pos, min(end, pos + LM_WIN)) into the window; returns how many. */
static __always_inline u32 load_win(struct __sk_buff *skb, struct lm_scratch *s, u32 pos,
                                    u32 end) {
    s->c.wlen = 0; /* what resp_head copied is overwritten */
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

/* The same, up to a body window (LM_BWIN). */
static __always_inline u32 load_bwin(struct __sk_buff *skb, struct lm_scratch *s, u32 pos,
                                     u32 end) {
    s->c.wlen = 0; /* what resp_head copied is overwritten */
    if (pos >= end)
        return 0;
    u64 n = end - pos;
    if (n > LM_BWIN)
        n = LM_BWIN;
    asm volatile("" : "+r"(n));
    n = ((n - 1) & BMASK) + 1;
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
        h->ctype = 0;
    }
    return n;
}
