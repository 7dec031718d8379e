/* Layouts and constants shared by the kernel probes (http.bpf.c) and user space.
 *
 * This header is the one source of truth: BCC compiles it with the probes and builds the
 * ctypes of every map key and value from these structs, and probes/abi.py reads the LM_*
 * #defines below (plain `#define NAME number` lines, one per line: keep them that way).
 * Sizes that the agent configures (map entries, scan limit, histogram resolution) are not
 * here: the loader passes them with -D, so changing them needs no edit of this file.
 */
#ifndef LOADMESH_H
#define LOADMESH_H

/* Segment bytes copied into per-CPU scratch for one head: an inference client's request
 * head (request line, host, auth token, content type and length) and a server's response
 * head fit in it; a power of two lets the verifier bound masked offsets. */
#define LM_WIN 512
/* Bytes copied for one step of a body search (request bodies for "model", streamed answers
 * for SSE events): a 64 KiB body, the most one segment carries, takes 16 of the 30 steps. */
#define LM_BWIN 4096
/* Bytes first copied for a head on a flow that has no hint from its previous head yet;
 * copying costs about 0.3 ns a byte, so heads are copied to their end and little more. */
#define LM_HEAD_WIN 256
/* Body bytes copied beyond a request head for the model scan: clients that put "model"
 * first in the JSON (most) need no second copy. */
#define LM_BODY_PEEK 96
/* Longest model name kept (and hashed). Real model ids ("meta-llama/Llama-3.1-70B-
 * Instruct", paths to checkpoints) stay well under it; a longer value counts as no model. */
#define LM_NAME_MAX 128
/* Requests one connection may have outstanding with their own start time and model. HTTP/1
 * pipelining clients rarely go past a few; beyond it requests are still counted once. */
#define LM_PIPE_DEPTH 8
/* Parsing steps (tail calls) per segment: each step handles one unit (a head, a window of
 * body search, a run of chunk headers, an answer's end). The kernel allows 33 tail calls
 * per packet; the entry program uses one. */
#define LM_MAX_STEPS 30
/* Chunk-size lines followed in one step of a chunked (streaming) response. */
#define LM_CHUNK_HOPS 16
/* Last bytes of a JSON answer (Content-Length) searched for its "usage" object: servers
 * put it at the end (vLLM: then three short keys, about 80 bytes). */
#define LM_USAGE_TAIL 512

/* Rows of the model figures kept, beyond the configured number (LM_ROWS), for model-less
 * rows ("-") made once the others are all taken: a port's few endpoints and statuses. */
#define LM_SPARE_ROWS 16

/* Endpoint classes, from the request path: the unit of a model's figures, so that
 * scrapes of a server's /metrics and health checks never mix with inference. */
#define LM_EP_OTHER 0
#define LM_EP_CHAT 1        /* /v1/chat/completions */
#define LM_EP_COMPLETIONS 2 /* /v1/completions */
#define LM_EP_EMBEDDINGS 3  /* /v1/embeddings */
#define LM_EP_RESPONSES 4   /* /v1/responses */
#define LM_EP_GENERATE 5    /* /generate, /generate_stream (TGI's and SGLang's own API) */
#define LM_EP_COUNT 6

/* Histogram kinds (lm_row.hist[bucket * LM_HK_COUNT + kind]): what the latency measures,
 * from the request's first byte on the wire. */
#define LM_HK_TTFB 0 /* to the answer's first byte */
#define LM_HK_TTFT 1 /* to a stream's first SSE data: event */
#define LM_HK_ITL 2  /* between consecutive data: events of a stream */
#define LM_HK_E2E 3  /* to the answer's last byte */
#define LM_HK_COUNT 4

/* How a request ended (lm_req_stats.outcomes). */
#define LM_OUT_COMPLETE 0   /* its answer ended where its framing said */
#define LM_OUT_ERROR 1      /* a data: event carried {"error": ...} inside the stream */
#define LM_OUT_ABORTED 2    /* the client closed or reset the connection before the end */
#define LM_OUT_TRUNCATED 3  /* the server closed or reset it in the middle of the answer */
#define LM_OUT_UNANSWERED 4 /* the server closed or reset it before the answer began */
#define LM_OUT_COUNT 5

