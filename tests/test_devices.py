"""switchhead.devices: the questions asked of the machine answer or refuse in one line."""

import pytest
import torch

from switchhead import PRESETS, TransformerLM
from switchhead.devices import autocast_off, check_allocation, memory, native_half
from switchhead.errors import ConfigError, SwitchheadError


def test_native_half_answers_for_half_dtypes_and_refuses_others():
    assert isinstance(native_half(torch.bfloat16), bool) and isinstance(native_half(torch.float16), bool)
    for dtype in (torch.float32, "bfloat16", None):  # float32 was a KeyError
        with pytest.raises(SwitchheadError, match="native_half asks about torch.bfloat16 or torch.float16"):
            native_half(dtype)


def test_autocast_off_switches_off_only_its_device_type_and_restores_it():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with autocast_off("cpu"):
            assert not torch.is_autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        with autocast_off("cuda"):  # another device type's autocast, off already: the CPU's stays on
            assert torch.is_autocast_enabled("cpu")
    with autocast_off("cpu"), autocast_off("meta"):  # off already; meta has no autocast at all
        assert not torch.is_autocast_enabled("cpu")


def test_memory_takes_a_device_or_its_name():
    assert memory("cpu") == memory(torch.device("cpu"))  # a name had no .type
    have = memory("cpu", available=True)
    if have is not None:  # Linux, macOS: a size and a phrase
        assert have[0] > 0 and "GiB" in have[1]
    for bad, message in ((5, "expected a torch.device or a device name, got int"), ("nowhere", "unknown device")):
        with pytest.raises(SwitchheadError, match=message):
            memory(bad)


def test_check_allocation_refuses_sizes_that_are_not_byte_counts_and_what_cannot_fit():
    check_allocation(1024, "cpu", "a buffer")
    for n in (-1, 2.5, "1024", True):
        with pytest.raises(SwitchheadError, match="a buffer: a size in bytes must be an integer >= 0"):
            check_allocation(n, "cpu", "a buffer")
    with pytest.raises(SwitchheadError, match="a buffer would need more than 2\\*\\*63 bytes"):
        check_allocation(2**64, "cpu", "a buffer")


def _allocator_fails(message):
    """nn.Embedding.__init__ failing as the allocator does, except where nothing is allocated (the meta device, on
    which the parameter count builds the model)."""
    original = torch.nn.Embedding.__init__

    def init(self, *args, **kwargs):
        if torch.empty(0).device.type == "meta":
            return original(self, *args, **kwargs)
        raise RuntimeError(message)
    return init


def test_a_model_too_large_to_allocate_is_one_line(monkeypatch):
    """The CPU allocator's refusal (as a request beyond RAM + swap gets; where memory is overcommitted it would be
    granted) became a ConfigError naming the size; other errors pass through as they are."""
    cfg = PRESETS["tiny-switchhead"]
    total = sum(p.numel() for p in TransformerLM(cfg).parameters())
    monkeypatch.setattr(torch.nn.Embedding, "__init__", _allocator_fails(
        "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate"))
    with pytest.raises(ConfigError, match=rf"a model of this config has {total:,} parameters, which could not be "
                                          rf"allocated \({total * 4 / 2**30:,.4g} GiB in torch.float32\)"):
        TransformerLM(cfg)
    monkeypatch.setattr(torch.nn.Embedding, "__init__", _allocator_fails("something else"))
    with pytest.raises(RuntimeError, match="^something else$"):
        TransformerLM(cfg)
