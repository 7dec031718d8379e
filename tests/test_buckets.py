"""Log-linear bucket math: layout, bounds, and percentile accuracy (unit and property)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from loadmesh.probes import buckets

values = st.integers(min_value=0, max_value=buckets.MAX_VALUE)


def exact_percentile(samples: list[int], q: float) -> int:
    """Nearest-rank definition, the one buckets.percentile follows."""
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def test_layout_covers_10us_to_600s_with_16_sub_buckets_per_power_of_two() -> None:
    assert buckets.SUB_BUCKETS >= 16
    assert buckets.index(10_000) < buckets.index(600 * 10**9) < buckets.N_BUCKETS - 1
    assert buckets.N_BUCKETS <= 1 << 16  # lm_hist_key.bucket is a __u16
    for power in range(buckets.SUB_BITS, buckets.MAX_EXP):
        octave = {buckets.index(v) for v in range(1 << power, 1 << (power + 1),
                                                    max(1, (1 << power) >> 8))}
        assert len(octave) == buckets.SUB_BUCKETS


def test_buckets_tile_the_range_without_gaps() -> None:
    assert buckets.bounds(0) == (0, 1)
    for i in range(buckets.N_BUCKETS - 1):
        lo, hi = buckets.bounds(i)
        assert lo < hi == buckets.bounds(i + 1)[0]
        assert buckets.index(lo) == i == buckets.index(hi - 1)
    assert buckets.bounds(buckets.N_BUCKETS - 1)[1] == buckets.MAX_VALUE + 1


def test_out_of_range_values_clamp() -> None:
    assert buckets.index(-5) == 0
    assert buckets.index(10**15) == buckets.N_BUCKETS - 1


@given(values)
def test_value_lies_in_its_bucket(v: int) -> None:
    lo, hi = buckets.bounds(buckets.index(v))
    assert lo <= v < hi


@given(values)
def test_midpoint_within_1_32_of_every_value_in_the_bucket(v: int) -> None:
    mid = buckets.midpoint(buckets.index(v))
    assert abs(mid - v) <= v / 32 + 1e-9


@given(st.integers(min_value=buckets.SUB_BUCKETS, max_value=buckets.MAX_VALUE))
def test_bucket_width_at_most_1_16_of_its_lower_bound(v: int) -> None:
    lo, hi = buckets.bounds(buckets.index(v))
    assert (hi - lo) * buckets.SUB_BUCKETS <= lo


@settings(max_examples=300)
@given(st.lists(st.integers(min_value=10_000, max_value=600 * 10**9), min_size=1,
                max_size=400),
       st.sampled_from([0.5, 0.9, 0.95, 0.99, 0.999, 1.0]))
def test_percentile_within_about_3_percent(samples: list[int], q: float) -> None:
    est = buckets.percentile(buckets.histogram(samples), q)
    exact = exact_percentile(samples, q)
    assert est is not None
    assert abs(est - exact) <= exact / 32


def test_percentile_of_nothing_is_none() -> None:
    assert buckets.percentile({}, 0.99) is None
    assert buckets.percentile({5: 0}, 0.5) is None


def test_percentile_picks_the_nearest_rank_bucket() -> None:
    counts = {buckets.index(1_000_000): 99, buckets.index(50_000_000): 1}
    assert buckets.percentile(counts, 0.99) == buckets.midpoint(buckets.index(1_000_000))
    assert buckets.percentile(counts, 1.0) == buckets.midpoint(buckets.index(50_000_000))


def test_upper_bound_is_the_last_value_in_the_bucket() -> None:
    for v in (0, 15, 16, 17, 1000, 123_456_789):
        i = buckets.index(v)
        assert buckets.index(buckets.upper_bound(i)) == i
        assert buckets.index(buckets.upper_bound(i) + 1) == i + 1


def test_add_into_merges_counts() -> None:
    target = {1: 2}
    buckets.add_into(target, {1: 3, 4: 1})
    assert target == {1: 5, 4: 1}
