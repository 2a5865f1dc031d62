"""Which processes have a namespace open, told by the kernel: one locked file per open store.

Every `PageStore` that opens a namespace creates ``procs/<token>`` in the namespace's first
directory (0600, holding its pid), locked with an exclusive `flock` before it appears under that
name (created under a temporary name, then renamed), and keeps the lock until it closes. The index
tags what the store holds in the shared database -- slots it reserved for writing, slots it is
reading -- with that token. The kernel drops the lock when the process dies, however it dies
(kill -9 included), so another process tells a live owner from a dead one by trying the lock:

* `alive(token)` is False once the owner's lock can be taken (it closed, or died), and the
  survivors then reclaim what the dead owner held (`Index` does it);
* a lock, unlike a pid, names one open store even across pid namespaces (containers sharing a
  disk) and is never confused by a reused pid.

Opening a namespace (creating, sizing, recovering it) is serialised by `setup_lock`, an exclusive
`flock` on the namespace's ``lock`` file held only while a store opens: the first opener of a
namespace nobody else has open recovers it; later ones join it as it is. Removing a namespace
(`hicache-gds clear`, or eviction to make room for a new one) holds the same lock
(`setup_lock_if_free`), so nothing opens a namespace while it is being removed; an opener that
waited on the lock of a namespace removed meanwhile creates its directories again and starts it
empty.

When it was last used (`read_use`): every open writes the opener's pid into the ``lock`` file, so
its mtime is the last open; every `close` sets the mtime of the ``closed`` file (`record_close`).
Both are file metadata, kept by the kernel however the process dies; a machine crash may lose the
last few seconds of them (the file system's journal commit), which only changes which idle
namespace goes first. A store killed with
SIGKILL records no close: its ``procs/`` file stays behind with its lock free (`procs_state` counts
it), and its last work is the newest write of the namespace's index (`namespaces` reads that).

`holders(namespace_dir)` lists the pids that have a namespace open, for operators' tools.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..errors import ConfigError, StoreLockedError
from .slabset import private_dir

__all__ = ["Membership", "Use", "holders", "procs_state", "setup_lock", "setup_lock_if_free", "record_close",
           "read_use", "LOCK_FILE", "PROCS_DIR", "CLOSED_FILE", "SETUP_WAIT_S"]

log = logging.getLogger("hicache_gds.owners")
LOCK_FILE = "lock"
"""The namespace's file `setup_lock` locks while a store opens."""
PROCS_DIR = "procs"
CLOSED_FILE = "closed"
"""In a namespace's first directory: its mtime is when a store last closed the namespace."""
SETUP_WAIT_S = 120.0
"""How long an open waits for another process's open of the same namespace before it fails."""


def _procs_dir(namespace_dir: str, create: bool) -> str:
    path = os.path.join(namespace_dir, PROCS_DIR)
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"GDS_PATH: {path} is a symbolic link or not a directory; the store never follows "
                          f"links inside its namespace (remove it)")
    return path


_TMP_PREFIX = ".new-"
_STALE_TMP_S = 60.0  # a temporary entry unlocked for this long was left by a process that died creating it


