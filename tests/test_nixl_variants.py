"""NIXL's CUDA 12 and CUDA 13 builds: which one a process imports, and that hicache-gds and SGLang's
HiCacheNixl (``from nixl._api import ...``) always end up on the same one.

The decision rules are checked as a table (`_nixl_variant.choose`); then each situation runs in a
subprocess with real NIXL wheels: ``nixl-cu12==1.5.1`` and ``nixl-cu13==1.5.1`` installed with
``pip --target`` into directories of their own (both install and load on a CPU machine), a
store written and read through NIXL POSIX, and the bytes compared. A CUDA 12 host is the one thing
simulated: torch's ``version.cuda`` is set to "12.8" before NIXL is imported, which is what NIXL's
meta-package reads to pick a build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from hicache_gds._nixl_variant import Facts, choose, extra_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NIXL_VERSION = "1.5.1"


# -- the rules ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("facts,first,why", [
    (Facts("cu12", True, ("cu12", "cu13"), "13.0"), "nixl_cu12._api", "already imported"),
    (Facts(None, True, ("cu12", "cu13"), "12.8"), "nixl._api", "meta-package"),
    (Facts(None, False, ("cu12",), "13.0"), "nixl_cu12._api", "only NIXL installed"),
    (Facts(None, False, ("cu12", "cu13"), "12.4"), "nixl_cu12._api", "matches torch"),
    (Facts(None, False, ("cu12", "cu13"), None), "nixl_cu13._api", "matches torch"),
])
def test_choice_rules(facts, first, why):
    c = choose(facts)
    assert c.modules[0] == first and why in c.reason


def test_meta_package_falls_back_to_the_installed_build_matching_cuda_first():
    c = choose(Facts(None, True, ("cu12", "cu13"), "12.8"))
    assert c.modules == ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def test_nothing_installed_is_no_module_and_says_so():
    c = choose(Facts(None, False, (), None))
    assert c.modules == () and "no NIXL" in c.reason


@pytest.mark.parametrize("cuda,extra", [("12.8", "cu12"), ("13.0", "cu13"), (None, "cu13"), ("11.8", "cu13")])
def test_extra_for_the_torch_build(cuda, extra):
    assert extra_for(cuda) == extra


def test_extra_script_runs_before_anything_is_installed():
    # scripts/test.sh and bench.sh run the file with the bare interpreter to choose the extra
    p = subprocess.run([sys.executable, "-S", os.path.join(REPO, "hicache_gds", "_nixl_variant.py"), "--extra"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() in ("cu12", "cu13")


# -- real wheels, one process per situation --------------------------------------------------------

def _pip_target(dest: str, *reqs: str) -> None:
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary", ":all:", "--target", dest, *reqs], capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        pytest.skip(f"cannot install {' '.join(reqs)} here: {p.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """Directories holding nixl-cu12 alone, nixl-cu13 alone, and the store's pure deps (no torch);
    removed at the end (hundreds of MB)."""
    import numpy
    import xxhash
    root = tmp_path_factory.mktemp("nixl-sites")
    out = {}
    for v in ("cu12", "cu13"):
        out[v] = str(root / v)
        _pip_target(out[v], f"nixl-{v}=={NIXL_VERSION}")
    out["deps"] = str(root / "deps")
    _pip_target(out["deps"], f"numpy=={numpy.__version__}", f"xxhash=={xxhash.VERSION}")
    yield out
    shutil.rmtree(root, ignore_errors=True)


# Writes 8 random pages through NIXL POSIX, reads them back into poisoned memory, compares bytes;
# reports what NIXL was chosen and which builds ended up imported.
_STORE = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from hicache_gds import PageStore, Pages
    from hicache_gds._nixl import nixl_api, nixl_info
    from hicache_gds.memory import HostBuffer
    PAGE = 64 << 10
    out = {"info": nixl_info()}
    if os.environ.get("SGLANG_NIXL"):   # SGLang's HiCacheNixl, after hicache-gds: the same NIXL?
        from sglang.srt.mem_cache.storage.nixl import hicache_nixl
        out["sglang_same_agent_class"] = hicache_nixl.nixl_agent is nixl_api().nixl_agent
    if out["info"].get("module"):
        with PageStore(PAGE, {"model": "variant"}, config={"gds_path": os.environ["GDS"], "capacity": 32 * PAGE,
                                                           "engine": "nixl-posix"}) as st:
            buf = HostBuffer(16 * PAGE, pinned=False)
            arr = buf.numpy()
            arr[:8 * PAGE] = np.random.default_rng(5).integers(0, 256, 8 * PAGE, dtype=np.uint8)
            arr[8 * PAGE:] = 0xEE
            st.register_memory(buf.addr, buf.nbytes)
            keys = [f"k{i}" for i in range(8)]
            out["put"] = st.put(keys, Pages.contiguous(buf.addr, PAGE, range(8)))
            out["get"] = st.get(keys, Pages.contiguous(buf.addr, PAGE, range(8, 16)))
            out["same_bytes"] = bool((arr[:8 * PAGE] == arr[8 * PAGE:]).all())
            out["engine"] = st.stats()["engine"]
            st.deregister_memory(buf.addr)
            buf.close()
    out["loaded"] = sorted(m for m in ("nixl_cu12", "nixl_cu13") if m in sys.modules)
    print(json.dumps(out))
""")


