"""Host memory standing in for GPU memory in a `RemoteTier`, so its device-page paths run without a GPU.

`host_as_vram(tier)` makes the tier's UCX engine register and move "VRAM" regions as the host
memory they are, maps device addresses to torch's cpu device, and runs the device checksum there.
Everything else is what a GPU runs: gets of device pages go through staging of the pages' device
kind, each request's pages are copied out with `scatter_device`, and verified by the device
checksum on the caller's pages. Pages written this way carry hgc1, the device checksum's tag.
(`tests/fake_vram.py` does the same for the NVMe store's engines.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

__all__ = ["cpu_device_sums", "host_as_vram"]


def cpu_device_sums(impl: str = "torch") -> Any:
    """`checksum.device_checksums` on torch's cpu device: the device checksum over host memory
    standing in for device memory (torch, or Triton's interpreter with impl "triton")."""
    import torch

    from ..checksum import device_checksums
    return functools.partial(device_checksums, device=torch.device("cpu"), impl=impl)


def host_as_vram(tier: Any) -> Any:
    import torch

    from ..engines.base import MemKind

    eng = tier.engine
    eng._caps = dataclasses.replace(eng._caps, mem_kinds=eng._caps.mem_kinds | {MemKind.VRAM})
    register, prepare = eng._register, eng._prepare
    eng._register = lambda addr, nbytes, kind: register(addr, nbytes, MemKind.DRAM)
    eng._prepare = lambda op, kind, *rest: prepare(op, MemKind.DRAM, *rest)
    tier._stagings.device_of = lambda addr: torch.device("cpu")
    tier._device_sums = cpu_device_sums()
    return tier
