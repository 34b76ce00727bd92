"""Engine configuration: one dataclass, validated on construction (vLLM names where they agree)."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", "reference", "cuda")
WEIGHT_MODES = ("auto", "fp8")


@dataclass
class EngineConfig:
    model: str | None = None  # .pth file or fla-hub directory; None = demo model
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # weights: bfloat16 on CUDA, float32 on CPU
    state_dtype: str = "float32"  # wkv state
    weights: str = "auto"  # auto: as stored (fp8 matrices of a quantized file stay fp8); fp8: quantize at load
    backend: str = "auto"  # auto = cuda kernels on a GPU, reference otherwise
    max_num_seqs: int = 256  # concurrent sequences (state slots)
    max_num_batched_tokens: int = 8192  # tokens per step: decodes + admitted prompt chunks
    prefill_per_decode: float = 3.0  # while sequences decode: prompt tokens per step per decoding one (0: no cap)
    min_prefill_chunk: int = 2048  # ... but at least this many (engine.scheduler)
    prefill_hold_tokens: int = 0  # beside decodes, new prompts wait until this many prompt tokens wait (0: never)
    prefill_hold_steps: int = 4  # ... for at most this many steps in a row
    max_model_len: int = 1 << 20  # prompt + output tokens per sequence
    enforce_eager: bool = False  # no CUDA graphs
    prefill_graphs: bool = True  # packed prefills replay graphs captured per (tokens, sequences) bucket
    gpu_memory_utilization: float = 0.90
    seed: int = 0  # seeds requests that bring none
    async_scheduling: bool = True  # launch step t+1 before finishing step t on the host (engine.engine)
    prefix_cache_gib: float = 2.0  # prompt-prefix states kept beside the slots (engine.prefix_cache; 0: no cache)
    prefix_cache_host_gib: float = 4.0  # ... and in pinned host memory once pushed out of the device (CUDA only)
    prefix_min_tokens: int = 32  # no checkpoint for shorter prefixes
    prefix_interval: int = 4096  # checkpoints every this many tokens inside long prompts (0: none)
    initial_states: dict[str, str] = field(default_factory=dict)  # name -> state-tuning file (engine.initial_states)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"state_dtype must be float32 or bfloat16, got {self.state_dtype!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}) so prompts are never starved")
        if self.prefill_per_decode < 0 or self.min_prefill_chunk < 1:
            raise ValueError("prefill_per_decode must be >= 0 and min_prefill_chunk >= 1")
        if self.prefill_hold_tokens < 0 or self.prefill_hold_steps < 0:
            raise ValueError("prefill_hold_tokens and prefill_hold_steps must be >= 0")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.prefix_cache_gib < 0 or self.prefix_cache_host_gib < 0 or self.prefix_min_tokens < 1 \
                or self.prefix_interval < 0:
            raise ValueError("prefix_cache_gib and prefix_cache_host_gib must be >= 0, prefix_min_tokens >= 1 and "
                             "prefix_interval >= 0")
        if not 0.1 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in [0.1, 1], got {self.gpu_memory_utilization}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"