/* Indexes of the `errors` per-CPU array: what went wrong, counted, never silent. */
#define LM_ERR_FP_FULL 0          /* a fingerprints row could be neither made nor found */
#define LM_ERR_ROWS_FULL 1        /* rows all taken: a new row's figures went to "-", or dropped */
#define LM_ERR_MODELS_FULL 2      /* models map full: a model's name is not shown */
#define LM_ERR_SCAN_GAVE_UP 3     /* a body longer than the scan limits held no "model" in them */
#define LM_ERR_MODEL_TOO_LONG 4   /* "model" value longer than LM_NAME_MAX */
#define LM_ERR_MODEL_LOST 5       /* "model" cut by a segment end, and the bytes after it lost */
#define LM_ERR_RESP_NO_REQ 6      /* response with no request waiting for it */
#define LM_ERR_PIPE_OVERFLOW 7    /* request beyond LM_PIPE_DEPTH outstanding */
#define LM_ERR_FRAMING_LOST 8     /* expected a head where the framing pointed, found none */
#define LM_ERR_STEPS_EXHAUSTED 9  /* segment needed more than LM_MAX_STEPS steps */
#define LM_ERR_EVENT_CUT 10       /* a data: event cut by a segment end: taken as a token */
#define LM_ERR_COUNT 11

/* lm_flow_state.flags */
#define LM_F_REQ_FRAMED 1    /* req_next is where the next request head starts */
#define LM_F_AWAIT_MODEL 2   /* newest request's body is still being scanned for "model" */
#define LM_F_RESP_SYNCED 4   /* resp_hwm is valid */
#define LM_F_RESP_FRAMED 8   /* resp_next: the answer's end, or the next head (or chunk line) */
#define LM_F_RESP_CHUNKED 16 /* resp_next points at a chunk-size line */
#define LM_F_UPGRADED 32     /* 101 Switching Protocols: the connection left HTTP/1 */
#define LM_F_FIN_CLIENT 64
#define LM_F_FIN_SERVER 128
#define LM_F_TAIL_SCAN 256   /* the model search moved on to the body's last LM_SCAN_LIMIT bytes */
#define LM_F_KEY_CARRY 512   /* carry: the last 7 bytes searched, a "model" key may go on */
#define LM_F_VAL_CARRY 1024  /* carry: FNV-1a of a "model" value cut by the segment end */

/* lm_flow_state.aflags: the answer being sent, the oldest outstanding request's. */
#define LM_A_ACTIVE 1  /* its head was seen and its last byte not yet */
#define LM_A_SSE 2     /* Content-Type: text/event-stream */
#define LM_A_FIRST 4   /* its first data: event passed: the request is running, no longer waiting */
#define LM_A_USAGE 8   /* a "usage" object gave its output tokens */
#define LM_A_ERROR 16  /* a data: event carried an error */
#define LM_A_CLOSE 32  /* its body ends with the connection (no length, not chunked) */
#define LM_A_JSON 64   /* Content-Type: application/json: its tail may hold "usage" */
#define LM_A_CARRY 128 /* sse_carry holds the last 7 bytes searched for "\ndata:" */
#define LM_A_DONE 256  /* data: [DONE] passed */

/* A TCP connection as seen from the server: IPv4 addresses are stored IPv4-mapped
 * (::ffff:a.b.c.d) so both families share one key. Ports in host byte order. Aligned to 8
 * (its size and layout are the same): clang then fills and copies it a word at a time,
 * where at its natural alignment of 2 it took twenty 2-byte stores per packet. */
struct lm_flow {
    __u8 client[16];
    __u8 server[16];
    __u16 client_port;
    __u16 server_port;
    __u8 proto;
    __u8 pad[3];
} __attribute__((aligned(8)));

struct lm_req {
    __u64 start_ns; /* bpf_ktime_get_ns() at the segment holding the request's first byte */
    __u64 model_id; /* FNV-1a 64 of the "model" value; 0 while unknown or absent */
};

