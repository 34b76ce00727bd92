"""Our reference RWKV-7 against the official `rwkv` package (RWKV_V7_ON=1, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from engine.demo import write_demo_model
from engine.model import ReferenceRwkv7
from engine.state import StatePool
from engine.weights import load_model

SHAPES = [  # (layers, width, head_size, vocab)
    (2, 128, 64, 512),
    (3, 256, 64, 1024),  # 4 heads
    (1, 128, 32, 300),  # 4 heads of 32, a single layer (no value residual)
]
PROMPT_LEN, DECODE_STEPS, TOLERANCE = 64, 64, 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("layers,width,head_size,vocab", SHAPES)
def test_logits_match_official_package(tmp_path, layers, width, head_size, vocab):
    from rwkv.model import RWKV
    path = write_demo_model(tmp_path / "m.pth", layers=layers, width=width, vocab=vocab,
                            head_size=head_size, seed=layers * 1000 + width)
    official = RWKV(model=str(path)[:-len(".pth")], strategy="cpu fp32")
    weights = load_model(path)
    pool = StatePool(weights.shape, num_slots=3, device="cpu")
    ours = ReferenceRwkv7(weights, pool)
    gen = torch.Generator().manual_seed(width)
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()

    ref, state = official.forward(prompt, None)
    got = ours.prefill([prompt], [1])[0]
    errors = [rel_err(got, ref)]
    token = int(ref.argmax())
    for _ in range(DECODE_STEPS):
        ref, state = official.forward(token, state)
        got = ours.decode(torch.tensor([token]), torch.tensor([1]))[0]
        errors.append(rel_err(got, ref))
        token = int(torch.multinomial(torch.softmax(ref, -1), 1, generator=gen))
    assert max(errors) <= TOLERANCE, f"max relative error {max(errors):.2e} (per step: {errors})"
    # the state itself matches too (official layout: att shift, wkv, ffn shift per layer)
    for ours_t, ref_t in zip(pool.snapshot(1), state):
        assert rel_err(ours_t, ref_t) <= TOLERANCE
