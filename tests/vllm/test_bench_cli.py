"""The GPU benchmark's server command lines parse with the installed vLLM's own CLI (0.26 on the GPU
machine; 0.33 too), so the first run on scarce GPU time does not stop at an unknown flag."""

from __future__ import annotations

import os
import sys

import pytest

E2E = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "e2e")
sys.path.insert(0, E2E)
import bench_vllm_server as bench  # noqa: E402


@pytest.mark.parametrize("shape", ["llama3-8b-shape", "llama-32b-shape"])
@pytest.mark.parametrize("cfg", bench.CONFIGS)
def test_server_command_parses_with_vllms_cli(tmp_path, cfg, shape):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    try:  # 0.26
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:  # 0.33 moved the server's arguments (its api_server module still runs them)
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args

    a = bench.parse(["--dir", str(tmp_path), "--model", os.path.join(E2E, shape)])
    a.seed_read_GBps = 1.66
    cmd, env = bench.server_command(cfg, a, 8000, str(tmp_path / cfg))
    # The V1 model runner, which hands offloading connectors one cross-layer KV tensor, by vLLM's own switch.
    from vllm import envs
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and "VLLM_USE_V2_MODEL_RUNNER" in envs.environment_variables
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    validate_parsed_serve_args(ns)
    assert ns.enable_prompt_tokens_details and ns.port == 8000
    ea = AsyncEngineArgs.from_cli_args(ns)
    assert os.path.basename(ea.model) == shape and ea.load_format == "dummy"
    assert ea.skip_tokenizer_init and ea.enforce_eager and ea.num_gpu_blocks_override == a.gpu_blocks
    ktc = ea.kv_transfer_config
    if cfg == "recompute":
        assert ktc is None
        return
    assert ktc.kv_role == "kv_both"
    if cfg in ("gds", "bounce", "gds-cost"):
        assert ktc.kv_connector == "HiCacheGDSConnector" and ktc.kv_load_failure_policy == "recompute"
        assert ktc.kv_connector_module_path == "hicache_gds_vllm.connector"
    else:
        assert ktc.kv_connector == "OffloadingConnector"