/* Value of `inflight`. Sequence numbers are TCP sequence numbers of the payload. */
struct lm_flow_state {
    struct lm_req ring[LM_PIPE_DEPTH]; /* outstanding requests, oldest at head % depth */
    __u8 ep[LM_PIPE_DEPTH];            /* their endpoint classes (LM_EP_*) */
    __u64 overflow_ns;  /* start of the oldest request queued beyond the ring */
    __u32 head;         /* free-running ring positions: tail - head = requests in ring */
    __u32 tail;
    __u32 overflow;     /* requests beyond the ring: answered after the ring drains */
    __u32 req_hwm;      /* first request-direction byte not seen yet */
    __u32 req_next;     /* where the next request head starts (LM_F_REQ_FRAMED) */
    __u32 resp_hwm;     /* first response-direction byte not seen yet (LM_F_RESP_SYNCED) */
    __u32 resp_next;    /* see LM_F_RESP_FRAMED */
    __u32 scan_left;    /* body bytes the newest request's model scan may still read */
    __u16 flags;        /* LM_F_* */
    __u8 head_mask;     /* ring slots holding HEAD requests: their responses have no body */
    __u8 pad;
    __u16 req_win;      /* bytes to copy for the next request head: the last head's length */
    __u16 resp_win;     /* plus some slack, so a keep-alive flow copies little beyond it */
    /* A "model" key or value cut by the end of a segment, for the next one to finish
     * (LM_F_KEY_CARRY, LM_F_VAL_CARRY): the bytes, or the value's hash so far. */
    __u64 carry;
    __u8 carry_len;   /* LM_F_VAL_CARRY: value bytes hashed */
    __u8 carry_phase; /* LM_F_VAL_CARRY: where parse_value stopped (PV_*) */
    __u8 pad2[6];
    /* The answer being sent (LM_A_ACTIVE): to the oldest outstanding request. */
    __u64 ans_start;  /* its request's start_ns */
    /* Its request's model_id and endpoint; also while no answer is being sent, those of
     * the oldest outstanding request (not beyond the ring): the reader counts a connection
     * with one request outstanding, nearly every busy one, from these fixed fields. */
    __u64 ans_model;
    __u64 event_ns;   /* its last data: event */
    __u64 sse_carry;  /* its last 7 bytes searched, oldest in the low byte (LM_A_CARRY) */
    __u32 events;     /* its data: events, [DONE] and errors left out */
    __u32 out_tokens; /* usage: completion_tokens (or output_tokens) */
    __u32 in_tokens;  /* usage: prompt_tokens (or input_tokens) */
    __u32 ans_row;    /* its row in row_data + 1, from its head on; 0: no row (rows full) */
    __u16 status;
    __u16 aflags;     /* LM_A_* */
    __u8 ans_ep;      /* see ans_model */
    __u8 pad3;
    /* The flow's row of `fingerprints` (the model and status of its latest answers) while
     * it is only here: added to the map when the model or status changes and when the
     * connection ends, so a keep-alive connection's run of like answers costs no map
     * operation each. A dump adds these to the map's rows (probes/maps.py). */
    __u16 fp_status;
    __u32 fp_count;
    __u64 fp_model;
    __u64 fp_lat_sum;
    __u64 fp_lat_max;
    __u64 fp_last; /* like lm_fp_val.last_ns */
};

struct lm_fp_key {
    struct lm_flow flow;
    __u64 model_id;
    __u16 status;
    __u8 pad[6];
};

struct lm_fp_val {
    __u64 count;
    __u64 lat_sum_ns;
    __u64 lat_max_ns;
    __u64 last_ns; /* bpf_ktime_get_ns() of the last response (CLOCK_MONOTONIC) */
};

/* A row of the model figures: model, serving port (one host may serve a model on several),
 * endpoint and status. `rows` gives its index in `row_data`. */
struct lm_row_key {
    __u64 model_id;
    __u16 port;
    __u16 status;  /* of the answer; 0 for requests that ended before an answer began */
    __u8 endpoint; /* LM_EP_* */
    __u8 pad[3];
};

/* How a row's requests ended and the tokens their usage objects reported. Output tokens
 * of streams without usage come from their data: events (the TTFT and ITL samples);
 * usage_events says how many of those the usage replaces. e2e_ns and e2e_tokens give, over
 * the answers whose end was seen, the time a request spends in the server per output
 * token: the same figure whether it streamed or not. */
struct lm_req_stats {
    __u64 outcomes[LM_OUT_COUNT];
    __u64 usage_answers; /* answers whose usage gave their output tokens */
    __u64 usage_events;  /* the data: events of those answers */
    __u64 output_tokens; /* from usage */
    __u64 prompt_tokens; /* from usage */
    __u64 e2e_ns;        /* request's first byte to answer's last, over the answers timed so */
    __u64 e2e_tokens;    /* their output tokens (usage, else data: events) */
};

/* Value of `row_data`: a row's outcomes and usage, and its latency histograms, one per
 * kind (LM_HK_*), in log-linear buckets of ns (probes/buckets.py; LM_HIST_BUCKETS comes
 * from the loader with the layout's other figures). The kinds interleave, bucket by
 * bucket (hist[bucket * LM_HK_COUNT + kind]): an answer's ttfb and e2e, nearly always in
 * one bucket, are then added in one cache line. One dimension: BCC's ctypes of a
 * two-dimensional array keep only the first. */
struct lm_row {
    struct lm_req_stats req;
    __u64 hist[LM_HIST_BUCKETS * LM_HK_COUNT];
};

/* An entry of `row_cache`: a row key this CPU has resolved lately, and its index + 1
 * (0: empty). */
struct lm_row_slot {
    struct lm_row_key key;
    __u32 row;
    __u32 pad;
};

struct lm_model_name {
    __u32 len;
    char name[LM_NAME_MAX];
};

/* Per serving port, from tracepoints (all network namespaces of the host). */
struct lm_port_stats {
    __u64 conns_accepted;  /* SYN_RECV -> ESTABLISHED on a local server socket */
    __u64 conns_opened;    /* SYN_SENT -> ESTABLISHED on a local client socket */
    __u64 retransmits;
    __u64 resets_sent;
    __u64 resets_received;
};

#endif
