"""Build the Triton kernels for a GPU without having one, and read what each build would use on it.

`launches` runs the op's Triton forward and backward on CPU tensors with the kernels swapped for recorders, so
the recorded arguments are exactly what a CUDA run passes. `build` compiles one recorded launch with one of its
autotune configs through Triton's own argument specialisation (pointer alignment, integers equal to 1 folded,
integers divisible by 16 marked) for a CUDA architecture, and reads registers and stack (spills) from the
binary with the cuobjdump that ships with Triton, shared memory from the build, and whether the main loop got
async copies (some kept in flight while a step computes) and tensor-core instructions (kept in flight, for
wgmma) from the PTX.

Nothing here measures speed; it catches builds that cannot be fast: register spills, scalar loads, no
pipelining. Used by `benchmarks/kernel_resources.py` and the tests.

`simulated_gpu` measures something the builds cannot show, the host time of a CUDA call, on a machine without a
GPU: the op runs its compiled path on CPU tensors, through a stand-in for Triton's CUDA driver whose launches do
nothing. Used by `benchmarks/kernels.py --host --simulated`, `--launch --simulated` and the tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor


@dataclass
class Launch:
    kernel: str  # attribute name in triton_kernels
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Build:
    registers: int
    stack_bytes: int  # per thread; > 0 means spills (the kernels keep no local arrays)
    shared_bytes: int
    async_copies: bool  # cp.async in the PTX: tile loads are vectorised and pipelined
    # With cp.async: whether the main loop waits for all but some of the copies issued (a wait_group N > 0),
    # so that loads for later steps stay in flight while this one computes; None without cp.async.
    copies_in_flight: bool | None
    tensor_cores: bool  # tensor-core instructions in the PTX: mma.sync, wgmma (sm_90) or tcgen05.mma (sm_100)
    # With wgmma (sm_90): whether one is left in flight while the next tile is loaded and issued (a wait for at
    # most N > 0 pending groups) rather than each awaited before going on; None without wgmma.
    mma_in_flight: bool | None
    atomics: tuple[str, ...]  # the distinct atomic instructions in the PTX, e.g. atom.global.gpu.relaxed.add.v4.f32


KERNELS = (
    "_count_pairs_kernel", "_place_pairs_kernel", "_grouped_matmul_kernel", "_weight_grad_kernel", "_gather_kernel",
)


def _compiled_module() -> ModuleType:
    from switchhead.kernels import triton_kernels

    triton_kernels = triton_kernels.load()  # as `ops` will see it (re-imported if TRITON_INTERPRET changed)
    if triton_kernels._INTERPRETED:
        raise RuntimeError("gpu_build needs the compiled kernels: unset TRITON_INTERPRET")
    return triton_kernels


class _Recorder:
    def __init__(self, name: str, into: list[Launch]):
        self.name, self.into = name, into

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.into.append(Launch(self.name, args, kwargs))


@contextmanager
def _recording(tk: ModuleType, into: list[Launch]):
    saved = {name: getattr(tk, name) for name in (*KERNELS, "_require_runnable")}
    try:
        for name in KERNELS:
            setattr(tk, name, _Recorder(name, into))
        tk._require_runnable = lambda t: None
        yield
    finally:
        for name, value in saved.items():
            setattr(tk, name, value)


def launches(
    x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int, allow_tf32: bool = False,
    dense_grad_x: bool = False,
) -> list[Launch]:
    """The kernel launches of one forward and one backward (all gradients) of the Triton op on these inputs, with
    torch's TF32 setting for fp32 matmuls (which picks the kernels' precision) set as given meanwhile, and grad_x
    by the kernel or (`dense_grad_x`) by cuBLAS, as `triton_kernels.backward` takes it."""
    tk = _compiled_module()
    recorded: list[Launch] = []
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32  # a property of torch's cuBLAS module: set and restore
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        with _recording(tk, recorded):
            tk.forward(x, weight, index, gate, n_out)
            grad = torch.zeros(x.shape[0], n_out, weight.shape[2], dtype=x.dtype)
            tk.backward(grad, x, weight, index, gate, gate is not None, dense_grad_x=dense_grad_x)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    return recorded


def configs(launch: Launch, prune: bool = True) -> list:
    """The autotune configs the tuner would try for this launch (after its precision pruning unless `prune` is
    False); [None] if the kernel is not autotuned (its block sizes are in the launch's own arguments)."""
    kernel = getattr(_compiled_module(), launch.kernel)
    if not hasattr(kernel, "configs"):
        return [None]
    if not (prune and kernel.early_config_prune):
        return list(kernel.configs)
    return kernel.early_config_prune(kernel.configs, dict(zip(kernel.arg_names, launch.args)), **launch.kwargs)


def build(launch: Launch, config=None, arch: int = 90) -> Build:
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = getattr(_compiled_module(), launch.kernel)
    fn = kernel.fn if hasattr(kernel, "configs") else kernel  # the JITFunction, under its Autotuner if tuned
    kwargs = {**launch.kwargs, **(config.all_kwargs() if config is not None else {})}
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(item.split(":", 1) for item in usage.split() if item.split(":", 1)[0] in ("REG", "STACK"))
    ptx = compiled.asm["ptx"]
    waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)]
    copy_waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    return Build(
        registers=int(fields["REG"]),
        stack_bytes=int(fields["STACK"]),
        shared_bytes=compiled.metadata.shared,
        async_copies="cp.async" in ptx,
        copies_in_flight=max(copy_waits) > 0 if copy_waits else None,
        tensor_cores=any(op in ptx for op in ("mma.sync", "wgmma", "tcgen05.mma")),
        mma_in_flight=max(waits) > 0 if waits else None,
        atomics=tuple(sorted(set(re.findall(r"\b(?:atom|red)\.[\w.]+", ptx)))),
    )


