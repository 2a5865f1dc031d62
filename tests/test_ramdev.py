"""benchmarks/ramdev.sh: RAM-backed ext4 devices that take O_DIRECT, their written sectors (what the
e2e harness waits on), and their removal; bad input is refused with a message naming it."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "ramdev.sh")
sys.path.insert(0, os.path.join(REPO, "benchmarks", "e2e"))

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("losetup") or not shutil.which("mkfs.ext4"),
                                reason="needs root, losetup and mkfs.ext4 (CI runs as root)")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_up_write_status_down(tmp_path):
    root = str(tmp_path / "ram")
    up = run("up", "--size", "96M", "--count", "2", "--root", root)
    try:
        assert up.returncode == 0, up.stderr
        mounts = up.stdout.strip().splitlines()[-1].split(",")
        assert mounts == [f"{root}/dev0", f"{root}/dev1"]
        assert all(os.stat(m).st_mode & 0o777 == 0o700 for m in mounts)
        from e2elib import wait_writes_quiet, written_sectors
        before = written_sectors(mounts)
        assert len(before) == 2 and all(v >= 0 for v in before.values())
        buf = mmap.mmap(-1, 4 << 20)
        buf.write(os.urandom(4 << 20))
        fd = os.open(os.path.join(mounts[1], "f"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            for i in range(4):
                os.pwrite(fd, buf, i * (4 << 20))  # O_DIRECT: accepted, unlike tmpfs
            os.fsync(fd)
        finally:
            os.close(fd)
        quiet = wait_writes_quiet(mounts, quiet_s=0.5, timeout_s=20)
        assert quiet["quiet"] and sum(quiet["bytes_written"].values()) >= 0
        after = written_sectors(mounts)
        dev1 = f"{os.major(os.stat(mounts[1]).st_dev)}:{os.minor(os.stat(mounts[1]).st_dev)}"
        assert (after[dev1] - before[dev1]) * 512 >= 16 << 20
        st = run("status", "--root", root)
        assert st.returncode == 0 and len(st.stdout.splitlines()) == 2 and "written_sectors=" in st.stdout
    finally:
        down = run("down", "--root", root)
    assert down.returncode == 0, down.stderr
    assert not os.path.exists(root)
    assert root not in subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout


def test_down_frees_the_memory_when_the_image_is_released_late(tmp_path):
    """A process still holding the device's image open (as udev's probe may, just after the loop
    device is detached) keeps its tmpfs busy: `down` waits for the release and then frees it,
    instead of leaving the memory taken (a run on the GPU machine lost 48 GiB of RAM that way)."""
    root = str(tmp_path / "ram")
    up = run("up", "--size", "64M", "--root", root)
    assert up.returncode == 0, up.stderr
    img = next(os.path.join(root, "backing", f) for f in os.listdir(os.path.join(root, "backing")))
    holder = subprocess.Popen([sys.executable, "-c", f"import time; f = open({img!r}, 'rb'); time.sleep(1.5)"])
    try:
        time.sleep(0.3)  # the image is open before down runs
        down = run("down", "--root", root)
    finally:
        holder.wait(10)
    assert down.returncode == 0, down.stderr
    assert "lazily" not in down.stderr
    assert not os.path.exists(root)
    assert root not in subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("args, msg", [(["up"], "needs --size"), (["up", "--size", "8Q"], "is not a size"),
                                       (["up", "--size", "1M"], "below 64M"),
                                       (["up", "--size", "64M", "--count", "0"], "positive integer"),
                                       (["up", "--size", "100000G"], "of RAM"), (["frob"], "usage"),
                                       (["up", "--size", "64M", "--bogus"], "unknown argument")])
def test_bad_input_is_refused_by_name(tmp_path, args, msg):
    r = run(*args, "--root", str(tmp_path / "x")) if args[0] == "up" and "--bogus" not in args else run(*args)
    assert r.returncode != 0 and msg.lower() in (r.stderr + r.stdout).lower(), r.stderr
    assert not os.path.exists(tmp_path / "x" / "backing")
