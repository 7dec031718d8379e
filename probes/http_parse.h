/* HTTP/1 and JSON parsing for the probes: pure functions over the per-CPU window that
 * http.bpf.c copies segment bytes into. No map is touched here (BCC rewrites map calls
 * only in its main source, which http.bpf.c is), so everything in this file can be read,
 * and reasoned about, as plain C over a byte array.
 *
 * Every loop is bounded and keeps its cursor an unknown scalar for the verifier (XOR with
 * a zero loaded from the scratch, or a round trip through the scratch), so that the states
 * of successive iterations converge and get pruned instead of being walked path by path.
 */
#ifndef LM_HTTP_PARSE_H
#define LM_HTTP_PARSE_H

#define WMASK (LM_WIN - 1)
#define BMASK (LM_BWIN - 1)
#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
#define LOWER 0x2020202020202020ULL /* OR-ing it lower-cases ASCII letters */

#define C4(a, b, c, d) ((__u32)(a) | (__u32)(b) << 8 | (__u32)(c) << 16 | (__u32)(d) << 24)
#define C8(a, b, c, d, e, f, g, h) ((__u64)C4(a, b, c, d) | (__u64)C4(e, f, g, h) << 32)
#define LOW(n) ((1ULL << (8 * (n))) - 1) /* the first n bytes of a little-endian word */
#define KEY7 C8('"', 'm', 'o', 'd', 'e', 'l', '"', 0)
#define HTTP7 C8('H', 'T', 'T', 'P', '/', '1', '.', 0)
#define DATA6 C8('\n', 'd', 'a', 't', 'a', ':', 0, 0)
#define USAGE7 C8('"', 'u', 's', 'a', 'g', 'e', '"', 0)
/* A volatile load, so clang does not forward the last store and the verifier sees a map
 * value (an unknown scalar) rather than a constant: see lm_ctx.zero. */
#define LOAD(x) (*(volatile typeof(x) *)&(x))
/* A volatile store: clang may not keep the value in a register (or a stack slot) instead,
 * where the verifier would track it exactly and tell loop iterations apart by it. */
#define STORE(x, v) (*(volatile typeof(x) *)&(x) = (v))
/* Iterations of a search loop over a window: 8 bytes each, and a margin for the candidate
 * bytes that are not the token. */
#define WIN_ITERS (LM_WIN / 8 + 24)
#define BWIN_ITERS (LM_BWIN / 8 + 24)

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
     * (which blew the 1M-instruction verification limit). */
    __u32 zero;
    /* Results and bounds that leave loops go through these fields for the same reason. */
    __u32 cur;
    __u32 cl_at;
    __u32 ct_at;
    __u32 lim;
    __u32 n;
    __u32 stop;
    __u32 hlen;
    __u32 line;  /* parse_head: where the window's last line starts */
    __u64 vhash; /* parse_value's state: FNV-1a of the value so far */
    __u32 vlen;  /* value bytes hashed */
    __u32 aend;  /* response steps: where the answer being sent ends in this segment */
    __u32 num;   /* parse_uint's result */
    __u32 last;  /* count_events: where the window's last data: event starts */
    __u32 prev;  /* ... and the one before it */
    __u32 tokens; /* count_events: data: events in the window */
    __u8 cut;    /* event_kind: an event cut by the segment's end */
    __u8 pad[3];
    __u32 out_at; /* parse_usage: where the output and prompt counts' keys end */
    __u32 in_at;
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
    __u32 wbase; /* the window holds payload bytes [wbase, wbase + wlen) (resp_head) */
    __u32 wlen;
    __u32 ufrom; /* lm_usage: the payload bytes to search for "usage", */
    __u32 uto;
    __s8 uafter; /* and the step after it */
    __u8 hopped; /* this segment's chunk lines were followed */
    __u8 dir;    /* STEP_REQ: the segment goes to the server; STEP_RESP: from it */
};

struct lm_scratch {
    struct lm_ctx c;
    struct lm_flow_state fresh;
    struct lm_model_name name;
    __u8 win[LM_BWIN + 16]; /* +16: 8-byte reads at masked offsets stay inside the value */
};

/* ---- bytes ---- */

static __always_inline u64 rd64(const u8 *w, u32 off) {
    return *(const u64 *)(w + (off & WMASK));
}

static __always_inline u8 rd8(const u8 *w, u32 off) {
    return w[off & WMASK];
}

/* The same over a whole body window. */
static __always_inline u64 brd64(const u8 *w, u32 off) {
    return *(const u64 *)(w + (off & BMASK));
}

static __always_inline u8 brd8(const u8 *w, u32 off) {
    return w[off & BMASK];
}

