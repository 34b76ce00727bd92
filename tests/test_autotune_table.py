"""The shipped autotune table: Triton's own key for a call, and a choice that round-trips through the file."""

import json

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from engine.cuda.autotune import TunedConfigs, Tuning, config_dict, kernel_name, tuned_path, tuning_key  # noqa: E402

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (32, 64) for w in (2, 4)]


@triton.autotune(configs=CONFIGS, key=["n", "FLAG"])
@triton.jit
def _scale(x, y, n, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)


def test_key_is_the_key_args_then_tensor_dtypes():
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.float16)
    assert tuning_key(_scale, (x, y, 8), {"FLAG": True}) == (8, True, "torch.float32", "torch.float16")
    assert tuning_key(_scale, (x, y, 9), {"FLAG": True}) != tuning_key(_scale, (x, y, 8), {"FLAG": True})


def test_a_written_choice_is_picked_from_the_kernels_configs(tmp_path):
    key = json.dumps([8, True, "torch.float32"])
    name = kernel_name(_scale)
    assert name.endswith("test_autotune_table._scale")
    table = TunedConfigs(device="Some GPU 80GB")
    table.add([Tuning(name, key, len(CONFIGS), config_dict(CONFIGS[3]), "tuned", 1.0)])
    path = tuned_path("Some GPU 80GB", tmp_path)
    assert path.name == "Some_GPU_80GB.json"
    path.write_text(table.to_json())
    loaded = TunedConfigs.for_device("Some GPU 80GB", tmp_path)
    assert loaded.pick(name, key, _scale.configs) is CONFIGS[3]
    assert loaded.pick(name, json.dumps([9, True, "torch.float32"]), _scale.configs) is None
    # a config the kernel no longer offers is not taken
    assert loaded.pick(name, key, CONFIGS[:3]) is None
    assert TunedConfigs.for_device("Another GPU", tmp_path).kernels == {}
