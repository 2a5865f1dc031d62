import pytest
from hypothesis import given, settings, strategies as st

from hicache_gds.config import Config, describe_keys, parse_size
from hicache_gds.errors import ConfigError


def test_defaults():
    c = Config.load({}, env={})
    assert c.enable_gds == "auto" and c.gds_path == () and c.engine == "auto" and c.verify


def test_env_and_dict_precedence(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    env = {"ENABLE_GDS": "0", "GDS_PATH": f"{a},{b}", "HICACHE_GDS_IO_TIMEOUT": "5"}
    c = Config.load({}, env=env)
    assert c.enable_gds == "0" and c.gds_path == (str(a), str(b)) and c.io_timeout == 5.0
    c = Config.load({"enable_gds": "1", "io_timeout": 2}, env=env)
    assert c.enable_gds == "1" and c.io_timeout == 2.0 and c.sources["enable_gds"] == "config"
    assert c.sources["gds_path"] == "env"


@pytest.mark.parametrize("key,value,msg", [
    ("enable_gds", "yes please", "enable_gds: 'yes please' is not one of auto, 1, 0"),
    ("nixl_queue", "epoll", "nixl_queue: 'epoll' is not one of uring, aio, posix_aio"),
    ("capacity", "12 parsecs", "capacity: expected a byte count"),
    ("capacity_fraction", "1.5", "capacity_fraction: expected a fraction in (0, 1]"),
    ("io_timeout", "-1", "io_timeout: expected a number of seconds > 0"),
    ("io_threads", "0", "io_threads: expected an integer >= 1"),
    ("checksum_threads", "-1", "checksum_threads: expected an integer >= 0"),
    ("verify", "maybe", "verify: 'maybe' is not a boolean"),
    ("engine", "../../etc", "engine: '../../etc' is not an engine name"),
    ("gds_path", "/a,/a", "gds_path: a directory is listed twice"),
])
def test_bad_values_name_the_key_and_accepted_values(key, value, msg):
    with pytest.raises(ConfigError) as e:
        Config.load({key: value}, env={})
    assert msg in str(e.value)


def test_unknown_key_and_env_var():
    with pytest.raises(ConfigError, match="unknown config key 'capacty'.*accepted keys: enable_gds"):
        Config.load({"capacty": 1}, env={})
    with pytest.raises(ConfigError, match="unknown environment variable HICACHE_GDS_CAPACTY"):
        Config.load({}, env={"HICACHE_GDS_CAPACTY": "1"})
    # an adapter's own variable of the same prefix is not a typo of the store's
    assert Config.load({}, env={"HICACHE_GDS_TRACE": "1"}).verify is True
    # nor is the remote tier's cluster secret, which page servers and clients read from the environment
    assert Config.load({}, env={"HICACHE_GDS_CLUSTER_SECRET": "s", "HICACHE_GDS_CLUSTER_SECRET_FILE": "/f"}).verify


def test_ignored_adapter_keys():
    c = Config.load({"backend_name": "gds", "verify": "0"}, env={}, ignore=("backend_name",))
    assert not c.verify


def test_sizes():
    assert parse_size("4k") == 4096 and parse_size("2MiB") == 2 << 20 and parse_size("1.5G") == 3 << 29
    assert parse_size(123) == 123
    with pytest.raises(ConfigError):
        parse_size(True)


def test_every_key_is_documented():
    keys = describe_keys()
    assert {k for k, *_ in keys} == {f for f in Config.__dataclass_fields__ if f != "sources"}
    assert all(h for *_, h in keys)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([k for k, *_ in describe_keys()] + ["bogus", ""]),
                       st.one_of(st.text(max_size=20), st.integers(), st.floats(allow_nan=True), st.booleans(),
                                 st.none(), st.lists(st.text(max_size=5), max_size=3)), max_size=4))
def test_fuzz_config_never_crashes_with_anything_but_config_error(overrides):
    try:
        Config.load(overrides, env={})
    except ConfigError:
        pass
