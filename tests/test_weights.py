"""Model files: official .pth and fla-hub layouts load to the same model; bad files get named errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.demo import random_state_dict, write_demo_model
from engine.model import ReferenceRwkv7
from engine.state import StatePool
from engine.weights import ModelFormatError, load_model


@pytest.fixture()
def good_sd():
    return random_state_dict(layers=2, width=128, vocab=300, seed=3)


def save(tmp_path, sd, name="m.pth"):
    path = tmp_path / name
    torch.save(sd, path)
    return path


def error_of(path) -> str:
    with pytest.raises(ModelFormatError) as info:
        load_model(path)
    return str(info.value)


def test_shapes_are_read_from_the_weights(tmp_path):
    sd = random_state_dict(layers=3, width=256, vocab=777, head_size=32, seed=1)
    for i in range(3):  # an unusual gate rank: nothing may come from a table
        sd[f"blocks.{i}.att.g1"], sd[f"blocks.{i}.att.g2"] = torch.randn(256, 48) * 0.01, torch.randn(48, 256) * 0.01
    s = load_model(save(tmp_path, sd)).shape
    assert (s.n_layer, s.n_embd, s.n_head, s.head_size, s.vocab_size, s.dim_ffn) == (3, 256, 8, 32, 777, 1024)
    assert (s.dim_w, s.dim_a, s.dim_v, s.dim_g) == (32, 32, 32, 48)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_files_load(tmp_path, dtype):
    path = write_demo_model(tmp_path / "m.pth", layers=1, width=64, vocab=100, head_size=32, dtype=dtype)
    w = load_model(path).to("cpu", torch.float32)
    assert w.tensors["head.weight"].dtype == torch.float32


def test_hf_layout_gives_the_same_logits(tmp_path):
    pth = write_demo_model(tmp_path / "m.pth", layers=2, width=128, vocab=300, seed=5)
    hf = write_demo_model(tmp_path / "hf", layers=2, width=128, vocab=300, seed=5, fmt="hf")
    logits = []
    for path in (pth, hf):
        w = load_model(path)
        model = ReferenceRwkv7(w, StatePool(w.shape, 1, "cpu"))
        logits.append(model.prefill([list(range(1, 40))], [0])[0])
    assert torch.allclose(logits[0], logits[1], rtol=0, atol=1e-5)


def test_missing_file(tmp_path):
    assert "not found" in error_of(tmp_path / "nope.pth")


def test_truncated_file(tmp_path, good_sd):
    path = save(tmp_path, good_sd)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert "cannot read" in error_of(path)


def test_not_a_torch_file(tmp_path):
    path = tmp_path / "m.pth"
    path.write_text("hello, I am a text file")
    assert "cannot read" in error_of(path)


def test_not_a_state_dict(tmp_path):
    assert "state dict of tensors" in error_of(save(tmp_path, {"step": 3, "lr": 0.1}))


def test_rwkv6_file_is_named(tmp_path, good_sd):
    good_sd["blocks.0.att.time_maa_x"] = torch.zeros(1, 1, 128)
    assert "RWKV-6" in error_of(save(tmp_path, good_sd))


def test_missing_key_is_named(tmp_path, good_sd):
    del good_sd["blocks.1.att.k_k"]
    assert "missing key 'blocks.1.att.k_k'" in error_of(save(tmp_path, good_sd))


def test_wrong_shape_is_named(tmp_path, good_sd):
    good_sd["blocks.1.att.w2"] = torch.zeros(7, 128)
    msg = error_of(save(tmp_path, good_sd))
    assert "blocks.1.att.w2" in msg and "(7, 128)" in msg


def test_missing_layer_is_named(tmp_path, good_sd):
    for k in [k for k in good_sd if k.startswith("blocks.1.")]:
        good_sd[k.replace("blocks.1.", "blocks.2.")] = good_sd.pop(k)
    assert "layer(s) [1] missing" in error_of(save(tmp_path, good_sd))


def test_integer_tensor_is_named(tmp_path, good_sd):
    good_sd["blocks.0.att.a0"] = torch.zeros(1, 1, 128, dtype=torch.int32)
    assert "'blocks.0.att.a0' has dtype torch.int32" in error_of(save(tmp_path, good_sd))


def test_hf_directory_without_config(tmp_path):
    (tmp_path / "hf").mkdir()
    assert "no config.json" in error_of(tmp_path / "hf")


def test_cli_reports_bad_model_without_traceback(tmp_path):
    path = tmp_path / "bad.pth"
    path.write_bytes(b"\x00" * 100)
    proc = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--model", str(path),
                           "--prompt", "hi", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr and "Traceback" not in proc.stderr
