"""Log-linear latency buckets: the kernel probe files each latency (in ns) under index(),
user space turns bucket counts back into percentiles, a Prometheus exporter into `le`
bounds.

Values below 2**SUB_BITS ns get a bucket each; above, every power of two is split into
2**SUB_BITS equal sub-buckets (HDR-histogram layout). A bucket is then at most 1/16 of its
lower bound wide, so reporting its midpoint is within 1/32 (3.1%) of any value in it.
Values clamp below 2**MAX_EXP ns (about 18 minutes), which covers 10 us to 600 s with room.

http_record.bpf.c's lm_bucket() is the same arithmetic; the loader passes SUB_BITS and MAX_EXP to
it so the two cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

SUB_BITS = 4
SUB_BUCKETS = 1 << SUB_BITS
MAX_EXP = 40
MAX_VALUE = (1 << MAX_EXP) - 1


def index(value_ns: int) -> int:
    """Bucket of a latency in ns (negative counts as 0, too large as MAX_VALUE)."""
    v = min(max(int(value_ns), 0), MAX_VALUE)
    if v < SUB_BUCKETS:
        return v
    shift = v.bit_length() - 1 - SUB_BITS
    return ((shift + 1) << SUB_BITS) + ((v >> shift) - SUB_BUCKETS)


N_BUCKETS = index(MAX_VALUE) + 1


def bounds(idx: int) -> tuple[int, int]:
    """Integer values v with lo <= v < hi fall into bucket idx."""
    if not 0 <= idx < N_BUCKETS:
        raise ValueError(f"bucket {idx} outside 0..{N_BUCKETS - 1}")
    if idx < SUB_BUCKETS:
        return idx, idx + 1
    shift = (idx >> SUB_BITS) - 1
    mantissa = SUB_BUCKETS + (idx & (SUB_BUCKETS - 1))
    return mantissa << shift, (mantissa + 1) << shift


def midpoint(idx: int) -> float:
    """Middle of the integers a bucket holds: within 1/32 of each of them, exact below 16."""
    lo, hi = bounds(idx)
    return (lo + hi - 1) / 2


def upper_bound(idx: int) -> int:
    """Largest value in the bucket, i.e. its inclusive `le` bound in ns."""
    return bounds(idx)[1] - 1


def percentile(counts: Mapping[int, int], q: float) -> float | None:
    """Nearest-rank q-quantile (0 < q <= 1) in ns, as the midpoint of the bucket holding the
    ceil(q * total)-th smallest sample; None without samples."""
    if not 0 < q <= 1:
        raise ValueError(f"quantile {q} outside (0, 1]")
    total = sum(n for n in counts.values() if n > 0)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for idx in sorted(counts):
        n = counts[idx]
        if n <= 0:
            continue
        seen += n
        if seen >= rank:
            return midpoint(idx)
    raise AssertionError("unreachable: rank <= total")


def add_into(target: dict[int, int], counts: Mapping[int, int]) -> None:
    """target += counts, bucket by bucket."""
    for idx, n in counts.items():
        target[idx] = target.get(idx, 0) + n


def histogram(values_ns: Iterable[int]) -> dict[int, int]:
    """Bucket counts of raw values (tests, and anything that holds samples)."""
    out: dict[int, int] = {}
    for v in values_ns:
        i = index(v)
        out[i] = out.get(i, 0) + 1
    return out
