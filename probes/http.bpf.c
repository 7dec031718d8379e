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
 * hence __always_inline. Pure parsing lives in http_parse.h; what touches maps is here, the
 * one source BCC rewrites map calls in. The loader compiles this file followed by
 * tcpstats.bpf.c as one text: BCC generates tracepoint argument structs only for its main
 * source, so the tracepoints cannot come in through an #include.
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

#if !defined(LM_INFLIGHT_ENTRIES) || !defined(LM_FP_ENTRIES) || !defined(LM_HIST_ENTRIES) || \
    !defined(LM_MODEL_ENTRIES) || !defined(LM_PORT_ENTRIES) || !defined(LM_SCAN_LIMIT) ||   \
    !defined(LM_HIST_SUB_BITS) || !defined(LM_HIST_MAX_EXP) || !defined(LM_REQ_ENTRIES)
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

/* Latency histograms per model, serving port, endpoint, status and kind: only touched
 * buckets exist, so the size bounds what is in use (a model's latencies span a few powers
 * of two). One copy for all CPUs, counted with atomic adds: its size does not grow with the
 * CPUs, and user space reads it four times a second. Preallocated, as fingerprints. */
BPF_F_TABLE("hash", struct lm_hist_key, u64, histograms, LM_HIST_ENTRIES, 0);

/* Per model, port and endpoint: outcomes and usage tokens of ended requests (atomic adds,
 * one copy for all CPUs, as histograms). Bounded by models x ports x endpoints. */
BPF_F_TABLE("hash", struct lm_req_key, struct lm_req_stats, requests, LM_REQ_ENTRIES, 0);

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

/* The segment's time, read on first use: only heads and events need it, and the clock
 * costs about as much as the flow lookup. */
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

/* ---- recording ---- */

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

/* n samples of latency lat (ns) of one kind for the answer being sent. */
static __always_inline void sample(struct lm_ctx *c, struct lm_flow_state *st, u8 kind,
                                   u64 lat, u64 n) {
    /* through the scratch: lm_bucket's 64 paths leave one state behind */
    c->cur = lm_bucket(lat);
    struct lm_hist_key hk = {.model_id = st->ans_model, .status = st->status,
                             .bucket = LOAD(c->cur), .port = c->flow.server_port,
                             .kind = kind, .endpoint = st->ans_ep};
    u64 *hv = histograms.lookup(&hk);
    if (!hv) {
        u64 zero = 0;
        histograms.update(&hk, &zero);
        hv = histograms.lookup(&hk);
    }
    if (hv)
        __sync_fetch_and_add(hv, n);
    else
        err(LM_ERR_HIST_FULL);
}

/* The flow's row: one more answer of this model and status, with its time to first byte. */
static __always_inline void record_flow(struct lm_ctx *c, u64 model, u16 status, u64 lat) {
    struct lm_fp_key k = {};
    __builtin_memcpy(&k.flow, &c->flow, sizeof(k.flow));
    k.model_id = model;
    k.status = status;
    struct lm_fp_val *v = fingerprints.lookup(&k);
    if (!v) {
        /* A new row is born with its first answer: one map operation, not three. */
        struct lm_fp_val first = {.count = 1, .lat_sum_ns = lat, .lat_max_ns = lat,
                                  .last_ns = c->now};
        if (!fingerprints.insert(&k, &first))
            return;
        v = fingerprints.lookup(&k); /* another CPU made it meanwhile */
        if (!v) {
            err(LM_ERR_FP_FULL);
            return;
        }
    }
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->lat_sum_ns, lat);
    /* Racy across CPUs (a larger max written at once elsewhere may be lost), as last_ns:
     * both are for the operator's eye, no figure depends on them. */
    if (lat > v->lat_max_ns)
        v->lat_max_ns = lat;
    v->last_ns = c->now;
}

static __always_inline struct lm_req_stats *req_stats(u64 model, u16 port, u8 ep) {
    struct lm_req_key k = {.model_id = model, .port = port, .endpoint = ep};
    struct lm_req_stats *v = requests.lookup(&k);
    if (!v) {
        struct lm_req_stats zero = {};
        requests.update(&k, &zero);
        v = requests.lookup(&k);
        if (!v)
            err(LM_ERR_REQUESTS_FULL);
    }
    return v;
}

/* A request that ended with no answer begun: it has no latency, only an outcome. */
static __always_inline void count_ended(u64 model, u16 port, u8 ep, u32 outcome, u64 n) {
    struct lm_req_stats *v = req_stats(model, port, ep);
    if (v)
        __sync_fetch_and_add(&v->outcomes[outcome % LM_OUT_COUNT], n);
}

/* ---- the request queue of a connection ---- */

static __always_inline void push_request(struct lm_flow_state *st, u64 now, int is_head, u8 ep) {
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
    st->ep[slot] = ep;
    if (st->tail == st->head) { /* the oldest outstanding now: see lm_flow_state.ans_model */
        st->ans_model = 0;
        st->ans_ep = ep;
    }
    if (is_head)
        st->head_mask |= 1 << slot;
    else
        st->head_mask &= ~(1 << slot);
    st->tail++;
}

/* The answer being sent ends: its latency to the last byte (when known: not after its
 * framing was lost), its outcome and usage, and its request leaves the queue. */
