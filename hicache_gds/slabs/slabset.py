"""Slab files: preallocated per namespace, one per `GDS_PATH` directory, fixed-size 4 KiB-aligned slots.

Slots are placed by `ondisk.place` (slot s in directory s % ndirs at offset (s // ndirs) *
slot_bytes, so consecutive slots stripe across drives), the directories in the namespace's
recorded order (`ondisk.stripe_order`). Directories are created 0700 and files 0600; symlinks are refused at every
level the store creates, so nothing is ever written outside `GDS_PATH`.
"""

from __future__ import annotations

import errno
import os
import stat

import numpy as np

from ..errors import ConfigError, StoreFullError
from .ondisk import place

__all__ = ["META_FILE", "SlabSet", "prepare_root", "private_dir"]

META_FILE = "namespace.json"
"""In a namespace's first directory: its identity, slot size and directories (`PageStore` writes it)."""


def prepare_root(path: str, writable: bool = True) -> str:
    """Check one `GDS_PATH` entry: an existing directory, writable unless `writable=False` (readers).
    Returns its real path."""
    if not os.path.lexists(path):
        raise ConfigError(f"GDS_PATH: {path} does not exist; create it (one directory per NVMe drive)")
    if not os.path.isdir(path):
        raise ConfigError(f"GDS_PATH: {path} is not a directory")
    if not writable:
        if not os.access(path, os.X_OK):
            raise ConfigError(f"GDS_PATH: {path} cannot be searched by this process")
    elif not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"GDS_PATH: {path} is not writable by this process")
    return os.path.realpath(path)


def private_dir(parent: str, name: str) -> str:
    """Create (or check) `parent/name` as a real directory with mode 0700; never follow a symlink."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"bad directory name {name!r}")
    path = os.path.join(parent, name)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"GDS_PATH: {path} exists but is not a plain directory (symlink or file); "
                          f"remove it or choose another GDS_PATH")
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


class SlabSet:
    """The slab files of one namespace: `nslots` slots of `slot_bytes` striped over `dirs`."""

    FILE_NAME = "slab.bin"

    def __init__(self, dirs: list[str], slot_bytes: int, nslots: int, preallocate: bool = True,
                 create: bool = True) -> None:
        """`create=False` describes files another process owns (a `PageReader`'s view: paths and
        placement) and touches nothing; `nslots` and `file_bytes` are then the caller's guess."""
        if slot_bytes % 4096:
            raise ValueError("slot_bytes must be a multiple of 4096")
        self.dirs = dirs
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        self.paths = [os.path.join(d, self.FILE_NAME) for d in dirs]
        nd = len(dirs)
        self.file_bytes = [((nslots - i + nd - 1) // nd) * slot_bytes for i in range(nd)]
        for path, size in zip(self.paths, self.file_bytes):
            if create:
                self._create(path, size, preallocate)

    @staticmethod
    def _create(path: str, size: int, preallocate: bool) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"GDS_PATH: {path} is not a regular file")
            if stat.S_IMODE(st.st_mode) != 0o600:
                os.fchmod(fd, 0o600)
            if st.st_size != size:
                os.ftruncate(fd, size)
            # Allocated already (by an earlier open, or by its sizing): no walk over its blocks again.
            if preallocate and size and not (st.st_size == size and st.st_blocks * 512 >= size):
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno == errno.ENOSPC:
                        os.ftruncate(fd, 0)
                        raise StoreFullError(errno.ENOSPC, f"no room for {size} bytes of page slots in "
                                             f"{os.path.dirname(path)}; lower HICACHE_GDS_CAPACITY") from exc
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
        finally:
            os.close(fd)

    def place(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, byte offset) arrays for an array of slots."""
        return place(slots, len(self.dirs), self.slot_bytes)