/* Has-zero-byte test of w ^ byte*ONES: nonzero when w holds that byte. */
static __always_inline u64 has_byte(u64 w, u64 pattern) {
    u64 x = w ^ pattern;
    return (x - ONES) & ~x & HIGHS;
}

/* Index (0-7) of the lowest byte flagged (bit 7 of a byte) by a has-zero-byte mask,
 * branch-free: isolating the lowest flag gives 256^k << 7, and multiplying 256^k by bytes
 * 7,6,..,0 brings byte k's value, k, to the top. Branches here would hand the verifier
 * eight constant offsets per word, each a separate state to explore. */
static __always_inline u32 first_flagged(u64 t) {
    u64 l = (t & (~t + 1)) >> 7;
    return (u32)((l * 0x0001020304050607ULL) >> 56);
}

static __always_inline int json_space(u8 ch) {
    return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\n';
}

/* ---- request and status lines ---- */

/* 0: not a request line; 1: a request; 2: a HEAD request (its response has no body);
 * 3: a POST, the method of every inference endpoint. */
static __always_inline int method_kind(u64 w) {
    u32 lo = (u32)w;
    u8 fifth = (u8)(w >> 32);
    if (lo == C4('P', 'O', 'S', 'T') && fifth == ' ')
        return 3;
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
    return (w & LOW(7)) == HTTP7 && (minor == '0' || minor == '1');
}

static __always_inline int path_end(u8 ch) {
    return ch == ' ' || ch == '?';
}

/* The endpoint class of a POST whose request line starts the window (n bytes): the path
 * begins after "POST ". Eight-byte compares of the known paths, nothing else. */
static __always_inline u8 endpoint_of(const u8 *w, u32 n) {
    if (n < 32)
        return LM_EP_OTHER;
    u64 a = rd64(w, 5), b = rd64(w, 13);
    if (a == C8('/', 'v', '1', '/', 'c', 'h', 'a', 't')) {
        if (b == C8('/', 'c', 'o', 'm', 'p', 'l', 'e', 't') &&
            (rd64(w, 21) & LOW(4)) == C4('i', 'o', 'n', 's') && path_end(rd8(w, 25)))
            return LM_EP_CHAT;
    } else if (a == C8('/', 'v', '1', '/', 'c', 'o', 'm', 'p')) {
        if ((b & LOW(7)) == C8('l', 'e', 't', 'i', 'o', 'n', 's', 0) && path_end(rd8(w, 20)))
            return LM_EP_COMPLETIONS;
    } else if (a == C8('/', 'v', '1', '/', 'e', 'm', 'b', 'e')) {
        if ((b & LOW(6)) == C8('d', 'd', 'i', 'n', 'g', 's', 0, 0) && path_end(rd8(w, 19)))
            return LM_EP_EMBEDDINGS;
    } else if (a == C8('/', 'v', '1', '/', 'r', 'e', 's', 'p')) {
        if ((b & LOW(5)) == C8('o', 'n', 's', 'e', 's', 0, 0, 0) && path_end(rd8(w, 18)))
            return LM_EP_RESPONSES;
    } else if (a == C8('/', 'g', 'e', 'n', 'e', 'r', 'a', 't') && (u8)b == 'e') {
        if (path_end(rd8(w, 14)) ||
            ((rd64(w, 14) & LOW(7)) == C8('_', 's', 't', 'r', 'e', 'a', 'm', 0) &&
             path_end(rd8(w, 21))))
            return LM_EP_GENERATE;
    }
    return LM_EP_OTHER;
}

/* ---- heads ---- */

#define CT_OTHER 0
#define CT_SSE 1  /* text/event-stream */
#define CT_JSON 2 /* application/json */

struct head {
    u32 len;     /* bytes up to and including the empty line; 0: not inside the window */
    u32 clen;    /* Content-Length */
    u8 has_clen;
    u8 chunked;  /* Transfer-Encoding present (chunked is the only one HTTP/1.1 frames) */
    u8 ctype;    /* CT_* */
};

/* Walks the header lines of the head at win[0..n) a word at a time: a line end is found
 * with a has-zero-byte test on 8 bytes, and only line starts are compared with header
 * names. Content-Length digits and the Content-Type are read after the walk to keep the
 * loop small. */
