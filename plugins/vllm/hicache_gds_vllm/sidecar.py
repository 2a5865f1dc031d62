"""Files the scheduler and the workers share under `GDS_PATH[0]/vllm-<engine id>/`.

vLLM gives the two sides one channel (job ids and counts); everything else they must agree on
goes through this directory, which only this adapter writes:

* `capacity.json` — chunks per (rank, group) namespace. Written once by whichever process gets
  there first (link() makes it first-writer-wins), so the manager's capacity and every worker's
  slot count are the same number without the processes talking.
* `stores-r<rank>.json` — the namespace directories a worker opened, so a restarted manager can
  find the pages that survived (warm start); and `stores-<engine_id>-r<rank>.json`, the same for
  one running engine, which its own manager reads first: two engines of one identity whose
  workers were handed different KV layouts (0.26 with two attention backends, say) open different
  namespaces, and each manager must consult its own workers' (removed at the worker's shutdown).
* `failed-<engine_id>-r<rank>.log` — keys whose store or load failed on that rank, appended
  *before* the worker reports the job finished. The manager reads them in `complete_store`, before
  it makes a chunk loadable, and in `complete_load`; vLLM itself accepts only success for a job.
  Two events travel the same way: `FAULT <reason>`, a load that failed as a whole (the engine
  refused it: it would fail again), after which the manager holds that rank's chunks back, and
  `LOAD_OK`, the first load of that rank to succeed after one.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Iterable, Mapping

from hicache_gds import prepare_root, private_dir, read_keys

__all__ = ["SideDir", "FailureLog", "read_store_keys", "FAULT", "LOAD_OK"]

log = logging.getLogger("hicache_gds_vllm")

FAULT = "!fault"  # a failure log line starting so: a load of that rank failed as a whole (the reason follows)
LOAD_OK = "!load-ok"  # ... and this one: a load of that rank succeeded after one (keys are hex: never "!")


class SideDir:
    """The adapter's directory for one engine identity (`spec_id`)."""

    def __init__(self, gds_path: str, spec_id: str) -> None:
        self.path = private_dir(prepare_root(gds_path), f"vllm-{spec_id}")

    def _atomic_json(self, name: str, obj: object, *, exclusive: bool = False) -> bool:
        final = os.path.join(self.path, name)
        tmp = f"{final}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            if exclusive:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, final)
                tmp = ""
            return True
        finally:
            if tmp:
                os.unlink(tmp)

    def _read_json(self, name: str) -> object | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("hicache-gds-vllm: ignoring unreadable %s in %s: %s", name, self.path, exc)
            return None

    def agreed_capacity(self, proposed: int, explicit: bool) -> int:
        """Chunks per namespace. An explicit setting wins (and is recorded); otherwise the first
        process's proposal, computed from free space, stays for the life of the directory."""
        if explicit:
            self._atomic_json("capacity.json", {"chunks": proposed})
            return proposed
        self._atomic_json("capacity.json", {"chunks": proposed}, exclusive=True)
        got = self._read_json("capacity.json")
        if isinstance(got, dict) and isinstance(got.get("chunks"), int) and got["chunks"] > 0:
            return int(got["chunks"])
        return proposed

    def write_stores(self, rank: int, dirs: Mapping[int, str], engine_id: str | None = None) -> None:
        obj = {str(g): d for g, d in dirs.items()}
        if engine_id is not None:
            self._atomic_json(self._engine_stores(engine_id, rank), obj)
        self._atomic_json(f"stores-r{rank}.json", obj)

    def read_stores(self, rank: int, engine_id: str | None = None) -> dict[int, str]:
        """Group position -> namespace directory of `rank`: the running engine's own, where its
        worker wrote them, else the last any worker wrote."""
        got = self._read_json(self._engine_stores(engine_id, rank)) if engine_id is not None else None
        if not isinstance(got, dict):
            got = self._read_json(f"stores-r{rank}.json")
        return {int(g): str(d) for g, d in got.items()} if isinstance(got, dict) else {}

    def forget_engine(self, engine_id: str, rank: int) -> None:
        """Remove what one engine's worker wrote for itself (at its shutdown)."""
        for name in (self._engine_stores(engine_id, rank), self.failure_log(engine_id, rank)):
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass

    @staticmethod
    def _safe(engine_id: str) -> str:
        return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in engine_id)[:80]

    def _engine_stores(self, engine_id: str, rank: int) -> str:
        return f"stores-{self._safe(engine_id)}-r{rank}.json"

    def failure_log(self, engine_id: str, rank: int) -> str:
        return os.path.join(self.path, f"failed-{self._safe(engine_id)}-r{rank}.log")


class FailureLog:
    """Append-only list of hex keys. The writer appends whole lines with one write(); the reader
    keeps its offset and returns only complete new lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def append(self, keys: Iterable[str]) -> None:
        data = "".join(f"{k}\n" for k in keys).encode()
        if not data:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def poll(self) -> list[str]:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return []
        if size < self._offset:  # recreated: start over
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        return [ln.decode() for ln in lines if ln]

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def read_store_keys(namespace_dir: str) -> list[str]:
    """Keys a worker's namespace holds, least recently used first, read without writing."""
    return read_keys(namespace_dir)