static __always_inline void end_answer(struct lm_ctx *c, struct lm_flow_state *st, u32 outcome,
                                       int timed) {
    if (!(st->aflags & LM_A_ACTIVE))
        return;
    u64 e2e = timed ? seg_time(c) - st->ans_start : 0;
    u8 kind = LM_HK_E2E;
    if (st->aflags & LM_A_TTFB) {
        /* resp_head put the ttfb off (event_ns: the head's time): one sample for both
         * when the answer ended at that same instant */
        if (timed && c->now == st->event_ns)
            kind = LM_HIST_TTFB_E2E;
        else
            sample(c, st, LM_HK_TTFB, st->event_ns - st->ans_start, 1);
    }
    if (timed)
        sample(c, st, kind, e2e, 1);
    if ((st->aflags & LM_A_ERROR) && outcome == LM_OUT_COMPLETE)
        outcome = LM_OUT_ERROR;
    struct lm_req_stats *v = req_stats(st->ans_model, c->flow.server_port, st->ans_ep);
    if (v) {
        __sync_fetch_and_add(&v->outcomes[outcome % LM_OUT_COUNT], 1);
        if (st->aflags & LM_A_USAGE) {
            __sync_fetch_and_add(&v->usage_answers, 1);
            __sync_fetch_and_add(&v->usage_events, st->events);
            __sync_fetch_and_add(&v->output_tokens, st->out_tokens);
        }
        if (st->in_tokens)
            __sync_fetch_and_add(&v->prompt_tokens, st->in_tokens);
        if (timed) {
            __sync_fetch_and_add(&v->e2e_ns, e2e);
            __sync_fetch_and_add(&v->e2e_tokens,
                                 (st->aflags & LM_A_USAGE) ? st->out_tokens : st->events);
        }
    }
    if (st->tail != st->head)
        st->head++;
    else if (st->overflow)
        st->overflow--;
    st->aflags = 0;
    if (st->tail != st->head) { /* the next request is the oldest outstanding now */
        u32 slot = st->head & (LM_PIPE_DEPTH - 1);
        st->ans_model = st->ring[slot].model_id;
        st->ans_ep = st->ep[slot];
    }
}

/* The connection ends: RST either way, or a FIN. The answer being sent and every request
 * still queued end with it, by who ended it first. A client's FIN ends its requests too:
 * HTTP clients do not half-close, they close when they give up (a timeout, a stream read
 * no further), and the answers that may still come are for no one. The state goes when
 * nothing more can come (RST, or the server's FIN); until then an answer to no request is
 * expected, not an error. */
static __always_inline void close_flow(struct lm_ctx *c, struct lm_flow_state *st,
                                       int from_client) {
    if (!c->rst)
        st->flags |= from_client ? LM_F_FIN_CLIENT : LM_F_FIN_SERVER;
    int by_client = (st->flags & LM_F_FIN_CLIENT) || (c->rst && from_client);
    u16 port = c->flow.server_port;
    if (st->aflags & LM_A_ACTIVE) {
        u32 outcome = by_client ? LM_OUT_ABORTED : LM_OUT_TRUNCATED;
        if ((st->aflags & LM_A_DONE) ||
            ((st->aflags & LM_A_CLOSE) && !from_client && !c->rst))
            outcome = LM_OUT_COMPLETE; /* the stream had ended, or this FIN ends the body */
        end_answer(c, st, outcome, outcome == LM_OUT_COMPLETE);
    }
    u32 queued = by_client ? LM_OUT_ABORTED : LM_OUT_UNANSWERED;
#pragma unroll
    for (int i = 0; i < LM_PIPE_DEPTH; i++) {
        if (st->head + i == st->tail)
            break;
        u32 slot = (st->head + i) & (LM_PIPE_DEPTH - 1);
        count_ended(st->ring[slot].model_id, port, st->ep[slot], queued, 1);
    }
    if (st->overflow)
        count_ended(0, port, LM_EP_OTHER, queued, st->overflow);
    st->head = st->tail;
    st->overflow = 0;
    /* what the server may still send belongs to no request: nothing to frame */
    st->flags &= ~(LM_F_RESP_FRAMED | LM_F_RESP_CHUNKED);
    if (c->rst || !from_client)
        inflight.delete(&c->flow);
}

/* Every step ends here: the next step of the segment, if any, then the connection's end
 * when the segment carried FIN or RST. */
static __always_inline int dispatch(struct __sk_buff *skb, struct lm_ctx *c, int next) {
    if (next >= 0)
        lm_steps.call(skb, next);
    if (c->fin || c->rst)
        lm_steps.call(skb, STEP_CLOSE);
    return PASS;
}

/* ---- request direction ---- */

#define CARRIES (LM_F_KEY_CARRY | LM_F_VAL_CARRY)

static __always_inline void lose_req(struct lm_flow_state *st) {
    if (st->flags & LM_F_VAL_CARRY)
        err(LM_ERR_MODEL_LOST);
    st->flags &= ~(LM_F_REQ_FRAMED | LM_F_AWAIT_MODEL | LM_F_TAIL_SCAN | CARRIES);
}

/* The newest request gets the model; one that overflowed the ring keeps model 0. The
 * name goes to `models` once, copied from the packet (the window holds payload from wbase);
 * a value that began in an earlier segment (name_here 0) leaves that to a later request. */
