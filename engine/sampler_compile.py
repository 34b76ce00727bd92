"""The sampler's kernels compiled by a child process, into the kernel cache the worker reads.

A cold compile of a filter variant takes several seconds of one core, and Triton's front end holds the GIL while
it builds a kernel's IR: compiled in threads of the worker, the sampler's ~20 kernels starved the worker's own
compiles of the model's kernels, which run one after another as a warm-up step first launches them (the start's
longest path). A child process, at a lower CPU priority, compiles them into the same Triton cache directory
(``TRITON_CACHE_DIR``, inherited) while the worker compiles the model; the worker's own sampler warm-up then
loads each kernel from the cache. The child dies with the worker (PR_SET_PDEATHSIG where Linux has it).

    python -m engine.sampler_compile --num-slots 256 --vocab 65536 --device cuda:0 --batch-sizes 1,2,4,8
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

PROGRESS = "compiled "  # the child's progress lines: "compiled 3/24"
NICE = 10  # the child yields cores to the worker's own compiles (the start's longest path)


def compile_in_child(num_slots: int, vocab_size: int, device, batch_sizes: Sequence[int],
                     compiled: Callable[[int, int], None] | None = None) -> bool:
    """Run the child and wait for it; ``compiled(done, total)`` as it reports each kernel. False (logged) if it
    failed: the caller then compiles in its own process."""
    cmd = [sys.executable, "-m", "engine.sampler_compile", "--num-slots", str(num_slots), "--vocab",
           str(vocab_size), "--device", str(device), "--batch-sizes", ",".join(map(str, batch_sizes)),
           "--parent", str(os.getpid())]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True)
    except OSError as e:
        log.warning("sampler compile process did not start: compiling in the worker", extra={"error": str(e)})
        return False
    tail: collections.deque[str] = collections.deque(maxlen=20)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(PROGRESS) and compiled is not None:
            done, total = line[len(PROGRESS):].strip().split("/")
            compiled(int(done), int(total))
        else:
            tail.append(line.rstrip())
    rc = proc.wait()
    if rc != 0:
        log.warning("sampler compile process failed: compiling in the worker",
                    extra={"returncode": rc, "output": "\n".join(tail)})
    return rc == 0


def _die_with(parent: int) -> None:
    """SIGTERM when the parent dies (Linux), and exit now if it already has."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-slots", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", required=True, help="comma-separated")
    p.add_argument("--parent", type=int, default=None, help="exit when this process does")
    args = p.parse_args(argv)
    if args.parent is not None:
        _die_with(args.parent)
    try:
        os.nice(NICE)
    except OSError:
        pass
    from engine.sampler import Sampler

    def report(done: int, total: int) -> None:
        print(f"{PROGRESS}{done}/{total}", flush=True)

    sampler = Sampler(args.num_slots, args.vocab, args.device)
    sampler.warm_up([int(b) for b in args.batch_sizes.split(",")], threads=os.cpu_count() or 1, compiled=report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
