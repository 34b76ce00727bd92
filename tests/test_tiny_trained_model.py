"""The tiny trained model (benchmarks/tiny_trained_model.py): a few training steps on CPU, the file in the official
layout, and the engine's reference forward on that file equal to the training forward."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks.tiny_trained_model import MAX_DELTA_LOGIT, parse_args, run
from engine.demo import random_state_dict

REPO = Path(__file__).resolve().parent.parent


def test_a_few_steps_give_a_finite_loss_and_a_file_the_engine_reproduces(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for src in ("benchmarks/tiny_trained_model.py", "engine/model.py", "engine/weights.py"):
        (corpus / Path(src).name).write_bytes((REPO / src).read_bytes())  # small, fixed text
    out = tmp_path / "tiny.pth"
    result = run(parse_args(["--out", str(out), "--layers", "2", "--width", "64", "--head-size", "32",
                             "--seq-len", "16", "--batch", "2", "--steps", "3", "--corpus", str(corpus),
                             "--held-out-windows", "4"]))
    assert all(math.isfinite(x) for x in (result.first_loss, result.last_loss, result.held_out_end))
    assert result.max_delta_logit <= MAX_DELTA_LOGIT

    saved = torch.load(out, weights_only=True)
    initial = random_state_dict(2, 64, 256, 32, seed=0)
    assert list(saved) == list(initial)  # the official names, in random_state_dict's order
    assert all(saved[k].shape == initial[k].shape and saved[k].dtype == torch.float32 for k in initial)
    assert not torch.equal(saved["blocks.1.att.key.weight"], initial["blocks.1.att.key.weight"])  # it trained
