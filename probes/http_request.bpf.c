/* Part of the HTTP probe (http.bpf.c): the request direction. A request head (method,
 * path, Content-Length or chunked), then its body searched for the JSON "model" in windows,
 * across segments where it must; the model's name is kept once per model. */

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