static __always_inline void parse_head(struct lm_scratch *s, u32 n, struct head *h) {
    const u8 *w = s->win;
    struct lm_ctx *c = &s->c;
    c->cl_at = 0;
    c->ct_at = 0;
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
        if (a == C8('c', 'o', 'n', 't', 'e', 'n', 't', '-')) {
            if ((b & LOW(7)) == C8('l', 'e', 'n', 'g', 't', 'h', ':', 0))
                c->cl_at = l + 15;
            else if ((b & LOW(5)) == C8('t', 'y', 'p', 'e', ':', 0, 0, 0))
                c->ct_at = l + 13;
        } else if (a == C8('t', 'r', 'a', 'n', 's', 'f', 'e', 'r') &&
                   b == C8('-', 'e', 'n', 'c', 'o', 'd', 'i', 'n')) {
            c->chunked = 1;
        }
    }
    /* results through the scratch, so exits from every iteration look alike after */
    h->len = LOAD(c->hlen);
    h->chunked = LOAD(c->chunked);
    if (!h->len)
        return;
    u32 t = LOAD(c->ct_at);
    if (t) {
        for (int i = 0; i < 4; i++)
            if (rd8(w, t) == ' ')
                t++;
        if (t + 16 <= n) {
            u64 v = rd64(w, t) | LOWER;
            if (v == C8('t', 'e', 'x', 't', '/', 'e', 'v', 'e'))
                h->ctype = CT_SSE;
            else if (v == C8('a', 'p', 'p', 'l', 'i', 'c', 'a', 't') &&
                     (rd64(w, t + 8) | LOWER) == C8('i', 'o', 'n', '/', 'j', 's', 'o', 'n'))
                h->ctype = CT_JSON;
        }
    }
    u32 d = LOAD(c->cl_at);
    if (!d)
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

/* ---- searching a body window ---- */

struct found {
    int at;   /* window index of the token's first byte, or -1 */
    u32 stop; /* first token start not examined (when not found) */
};

/* Looks for a token of 2 to 8 bytes (key, its bytes beyond `mask` zero) starting in
 * win[a..lim). Candidates are where the token's first two bytes stand, found 8 at a time
 * with a has-zero-byte test on the word and on the word one byte on (a pair keeps them
 * rare whatever the text: a body of "mmmm..." holds no '"m', and a candidate per byte
 * would take an iteration per byte), each checked as one masked 8-byte compare. `need`
 * bytes from the token's start must be in the window for the caller to use a match;
 * fewer, and the match counts as cut by the window end. final: no byte follows win[n-1]
 * in this segment, so a cut token is not worth a reload. Loop bounds go through the
 * scratch so the verifier walks the loop once, not once per range the callers' paths give
 * them. iters bounds the loop: the verifier walks every iteration, so a search over a
 * head window takes fewer than one over a body window. */
static __always_inline struct found find_token(struct lm_scratch *s, u32 a, u32 lim, u32 n,
                                               int final, u64 key, u64 mask, u32 need,
                                               const int iters) {
    const u8 *w = s->win;
    struct lm_ctx *c = &s->c;
    u32 zero = LOAD(c->zero);
    c->lim = lim; /* candidates at or past it start no token before lim */
    c->n = n;
    c->stop = ~0U; /* stays so only when the loop runs out of iterations */
    u32 p = a ^ zero;
    for (int i = 0; i < iters; i++) {
        if (p >= LOAD(c->lim)) {
            c->stop = lim;
            break;
        }
        u64 t = has_byte(brd64(w, p), (key & 0xff) * ONES) &
                has_byte(brd64(w, p + 1), (key >> 8 & 0xff) * ONES);
        if (!t) {
            p = (p + 8) ^ zero;
            continue;
        }
        u32 q = p + first_flagged(t);
        if (q >= LOAD(c->lim)) {
            c->stop = lim;
            break;
        }
        if (q + need > LOAD(c->n)) {
            /* a token cut by the window end: resume from it, unless nothing follows */
            c->stop = final ? lim : q;
            break;
        }
        if ((brd64(w, q) & mask) == key) {
            struct found f = {.at = q, .stop = q};
            return f;
        }
        p = (q + 1) ^ zero;
    }
    c->cur = p;
    struct found f = {.at = -1, .stop = LOAD(c->stop)};
    if (f.stop == ~0U)
        f.stop = LOAD(c->cur);
    return f;
}

/* Window offset of the last `"usage"` key in win[a..n), or -1. A top-level usage object
 * comes after the content (OpenAI, vLLM, SGLang and TGI write it after "choices", or
 * "data" for embeddings), so the search starts at the end and goes back a word at a time;
 * a string cannot hold those 7 bytes (its quotes are escaped). Candidates are the '"u'
 * pairs, as in find_token; those of one word are compared lowest first, one per
 * iteration. */
