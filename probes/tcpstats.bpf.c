/* loadmesh TCP signals per serving port, from tracepoints (kprobes and fentry are not
 * available on the target kernels). Compiled after the http*.bpf.c parts in one text (see
 * http.bpf.c): it uses their serving_ports bitmap and port_stats map. Tracepoints see every
 * network namespace of the host, so a client and a server on the same host both count
 * (opened and accepted). */

#define LM_TCP_ESTABLISHED 1
#define LM_TCP_SYN_SENT 2
#define LM_TCP_SYN_RECV 3

static __always_inline struct lm_port_stats *port_entry(u16 port) {
    u32 k = port;
    struct lm_port_stats *v = port_stats.lookup(&k);
    if (v)
        return v;
    struct lm_port_stats zero = {};
    port_stats.update(&k, &zero);
    return port_stats.lookup(&k);
}

/* The serving port among a connection's two, or 0. */
static __always_inline u16 serving_of(u16 a, u16 b) {
    if (serving(a))
        return a;
    if (serving(b))
        return b;
    return 0;
}

TRACEPOINT_PROBE(sock, inet_sock_set_state) {
    if (args->protocol != IPPROTO_TCP || args->newstate != LM_TCP_ESTABLISHED)
        return 0;
    if (args->oldstate == LM_TCP_SYN_RECV && serving(args->sport)) {
        struct lm_port_stats *v = port_entry(args->sport);
        if (v)
            v->conns_accepted += 1;
    } else if (args->oldstate == LM_TCP_SYN_SENT && serving(args->dport)) {
        struct lm_port_stats *v = port_entry(args->dport);
        if (v)
            v->conns_opened += 1;
    }
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb) {
    u16 port = serving_of(args->sport, args->dport);
    if (port) {
        struct lm_port_stats *v = port_entry(port);
        if (v)
            v->retransmits += 1;
    }
    return 0;
}

/* Since 6.10 the tcp_send_reset record has an `enum sk_rst_reason` field; BCC declares the
 * record from tracefs, so the enum must be complete here. The loader says which applies. */
#if defined(LM_RST_REASON_HEADER)
#include <net/rstreason.h>
#elif defined(LM_RST_REASON_ENUM)
enum sk_rst_reason { LM_RST_REASON_UNUSED };
#endif

TRACEPOINT_PROBE(tcp, tcp_send_reset) {
#ifdef LM_SEND_RESET_SOCKADDR
    /* kernels >= 6.10 record struct sockaddr_in/in6: the port follows the family */
    u16 sport = (u16)args->saddr[2] << 8 | args->saddr[3];
    u16 dport = (u16)args->daddr[2] << 8 | args->daddr[3];
#else
    u16 sport = args->sport, dport = args->dport;
#endif
    u16 port = serving_of(sport, dport);
    if (port) {
        struct lm_port_stats *v = port_entry(port);
        if (v)
            v->resets_sent += 1;
    }
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_receive_reset) {
    u16 port = serving_of(args->sport, args->dport);
    if (port) {
        struct lm_port_stats *v = port_entry(port);
        if (v)
            v->resets_received += 1;
    }
    return 0;
}
