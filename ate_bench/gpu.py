"""Active GPU time of an agent session: utilization of the visible GPUs sampled in a thread.

Busy time integrates utilization/100 over the sampling intervals, summed over GPUs (GPU-seconds).
The source is pynvml when importable, else `nvidia-smi` polling, else none (zero): the benchmark
runs on machines without GPUs, where the operate tasks run on the CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time


def _visible(indices: list[int]) -> list[int]:
    """CUDA_VISIBLE_DEVICES (numeric form) narrows the GPUs a task can see."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return indices
    wanted = [int(x) for x in env.split(",") if x.strip().isdigit()]
    return [i for i in indices if i in wanted]


def utilization_reader():
    """A function returning {gpu index: utilization %} now, and the source's name; (None, 'none')
    when no GPU can be read."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible(list(range(pynvml.nvmlDeviceGetCount())))}
        return (lambda: {i: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for i, h in handles.items()}), "pynvml"
    except Exception:  # not installed, no driver, no GPU
        pass
    if shutil.which("nvidia-smi"):
        def read() -> dict[int, float]:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            rows = [line.split(",") for line in out.strip().splitlines() if "," in line]
            util = {int(i): float(u) for i, u in rows if i.strip().isdigit() and u.strip().replace(".", "").isdigit()}
            return {i: util[i] for i in _visible(sorted(util))}
        try:
            if read():
                return read, "nvidia-smi"
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    return None, "none"


class GpuSampler:
    """with GpuSampler() as s: ...  -> s.busy_seconds (GPU-seconds at 100% utilization)."""

    def __init__(self, interval: float = 0.5, reader=None, source: str = "custom"):
        self.interval = interval
        self.reader, self.source = (reader, source) if reader else utilization_reader()
        self.busy_seconds = 0.0
        self.gpus = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        last = time.monotonic()
        while True:
            stopping = self._stop.wait(self.interval)
            now = time.monotonic()
            try:
                util = self.reader()
            except Exception:  # a failing read counts as idle, it must not end the session
                util = {}
            self.gpus = max(self.gpus, len(util))
            self.busy_seconds += (now - last) * sum(util.values()) / 100.0
            last = now
            if stopping:
                return

    def __enter__(self):
        if self.reader is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.reader is not None:
            self._stop.set()
            self._thread.join()
