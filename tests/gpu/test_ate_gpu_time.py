"""ATE-Bench's active GPU time on a real GPU: a session that keeps one GPU busy for a few seconds is
measured as about that many GPU-seconds, and an idle stretch as nearly none (skipped without CUDA)."""

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ate_bench.gpu import GpuSampler  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_busy_and_idle_gpu_time():
    with GpuSampler(interval=0.2) as idle:
        time.sleep(2.0)
    a = torch.randn(8192, 8192, device="cuda")
    with GpuSampler(interval=0.2) as busy:
        start = time.monotonic()
        while time.monotonic() - start < 5.0:
            for _ in range(20):
                a = torch.tanh(a @ a * 1e-4)
            torch.cuda.synchronize()
        elapsed = time.monotonic() - start
    assert busy.source in ("pynvml", "nvidia-smi") and busy.gpus >= 1
    # utilization is the share of time a kernel ran: a matmul loop keeps it near 100% on our GPU;
    # other visible GPUs may be busy with someone else's work, hence the upper bound of all of them
    assert 0.6 * elapsed < busy.busy_seconds < busy.gpus * elapsed * 1.1 + 0.5, (busy.busy_seconds, elapsed)
    assert idle.busy_seconds < 0.5 * busy.busy_seconds
