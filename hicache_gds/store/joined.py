"""`JoinedStore`: a namespace other processes write, joined by its directory for lookups and
leases only (a vLLM scheduler, which holds no KV memory: its workers own the stores).

It writes nothing but its leases (and its place among the namespace's processes, so the others
reclaim those leases if it dies); `put`, `get`, `delete` and `register_memory` raise
`ReadOnlyError`; `clear` does too (the namespace's writers clear it).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from ..config import Config
from ..engines.base import MemKind, Op, Transfer
from ..errors import ReadOnlyError, StoreClosedError
from ..index import INDEX_FILE, Index
from ..layout import Pages
from ..slabs.owners import Membership
from .mover import MAX_KEY_BYTES
from .protocol import Lease, Store

__all__ = ["JoinedStore"]


def _no_post(op: Op, kind: MemKind, mem: np.ndarray, fil: np.ndarray) -> list[Transfer]:
    raise ReadOnlyError("a joined namespace moves no bytes (lookups and leases only)")


class JoinedStore(Store):
    """Lookups and leases on the namespace at `namespace_dir` (module docstring). Raises
    `FileNotFoundError` while no store has created it yet."""

    read_only = True

    def __init__(self, namespace_dir: str, config: Config | None = None) -> None:
        self.config = config if config is not None else Config.load({})
        self.namespace = os.path.basename(os.path.normpath(namespace_dir))
        self.page_bytes = self.slot_bytes = 0  # not known from the directory alone
        self.dirs = [namespace_dir]
        self._member: Membership | None = Membership(namespace_dir)
        try:
            self.index: Index | None = Index.join(os.path.join(namespace_dir, INDEX_FILE), self._member)
        except BaseException:
            self._member.close()
            raise

    def _ix(self) -> Index:
        if self.index is None:
            raise StoreClosedError(f"joined namespace {self.namespace} is closed")
        return self.index

    @staticmethod
    def _keys(keys: Sequence[str]) -> list[str]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise TypeError(f"keys must be a list of str, got {type(keys).__name__}")
        for i, k in enumerate(keys):
            if not isinstance(k, str) or not k or len(k) > MAX_KEY_BYTES or "\x00" in k:
                raise ValueError(f"key {i} must be a non-empty str of at most {MAX_KEY_BYTES} characters without NUL")
        return list(keys)

    def _refuse(self, op: str) -> ReadOnlyError:
        return ReadOnlyError(f"{op}: namespace {self.namespace} is joined for lookups and leases only")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        return self._ix().contains(self._keys(keys))

    def prefix(self, keys: Sequence[str]) -> int:
        # docstring inherited
        return self._ix().prefix_len(self._keys(keys))

    def lease(self, keys: Sequence[str]) -> Lease:
        """Lease the present pages of `keys` (no process reuses their slots until released); file
        ids and offsets are not known here (0). Raises `OSError` when the index cannot be written."""
        ix = self._ix()
        keys = self._keys(keys)
        entries = ix.lookup_pin(keys)
        present = np.array([e is not None for e in entries], dtype=bool)
        slots = np.array([e.slot if e is not None else 0 for e in entries], dtype=np.int64)
        nbytes = np.array([e.nbytes if e is not None else 0 for e in entries], dtype=np.int64)
        sums = np.array([e.csum if e is not None else 0 for e in entries], dtype=np.int64)
        zeros = np.zeros(len(keys), dtype=np.uint64)
        return Lease(keys, present, zeros, zeros.copy(), nbytes, sums, slots=slots, protected=True, post=_no_post,
                     unpin=ix.unpin, drop=None)

    def put(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        raise self._refuse("put")

    def get(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        raise self._refuse("get")

    def delete(self, keys: Sequence[str]) -> list[bool]:
        raise self._refuse("delete")

    def clear(self) -> int:
        raise self._refuse("clear")

    def register_memory(self, addr: int, nbytes: int, kind: MemKind = MemKind.DRAM) -> None:
        raise self._refuse("register_memory")

    def deregister_memory(self, addr: int) -> None:
        raise self._refuse("deregister_memory")

    def page_checksums(self, pages: Pages, like: np.ndarray | None = None) -> np.ndarray:
        raise self._refuse("page_checksums")

    @property
    def capabilities(self) -> Any:
        return None

    def stats(self) -> dict[str, Any]:
        # docstring inherited
        out: dict[str, Any] = {"namespace": self.namespace, "dirs": list(self.dirs), "read_only": True,
                               "engine": "none", "path": "lookups and leases"}
        if self.index is not None:
            out.update(self.index.stats())
        return out

    def close(self) -> None:
        """Return the leases still held and leave the namespace. Idempotent."""
        ix, self.index = self.index, None
        if ix is not None:
            ix.close()
        member, self._member = self._member, None
        if member is not None:
            member.close()
