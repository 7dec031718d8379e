"""Crafted TCP segments for the probes, run one at a time through BPF_PROG_TEST_RUN: the
real entry program, maps and tail-called steps, fed exact bytes with no network stack
between. Used by tests/test_probe_crafted.py and scripts/bench_probe_steps.py.

    conn = Connection(40000)
    ns = test_run(probes.program_fd("lm_tc_eth"), conn.request(b"POST / HTTP/1.1..."))
"""

from __future__ import annotations

import ctypes
import os
import struct

CLIENT, SERVER = bytes([10, 9, 0, 1]), bytes([10, 9, 0, 2])
BPF_PROG_TEST_RUN = 10
SYS_BPF = {"x86_64": 321, "aarch64": 280}[os.uname().machine]  # bpf(2)


class TestRunAttr(ctypes.Structure):
    """union bpf_attr's test member (include/uapi/linux/bpf.h)."""

    _fields_ = [("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
                ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),
                ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32),
                ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32),
                ("batch_size", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)


def test_run(prog_fd: int, frame: bytes) -> int:
    """One run of a TC program on one frame; the kernel's duration of it in ns."""
    data = ctypes.create_string_buffer(frame, len(frame))
    out = ctypes.create_string_buffer(len(frame) + 256)
    attr = TestRunAttr(prog_fd=prog_fd, data_in=ctypes.addressof(data),
                       data_size_in=len(frame), data_out=ctypes.addressof(out),
                       data_size_out=len(out), repeat=1)
    if _libc.syscall(SYS_BPF, BPF_PROG_TEST_RUN, ctypes.byref(attr), ctypes.sizeof(attr)) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"BPF_PROG_TEST_RUN: {os.strerror(err)}")
    return attr.duration


test_run.__test__ = False  # type: ignore[attr-defined]  # not a test for pytest to collect


def _checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


def frame(src: bytes, dst: bytes, sport: int, dport: int, seq: int, payload: bytes,
          flags: int = 0x18) -> bytes:
    """Ethernet + IPv4 + TCP (PSH|ACK unless told) around payload."""
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 1, 5 << 4, flags, 65535, 0, 0)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + len(payload), 0, 0x4000, 64,
                     6, 0, src, dst)
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    return b"\x02" * 6 + b"\x04" * 6 + b"\x08\x00" + ip + tcp + payload


class Connection:
    """One keep-alive connection from CLIENT to SERVER:port: each segment it makes follows
    the last in its direction's byte stream."""

    def __init__(self, client_port: int, port: int) -> None:
        self.client_port = client_port
        self.port = port
        self.req_seq = 1000
        self.resp_seq = 500_000

    def request(self, payload: bytes) -> bytes:
        f = frame(CLIENT, SERVER, self.client_port, self.port, self.req_seq, payload)
        self.req_seq += len(payload)
        return f

    def answer(self, payload: bytes) -> bytes:
        f = frame(SERVER, CLIENT, self.port, self.client_port, self.resp_seq, payload)
        self.resp_seq += len(payload)
        return f

    def ack(self) -> bytes:
        return frame(CLIENT, SERVER, self.client_port, self.port, self.req_seq, b"", 0x10)