static __always_inline void set_model(struct __sk_buff *skb, struct lm_scratch *s,
                                      struct lm_flow_state *st, u64 id, u32 wbase,
                                      int name_here) {
    if (!st->overflow && st->tail != st->head) {
        st->ring[(st->tail - 1) & (LM_PIPE_DEPTH - 1)].model_id = id;
        if (st->tail - 1 == st->head && !(st->aflags & LM_A_ACTIVE))
            st->ans_model = id; /* the oldest outstanding, its answer not begun */
    }
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

/* In the tail scan, moves c->pos past the body bytes before its last LM_SCAN_LIMIT. */
static __always_inline void tail_skip(struct lm_ctx *c, struct lm_flow_state *st) {
    s32 from = (s32)(st->req_next - LM_SCAN_LIMIT - c->seq);
    if (from > (s32)c->pos) {
        c->pos = from < (s32)c->len ? (u32)from : c->len;
        st->flags &= ~CARRIES; /* what they carried does not continue here */
    }
}

/* The body's first LM_SCAN_LIMIT bytes held no "model": when the end is known
 * (Content-Length), its last LM_SCAN_LIMIT bytes are searched too (openai-python writes
 * "model" after "messages"). Returns 0 when there is nothing left to search. */
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

/* What the rest of this segment holds in the request direction: the rest of a long head
 * or a new head (STEP_REQ), body bytes to search for "model" (STEP_BODY), or nothing. */
static __always_inline int req_more(struct lm_ctx *c, struct lm_flow_state *st) {
    if (c->pos >= c->len)
        return STEP_NONE;
    if (c->hcont)
        return STEP_REQ;
    if (!(st->flags & LM_F_REQ_FRAMED))
        return (st->flags & LM_F_AWAIT_MODEL) ? STEP_BODY : STEP_NONE;
    s32 r = (s32)(st->req_next - c->seq);
    if ((st->flags & LM_F_AWAIT_MODEL) && r > (s32)c->pos)
        return STEP_BODY;
    return r >= (s32)c->pos && r < (s32)c->len ? STEP_REQ : STEP_NONE;
}

/* One window of the newest request's body scan: window holds payload bytes from wbase,
 * n of them; the scan looks at key starts from win[a] up to the body end. */
static __always_inline int model_scan(struct __sk_buff *skb, struct lm_scratch *s,
                                      struct lm_flow_state *st, u32 wbase, u32 a, u32 n,
                                      u32 end, const int iters) {
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
        u32 j = bridged(s, st->carry, n, KEY7, 7);
        if (j)
            from = j;
    }
    if (from < 0) {
        carry = 0;
        f = find_token(s, a, lim, n, final, KEY7, LOW(7), 7, iters);
        if (f.at >= 0)
            from = f.at + 7;
    }
    if (from >= 0) {
        u64 id = 0;
        int r = parse_value(s, from, n, &id);
        if (r == VAL_CUT && !carry && !final && (f.at > (int)a || n < LM_BWIN)) {
            /* the value runs past the window, and a window from the key holds more */
            st->scan_left -= f.at - a;
            c->pos = wbase + f.at;
            return STEP_BODY;
        }
        if (r == VAL_INVALID && f.at >= 0) {
            /* a "model" key with no string value: not the request's, search on after it */
            st->scan_left -= f.at + 7 - a;
            c->pos = wbase + f.at + 7;
            return req_more(c, st);
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
        st->carry = brd64(s->win, n - 8) >> 8;
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
 * queue the request with its endpoint, learn its framing from the head and plan the scan
 * of the body's first bytes, which share the window. Returns 1 when the plan is to scan
 * now. */
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
        u8 ep = kind == 3 ? endpoint_of(s->win, n) : LM_EP_OTHER;
        push_request(st, seg_time(c), kind == 2, ep);
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

/* One step in the request direction: a head, with the start of its body when the window
 * holds it. Returns the next step. */
static __always_inline int req_step(struct __sk_buff *skb, struct lm_scratch *s,
                                    struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    struct scan sc = {};
    int kind = 0;
    u32 at = 0;
    if (st->flags & LM_F_UPGRADED)
        return STEP_NONE;
    if (c->hcont) {
        at = c->pos; /* the rest of a head the last step began */
    } else if (!(st->flags & LM_F_REQ_FRAMED)) {
        /* without framing a head is recognised only at the start of a segment */
        if (c->steps == 1 && c->pos == 0)
            kind = method_kind(peek8(skb, c, 0));
        if (!kind)
            return (st->flags & LM_F_AWAIT_MODEL) ? STEP_BODY : STEP_NONE;
    } else {
        s32 r = (s32)(st->req_next - c->seq);
        if (st->flags & LM_F_AWAIT_MODEL) {
            if (r > (s32)c->pos)
                return STEP_BODY; /* the body before the next head */
            st->flags &= ~LM_F_AWAIT_MODEL;
        }
        if (r < (s32)c->pos || r >= (s32)c->len)
            return STEP_NONE;
        at = r;
    }
    if (!req_head(skb, s, st, at, kind, &sc))
        return req_more(c, st);
    return model_scan(skb, s, st, sc.wbase, sc.a, sc.n, sc.end, WIN_ITERS);
}

/* One window of the body of the newest request, searched for "model". */
static __always_inline int body_step(struct __sk_buff *skb, struct lm_scratch *s,
                                     struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    u32 end = c->len;
    if (st->flags & LM_F_REQ_FRAMED) {
        if (st->flags & LM_F_TAIL_SCAN) {
            tail_skip(c, st);
            if (c->pos >= c->len)
                return STEP_NONE;
        }
        s32 r = (s32)(st->req_next - c->seq);
        if (r <= (s32)c->pos) {
            st->flags &= ~LM_F_AWAIT_MODEL; /* the body ended: it had no "model" */
            return req_more(c, st);
        }
        if (r < (s32)c->len)
            end = r;
    }
    u32 n = load_bwin(skb, s, c->pos, end);
    if (!n) {
        lose_req(st);
        return STEP_NONE;
    }
    return model_scan(skb, s, st, c->pos, 0, n, end, BWIN_ITERS);
}

/* The state of the connection a request-direction step works on; the first step of a
 * segment creates it (a request starts the segment) or checks the segment against it. */
static __always_inline struct lm_flow_state *req_enter(struct __sk_buff *skb,
                                                       struct lm_scratch *s) {
    struct lm_ctx *c = &s->c;
    struct lm_flow_state *st = inflight.lookup(&c->flow);
    if (c->steps == 0) {
        if (!st) {
            if (!method_kind(peek8(skb, c, 0)))
                return 0;
            __builtin_memset(&s->fresh, 0, sizeof(s->fresh));
            s->fresh.req_hwm = c->seq;
            inflight.update(&c->flow, &s->fresh);
            st = inflight.lookup(&c->flow);
            if (!st)
                return 0;
        }
        s32 d = (s32)(st->req_hwm - c->seq);
        if (d >= (s32)c->len)
            return 0; /* a retransmission of bytes already parsed */
        if (d > 0) {
            c->pos = d;
        } else if (d < 0 && (!(st->flags & LM_F_REQ_FRAMED) ||
                             (s32)(st->req_next - c->seq) < 0)) {
            lose_req(st); /* bytes never seen held what the framing needed */
        }
        st->req_hwm = c->seq + c->len;
    }
    if (!st)
        return 0;
    if (c->steps >= LM_MAX_STEPS) {
        err(LM_ERR_STEPS_EXHAUSTED);
        lose_req(st);
        return 0;
    }
    c->steps++;
    return st;
}

int lm_req(struct __sk_buff *skb) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    if (!s)
        return PASS;
    struct lm_flow_state *st = req_enter(skb, s);
    return dispatch(skb, &s->c, st ? req_step(skb, s, st) : STEP_NONE);
}

int lm_body(struct __sk_buff *skb) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    if (!s)
        return PASS;
    struct lm_flow_state *st = req_enter(skb, s);
    return dispatch(skb, &s->c, st ? body_step(skb, s, st) : STEP_NONE);
}

/* ---- response direction ---- */

static __always_inline void lose_resp(struct lm_flow_state *st) {
    st->flags &= ~(LM_F_RESP_FRAMED | LM_F_RESP_CHUNKED);
}

/* Follows chunk-size lines from resp_next while they are in this segment; at the last
 * chunk resp_next becomes the answer's end. */
static __always_inline void chunk_hops(struct __sk_buff *skb, struct lm_scratch *s,
                                       struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    c->hopped = 1;
    for (int i = 0; i < LM_CHUNK_HOPS; i++) {
        s32 r = (s32)(st->resp_next - c->seq);
        if (r < 0 || r >= (s32)c->len)
            return;
        u32 n = load_win(skb, s, r, r + 12 < c->len ? r + 12 : c->len);
        u64 size = 0;
        u32 j = hex_size(s, n, &size);
        /* a chunk-size line cut by the segment end, with extensions, or malformed */
        if (j == 0 || j + 2 > n || rd8(s->win, j) != '\r' || rd8(s->win, j + 1) != '\n' ||
            size > 0x7fffffff) {
            err(LM_ERR_FRAMING_LOST);
            lose_resp(st);
            return;
        }
        if (size == 0) {
            /* last chunk and the empty line ending the (trailer-less) body */
            st->resp_next = c->seq + r + j + 4;
            st->flags &= ~LM_F_RESP_CHUNKED;
            return;
        }
        st->resp_next = c->seq + r + j + 2 + (u32)size + 2;
    }
    c->hopped = 0; /* more chunk lines than one step follows: the next step goes on */
}

/* A status line at `at`: the answer to the oldest outstanding request begins. Records its
 * time to first byte, learns its framing and whether it streams (SSE). */
static __always_inline int resp_head(struct __sk_buff *skb, struct lm_scratch *s,
                                     struct lm_flow_state *st, u32 at) {
    struct lm_ctx *c = &s->c;
    struct head h = {};
    u32 n = load_head(skb, s, at, st->resp_win, &h);
    const u8 *w = s->win;
    u8 d0 = rd8(w, 9), d1 = rd8(w, 10), d2 = rd8(w, 11);
    if (n < 13 || !is_status_line(rd64(w, 0)) || rd8(w, 8) != ' ' || d0 < '1' || d0 > '5' ||
        d1 < '0' || d1 > '9' || d2 < '0' || d2 > '9') {
        err(LM_ERR_FRAMING_LOST);
        lose_resp(st);
        return STEP_NONE;
    }
    u16 status = (d0 - '0') * 100 + (d1 - '0') * 10 + (d2 - '0');
    int interim = status < 200 && status != 101; /* 100 Continue and friends */
    int no_body = interim;
    if (!interim) {
        u64 now = seg_time(c);
        if (st->tail != st->head) {
            u32 slot = st->head & (LM_PIPE_DEPTH - 1);
            no_body = (st->head_mask >> slot) & 1;
            st->ans_start = st->ring[slot].start_ns;
            st->ans_model = st->ring[slot].model_id;
            st->ans_ep = st->ep[slot];
        } else if (st->overflow) {
            st->ans_start = st->overflow_ns;
            st->ans_model = 0;
            st->ans_ep = LM_EP_OTHER;
        } else if (!(st->flags & LM_F_FIN_CLIENT)) {
            err(LM_ERR_RESP_NO_REQ);
        }
        if (st->tail != st->head || st->overflow) {
            st->aflags = LM_A_ACTIVE | (h.ctype == CT_SSE ? LM_A_SSE : 0) |
                         (h.ctype == CT_JSON ? LM_A_JSON : 0);
            st->status = status;
            st->events = 0;
            st->out_tokens = 0;
            st->in_tokens = 0;
            record_flow(c, st->ans_model, status, now - st->ans_start);
            if (h.len && h.has_clen && !h.chunked && at + h.len + h.clen <= c->len) {
                /* the whole answer is in this segment: end_answer samples its ttfb with
                 * its e2e, the same figure */
                st->aflags |= LM_A_TTFB;
                st->event_ns = now;
            } else {
                sample(c, st, LM_HK_TTFB, now - st->ans_start, 1);
            }
        }
    }
    if (status == 101) {
        end_answer(c, st, LM_OUT_COMPLETE, 1);
        st->flags |= LM_F_UPGRADED;
        return STEP_NONE;
    }
    if (!h.len) {
        /* a head longer than a window: the answer ends with the connection, or when a
         * status line starts a later segment */
        lose_resp(st);
        return STEP_NONE;
    }
    c->wbase = at;
    c->wlen = n;
    /* The next head's copy: this one and some slack, and the body of a JSON answer when
     * all of it fits, for its usage object (a longer one has its tail copied alone). Other
     * answers only widen it: a copy stops at the segment's end, so a head alone in its
     * segment (a stream's, say) costs no more for it. */
    u32 want = h.len + 16;
    if (h.ctype == CT_JSON && h.has_clen && want + h.clen <= LM_WIN)
        want += h.clen;
    if (want > LM_WIN)
        want = LM_WIN;
    if (h.ctype == CT_JSON || want > st->resp_win)
        st->resp_win = want;
    u32 body = at + h.len;
    st->flags = (st->flags | LM_F_RESP_FRAMED) & ~LM_F_RESP_CHUNKED;
    if (no_body || status == 204 || status == 304) {
        st->resp_next = c->seq + body;
    } else if (h.chunked) {
        st->resp_next = c->seq + body;
        st->flags |= LM_F_RESP_CHUNKED;
    } else if (h.has_clen) {
        st->resp_next = c->seq + body + h.clen;
    } else {
        lose_resp(st); /* delimited by the connection's close */
        st->aflags |= LM_A_CLOSE;
    }
    c->pos = body;
    /* the body of a stream starts a new line: a first "data:" right here is an event */
    st->sse_carry = (u64)'\n' << 48;
    st->aflags |= LM_A_CARRY;
    return STEP_RESP;
}

/* Unframed, with requests outstanding (a pipelining client, or framing lost): searches
 * the rest of the segment, a window per step, for a status line. Returns its offset, or -1
 * with c->pos moved past what was searched. */
static __always_inline int status_scan(struct __sk_buff *skb, struct lm_scratch *s) {
    struct lm_ctx *c = &s->c;
    u32 n = load_win(skb, s, c->pos, c->len);
    if (!n) {
        c->pos = c->len;
        return -1;
    }
    struct found f = find_token(s, 0, n, n, c->pos + n >= c->len, HTTP7, LOW(7), 7, WIN_ITERS);
    if (f.at >= 0)
        return c->pos + f.at;
    c->pos += f.stop;
    return -1;
}

/* The token counts of the usage object in win[a..n), if one is there. */
static __always_inline void read_usage(struct lm_scratch *s, struct lm_flow_state *st, u32 a,
                                       u32 n) {
    int at = rfind_usage(s, a, n);
    u32 out = 0, in = 0;
    int got = at >= 0 ? parse_usage(s, at, n, &out, &in) : 0;
    if (in)
        st->in_tokens = in; /* an embedding's usage has prompt tokens only */
    if (got) {
        st->out_tokens = out;
        st->aflags |= LM_A_USAGE;
    }
}

/* The answer ends at c->aend, complete; returns the next step. */
static __always_inline int answer_done(struct lm_ctx *c, struct lm_flow_state *st) {
    end_answer(c, st, LM_OUT_COMPLETE, 1);
    c->pos = c->aend;
    return c->aend < c->len ? STEP_RESP : STEP_NONE;
}

/* Has lm_usage search payload bytes [from, to) of this segment for a "usage" object, then
 * go on with step `after` (AFTER_END: end the answer at c->aend first and go on from there,
 * so a JSON answer's end costs no tail call back to lm_resp). Its own program: entered from
 * one state, the verifier walks the search and the parse once, where inline they would be
 * walked once per path before them. */
static __always_inline int usage_next(struct lm_ctx *c, u32 from, u32 to, int after) {
    c->ufrom = from;
    c->uto = to;
    c->uafter = after;
    return STEP_USAGE;
}

/* One step in the response direction: a head, then what follows it in the segment: the
 * chunk lines, the usage at a JSON answer's end, the answer's end. SSE events go to lm_sse.
 * Falls through from one unit to the next where it can: each tail call costs ~30 ns, and a
 * short JSON answer (head, body and end in one segment) then takes one step. Returns the
 * next step. */
static __always_inline int resp_step(struct __sk_buff *skb, struct lm_scratch *s,
                                     struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    if (st->flags & LM_F_UPGRADED)
        return STEP_NONE;
    if (!(st->aflags & LM_A_ACTIVE)) {
        u32 at = 0;
        s32 r = (s32)(st->resp_next - c->seq);
        if ((st->flags & LM_F_RESP_FRAMED) && r < 0)
            lose_resp(st); /* it points at bytes before this segment: lost with them */
        if (st->flags & LM_F_RESP_FRAMED) {
            if (r < (s32)c->pos || r >= (s32)c->len)
                return STEP_NONE;
            at = r; /* resp_head checks that a status line starts there */
        } else if (c->steps != 1 || c->pos != 0 || !is_status_line(peek8(skb, c, 0))) {
            /* unframed: a head starts a segment, or (pipelining) comes anywhere in it */
            if (st->tail == st->head && !st->overflow)
                return STEP_NONE;
            int p = status_scan(skb, s);
            if (p < 0)
                return c->pos < c->len ? STEP_RESP : STEP_NONE;
            at = p;
        }
        int next = resp_head(skb, s, st, at);
        if (next != STEP_RESP || !(st->aflags & LM_A_ACTIVE))
            return next;
    }
    c->aend = NOWHERE;
    if (!(st->flags & LM_F_RESP_FRAMED)) {
        /* framing lost, or the body ends with the connection: a status line starting a
         * segment is the next answer, so this one ended (when, the wire did not say) */
        if (!(st->aflags & LM_A_CLOSE) && c->steps == 1 && c->pos == 0 &&
            is_status_line(peek8(skb, c, 0))) {
            end_answer(c, st, LM_OUT_COMPLETE, 0);
            return STEP_RESP;
        }
    } else {
        if ((st->flags & LM_F_RESP_CHUNKED) && !c->hopped) {
            chunk_hops(skb, s, st);
            if (!c->hopped)
                return STEP_RESP; /* more chunk lines than one step follows */
        }
        s32 r = (s32)(st->resp_next - c->seq);
        if ((st->flags & (LM_F_RESP_FRAMED | LM_F_RESP_CHUNKED)) == LM_F_RESP_FRAMED &&
            r >= 0 && r <= (s32)c->len)
            c->aend = r < (s32)c->pos ? c->pos : (u32)r;
    }
    u32 lim = c->aend < c->len ? c->aend : c->len;
    if ((st->aflags & LM_A_SSE) && c->pos < lim)
        return STEP_SSE;
    if (c->aend == NOWHERE)
        return STEP_NONE;
    if ((st->aflags & (LM_A_JSON | LM_A_SSE)) == LM_A_JSON && c->aend > c->pos) {
        /* the usage object sits in a JSON answer's last bytes: read here when the head's
         * window holds them, else by lm_usage, which then ends the answer */
        u32 from = c->aend > c->pos + LM_USAGE_TAIL ? c->aend - LM_USAGE_TAIL : c->pos;
        u32 wb = c->wbase;
        if (from >= wb && c->aend <= wb + c->wlen) {
            /* resp_win asks for the whole of a short answer: no copy, no tail call */
            read_usage(s, st, from - wb, c->aend - wb);
            return answer_done(c, st);
        }
        return usage_next(c, from, c->aend, AFTER_END);
    }
    return answer_done(c, st);
}

/* The state of the connection a response-direction step works on (lm_resp, lm_sse); the
 * first step of a segment checks the segment against it. */
static __always_inline struct lm_flow_state *resp_enter(struct __sk_buff *skb,
                                                        struct lm_scratch *s) {
    struct lm_ctx *c = &s->c;
    struct lm_flow_state *st = inflight.lookup(&c->flow);
    if (!st) {
        if (c->steps == 0 && is_status_line(peek8(skb, c, 0)))
            err(LM_ERR_RESP_NO_REQ);
        return 0;
    }
    if (c->steps == 0) {
        c->hopped = 0;
        c->wlen = 0;
        if (!(st->flags & LM_F_RESP_SYNCED)) {
            if (!is_status_line(peek8(skb, c, 0)))
                return 0;
            st->resp_hwm = c->seq;
            st->flags |= LM_F_RESP_SYNCED;
        }
        s32 d = (s32)(st->resp_hwm - c->seq);
        if (d >= (s32)c->len)
            return 0; /* a retransmission of bytes already parsed */
        if (d > 0) {
            c->pos = d;
        } else if (d < 0) {
            /* bytes never seen: framing that pointed into them is lost, and with it
             * where a stream's events start */
            if (!(st->flags & LM_F_RESP_FRAMED) || (s32)(st->resp_next - c->seq) < 0)
                lose_resp(st);
            st->aflags &= ~LM_A_CARRY;
        }
        st->resp_hwm = c->seq + c->len;
    }
    if (c->steps >= LM_MAX_STEPS) {
        err(LM_ERR_STEPS_EXHAUSTED);
        lose_resp(st);
        return 0;
    }
    c->steps++;
    return st;
}

int lm_resp(struct __sk_buff *skb) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    if (!s)
        return PASS;
    struct lm_flow_state *st = resp_enter(skb, s);
    return dispatch(skb, &s->c, st ? resp_step(skb, s, st) : STEP_NONE);
}

