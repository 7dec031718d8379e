"""scripts/sim_band_chance.py: the chance alarms of the bands and of the arrivals' floor."""

from __future__ import annotations

import random
import statistics

from script_modules import script

sim = script("sim_band_chance")


def test_the_floors_threshold_gives_chance_alarms_as_rarely_as_asked() -> None:
    threshold = sim.page_threshold(1.5, 1.5, 100.0, 100)
    rng = random.Random(7)
    by_chance = statistics.fmean(sim.page_alarm(1.5, 1.0, 1.5, threshold, rng) for _ in range(300))
    assert 60 < by_chance < 170
    excess = statistics.median(sim.page_alarm(1.5, 1.5, 1.5, threshold, rng) for _ in range(300))
    assert excess < by_chance / 3


def test_a_host_given_twice_its_share_grows_its_band_and_the_others_seldom() -> None:
    counts = sim.growths(0, 60.0, 0.8, (0, 2.0))
    grown, first = counts[0]
    assert grown > 0 and first is not None and first < 30
    assert sum(g for g, _ in counts[1:]) < grown
