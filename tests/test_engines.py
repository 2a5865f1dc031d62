"""Every engine that runs on the CPU machine passes the shipped conformance suite."""

import pytest

from hicache_gds.engines import EngineOptions, create_engine, engine_names, register_engine
from hicache_gds.engines.faulty import Faults, FaultyEngine
from hicache_gds.errors import EngineUnavailable
from hicache_gds.testing import EngineTests


class TestNixlPosixAio(EngineTests):
    engine_name = "nixl-posix"


class TestNixlPosixUring(EngineTests):
    def make_engine(self):
        return create_engine("nixl-posix", EngineOptions(nixl_queue="uring"))


class TestBounce(EngineTests):
    engine_name = "bounce"


class TestFaultyPassThrough(EngineTests):
    def make_engine(self):
        return FaultyEngine(create_engine("bounce", EngineOptions()), Faults())


def test_registry_lists_builtin_engines():
    names = engine_names()
    for n in ("bounce", "nixl-posix", "nixl-gds", "nixl-gds-mt", "kvikio", "cufile"):
        assert n in names


def test_unknown_engine_names_the_known_ones():
    with pytest.raises(ValueError, match="known engines: .*nixl-posix"):
        create_engine("nixl-posx", EngineOptions())


def test_reregistering_a_name_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register_engine("bounce", "somewhere:Else")


def test_gds_on_a_machine_without_gpu_is_unavailable_not_a_hang():
    from hicache_gds.engines.gds_probe import gpu_present
    if gpu_present():
        pytest.skip("a GPU is present")
    for name in ("nixl-gds", "nixl-gds-mt"):
        with pytest.raises(EngineUnavailable, match="GPU"):
            create_engine(name, EngineOptions())