/* ---- SSE events of a streamed answer ---- */

/* What the data: event whose "data:" ends at window offset p is: [DONE] (the stream's
 * end), {"error"...} (the stream failed), or a token event (EV_*). */
static __always_inline int event_kind(struct lm_scratch *s, u32 p, u32 n) {
    const u8 *w = s->win;
    if (p < n && brd8(w, p) == ' ')
        p++;
    if (p + 6 > n) {
        /* too few bytes left in the segment to tell [DONE] from a token */
        s->c.cut = 1;
        return EV_TOKEN;
    }
    u64 v = brd64(w, p);
    if ((v & LOW(6)) == C8('[', 'D', 'O', 'N', 'E', ']', 0, 0))
        return EV_DONE;
    if (p + 8 <= n && v == C8('{', '"', 'e', 'r', 'r', 'o', 'r', '"'))
        return EV_ERROR;
    return EV_TOKEN;
}

/* Counts the data: events in win[0..n): the line starts "\ndata:", found by their '\n'
 * 8 bytes at a time; in the raw bytes, chunk lines included, every event line follows a
 * line end, the chunk-size line's own when the event starts a chunk. Leaves in c->stop the
 * first byte not searched (NOWHERE when the loop ran out of iterations: c->cur then), the
 * count in c->tokens and the last two events' offsets in c->last and c->prev (NOWHERE
 * for none). Which of them are [DONE] or an error is told after the loop: those come at a
 * stream's end, and a loop whose paths all leave the same registers is walked by the
 * verifier once per iteration, where one that branches on what it found is not. */
