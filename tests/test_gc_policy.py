"""The collector's settings once serving, and the clock that the worker's "loop stats" line reads."""

import gc

import pytest

from engine.gc_policy import GcClock, settle_heap
from worker.worker import WorkerConfig


@pytest.fixture
def restore_gc():
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)


def test_settle_heap_freezes_what_is_loaded_and_raises_only_the_young_threshold(restore_gc):
    loaded = [[i] for i in range(1000)]  # containers the collector tracks
    gc.set_threshold(700, 11, 12)
    settle_heap(40_000)
    assert gc.get_threshold() == (40_000, 11, 12)  # the older generations keep theirs: cycles are still collected
    assert gc.get_freeze_count() >= len(loaded)
    assert gc.get_count()[0] < 100  # collected just before


def test_gc_clock_counts_collections_by_generation_and_their_time(restore_gc):
    clock = GcClock()
    try:
        junk = []
        for _ in range(200):  # cycles, so the collections have something to do
            a = [junk]
            a.append(a)
        gc.collect(0)
        gc.collect(2)
        assert clock.collections[0] >= 1 and clock.collections[2] >= 1
        assert clock.seconds > 0
    finally:
        clock.close()
    before = list(clock.collections)
    gc.collect(0)
    assert clock.collections == before  # closed: no longer called


def test_a_zero_young_threshold_is_refused():
    """0 would turn the collector off (gc.set_threshold's meaning): reference cycles would never be freed."""
    with pytest.raises(ValueError, match="gc_young_threshold"):
        WorkerConfig(gc_young_threshold=0)


def test_the_loop_stats_line_reports_the_collections_since_the_last_line(restore_gc):
    from engine.phases import PhaseClock
    from worker.loop_stats import LoopStats
    gc.set_threshold(10**9, 10, 10)  # no automatic collection in between: only the ones below
    clock = GcClock()
    stats = LoopStats("w", 10.0, PhaseClock(), lambda: {}, clock)
    try:
        gc.collect(0)
        gc.collect(0)
        line = stats.report()
        assert (line["gc_young"], line["gc_full"]) == (2, 0) and line["gc_ms_per_s"] > 0
        gc.collect(2)
        line = stats.report()
        assert (line["gc_young"], line["gc_full"]) == (0, 1)
    finally:
        clock.close()
