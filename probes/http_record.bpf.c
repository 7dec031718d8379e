/* Part of the HTTP probe (http.bpf.c): what a request leaves in the maps. The row of the
 * model figures its answer counts in (outcome, usage, latency samples), the flow's row,
 * the connection's queue of outstanding requests and how it ends. Every step program ends
 * in dispatch(), which is here too. */

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

/* ---- rows of the model figures ---- */

/* A new row for k, as its index + 1. When every row is taken, k's figures go to the
 * model-less row ("-") of its port, endpoint and status, made from the spare indexes if it
 * has none yet: an attacker naming a new model in each request fills the rows, and the
 * models that come after are then counted, only not by name. 0 when the spares are taken
 * too: the figures are dropped. Both counted (rows_full). */
static __always_inline u32 new_row(struct lm_row_key *k) {
    u32 row;
    if (free_rows.pop(&row) == 0) {
        if (rows.insert(k, &row) != 0)
            free_rows.push(&row, 0); /* another CPU made the row meanwhile */
    } else {
        err(LM_ERR_ROWS_FULL);
        k->model_id = 0;
        u32 *r = rows.lookup(k);
        if (r)
            return *r + 1;
        if (spare_rows.pop(&row) != 0)
            return 0;
        if (rows.insert(k, &row) != 0)
            spare_rows.push(&row, 0);
    }
    u32 *r = rows.lookup(k); /* this CPU's, or another's made meanwhile */
    return r ? *r + 1 : 0;
}

/* The row of a model, serving port, endpoint and status, as its index + 1 (see new_row);
 * 0 for none. */
static __always_inline u32 row_index(u64 model, u16 port, u8 ep, u16 status) {
    struct lm_row_key k = {.model_id = model, .port = port, .status = status, .endpoint = ep};
    u64 tag = *(u64 *)&k.port; /* port, status, endpoint and the zero pad in one word */
    u32 slot = ((model ^ tag) * 0x9E3779B97F4A7C15ULL) >> (64 - ROW_SLOT_BITS);
    struct lm_row_slot *cs = row_cache.lookup(&slot);
    if (cs && cs->row && cs->key.model_id == model && *(u64 *)&cs->key.port == tag)
        return cs->row;
    u32 *r = rows.lookup(&k);
    u32 row;
    if (r) {
        row = *r + 1;
    } else {
        struct lm_row_key made = k;
        row = new_row(&made);
    }
    if (row && cs) {
        __builtin_memcpy(&cs->key, &k, sizeof(k));
        cs->row = row;
    }
    return row;
}

/* The row an index + 1 names; 0 for none. */
static __always_inline struct lm_row *row_at(u32 row) {
    if (!row)
        return 0;
    u32 i = row - 1;
    return row_data.lookup(&i);
}

/* n samples of latency lat (ns) of one kind for the answer being sent. */
static __always_inline void sample(struct lm_ctx *c, struct lm_flow_state *st, u8 kind,
                                   u64 lat, u64 n) {
    struct lm_row *r = row_at(st->ans_row);
    if (!r)
        return; /* rows_full, counted at its head */
    /* through the scratch: lm_bucket's 64 paths leave one state behind */
    c->cur = lm_bucket(lat);
    u32 i = LOAD(c->cur) * LM_HK_COUNT + kind;
    if (i < LM_HIST_BUCKETS * LM_HK_COUNT)
        __sync_fetch_and_add(&r->hist[i], n);
}