static __always_inline void count_events(struct lm_scratch *s, u32 n, int final) {
    const u8 *w = s->win;
    struct lm_ctx *c = &s->c;
    c->n = n;
    /* bytes from a "\n" to tell the event: "\ndata:" and, unless nothing follows in the
     * segment, what tells [DONE] or an error apart */
    c->lim = final ? 6 : 16;
    c->vlen = final ? n : 0; /* where a cut search stops: the end, or the cut token */
    c->cur = LOAD(c->zero);
    c->stop = NOWHERE;
    for (int i = 0; i < BWIN_ITERS; i++) {
        u32 p = LOAD(c->cur);
        if (p >= LOAD(c->n)) {
            c->stop = p;
            break;
        }
        u64 t = has_byte(brd64(w, p), '\n' * ONES);
        if (!t) {
            c->cur = p + 8;
            continue;
        }
        u32 q = p + first_flagged(t);
        if (q + LOAD(c->lim) > LOAD(c->n)) {
            /* cut by the window: the next one starts here; at the segment's end the carry
             * takes its bytes to the next segment */
            c->stop = LOAD(c->vlen) ? LOAD(c->vlen) : q;
            break;
        }
        c->cur = q + 1;
        if ((brd64(w, q) & LOW(6)) != DATA6)
            continue;
        c->cur = q + 6;
        STORE(c->tokens, LOAD(c->tokens) + 1);
        STORE(c->prev, LOAD(c->last));
        STORE(c->last, q + 6);
    }
}

