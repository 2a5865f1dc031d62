"""tests/vllm: the vLLM adapter (plugins/vllm) against vLLM's real Scheduler and OffloadingConnector, on
whichever of the adapter's releases is installed (scripts/test.sh runs it against 0.33 and 0.26).

The whole folder is skipped where vLLM (or the adapter) cannot be imported, as in the main suite's
venv: its test modules are not collected, and `test_0_vllm_available.py` reports one skip with the
reason. Set up with

    scripts/install-vllm-test-deps.sh python3.11                     # .venv-vllm: vLLM 0.33 (~3-6 min)
    scripts/install-vllm-test-deps.sh python3.11 .venv-vllm026 0.26   # .venv-vllm026: vLLM 0.26 (~3 min)
    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python -m pytest tests/vllm
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU: vLLM's CPU platform, before vllm is imported

import pytest


def _cpu_platform() -> None:
    """vLLM's CPU platform on this CPU machine. 0.33 chooses it by VLLM_TARGET_DEVICE=cpu; 0.26 only in
    a CPU build of vLLM (the PyPI wheel is a CUDA build) or on macOS, and otherwise runs on
    `UnspecifiedPlatform`, whose configs cannot be built. Tests only: a GPU machine finds CUDA."""
    import vllm.platforms as platforms
    plugins = getattr(platforms, "builtin_platform_plugins", {})
    cpu = plugins.get("cpu")
    if cpu is not None and cpu() is None and os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        plugins["cpu"] = lambda: "vllm.platforms.cpu.CpuPlatform"
        if type(getattr(platforms, "_current_platform", None)).__name__ == "UnspecifiedPlatform":
            platforms._current_platform = None  # `import vllm` resolved it already; nothing else holds it yet


def _missing() -> str | None:
    try:
        import vllm
        if getattr(vllm, "__file__", None) is None:  # only this folder, seen as a namespace package
            raise ImportError("No module named 'vllm'")
        _cpu_platform()
        import vllm.v1.kv_offload.base  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- ImportError, or a broken install raising anything
        return (f"vLLM is not importable here ({type(exc).__name__}: {exc}); "
                f"install it with scripts/install-vllm-test-deps.sh")
    try:
        import hicache_gds_vllm  # noqa: F401
    except ImportError as exc:
        return f"plugins/vllm is not installed ({exc}); pip install -e plugins/vllm --no-deps"
    return None


VLLM_MISSING = _missing()
if VLLM_MISSING:
    collect_ignore_glob = ["test_[a-z]*.py", "vllm_harness.py"]


@pytest.fixture
def gds_dir(tmp_path, monkeypatch):
    """A GDS_PATH on the real disk (tmp_path is, on these machines; O_DIRECT needs a real filesystem).
    Under the test's tmp_path, so it goes when the test passes (tmp_path_retention_policy). max_fill
    is 1, as in ``tests/conftest.py``: the shared disk may already be fuller than 90 %."""
    monkeypatch.setenv("HICACHE_GDS_MAX_FILL", "1")
    d = tmp_path / "gds"
    d.mkdir()
    return str(d)


@pytest.fixture
def vllm_missing() -> str | None:
    """Why this folder is skipped, or None."""
    return VLLM_MISSING
