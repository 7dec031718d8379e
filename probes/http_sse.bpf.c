/* Part of the HTTP probe (http.bpf.c): a streamed answer's SSE events. Each data: event
 * is a token (time to first token, inter-token gaps), [DONE] or an error; a final event's
 * "usage" is read by lm_usage. */

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

/* A segment the entry sent here straight (sse_chunk): the events of a chunked stream go
 * on, if the connection's state agrees; lm_resp takes anything else, as it would have
 * from the entry. */
static __always_inline int sse_first_step(struct __sk_buff *skb, struct lm_scratch *s,
                                          struct lm_flow_state *st) {
    struct lm_ctx *c = &s->c;
    if ((st->aflags & (LM_A_ACTIVE | LM_A_SSE)) != (LM_A_ACTIVE | LM_A_SSE) ||
        (st->flags & (LM_F_UPGRADED | LM_F_RESP_FRAMED | LM_F_RESP_CHUNKED)) !=
            (LM_F_RESP_FRAMED | LM_F_RESP_CHUNKED))
        return STEP_RESP;
    c->aend = NOWHERE;
    if (framed_body(skb, s, st) == STEP_RESP)
        return STEP_RESP;
    u32 lim = c->aend < c->len ? c->aend : c->len;
    return c->pos < lim ? STEP_SSE : STEP_RESP;
}

int lm_sse(struct __sk_buff *skb) {
    u32 zero = 0;
    struct lm_scratch *s = scratch.lookup(&zero);
    if (!s)
        return PASS;
    struct lm_flow_state *st = resp_enter(skb, s);
    if (st && s->c.steps == 1 && sse_first_step(skb, s, st) == STEP_RESP)
        return dispatch(skb, &s->c, STEP_RESP);
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
