"""The fused Triton kernels run on CPU through Triton's interpreter (no GPU needed) and must equal their twins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.queue_helpers import REPO


def test_triton_kernels_match_torch_twins_under_the_interpreter():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-m", "tests.kernel_check"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "kernel checks passed" in proc.stdout


def test_sampling_kernel_matches_torch_twin_under_the_interpreter():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-m", "tests.sampling_check"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "sampling checks passed" in proc.stdout
