"""Which devices a model can run on: one check for every command and for `switchhead.load`."""

from __future__ import annotations

import functools
import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from switchhead.errors import SwitchheadError, brief, is_int

# More CPU threads than this are refused: OpenMP crashed the process (a segfault, no message) when asked for
# 100,000, and no machine this runs on has a use for more.
MAX_THREADS = 1024


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux: no cheap way to tell
        return frozenset()


def native_half(dtype: torch.dtype) -> bool:
    """Does this CPU multiply `dtype` (bfloat16 or float16) natively: AVX512-BF16 / AMX-BF16, AVX512-FP16 /
    AMX-FP16? Without, PyTorch's CPU half-precision matrix products take a slow generic route (a switchhead-small
    training step under bf16 autocast took 26x float32's time on an AVX2 machine: docs/BENCHMARKS.md)."""
    wanted = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}.get(dtype)
    if wanted is None:
        raise SwitchheadError(f"native_half asks about torch.bfloat16 or torch.float16, got {brief(dtype)}")
    return any(flag in _cpu_flags() for flag in wanted)


def autocast_off(device_type: str) -> AbstractContextManager:
    """A context that switches autocast off on `device_type` where it is on, and otherwise one that does nothing:
    building and entering a torch.autocast costs several microseconds, and the model's routing and every expert
    projection ask for this a dozen times in each decode step, almost always with autocast already off. (A device
    type without autocast, such as meta, has nothing to switch off.)"""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


def set_threads(threads: int | None) -> None:
    """Use `threads` CPU threads for torch (None: leave torch's choice)."""
    if threads is None:
        return
    torch.set_num_threads(check_threads(threads))


def check_threads(threads: int) -> int:
    """`threads` if it is a usable thread count (ONNX Runtime hangs creating a million of them)."""
    if not is_int(threads) or not 1 <= threads <= MAX_THREADS:
        raise SwitchheadError(f"--threads must be an integer between 1 and {MAX_THREADS}, got {brief(threads)}")
    return threads


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` (default: cpu) as a torch.device, if a model can run there on this machine."""
    if isinstance(device, str) and not device.strip():
        raise SwitchheadError("the device is empty; give cpu, cuda, cuda:N or mps, or none for cpu")
    try:
        dev = torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError) as e:
        raise SwitchheadError(f"unknown device {device!r}: {e}") from None
    if dev.type not in ("cpu", "cuda", "mps"):  # e.g. meta, which holds no data
        raise SwitchheadError(f"device {device!r} cannot run a model; use cpu, cuda or mps")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SwitchheadError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise SwitchheadError(f"device {device!r} requested but MPS is not available")
    return dev


def memory(device: torch.device, available: bool = False) -> tuple[int, str] | None:
    """The memory a model on `device` draws from, in bytes, and a phrase saying so for messages: the whole of it,
    or with `available` what can be had now without swapping (Linux MemAvailable; free memory on a GPU). None
    where there is no way to ask. Up-front checks against it turn an allocation that would end in a traceback,
    or in the out-of-memory killer once the pages are touched, into one line."""
    if not isinstance(device, (torch.device, str)):  # (resolve_device would read an int as a CUDA index)
        raise SwitchheadError(f"expected a torch.device or a device name, got {type(device).__name__}")
    device = device if isinstance(device, torch.device) else resolve_device(device)  # a name had no .type
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Blocks PyTorch's caching allocator holds but no tensor uses are free to us, not to the driver.
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        have = free if available else total
        return have, f"{device} has {have / 2**30:,.1f} GiB" + (" free" if available else "")
    if available:
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
            return kib * 1024, f"this machine has {kib / 2**20:,.1f} GiB available"
        except (OSError, ValueError, IndexError, StopIteration):  # not Linux: fall back to the whole memory
            pass
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return have, f"this machine has {have / 2**30:,.1f} GiB"
    return None


def check_allocation(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse in one line what cannot fit: past torch's int64 sizes, or more than `device` has available now. A
    large tensor allocated piece by piece is granted beyond that and only fails when its pages are touched."""
    if not is_int(nbytes) or nbytes < 0:
        raise SwitchheadError(f"{what}: a size in bytes must be an integer >= 0, got {brief(nbytes)}")
    if nbytes >= 2**63:
        raise SwitchheadError(f"{what} would need more than 2**63 bytes")
    mem = memory(device, available=True)
    if mem is not None and nbytes > mem[0]:
        raise SwitchheadError(f"{what} needs {nbytes} bytes ({nbytes / 2**30:,.4g} GiB); {mem[1]}")


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed: torch.OutOfMemoryError (CUDA, MPS), the CPU allocator's
    RuntimeError (memory refused up front, e.g. beyond RAM + swap) or Python's MemoryError."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
