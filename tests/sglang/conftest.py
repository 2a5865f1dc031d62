"""Tests of the SGLang backend (plugins/sglang) against SGLang 0.5.23's real classes, on CPU.

Skipped as a whole when SGLang cannot be imported; `scripts/install-sglang-test-deps.sh` builds
the venv they need (.venv-sgl).
"""

import os
import sys

import pytest

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    import hicache_gds_sglang  # noqa: F401
except Exception as exc:  # noqa: BLE001 -- any import failure means "not this venv"
    pytest.skip(f"SGLang or hicache-gds-sglang is not importable ({type(exc).__name__}: {exc}); build the "
                f"venv with scripts/install-sglang-test-deps.sh and run .venv-sgl/bin/python -m pytest tests/sglang",
                allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))  # sgl_helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: sglang_pools


@pytest.fixture(autouse=True)
def _no_injector(monkeypatch):
    for k in ("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE",
              "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
        monkeypatch.delenv(k, raising=False)
