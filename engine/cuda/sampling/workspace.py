"""The host side's device state for the kernel: per program a band buffer and a processed row, the split race's
slots, and the vocabulary's hash table."""

from __future__ import annotations

import torch

from engine.cuda.sampling.common import NONE_YET
from engine.cuda.sampling.shapes import FEW_ROWS, SPLIT_ROWS, config_for
from engine.sample_torch import vocab_keys


class SamplingWorkspace:
    """Device scratch the kernel reuses every step: per program a band buffer and (allocated the first time
    a step has bias, a ban or penalties) a processed row."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        shapes = (config_for(vocab_size), config_for(vocab_size, rows=FEW_ROWS + 1, exact=True))  # many rows
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        self.programs = self.sms * max(c.programs_per_sm for c in shapes)  # the most programs of any shape
        cap = max(c.cap for c in shapes)  # and the largest band
        # a program's band values, then the same sorted (two rows of cap)
        self.band_v = torch.empty(self.programs, 2 * cap, dtype=torch.float32, device=device)
        self.band_i = torch.empty(self.programs, cap, dtype=torch.int32, device=device)
        self.best = torch.full((SPLIT_ROWS,), NONE_YET.value, dtype=torch.int64, device=device)  # split race
        self.rows: torch.Tensor | None = None
        # the per-id hashes as 32-bit words (engine.sample_torch.vocab_keys, wrapped), read by the race
        self.vocab_keys = vocab_keys(vocab_size, device).to(torch.int32)
        self.dummy = torch.zeros(16, dtype=torch.int32, device=device)

    def scratch_rows(self) -> torch.Tensor:
        """The programs' processed rows [programs, V], allocated on first use."""
        if self.rows is None:
            self.rows = torch.empty(self.programs, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.rows
