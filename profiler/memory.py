"""Memory a model needs per batch size: weights, runtime workspace and the batch's tensors.

On CPU the figure is the process's peak resident set while batches of that size run, minus the
resident set before the model was loaded (Linux: the peak is reset through
``/proc/self/clear_refs`` before each batch size; elsewhere the current RSS is used). On a GPU it is
the device memory in use after the batch ran minus the use before the model was loaded (runtimes
keep their memory arenas, so this is the high-water mark). Runtimes that report their own
``memory_mb()`` larger than this are believed; on an emulated GPU only the runtime's figure counts.
"""

from __future__ import annotations

import subprocess

from profiler.environment import cuda_index, is_cuda, is_emulated

MIB = 1024 * 1024


def _proc_status_kb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_rss_mb() -> float:
    kb = _proc_status_kb("VmRSS")
    if kb is not None:
        return kb / 1024.0
    try:
        import resource  # lazy: Unix-only; elsewhere the except below answers 0.0 (a top-level import would fail)

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except Exception:
        return 0.0


def _gpu_used_mb(device: str) -> float | None:
    index = cuda_index(device)
    try:
        import torch  # lazy: torch is an optional extra (~1 s to import)

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(index)
            return (total - free) / MIB
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", str(index)], capture_output=True, text=True, timeout=10, check=True)
        return float(out.stdout.strip())
    except Exception:
        return None


class MemoryProbe:
    """Measures memory relative to a baseline taken before the model is loaded."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.gpu = is_cuda(device)
        self.reported_only = is_emulated(device)  # an emulated GPU has no memory to measure
        self.baseline_mb = self._used_mb() or 0.0
        self._peak_reset = False

    def _used_mb(self) -> float | None:
        if self.reported_only:
            return 0.0
        return _gpu_used_mb(self.device) if self.gpu else _cpu_rss_mb()

    def start_batch(self) -> None:
        """Call before running a batch size's iterations."""
        if not self.gpu:
            self._peak_reset = _reset_peak_rss()

    def batch_mb(self, runtime_reported_mb: float = 0.0) -> float:
        """Memory needed by the batch size just run (MB), never below what the runtime reports."""
        if self.reported_only:
            return float(runtime_reported_mb or 0.0)
        if self.gpu:
            used = self._used_mb()
        else:
            peak = _proc_status_kb("VmHWM") if self._peak_reset else None
            used = peak / 1024.0 if peak is not None else self._used_mb()
        measured = max(0.0, (used or 0.0) - self.baseline_mb)
        return max(measured, float(runtime_reported_mb or 0.0))


def is_out_of_memory(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(s in text for s in ("out of memory", "outofmemory", "failed to allocate", "bad_alloc",
                                   "cannot allocate memory", "memoryerror"))
