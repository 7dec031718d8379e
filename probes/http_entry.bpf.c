/* Part of the HTTP probe (http.bpf.c): the programs TC runs. Per packet: L2 to L4, the
 * serving-port test first, then the connection's state and the tail call to the
 * direction's first step. */

/* Copies a header into *dst: straight from the skb's linear data, where the headers nearly
 * always are, else with bpf_skb_load_bytes (which also reads paged data, but costs a helper
 * call each time). Returns 0 on success. The source is read as the header's own type, so
 * clang copies it in 4-byte words (read from a byte pointer, it was copied byte by byte:
 * 60 instructions per header). The words may be unaligned (an IP header after a 14-byte
 * Ethernet header): the verifier allows that on CPUs that read them well (x86, arm64). */
#define COPY_HDR(skb, off, dst)                                                              \
    ({                                                                                       \
        u8 *data_ = (u8 *)(long)(skb)->data;                                                 \
        u8 *at_ = data_ + (off);                                                             \
        int rc_ = 0;                                                                         \
        if (at_ + sizeof(*(dst)) <= (u8 *)(long)(skb)->data_end)                             \
            __builtin_memcpy((dst), (const typeof(*(dst)) *)at_, sizeof(*(dst)));           \
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

/* The segment's time when the kernel already holds it: TCP stamps each segment it sends
 * with its departure time (CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns; later than now
 * only when paced), and the stamp stays with the segment through TC egress and, across a
 * veth, to the other namespace's ingress. Taking it spares the clock read, ~40 ns on this
 * machine, as much as the flow lookup. 0 where there is none (a segment from a NIC: no
 * stamp, or a realtime receive stamp): seg_time() reads the clock then. */
static __always_inline u64 stamped(struct __sk_buff *skb) {
    return skb->tstamp_type == BPF_SKB_TSTAMP_DELIVERY_MONO ? skb->tstamp : 0;
}

/* Whether a response segment's payload starts like one chunk of a stream's events: a
 * chunk-size line of 1 to 4 hex digits, then "data:". Such a segment goes straight to
 * lm_sse, which checks it against the connection's state and hands anything else to
 * lm_resp: for each event of a stream that spares lm_resp's program, its tail call and
 * its lookup, and an event is about every other segment the probes see. Read straight
 * from the linear data (a copy would cost a helper call on every answer's segment). */
static __always_inline int sse_chunk(struct __sk_buff *skb, u32 poff) {
    u8 *p = (u8 *)(long)skb->data + poff;
    if (p + 16 > (u8 *)(long)skb->data_end)
        return 0;
    u64 a = *(u64 *)p, b = *(u64 *)(p + 8);
#pragma unroll
    for (int j = 1; j <= 4; j++) {
        /* the 7 bytes "\r\ndata:" at offset j of the 16 */
        u64 at = (a >> (8 * j)) | (b << (64 - 8 * j));
        if ((at & LOW(7)) == C8('\r', '\n', 'd', 'a', 't', 'a', ':', 0))
            return 1;
    }
    return 0;
}

/* Per packet of the interface, what comes first is the one test most packets fail: is
 * either port served? It costs two header copies and two bitmap reads (array lookups the
 * JIT inlines: no helper call). Then whether the segment carries anything: a bare ACK
 * leaves there. The scratch and the addresses are touched only past both. */
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
    u32 poff = l4 + th.doff * 4;
    if (ip_end > skb->len)
        ip_end = skb->len;
    u32 len = ip_end > poff ? ip_end - poff : 0;
    /* A bare ACK, about every other segment of a stream: nothing to parse, nothing ends.
     * It leaves before the scratch and the 5-tuple are touched. */
    if (len == 0 && !(th.syn | th.fin | th.rst))
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
            c->now = stamped(skb);
            c->dir = dir;
            lm_steps.call(skb, STEP_CLOSE);
        }
        return PASS;
    }
    c->len = len;
    c->fin = th.fin;
    c->rst = th.rst;
    c->now = stamped(skb);
    c->dir = dir;
    if (len == 0) { /* FIN or RST */
        lm_steps.call(skb, STEP_CLOSE);
        return PASS;
    }
    c->poff = poff;
    c->seq = bpf_ntohl(th.seq);
    c->pos = 0;
    c->steps = 0;
    c->hcont = 0;
    /* constant indexes, each at its own call site: see dispatch() */
    if (dir == STEP_REQ) {
        lm_steps.call(skb, STEP_REQ);
        asm volatile("// req" ::: "memory");
    } else if (sse_chunk(skb, poff)) {
        lm_steps.call(skb, STEP_SSE);
        asm volatile("// sse" ::: "memory");
    } else {
        lm_steps.call(skb, STEP_RESP);
        asm volatile("// resp" ::: "memory");
    }
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
