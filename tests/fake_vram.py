"""Host memory presented as device memory, so the store's device-page paths run on the CPU machine.

`HostAsVram` wraps a host engine and declares VRAM, moving "device" descriptors as the host memory
they are; `cpu_device_sums` is `checksum.device_checksums` on those addresses (torch or Triton's
interpreter on the host). A store given both (`use_fake_vram(store)`) takes exactly the paths it
takes for GPU pages -- checksums of device pages computed by the device function in one call per
request, reads into device memory verified by it -- with nothing but the memory being fake.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hicache_gds.engines.base import Capabilities, MemKind, Op, Transfer, TransferEngine
from hicache_gds.testing.host_as_vram import cpu_device_sums  # noqa: F401 -- the tests' import point


class HostAsVram(TransferEngine):
    name = "host-as-vram"

    def __init__(self, inner: TransferEngine) -> None:
        super().__init__(inner.options)
        self.inner = inner

    @property
    def capabilities(self) -> Capabilities:
        caps = self.inner.capabilities
        return dataclasses.replace(caps, mem_kinds=caps.mem_kinds | {MemKind.VRAM}, path=caps.path + " (host as VRAM)")

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        self.inner.register_memory(addr, nbytes, MemKind.DRAM)

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        self.inner.deregister_memory(addr)

    def open_file(self, path: str) -> int:
        return self.inner.open_file(path)

    def close_file(self, file_id: int) -> None:
        self.inner.close_file(file_id)

    def _submit(self, op: Op, kind: MemKind, mem: np.ndarray, file: np.ndarray) -> Transfer:
        return self.inner.submit(op, MemKind.DRAM, mem, file)

    def close(self) -> None:
        self.inner.close()


def use_fake_vram(store, impl: str = "torch"):
    """Make `store` (built on a `HostAsVram` engine) checksum its "device" pages on the host."""
    store._device_sums = cpu_device_sums(impl)
    return store