def _run(tmp_path, path: list[str], prelude: str = "", isolated: bool = False, **env: str) -> dict:
    gds = tmp_path / "gds"
    gds.mkdir(exist_ok=True)
    e = dict(os.environ, GDS=str(gds), PYTHONPATH=os.pathsep.join(path + [REPO]), **env)
    cmd = [sys.executable] + (["-S"] if isolated else []) + ["-c", prelude + _STORE]
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=300, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _stored(r: dict) -> None:
    assert r["put"] == [True] * 8 and r["get"] == [True] * 8 and r["same_bytes"], r
    assert r["engine"] == "nixl-posix"


@pytest.mark.parametrize("variant", ["cu12", "cu13"])
@pytest.mark.slow
def test_only_one_build_installed_is_used(sites, tmp_path, variant):
    # `python -S`: no site-packages, so this build is the only NIXL (no meta-package, no torch)
    r = _run(tmp_path, [sites[variant], sites["deps"]], isolated=True)
    assert r["info"]["variant"] == variant and r["info"]["installed"] == [variant], r["info"]
    assert "only NIXL installed" in r["info"]["chosen_by"]
    assert r["loaded"] == [f"nixl_{variant}"]
    _stored(r)


def test_no_nixl_says_how_to_install_and_the_store_still_opens_with_bounce(sites, tmp_path):
    code = textwrap.dedent("""
        import json, os
        from hicache_gds import PageStore, EngineUnavailable
        from hicache_gds._nixl import nixl_info
        out = {"info": nixl_info()}
        with PageStore(65536, {"m": 1}, config={"gds_path": os.environ["GDS"], "capacity": 1 << 20}) as st:
            out["auto"] = st.stats()["engine"]
        try:
            PageStore(65536, {"m": 2}, config={"gds_path": os.environ["GDS"], "capacity": 1 << 20,
                                                "engine": "nixl-posix"})
        except EngineUnavailable as exc:
            out["named"] = str(exc)
        print(json.dumps(out))
    """)
    gds = tmp_path / "gds"
    gds.mkdir()
    e = dict(os.environ, GDS=str(gds), PYTHONPATH=os.pathsep.join([sites["deps"], REPO]))
    p = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["info"]["module"] is None and "hicache-gds[cu13]" in r["info"]["error"], r["info"]
    assert r["auto"] == "bounce"
    assert "hicache-gds[cu12]" in r["named"]