/* One window of a streamed answer's body, up to its end in this segment: its data: events
 * (the first is the time to first token, the gaps between them the inter-token latency)
 * and the token counts of a "usage" object in its last token event. Events of one segment
 * arrive together: after the first, their gaps are 0, recorded in one add. */
static __always_inline int sse_step(struct __sk_buff *skb, struct lm_scratch *s,
                                    struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    u32 lim = c->aend < c->len ? c->aend : c->len;
    u32 wbase = c->pos;
    u32 n = load_bwin(skb, s, wbase, lim);
    if (!n) {
        c->pos = lim;
        return c->aend == NOWHERE ? STEP_NONE : STEP_RESP;
    }
    int final = wbase + n >= lim;
    c->tokens = 0;
    c->last = NOWHERE;
    c->prev = NOWHERE;
    c->cut = 0;
    if (st->aflags & LM_A_CARRY) {
        /* an event line begun at the end of the last segment */
        u32 j = bridged(s, st->sse_carry, n, DATA6, 6);
        if (j) {
            c->tokens = 1;
            c->last = j;
        }
    }
    count_events(s, n, final);
    /* [DONE] ends a stream, an error event comes just before it: only the last two events
     * of a window can be either */
    int done_before = st->aflags & LM_A_DONE;
    u32 tokens = LOAD(c->tokens);
    u32 last = LOAD(c->last), prev = LOAD(c->prev);
    if (last != NOWHERE) {
        int kind = event_kind(s, last, n);
        if (kind != EV_TOKEN) {
            tokens--;
            last = prev;
            st->aflags |= kind == EV_DONE ? LM_A_DONE : LM_A_ERROR;
            if (kind == EV_DONE && prev != NOWHERE && event_kind(s, prev, n) == EV_ERROR) {
                tokens--;
                last = NOWHERE;
                st->aflags |= LM_A_ERROR;
            }
        }
    }
    /* through the scratch again, so the paths above leave one state */
    STORE(c->tokens, done_before ? 0 : tokens);
    STORE(c->last, last);
    if (c->cut)
        err(LM_ERR_EVENT_CUT);
    u32 stop = LOAD(c->stop);
    if (stop >= n && stop != NOWHERE) {
        /* searched to the window's end: its last bytes may begin an event line that the
         * next segment finishes */
        if (n >= 8) {
            st->sse_carry = brd64(s->win, n - 8) >> 8;
            st->aflags |= LM_A_CARRY;
        }
        c->pos = wbase + n;
    } else {
        /* an event cut by the window, or more events than one step takes: the next window
         * starts at the first byte not searched */
        st->aflags &= ~LM_A_CARRY;
        c->pos = wbase + (stop == NOWHERE ? LOAD(c->cur) : stop);
    }
    int next = c->pos < lim ? STEP_SSE : c->aend == NOWHERE ? STEP_NONE : STEP_RESP;
    tokens = LOAD(c->tokens);
    if (!tokens)
        return next;
    u64 now = seg_time(c);
    if (!(st->aflags & LM_A_FIRST)) {
        sample(c, st, LM_HK_TTFT, now - st->ans_start, 1);
        st->aflags |= LM_A_FIRST;
    } else {
        sample(c, st, LM_HK_ITL, now - st->event_ns, 1);
    }
    if (tokens > 1)
        sample(c, st, LM_HK_ITL, 0, tokens - 1);
    st->event_ns = now;
    st->events += tokens;
    /* a usage object rides at the end of the window's last token event, if anywhere */
    u32 last_ev = LOAD(c->last);
    if (last_ev == NOWHERE || ends_without_usage(s, n))
        return next;
    u32 from = last_ev + LM_WIN < n ? n - LM_WIN : last_ev;
    return usage_next(c, wbase + from, wbase + n, next);
}

