"""Just-in-time launch: the device timeline's estimate of when the device runs out of work (fed known times), and
a worker over a synthetic engine that starts a request arriving mid-step in the very next device step."""

from __future__ import annotations

import threading
import time

import orjson
import pytest

from engine.config import EngineConfig
from engine.device_timeline import DeviceTimeline
from engine.synthetic import synthetic_engine
from tests.queue_helpers import submit, wait_results
from worker import contract as c
from worker.worker import Worker, WorkerConfig

ROW_S, PROMPT_S, LAUNCH_S = 0.001, 0.0002, 0.002  # the simulated device: seconds a row, a prompt token; host launch


def run_steps(timeline: DeviceTimeline, steps: list[tuple[int, int]], host_late_s: float = 0.0) -> float:
    """Drive an overlapped loop over ``steps`` (rows, prompt tokens): launch step t+1, then wait for step t. The
    device's true times are known here; returns the time the last launched step truly finishes."""
    now, device_free = 0.0, 0.0
    for i, (rows, prompt) in enumerate(steps):
        started, now = now, now + LAUNCH_S
        device_free = max(device_free, now) + rows * ROW_S + prompt * PROMPT_S
        previous_free = device_free - rows * ROW_S - prompt * PROMPT_S  # when the step before it finishes
        timeline.launched(rows, prompt, started, now, after_another=i > 0)
        if i > 0:  # wait for the previous step: blocks until the device is done with it, unless the host is late
            now += host_late_s
            began, now = now, max(now, previous_free)
            timeline.collected(began, now)
    return device_free


def test_steady_decode_steps_give_a_slack_just_short_of_the_truth():
    timeline = DeviceTimeline()
    assert timeline.slack_s(0.0) == 0.0  # nothing launched
    truth = run_steps(timeline, [(256, 0)] * 12)
    now = truth - 256 * ROW_S + 0.001  # the last step has just begun on the device
    slack = timeline.slack_s(now)
    latest = truth - now - LAUNCH_S  # launching later than this leaves the device idle
    assert 0.8 * latest < slack < latest


def test_prompt_tokens_are_costed_apart_from_rows():
    timeline = DeviceTimeline()
    truth = run_steps(timeline, [(64, 0)] * 8 + [(64, 2048), (64, 0)] * 6 + [(64, 2048)])
    now = truth - (64 * ROW_S + 2048 * PROMPT_S) + 0.001
    latest = truth - now - LAUNCH_S
    assert 0.8 * latest < timeline.slack_s(now) < latest  # a rows-only cost would put it at a fifth of this


def test_a_step_found_done_lowers_trust_in_the_next_estimates():
    timeline, trusting = DeviceTimeline(), DeviceTimeline()
    run_steps(trusting, [(256, 0)] * 12)
    run_steps(timeline, [(256, 0)] * 12)
    timeline.collected(0.0, 0.0)  # a wait that did not block: the device had finished before the host came
    timeline.launched(256, 0, 10.0, 10.002, after_another=False)
    trusting.collected(0.0, 0.001)
    trusting.launched(256, 0, 10.0, 10.002, after_another=False)
    assert 0 < timeline.slack_s(10.003) < 0.6 * trusting.slack_s(10.003)


def test_no_estimate_without_a_step_in_flight_or_a_measured_one():
    timeline = DeviceTimeline()
    timeline.launched(16, 0, 0.0, 0.001, after_another=False)
    assert timeline.slack_s(0.002) == 0.0  # no device time measured yet
    run_steps(timeline, [(16, 0)] * 4)
    timeline.collected(1.0, 1.01)  # the last one collected: nothing in flight
    assert timeline.slack_s(1.02) == 0.0


class RecordingRunner:
    """Wraps a synthetic runner's launch: when each step truly starts on the simulated device, and its requests."""

    def __init__(self, runner):
        self.runner, self.steps = runner, []
        self._launch = runner.launch
        runner.launch = self.launch

    def launch(self, batch, before_sample=None):
        begins = max(self.runner._free_at, time.perf_counter())
        launched = self._launch(batch, before_sample)
        ids = {c.seq.request_id for c in batch.prefills} | {s.request_id for s in batch.decodes}
        self.steps.append((begins, ids))
        return launched


@pytest.mark.parametrize("launch", ["early", "just-in-time"])
def test_a_request_arriving_mid_step_starts_in_the_next_device_step(r, redis_url, launch):
    """A long request keeps 100 ms steps running; probes arrive mid-step. Launched early, the step after the
    running one is already queued when a probe arrives, so one more step starts on the device before the probe's;
    just in time, the probe joins the very next one (most of the time: a host late for one step stops trusting
    the estimate for a few)."""
    engine = synthetic_engine(EngineConfig(model="synthetic", device="cpu", max_num_seqs=4), 10, 100_000)
    recorder = RecordingRunner(engine.runner)
    worker = Worker(engine, WorkerConfig(redis_url=redis_url, name=f"jit-{launch}", launch=launch))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    pubsub = r.pubsub()
    pubsub.subscribe(c.out_channel("long"))
    pubsub.get_message(timeout=1)
    try:
        submit(r, "long", [1, 2, 3], max_tokens=60, ignore_eos=True, stream=True)
        time.sleep(1.0)  # ten steps: the timeline has measured some
        arrivals = {}
        for i in range(6):
            time.sleep(0.23)  # lands at a different point of a step each time
            arrivals[f"probe-{i}"] = time.perf_counter()
            submit(r, f"probe-{i}", [5, 6], max_tokens=1)
        results = wait_results(r, [*arrivals, "long"], 30)
    finally:
        worker.stop_now = True
        thread.join(timeout=30)
    assert all(res.status == "completed" for res in results.values())
    # outputs handed to the writer before a held launch: the stream still gets every delta, in order
    deltas = []
    while (msg := pubsub.get_message(timeout=1)) is not None:
        if msg["type"] == "message" and (body := orjson.loads(msg["data"]))["type"] == "delta":
            deltas += [t for ch in body["choices"] for t in ch["token_ids"]]
    assert deltas == results["long"].choices[0].token_ids and len(deltas) == 60
    before = []  # per probe: device steps that began after it arrived and before its own
    for rid, arrived in arrivals.items():
        own = next(begins for begins, ids in recorder.steps if rid in ids)
        before.append(sum(arrived < begins < own for begins, _ in recorder.steps))
    if launch == "early":
        assert sum(n >= 1 for n in before) >= 5, before
    else:
        assert sum(n == 0 for n in before) >= 4, before