# torchvision checks torch's CUDA build once, at its import: done before the build is made to read 12.8
_CUDA12 = ("import torch, torchvision\n"
           "torch.version.cuda = '12.8'  # a CUDA 12 build of torch, as NIXL's meta-package reads it\n")


@pytest.mark.slow
def test_cuda12_host_with_the_meta_package_uses_cu12_like_sglang(sites, tmp_path):
    # This environment has nixl-cu13 and the meta-package; nixl-cu12 added in front. The meta-package
    # picks cu12 for a CUDA 12 torch, so hicache-gds must too, or SGLang's import fails afterwards.
    r = _run(tmp_path, [sites["cu12"]], prelude=_CUDA12, SGLANG_NIXL="1")
    assert r["info"]["variant"] == "cu12" and "meta-package" in r["info"]["chosen_by"], r["info"]
    assert r["sglang_same_agent_class"] is True
    assert r["loaded"] == ["nixl_cu12"]
    _stored(r)


@pytest.mark.slow
def test_sglang_imported_nixl_first_hicache_gds_follows(sites, tmp_path):
    prelude = _CUDA12 + "from nixl._api import nixl_agent, nixl_agent_config  # as HiCacheNixl does\n"
    r = _run(tmp_path, [sites["cu12"]], prelude=prelude, SGLANG_NIXL="1")
    assert r["info"]["variant"] == "cu12" and "already imported" in r["info"]["chosen_by"], r["info"]
    assert r["sglang_same_agent_class"] is True and r["loaded"] == ["nixl_cu12"]
    _stored(r)


def test_a_build_imported_directly_wins_over_the_meta_package(sites, tmp_path):
    # torch here is a CUDA 13 build, so the meta-package would pick cu13: importing it now would crash
    r = _run(tmp_path, [sites["cu12"]], prelude="import nixl_cu12\n")
    assert r["info"]["variant"] == "cu12" and r["loaded"] == ["nixl_cu12"], r
    _stored(r)


@pytest.mark.slow
def test_this_environment_cuda13_torch_with_sglang(tmp_path):
    r = _run(tmp_path, [], SGLANG_NIXL="1")
    assert r["info"]["variant"] == "cu13" and r["sglang_same_agent_class"] is True, r
    assert r["loaded"] == ["nixl_cu13"]
    _stored(r)


@pytest.mark.slow
def test_doctor_names_the_build_and_the_cuda_it_found(sites, tmp_path):
    for path, variant in (([sites["cu12"], sites["deps"]], "cu12"), ([sites["cu13"], sites["deps"]], "cu13")):
        # sized: a default capacity depends on how full the (shared) disk is
        e = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [REPO]), HICACHE_GDS_CAPACITY="64M")
        p = subprocess.run([sys.executable, "-S", "-m", "hicache_gds.cli", "doctor", "--path", str(tmp_path)],
                           capture_output=True, text=True, env=e, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"nixl-{variant} {NIXL_VERSION} (CUDA {variant[2:]} build, module nixl_{variant})" in p.stdout
        assert "CUDA         : " in p.stdout and "POSIX (DRAM_SEG, FILE_SEG)" in p.stdout


def test_ucx_keeps_rdma_where_the_machine_has_rdma_devices(tmp_path):
    """UCX's InfiniBand module is left out only where no RDMA device exists (it crashes processes
    at exit there and has nothing to drive); with a device it stays, for every UCX user in the
    process (HiCacheNixl, NIXL-based PD disaggregation)."""
    from hicache_gds._nixl import env_defaults
    none = tmp_path / "none"
    assert env_defaults(str(none))["UCX_MODULES"] == "^ib"  # no /sys/class/infiniband at all
    none.mkdir()
    assert env_defaults(str(none))["UCX_MODULES"] == "^ib"  # the class exists, no device
    (none / "mlx5_0").mkdir()
    assert "UCX_MODULES" not in env_defaults(str(none))
    assert env_defaults(str(none))["NIXL_LOG_LEVEL"] == "ERROR"
