/* Part of the HTTP probe (http.bpf.c): the response direction. A status line and head
 * (time to first byte), the framing of the body (Content-Length or chunk lines, followed
 * by TCP sequence), an answer's end and its "usage". */

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
            st->ans_row = row_index(st->ans_model, c->flow.server_port, st->ans_ep, status);
            record_flow(c, st, st->ans_model, status, now - st->ans_start);
            sample(c, st, LM_HK_TTFB, now - st->ans_start, 1);
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

/* An answer's body goes on in this segment, framed: follows its chunk lines and, where
 * its end is in the segment, puts it in c->aend. Returns STEP_RESP when there are more
 * chunk lines than one step follows (the next step goes on), else STEP_NONE. */
static __always_inline int framed_body(struct __sk_buff *skb, struct lm_scratch *s,
                                       struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    if ((st->flags & LM_F_RESP_CHUNKED) && !c->hopped) {
        chunk_hops(skb, s, st);
        if (!c->hopped)
            return STEP_RESP;
    }
    s32 r = (s32)(st->resp_next - c->seq);
    if ((st->flags & (LM_F_RESP_FRAMED | LM_F_RESP_CHUNKED)) == LM_F_RESP_FRAMED &&
        r >= 0 && r <= (s32)c->len)
        c->aend = r < (s32)c->pos ? c->pos : (u32)r;
    return STEP_NONE;
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
    } else if (framed_body(skb, s, st) == STEP_RESP) {
        return STEP_RESP;
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