# The device id the simulated driver reports: not one a real GPU has, so that Triton's per-device kernel caches keep
# the simulated builds (whose launches do nothing) apart from real ones in the same process.
SIMULATED_DEVICE = -1


class _SimulatedUtils:
    @staticmethod
    def load_binary(name, kernel, shared, device):
        return 0, 0, 0, 0, 1024  # module, function, registers, spills, the most threads per block

    @staticmethod
    def get_device_properties(device):
        return {"max_shared_mem": 227 * 1024, "multiprocessor_count": 132}  # an H100's or H200's

    @staticmethod
    def unload_module(module):
        pass


class _SimulatedDriver:
    """What Triton's launch path asks of its active driver, for a GPU that is not there."""

    utils = _SimulatedUtils()

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return SIMULATED_DEVICE

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_benchmarker(self):
        # every autotune config "takes" the same time, so the tuner keeps the first one and builds no other
        return lambda kernel_call, quantiles=None, **kwargs: [1.0] * (len(quantiles) if quantiles else 1)

    def launcher_cls(self, src, metadata):
        def launch(grid_0, grid_1, grid_2, stream, function, packed, launch_metadata, enter_hook, exit_hook, *args):
            # the hooks see each launch as CUDA's launcher shows it to them (with launch_enter_hook set, Triton passes
            # a launch_metadata naming the kernel), and nothing runs between them
            if enter_hook is not None:
                enter_hook(launch_metadata)
            if exit_hook is not None:
                exit_hook(launch_metadata)

        return launch


@contextmanager
def simulated_gpu(arch: int = 90) -> Iterator[ModuleType]:
    """Inside: the compiled kernels (built for sm_`arch` on first use, as on the GPU) take CPU tensors, and every
    launch goes through Triton's whole Python path (argument binding and specialisation, the kernel cache, the
    autotuner's lookup) up to the driver's launch call, which returns at once. What a call then costs is the host
    time of the CUDA path, less the driver's launch calls and CUDA's own allocations. Results are whatever the
    buffers held: time with it, nothing else. Only the kernels' path runs (the cuBLAS routes of `ops._dense_on_cuda`
    need CUDA tensors). Autotune results made inside are dropped on the way out."""
    from triton.runtime import driver

    tk = _compiled_module()
    tuned = [getattr(tk, name) for name in KERNELS if hasattr(getattr(tk, name), "configs")]
    saved_caches = [dict(kernel.cache) for kernel in tuned]
    saved_require, saved_driver = tk._require_runnable, driver._active  # None where none was made yet (no GPU)
    driver.set_active(_SimulatedDriver(arch))
    tk._require_runnable = lambda t: None
    try:
        yield tk
    finally:
        tk._require_runnable = saved_require
        driver._active = saved_driver
        for name in KERNELS:  # nothing was loaded: a build dropped later must not unload itself through a real driver
            kernel = getattr(tk, name)
            builds = (kernel.fn if hasattr(kernel, "configs") else kernel).device_caches.get(SIMULATED_DEVICE)
            for build in builds[0].values() if builds else ():
                build.module = None  # (set again on its next use in here)
        for kernel, cache in zip(tuned, saved_caches):
            kernel.cache.clear()
            kernel.cache.update(cache)