static __always_inline int rfind_usage(struct lm_scratch *s, u32 a, u32 n) {
    const u8 *w = s->win;
    struct lm_ctx *c = &s->c;
    if (n < a + 8)
        return -1;
    u32 zero = LOAD(c->zero);
    c->lim = a;
    c->n = n;
    c->stop = ~0U;
    u32 p = (n - 8) ^ zero;
    u64 t = 0; /* the candidates of the word at p not yet compared */
    for (int i = 0; i < WIN_ITERS; i++) {
        if (!t)
            t = has_byte(brd64(w, p), '"' * ONES) & has_byte(brd64(w, p + 1), 'u' * ONES);
        if (t) {
            u32 q = p + first_flagged(t);
            t &= t - 1;
            if (q >= LOAD(c->lim) && q + 7 <= LOAD(c->n) &&
                (brd64(w, q) & LOW(7)) == USAGE7) {
                c->stop = q;
                break;
            }
            if (t)
                continue;
        }
        u32 lo = LOAD(c->lim);
        if (p <= lo)
            break;
        p = (p > lo + 8 ? p - 8 : lo) ^ zero;
    }
    u32 at = LOAD(c->stop);
    return at == ~0U ? -1 : (int)at;
}

/* Whether the event that ends win[0..n) closes without a usage object: its JSON ends
 * right after "choices" (`]}`, vLLM and SGLang leave usage out of a chunk without it) or
 * with `"usage":null}` (OpenAI), then the event's blank line and perhaps a chunk's CRLF.
 * Spares the usage search for all the events of a stream but the last. */
static __always_inline int ends_without_usage(struct lm_scratch *s, u32 n) {
    const u8 *w = s->win;
    struct lm_ctx *c = &s->c;
    c->cur = n;
    for (int i = 0; i < 6; i++) {
        u32 p = LOAD(c->cur);
        if (p < 3)
            return 0;
        u8 ch = brd8(w, p - 1);
        if (ch != '\n' && ch != '\r')
            break;
        c->cur = p - 1;
    }
    u32 p = LOAD(c->cur);
    if (p == n || p < 3)
        return 0; /* the event may go on past the window */
    u8 a = brd8(w, p - 2), b = brd8(w, p - 1);
    return b == '}' && (a == ']' || a == 'l');
}

/* Bytes of a token at the start of the window (1 to klen - 1) whose first part ended the
 * previous segment: `tail` holds that segment's last 7 searched bytes, oldest in the low
 * byte. 0 when the two do not join into the token. At most one split point can match:
 * each puts a different token byte last in `tail`. */
static __always_inline u32 bridged(struct lm_scratch *s, u64 tail, u32 n, u64 key, u32 klen) {
    u64 head = brd64(s->win, 0);
    s->c.cur = 0;
#pragma unroll
    for (u32 j = 1; j < 7; j++) {
        if (j >= klen)
            break;
        u64 in_tail = LOW(klen - j), in_head = LOW(j);
        if (j <= n && (tail >> (8 * (7 - (klen - j)))) == (key & in_tail) &&
            (head & in_head) == (key >> (8 * (klen - j))))
            s->c.cur = j;
    }
    return LOAD(s->c.cur);
}

/* Position after up to 4 JSON spaces from v; through the scratch so every count of spaces
 * leaves the verifier with the same state. */
static __always_inline u32 skip_space(struct lm_scratch *s, u32 v, u32 n) {
    s->c.cur = v;
    for (int i = 0; i < 4; i++) {
        u32 p = LOAD(s->c.cur);
        if (p >= n || !json_space(brd8(s->win, p)))
            break;
        s->c.cur = p + 1;
    }
    return LOAD(s->c.cur);
}

/* ---- the "model" value ---- */

enum { VAL_FOUND, VAL_INVALID, VAL_TOO_LONG, VAL_CUT };

/* Where parse_value is in `"model" : "value"`; kept across segments in carry_phase. */
#define PV_KEY 0   /* after the key: spaces, then ':' */
#define PV_COLON 1 /* after ':': spaces, then the opening quote */
#define PV_VALUE 2 /* inside the value: c->vlen bytes hashed into c->vhash */

