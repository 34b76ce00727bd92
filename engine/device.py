"""Host ↔ device transfers that never make the host wait for the GPU.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronises the stream: the host
waits for every kernel queued before it. The overlapped step loop queues step t+1 while the GPU runs step t, so
every transfer on its path goes through pinned memory, non-blocking, ordered on the stream like a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``values`` on ``device``, without a stream sync on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor on its way to the host: started now, read later (``wait``) without a sync in between."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type != "cuda":
            self.host, self.event = tensor, None
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host
