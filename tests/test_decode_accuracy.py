"""The teacher-forced accuracy report's math (benchmarks/decode_accuracy.py), on the tiny CPU model."""

from __future__ import annotations

import torch

from benchmarks.decode_accuracy import Report, build, kl_divergence, max_abs_logit_diff, slope, teacher_forced


def test_kl_divergence_is_that_of_the_softmaxes_and_zero_only_for_equal_distributions():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(5, 300, generator=gen) * 3, torch.randn(5, 300, generator=gen) * 3
    expected = torch.nn.functional.kl_div(torch.log_softmax(q.double(), -1), torch.log_softmax(p.double(), -1),
                                          log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kl_divergence(p, q), expected, rtol=1e-12, atol=1e-15)
    assert (kl_divergence(p, q) > 0).all()
    assert torch.allclose(kl_divergence(p, p + 7.0), torch.zeros(5, dtype=torch.float64), atol=1e-12)  # shift-free
    assert torch.equal(max_abs_logit_diff(p, q), (p.double() - q.double()).abs().amax(-1))


def test_the_trend_is_the_least_squares_slope():
    assert slope([3.0, 3.0, 3.0]) == 0.0
    assert abs(slope([1.0, 3.0, 5.0, 7.0]) - 2.0) < 1e-12
    assert abs(slope([0.0, 1.0, 0.0, 1.0]) - 0.2) < 1e-12
    r = Report(torch.arange(8, dtype=torch.float64).repeat(2, 1).t().contiguous(), torch.zeros(8, 2), block=2)
    assert r.block_means() == [0.5, 2.5, 4.5, 6.5]


def test_teacher_forcing_a_mode_against_itself_is_exact_and_bf16_state_is_close(tiny_weights):
    tokens = torch.randint(1, 65536, (2, 24), generator=torch.Generator().manual_seed(1))
    same = teacher_forced(build(tiny_weights, "cpu", torch.float32, 2), build(tiny_weights, "cpu", torch.float32, 2),
                          tokens, block=8)
    assert torch.equal(same.kl, torch.zeros_like(same.kl)) and torch.equal(same.max_abs, torch.zeros_like(same.kl))
    bf16 = teacher_forced(build(tiny_weights, "cpu", torch.float32, 2), build(tiny_weights, "cpu", torch.bfloat16, 2),
                          tokens, block=8)
    assert bf16.kl.shape == (24, 2) and (bf16.max_abs > 0).any()
    assert float(bf16.kl.max()) < 1e-2