int lm_sse(struct __sk_buff *skb) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    if (!s)
        return PASS;
    struct lm_flow_state *st = resp_enter(skb, s);
    return dispatch(skb, &s->c, st ? sse_step(skb, s, st) : STEP_NONE);
}

/* A "usage" object in the bytes usage_next() named: its output and prompt tokens. */
static __always_inline int usage_step(struct __sk_buff *skb, struct lm_scratch *s,
                                      struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    u32 n = load_win(skb, s, c->ufrom, c->uto);
    if (n)
        read_usage(s, st, 0, n);
    return c->uafter == AFTER_END ? answer_done(c, st) : c->uafter;
}

int lm_usage(struct __sk_buff *skb) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    if (!s)
        return PASS;
    struct lm_flow_state *st = resp_enter(skb, s);
    return dispatch(skb, &s->c, st ? usage_step(skb, s, st) : STEP_NONE);
}

/* The connection ended: see close_flow. */
int lm_close(struct __sk_buff *skb) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    if (!s)
        return PASS;
    struct lm_flow_state *st = inflight.lookup(&s->c.flow);
    if (st)
        close_flow(&s->c, st, s->c.dir == STEP_REQ);
    return PASS;
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

/* Per packet of the interface, what comes first is the one test most packets fail: is
 * either port served? It costs two header copies and two bitmap reads (array lookups the
 * JIT inlines: no helper call); the scratch, the addresses and the rest of the TCP header
 * are touched only past it. */
