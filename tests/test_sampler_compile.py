"""The sampler's compile child: started, its progress read, its failure reported (the caller then compiles)."""

import torch

from engine.cuda.sampling import compile_jobs, shape_of, variant_features
from engine.sampler_compile import compile_in_child


def test_child_runs_and_reports_success():
    calls = []
    assert compile_in_child(4, 256, torch.device("cpu"), [1, 2], lambda d, t: calls.append((d, t))) is True
    assert calls == []  # the torch path compiles nothing


def test_a_child_that_fails_is_reported_not_raised():
    assert compile_in_child(4, 256, "no-such-device", [1, 2]) is False


def test_compile_jobs_are_each_variant_and_shape_once_at_its_smallest_batch():
    sizes, v = [1, 2, 4, 8, 16, 32, 64, 128, 256], 65536
    jobs = compile_jobs(v, sizes)
    shapes = {(f, shape_of(f, v, b)) for f in variant_features() for b in sizes}
    assert sorted(map(repr, ((f, shape_of(f, v, b)) for f, b in jobs))) == sorted(map(repr, shapes))
    for f, b in jobs:
        assert all(shape_of(f, v, smaller) != shape_of(f, v, b) for smaller in sizes if smaller < b)
