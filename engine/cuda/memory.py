"""Size the state pool from free GPU memory (after the weights are loaded)."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig

log = logging.getLogger(__name__)

ACTIVATION_RESERVE_BYTES = 4 << 30  # prefill activations, graph pools, allocator slack


def slots_that_fit(config: EngineConfig, state_bytes_per_seq: int, vocab_size: int, device: torch.device) -> int:
    """Concurrent sequences that fit: free memory × utilisation − reserve, over per-sequence bytes."""
    free, total = torch.cuda.mem_get_info(device)
    budget = (free - (1 - config.gpu_memory_utilization) * total - ACTIVATION_RESERVE_BYTES
              - config.prefix_cache_gib * 2**30)  # the prefix cache's device tier sits beside the slots
    # per sequence: its state, plus fp32 logits and sampler rows for one decode row
    per_seq = state_bytes_per_seq + vocab_size * 4 * 3
    fit = max(1, int(budget // per_seq))
    slots = min(config.max_num_seqs, fit)
    log.info("sized state pool", extra={"free_gib": round(free / 2**30, 1), "state_bytes_per_seq": state_bytes_per_seq,
                                         "fit": fit, "max_num_seqs": config.max_num_seqs, "slots": slots})
    if fit < config.max_num_seqs:
        log.warning("max_num_seqs capped by GPU memory", extra={"max_num_seqs": config.max_num_seqs, "slots": slots})
    return slots