/* Adds the flow's row kept in its state (lm_flow_state.fp_*) to `fingerprints`. */
static __always_inline void flush_flow_row(struct lm_ctx *c, struct lm_flow_state *st) {
    if (!st->fp_count)
        return;
    struct lm_fp_key k = {};
    __builtin_memcpy(&k.flow, &c->flow, sizeof(k.flow));
    k.model_id = st->fp_model;
    k.status = st->fp_status;
    struct lm_fp_val *v = fingerprints.lookup(&k);
    if (!v) {
        /* A new row is born whole: one map operation, not three. */
        struct lm_fp_val first = {.count = st->fp_count, .lat_sum_ns = st->fp_lat_sum,
                                  .lat_max_ns = st->fp_lat_max, .last_ns = st->fp_last};
        if (!fingerprints.insert(&k, &first))
            goto done;
        v = fingerprints.lookup(&k); /* another CPU made it meanwhile */
        if (!v) {
            err(LM_ERR_FP_FULL);
            goto done;
        }
    }
    __sync_fetch_and_add(&v->count, st->fp_count);
    __sync_fetch_and_add(&v->lat_sum_ns, st->fp_lat_sum);
    /* Racy across CPUs (a larger max written at once elsewhere may be lost), as last_ns:
     * both are for the operator's eye, no figure depends on them. */
    if (st->fp_lat_max > v->lat_max_ns)
        v->lat_max_ns = st->fp_lat_max;
    v->last_ns = st->fp_last;
done:
    st->fp_count = 0;
}

/* The flow's row: one more answer of this model and status, with its time to first byte,
 * counted in the connection's state while the model and status stay (a server of one
 * model: nearly always). In the map at each answer, the row was 9% of the probes' time per
 * request on wrk's traffic (docs/probes.md, "Measured costs"). */
static __always_inline void record_flow(struct lm_ctx *c, struct lm_flow_state *st, u64 model,
                                        u16 status, u64 lat) {
    if (st->fp_count && (st->fp_model != model || st->fp_status != status))
        flush_flow_row(c, st);
    if (!st->fp_count) {
        st->fp_model = model;
        st->fp_status = status;
        st->fp_lat_sum = 0;
        st->fp_lat_max = 0;
    }
    st->fp_count++;
    st->fp_lat_sum += lat;
    if (lat > st->fp_lat_max)
        st->fp_lat_max = lat;
    st->fp_last = c->now;
}

/* A request that ended with no answer begun: it has no latency, only an outcome. */
static __always_inline void count_ended(u64 model, u16 port, u8 ep, u32 outcome, u64 n) {
    struct lm_row *r = row_at(row_index(model, port, ep, 0));
    if (r)
        __sync_fetch_and_add(&r->req.outcomes[outcome % LM_OUT_COUNT], n);
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
    if (timed)
        sample(c, st, LM_HK_E2E, e2e, 1);
    if ((st->aflags & LM_A_ERROR) && outcome == LM_OUT_COMPLETE)
        outcome = LM_OUT_ERROR;
    struct lm_row *r = row_at(st->ans_row);
    if (r) {
        struct lm_req_stats *v = &r->req;
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
    flush_flow_row(c, st);
    if (c->rst || !from_client)
        inflight.delete(&c->flow);
}

/* Every step ends here: the next step of the segment, if any, then the connection's end
 * when the segment carried FIN or RST.
 *
 * One call site per step, each with a constant index: the verifier then has the JIT jump
 * straight to the step, where a computed index jumps through a retpoline (this kernel,
 * like most, has them on). The empty asm after each call is a different statement per
 * step, so that clang cannot merge the calls back into one with a computed index. The
 * cases are written out: BCC rewrites `lm_steps.call` where it is written, not inside a
 * macro (one such macro did not compile). Measured
 * in turn with the computed index (bench_probe_steps.py, six pairs of runs): a request and
 * its JSON answer 936 -> 911 ns, a stream of eight events 4525 -> 4300 ns. */
static __always_inline int dispatch(struct __sk_buff *skb, struct lm_ctx *c, int next) {
    switch (next) {
    case STEP_REQ:
        lm_steps.call(skb, STEP_REQ);
        asm volatile("// step_req" ::: "memory");
        break;
    case STEP_RESP:
        lm_steps.call(skb, STEP_RESP);
        asm volatile("// step_resp" ::: "memory");
        break;
    case STEP_SSE:
        lm_steps.call(skb, STEP_SSE);
        asm volatile("// step_sse" ::: "memory");
        break;
    case STEP_BODY:
        lm_steps.call(skb, STEP_BODY);
        asm volatile("// step_body" ::: "memory");
        break;
    case STEP_USAGE:
        lm_steps.call(skb, STEP_USAGE);
        asm volatile("// step_usage" ::: "memory");
        break;
    }
    if (c->fin || c->rst)
        lm_steps.call(skb, STEP_CLOSE);
    return PASS;
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