def _sweep_stale(procs: str) -> None:
    """Remove temporary entries whose creator died between creating and renaming them (unlocked, old)."""
    try:
        names = [n for n in os.listdir(procs) if n.startswith(_TMP_PREFIX)]
    except OSError:
        return
    for n in names:
        path = os.path.join(procs, n)
        try:
            if time.time() - os.lstat(path).st_mtime < _STALE_TMP_S:
                continue
        except FileNotFoundError:
            continue
        if _try_lock(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _token_ok(token: str) -> bool:
    return 0 < len(token) <= 64 and all(c in "0123456789abcdef" for c in token)


def _try_lock(path: str) -> bool | None:
    """True: the file's lock was free (its owner is gone), False: held, None: no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    finally:
        os.close(fd)  # also drops the lock just taken


def _note_pid(fd: int) -> None:
    """Write this process's pid into a lock file: it only names the holder in messages, so a full
    file system (no block for it) must not refuse to open a namespace whose slabs already exist."""
    try:
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise


class Membership:
    """This store's entry in ``procs/``: a token, and the lock that says it is alive.

    The file appears under its token's name only once it is locked: it is created and locked
    under a temporary name (``.new-<token>``, which nothing judges), then renamed into place. A
    concurrent `others` or reclaim never finds it unlocked, so a live store is never judged dead."""

    def __init__(self, namespace_dir: str) -> None:
        self.dir = _procs_dir(namespace_dir, create=True)
        self.token = secrets.token_hex(8)
        self.path = os.path.join(self.dir, self.token)
        tmp = os.path.join(self.dir, _TMP_PREFIX + self.token)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _note_pid(fd)
            os.rename(tmp, self.path)  # the lock belongs to the open file, and goes with it
        except BaseException:
            os.close(fd)
            for p in (tmp, self.path):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            raise
        self._fd = fd
        self.namespace_dir = namespace_dir
        _sweep_stale(self.dir)

    def alive(self, token: str) -> bool:
        """Does the store that holds `token` still have the namespace open? (Our own token: yes.)

        A dead owner's file is removed here, so each dead owner is found once."""
        if token == self.token:
            return self._fd >= 0
        if not _token_ok(token):
            return False
        path = os.path.join(self.dir, token)
        free = _try_lock(path)
        if free:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return free is False

    def others(self) -> list[str]:
        """Tokens of the other stores that have the namespace open now (dead owners' files are removed)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return [t for t in names if t != self.token and _token_ok(t) and self.alive(t)]

    def close(self) -> None:
        if self._fd >= 0:
            record_close(self.namespace_dir)  # before the lock goes: a kill -9 between leaves a dead
            try:                              # procs/ file, not a close that never finished
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1


def procs_state(namespace_dir: str) -> tuple[list[int], int]:
    """(pids of the stores that have the namespace open, how many stores ended without closing --
    killed, or crashed -- and left their ``procs/`` file), without changing anything."""
    try:
        d = _procs_dir(namespace_dir, create=False)
    except FileNotFoundError:
        return [], 0
    pids, dead = [], 0
    for name in sorted(os.listdir(d)):
        if not _token_ok(name):
            continue
        path = os.path.join(d, name)
        free = _try_lock(path)
        if free is False:
            try:
                with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW | os.O_CLOEXEC)) as fh:
                    pids.append(int(fh.read(32).decode() or 0))
            except (OSError, ValueError):
                pids.append(0)
        elif free:
            dead += 1
    return sorted(pids), dead


def holders(namespace_dir: str) -> list[int]:
    """Pids of the processes that have the namespace at `namespace_dir` open (a `PageStore` each;
    a pid appears once per store it holds), without changing anything. [] when none or no such
    namespace; `ConfigError` for a symbolic link where its ``procs`` directory should be."""
    return procs_state(namespace_dir)[0]


@dataclass(frozen=True)
class Use:
    """A namespace's recorded use, in seconds since the epoch (None where never recorded)."""

    opened: float | None = None
    """The newest open by any store: the ``lock`` file's mtime (`setup_lock` writes the opener's
    pid into it at every open)."""
    closed: float | None = None
    """The newest close by any store: the ``closed`` file's mtime (`record_close`); a store
    killed with SIGKILL records none."""


def read_use(namespace_dir: str) -> Use:
    """The namespace's recorded use (`Use`), read from two files' metadata; nothing is opened."""
    out = []
    for name in (LOCK_FILE, CLOSED_FILE):
        try:
            st = os.lstat(os.path.join(namespace_dir, name))
            out.append(st.st_mtime if stat.S_ISREG(st.st_mode) else None)
        except OSError:
            out.append(None)
    return Use(*out)


def record_close(namespace_dir: str) -> None:
    """Record a store's close: the ``closed`` file's mtime becomes now (one system call; the file
    is created at a namespace's first close). A link planted there is never followed (its own
    time is set). Never raises: a store closes whether or not its close can be recorded."""
    path = os.path.join(namespace_dir, CLOSED_FILE)
    try:
        try:
            os.utime(path, follow_symlinks=False)
        except FileNotFoundError:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        log.debug("hicache-gds: cannot record the close of %s: %s", namespace_dir, exc)


def _linked(fd: int, path: str) -> bool:
    """`fd` is the file at `path` (not one unlinked since it was opened)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


@contextmanager
def setup_lock(dirs: str | Sequence[str], timeout: float = SETUP_WAIT_S) -> Iterator[None]:
    """Hold the namespace's ``lock`` file (in its first directory) exclusively while a store opens
    (`StoreLockedError` after `timeout` s, naming the pid that holds it).

    `dirs`: the namespace's directory, or all of them (one per `GDS_PATH` entry). A namespace
    removed while this waited (`hicache-gds clear`, eviction) has its directories created again,
    empty, and is locked afresh."""
    dirs = [dirs] if isinstance(dirs, str) else list(dirs)
    path = os.path.join(dirs[0], LOCK_FILE)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # its directory was removed
            _recreate(dirs)
            continue
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
                        raise StoreLockedError(f"namespace {dirs[0]} has been opening in pid "
                                               f"{holder} for over {timeout:.0f} s; nothing was opened") from None
                    time.sleep(0.01)
            if not _linked(fd, path):  # removed while we waited: lock what is there now
                os.close(fd)
                fd = -1
                _recreate(dirs)
                continue
            os.ftruncate(fd, 0)
            _note_pid(fd)
            yield
            return
        finally:
            if fd >= 0:
                os.close(fd)  # releases the lock


def _recreate(dirs: Sequence[str]) -> None:
    for d in dirs:
        private_dir(os.path.dirname(d), os.path.basename(d))


@contextmanager
def setup_lock_if_free(namespace_dir: str) -> Iterator[bool]:
    """Hold the namespace's setup lock if no store is opening it now: yields True while held,
    False (holding nothing) when a store is opening it. Also True, holding nothing, where no
    store could open it: `namespace_dir` is gone, or a symbolic link stands where the lock file
    should be (`setup_lock` refuses to follow it)."""
    path = os.path.join(namespace_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield _linked(fd, path)
    finally:
        os.close(fd)
