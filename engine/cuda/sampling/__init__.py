"""Token sampling in one persistent Triton kernel (``sample_rows``) with its plain-torch twin (``sample_rows_ref``:
``engine.sample_torch``, also the CPU sampler).

Same semantics as ``engine.sampler`` (its module doc), same counter-hash noise, same token: the exponential
race's winner ``argmax(s_i - log E_i)`` over the kept tokens ``{i : s_i >= tau}``; the kernel finds that set
without sorting the vocabulary. A persistent grid of small programs (``shapes.config_for``) loops over the rows,
a row at a time. Per row, one module a pass:

1. ``process``: rows with logit_bias, an active min_tokens ban, penalties or a grammar mask: the processed row
   times 1 / temperature goes to the program's scratch row (the sparse bias and ban entries rewritten from their
   raw logits: nothing matches ids against ids); later passes read it there. Rows with no filters and no logprobs
   take one pass with no scratch row instead.
2. ``stats``: max and greedy argmax, the finite count, raw log-sum-exp and top-k raw logprobs when asked, the race
   over every token (``race``; with the filters its runners-up too) and, for top_k rows, the lane band. Greedy
   and plain-temperature rows end here: one pass.
3. ``filters`` and ``search``: top_p rows test the race's winner and runners-up in one probe pass; top_k rows
   take the lane band when it decides; the rest narrow a bracket around the threshold with probe passes.
4. ``band``: the values left in the bracket are copied to the program's band buffer, sorted, tau read off it as
   the sorted rule reads it, and its kept tokens join the race.

``kernel`` holds the kernel and a row's way through these, ``split`` the split race (very few exact rows),
``shapes`` which variant and launch shape a step takes, ``workspace`` the device buffers, ``launch`` the launches
and the warm-up.

A pass reads 256 KB a row at vocabulary 65,536; what costs more than reading is arithmetic a value: the race's
noise (two 32-bit hashes, and two logs where a chunk can still change the winner), 8 probes, and barriers: every
reduction to a scalar inside a chunk loop is a block-wide one, so passes accumulate lane by lane and reduce once.
Measurements: BENCHMARKS.md, sampler (``python -m benchmarks.engine --sampler-only``).

A row's arithmetic depends only on its values and on the configuration, which depends only on the vocabulary
size: not on the batch size, its row or its program, so tokens are batch-invariant (sums that decide a token are
fixed-point integers, the same in any order and any program shape). Steps without filters or logprobs, whose
tokens are exact whatever the chunking, may switch shape with their size. Exact ties between two race keys go to
the lower id, where the twin (torch's argmax over its candidates) may pick the other: a probability-zero event
for continuous noise.
"""

from engine.cuda.sampling.launch import WARM_UP_THREADS, compile_jobs, sample_rows, sample_rows_ref, warm_up
from engine.cuda.sampling.race import counter_hash_rows, counter_hash_rows_ref
from engine.cuda.sampling.shapes import (FEW_FILTERED, FEW_ROWS, SPLIT_ROWS, KernelConfig, config_for, has_band,
                                         shape_of, variant_features)
from engine.cuda.sampling.workspace import SamplingWorkspace

__all__ = ["FEW_FILTERED", "FEW_ROWS", "SPLIT_ROWS", "WARM_UP_THREADS", "KernelConfig", "SamplingWorkspace",
           "compile_jobs", "config_for", "counter_hash_rows", "counter_hash_rows_ref", "has_band", "sample_rows", "sample_rows_ref",
           "shape_of", "variant_features", "warm_up"]