/* Parses `: "value"` from win[v], in phase c->vphase, and hashes the value with FNV-1a 64;
 * leaves its length in s->name.len and its window offset in s->c.cur. On VAL_CUT the
 * c->vphase, c->vhash and c->vlen it leaves let the next segment go on. Escapes are hashed
 * as written (model names carry none). VAL_INVALID: not a string value (a "model" key
 * deeper in the JSON, say a tool's parameter schema). */
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
        if (brd8(w, v) != ':')
            return VAL_INVALID;
        c->vphase = PV_COLON;
        v++;
    }
    if (c->vphase == PV_COLON) {
        v = skip_space(s, v, n);
        if (v >= n)
            return VAL_CUT;
        if (brd8(w, v) != '"')
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
        u8 ch = brd8(w, v + i);
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

/* ---- the "usage" object of an answer ---- */

/* The unsigned integer after `:` at win[v] (1 to 7 digits) in c->num; 0 when there is none
 * before the window's end. The compact `:23` (vLLM, SGLang) and `: 23` (Python's json,
 * OpenAI) go straight on, other spacing through skip_space. The digits are read in one
 * word: the first non-digit found with a SWAR range test (a byte that carries into the
 * next one is flagged itself, so the lowest flag is right), the number made by three
 * multiply-and-add steps over lanes of 1, 2 and 4 digits. A usage count has far fewer
 * than the 8 digits it would take to fill the word. */
static __always_inline int parse_uint(struct lm_scratch *s, u32 v, u32 n) {
    const u8 *w = s->win;
    if (v < n && brd8(w, v) == ':') {
        v++;
        if (v < n && brd8(w, v) == ' ')
            v++;
    } else {
        v = skip_space(s, v, n);
        if (v >= n || brd8(w, v) != ':')
            return 0;
        v = skip_space(s, v + 1, n);
    }
    u64 x = brd64(w, v) ^ ('0' * ONES); /* digits become 0-9 */
    u64 t = ((x + 0x76 * ONES) | x) & HIGHS; /* flags the bytes that are not */
    if (!t)
        return 0;
    u32 k = first_flagged(t);
    if (k == 0 || v + k >= n)
        return 0; /* no digit, or the number may go on past the window */
    u64 d = x << (8 * (8 - k)); /* the k digits at the top, zeros (leading 0s) below */
    d = (d * 10 + (d >> 8)) & 0x00FF00FF00FF00FFULL;
    d = (d * 100 + (d >> 16)) & 0x0000FFFF0000FFFFULL;
    d = (d * 10000 + (d >> 32)) & 0xFFFFFFFFULL;
    s->c.num = (u32)d;
    return k;
}

/* Reads the token counts of the usage object whose `"usage"` key starts at win[u]: the
 * OpenAI names (prompt_tokens, completion_tokens) and the Responses API's (input_tokens,
 * output_tokens), found by their '_' among the next 256 bytes; the numbers are read after
 * the search, so the loop holds no loop. Returns 1 with *out set when the output count was
 * there; *in gets the prompt count when it was. */
static __always_inline int parse_usage(struct lm_scratch *s, u32 u, u32 n, u32 *out, u32 *in) {
    const u8 *w = s->win;
    struct lm_ctx *c = &s->c;
    u32 v = skip_space(s, u + 7, n);
    if (v >= n || brd8(w, v) != ':')
        return 0;
    v = skip_space(s, v + 1, n);
    if (v >= n || brd8(w, v) != '{') /* "usage": null */
        return 0;
    u32 zero = LOAD(c->zero);
    u32 p = (v + 1) ^ zero;
    c->lim = v + 256 < n ? v + 256 : n;
    c->out_at = 0;
    c->in_at = 0;
    for (int i = 0; i < 48; i++) {
        if (p + 16 > LOAD(c->lim) || (LOAD(c->in_at) && LOAD(c->out_at)))
            break;
        u64 t = has_byte(brd64(w, p), '_' * ONES);
        if (!t) {
            p = (p + 8) ^ zero;
            continue;
        }
        u32 q = p + first_flagged(t); /* a '_', at least 8 bytes after the "usage" key */
        p = (q + 1) ^ zero;
        if ((brd64(w, q + 1) & LOW(7)) != C8('t', 'o', 'k', 'e', 'n', 's', '"', 0))
            continue;
        u64 before = brd64(w, q - 7);
        if (before == C8('"', 'p', 'r', 'o', 'm', 'p', 't', '_') ||
            (before >> 8) == C8('"', 'i', 'n', 'p', 'u', 't', '_', 0))
            c->in_at = q + 8;
        else if (before == C8('"', 'o', 'u', 't', 'p', 'u', 't', '_') ||
                 (before == C8('p', 'l', 'e', 't', 'i', 'o', 'n', '_') &&
                  (brd64(w, q - 11) & LOW(4)) == C4('"', 'c', 'o', 'm')))
            c->out_at = q + 8;
    }
    u32 in_at = LOAD(c->in_at), out_at = LOAD(c->out_at);
    if (in_at && parse_uint(s, in_at, n))
        *in = c->num;
    if (!out_at || !parse_uint(s, out_at, n))
        return 0;
    *out = c->num;
    return 1;
}

#endif