static __always_inline int entry(struct __sk_buff *skb, u32 l3) {
    u32 l4, ip_end;
    struct iphdr ip;
    struct ipv6hdr ip6;
    int v4 = skb->protocol == bpf_htons(ETH_P_IP);
    if (v4) {
        if (COPY_HDR(skb, l3, &ip) < 0)
            return PASS;
        if (ip.protocol != IPPROTO_TCP || (ip.frag_off & bpf_htons(0x3fff)))
            return PASS;
        if (ip.ihl < 5)
            return PASS;
        l4 = l3 + ip.ihl * 4;
        u32 tot = bpf_ntohs(ip.tot_len);
        ip_end = tot ? l3 + tot : skb->len; /* 0: a BIG TCP packet */
    } else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        if (COPY_HDR(skb, l3, &ip6) < 0)
            return PASS;
        if (ip6.nexthdr != IPPROTO_TCP) /* extension headers before TCP: not followed */
            return PASS;
        l4 = l3 + sizeof(ip6);
        u32 plen = bpf_ntohs(ip6.payload_len);
        ip_end = plen ? l4 + plen : skb->len;
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

    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    if (!s)
        return PASS;
    struct lm_ctx *c = &s->c;
    __u8 src[16], dst[16];
    if (v4) {
        mapped_v4(src, ip.saddr);
        mapped_v4(dst, ip.daddr);
    } else {
        __builtin_memcpy(src, &ip6.saddr, 16);
        __builtin_memcpy(dst, &ip6.daddr, 16);
    }
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
        /* A new connection on this 5-tuple starts from a clean state: the old one, whose
         * end was missed, ends as if the client had reset it (lm_close). */
        if (dir == STEP_REQ && !th.ack) {
            c->fin = 0;
            c->rst = 1;
            c->now = 0;
            c->dir = dir;
            lm_steps.call(skb, STEP_CLOSE);
        }
        return PASS;
    }
    u32 poff = l4 + th.doff * 4;
    if (ip_end > skb->len)
        ip_end = skb->len;
    c->len = ip_end > poff ? ip_end - poff : 0;
    c->fin = th.fin;
    c->rst = th.rst;
    c->now = 0;
    c->dir = dir;
    if (c->len == 0) {
        if (c->fin || c->rst)
            lm_steps.call(skb, STEP_CLOSE);
        return PASS;
    }
    c->poff = poff;
    c->seq = bpf_ntohl(th.seq);
    c->pos = 0;
    c->steps = 0;
    c->hcont = 0;
    lm_steps.call(skb, dir);
    return PASS;
}

/* Interfaces with an Ethernet header (Ethernet, veth, loopback). */
int lm_tc_eth(struct __sk_buff *skb) {
    return entry(skb, ETH_HLEN);
}

/* Interfaces whose packets start at the IP header (WireGuard, tun). */
int lm_tc_raw(struct __sk_buff *skb) {
    return entry(skb, 0);
}
