"""A CPU stand-in for a vLLM engine: the real Scheduler + offloading connector, with W simulated ranks.

Each rank is a WORKER-role connector over its own CPU KV cache (random bytes), handed over the way
the installed vLLM's model runner does it:

* ``layout="per-layer"``: per-layer views of one layer-outermost allocation (`register_kv_caches`;
  what 0.33 always does, and 0.26 for backends without a cross-layer layout);
* ``layout="cross-layer"`` (0.26): one (blocks, heads, layers, tokens, 2 x head_dim) tensor laid out
  as FlashAttention's cross-layer cache (`register_cross_layers_kv_cache`), as vLLM 0.26 allocates
  it for a single uniform group.

``connector`` picks vLLM's `OffloadingConnector` (the spec by name), this adapter's
`HiCacheGDSConnector`, or None (no connector: the baseline a connector must not make worse). A step runs the scheduler, hands the metadata to every rank exactly as the
model runner does (handle_preemptions, start_load_kv, wait_for_save, get_finished,
get_block_ids_with_load_errors, build_connector_worker_meta), aggregates the ranks' outputs the
way vLLM's executor does (job counts summed, failed blocks joined; a load is finished only when
every rank reports it), and feeds a ModelRunnerOutput back.

A stand-in forward pass writes the KV of the tokens each step computes: every block's bytes are a
function of the token prefix up to the block's end (and the rank), as a real model's are. So
after any mix of loads and recomputes, every full block of a request must hold
`expected_block(...)`: what computing it would have produced (`check_kv`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from functools import reduce

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hicache_gds_vllm import compat
from hicache_gds_vllm.connector import HiCacheGDSConnector
from hicache_gds_vllm.testing import kv_cache_tensors

BLOCK = 16
EOS = 0
CROSS_LAYER = compat.KV_HANDOFF.startswith("cross-layer")  # this vLLM can hand KV over as cross-layer blocks
LAYOUTS = ("per-layer", "cross-layer") if CROSS_LAYER else ("per-layer",)


def tiny_model_dir(root: str, layers: int, heads: int, head_dim: int) -> str:
    d = os.path.join(root, "tiny-llama")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": heads * head_dim,
                   "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": head_dim,
                   "num_hidden_layers": layers, "intermediate_size": 256, "vocab_size": 1000,
                   "max_position_embeddings": 4096, "torch_dtype": "float16"}, f)
    return d


def _aligned_random(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random int8 KV at a 4 KiB-aligned address, as a GPU's KV cache is (CUDA allocations are), so
    O_DIRECT engines take large pages straight from it, unstaged, as they do from VRAM."""
    n = 1
    for d in shape:
        n *= d
    raw = np.empty(n + 4096, dtype=np.int8)
    off = (-raw.ctypes.data) % 4096
    kv = torch.from_numpy(raw[off:off + n]).view(shape)  # its own storage, starting there (offset 0)
    kv.copy_(torch.randint(-128, 127, shape, dtype=torch.int8, generator=gen))
    return kv


class Engine:
    """Scheduler + `world_size` worker connectors sharing one KVCacheConfig."""

    def __init__(self, root: str, gds_path: str, *, world_size: int = 1, blocks_per_chunk: int = 2,
                 num_blocks: int = 64, layers: int = 2, heads: int = 4, head_dim: int = 64,
                 extra: dict | None = None, seed: int = 0, layout: str = "per-layer",
                 connector: str = "offloading", max_num_seqs: int = 4) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: this vLLM hands KV to workers as {LAYOUTS}")
        self.layers, self.num_blocks, self.layout, self.seed = layers, num_blocks, layout, seed
        extra_config = {"blocks_per_chunk": blocks_per_chunk, "gds_path": gds_path, "capacity": "64M",
                        "preallocate": False, "cost_model": "off", **(extra or {})}
        if connector == "offloading":
            extra_config.update(spec_name="HiCacheGDSOffloadingSpec", spec_module_path="hicache_gds_vllm")
            conn_cls, ktc = OffloadingConnector, {"kv_connector": "OffloadingConnector"}
        elif connector == "hicache":
            conn_cls = HiCacheGDSConnector
            ktc = {"kv_connector": "HiCacheGDSConnector", "kv_connector_module_path": "hicache_gds_vllm.connector"}
        elif connector is None:
            conn_cls, ktc = None, None
        else:
            raise ValueError(f"connector {connector!r}: 'offloading', 'hicache' or None")
        vc = VllmConfig(
            model_config=ModelConfig(model=tiny_model_dir(root, layers, heads, head_dim), skip_tokenizer_init=True,
                                     dtype="float16", max_model_len=4096),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                             max_model_len=4096, is_encoder_decoder=False),
            kv_transfer_config=None if ktc is None else KVTransferConfig(kv_role="kv_both",
                                                                       kv_connector_extra_config=extra_config, **ktc),
        )
        vc.parallel_config.world_size = world_size  # ranks are simulated in this process
        vc.cache_config.num_gpu_blocks = num_blocks
        self.vllm_config = vc
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_dim, dtype=torch.float16)
        self.page_bytes = spec.page_size_bytes
        names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks,
                                             kv_cache_tensors=kv_cache_tensors(names, self.page_bytes, num_blocks),
                                             kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        gen = torch.Generator().manual_seed(seed)
        # Per rank, the whole KV cache as int8 with blocks on dimension `_bdim`:
        # (L, B, H, N, 2*D*2) per-layer (layer-outermost), (B, H, L, N, 2*D*2) cross-layer.
        self.kv: list[torch.Tensor] = []
        self._bdim = 1 if layout == "per-layer" else 0
        self.workers: list = []
        for rank in range(world_size):
            rc = copy.deepcopy(vc)
            rc.parallel_config.rank = rank
            if conn_cls is None:
                self.kv.append(_aligned_random((layers, num_blocks, heads, BLOCK, 4 * head_dim), gen))
                continue
            conn = conn_cls(rc, KVConnectorRole.WORKER, self.kv_cache_config)
            if layout == "per-layer":
                kv = _aligned_random((layers, num_blocks, heads, BLOCK, 4 * head_dim), gen)
                with set_current_vllm_config(rc):
                    conn.register_kv_caches({n: kv[i].view(torch.float16) for i, n in enumerate(names)})
            else:
                from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
                kv = _aligned_random((num_blocks, heads, layers, BLOCK, 4 * head_dim), gen)
                with set_current_vllm_config(rc):
                    conn.register_cross_layers_kv_cache(kv.view(torch.float16), FlashAttentionBackend)
            self.kv.append(kv)
            self.workers.append(conn)
        self.scheduler = Scheduler(vllm_config=vc, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(vc), block_size=BLOCK,
                                   log_stats=True)
        # A real engine loads the model meanwhile; here, let the manager's warm start finish first.
        if conn_cls is not None:
            self.manager.wait_warm_start()
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        self.block_ids: dict[str, list[int]] = {}
        self.load_jobs = 0
        self.invalid_blocks: set[int] = set()  # every block a rank reported as failed to load
        self.computed_tokens = 0  # tokens the stand-in forward computed (recomputes included)
        self._recv_counts: dict[str, int] = {}

    # -- handles -------------------------------------------------------------------------------
    @property
    def manager(self):
        return self.scheduler.connector.connector_scheduler.manager

    def worker(self, rank: int = 0):
        return self.workers[rank].connector_worker.worker

    def _block(self, rank: int, block_id: int) -> torch.Tensor:
        return self.kv[rank].select(self._bdim, block_id)

    def block_bytes(self, rank: int, block_id: int) -> torch.Tensor:
        """All layers' bytes of one block on one rank, as uint8 (never compared as floats)."""
        return self._block(rank, block_id).contiguous().view(torch.uint8).clone()

    def write_block(self, rank: int, block_id: int, data: torch.Tensor) -> None:
        """Overwrite one block's bytes (all layers) on one rank, as a forward pass does."""
        blk = self._block(rank, block_id)
        blk.copy_(data.contiguous().view(torch.int8).view(blk.shape))

    def expected_block(self, rank: int, prefix: list[int]) -> torch.Tensor:
        """What the stand-in forward writes into a block whose tokens end `prefix` (uint8)."""
        blk = self._block(rank, 0)
        digest = hashlib.sha256(json.dumps([rank, self.seed, prefix]).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randint(0, 256, tuple(blk.shape), dtype=torch.uint8, generator=gen)

    def poison(self, value: int = 0xA5) -> None:
        for kv in self.kv:
            kv.view(torch.uint8).fill_(value)

    def check_kv(self, req_id: str, tokens: list[int], nblocks: int | None = None) -> None:
        """Every full block of `tokens` in the request's GPU blocks holds what computing it gives."""
        ids = self.block_ids[req_id]
        n = len(tokens) // BLOCK if nblocks is None else nblocks
        for r in range(len(self.workers)):
            for i in range(n):
                want = self.expected_block(r, tokens[:(i + 1) * BLOCK])
                got = self.block_bytes(r, ids[i]).view(want.shape)
                assert torch.equal(got, want), \
                    f"rank {r}: block {i} (id {ids[i]}) of {req_id} is not what compute gives"

    # -- driving -------------------------------------------------------------------------------
    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> None:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        self.scheduler.add_request(Request(req_id, tokens, sp, None, block_hasher=self._hasher))

    def _forward(self, so) -> None:
        """The stand-in model: write the blocks holding the tokens each request computes this step."""
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # the scheduler advanced it when it scheduled the step
            start = end - n
            toks = list(req.all_token_ids)
            ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            self.block_ids[req_id] = list(ids)
            self.computed_tokens += n
            for bi in range(start // BLOCK, (end - 1) // BLOCK + 1):
                upto = min((bi + 1) * BLOCK, end)
                for r in range(len(self.workers)):
                    self.write_block(r, ids[bi], self.expected_block(r, toks[:upto]))

    def step(self) -> None:
        so = self.scheduler.schedule()
        for nr in so.scheduled_new_reqs:
            self.block_ids[nr.req_id] = list(nr.block_ids[0])
        meta = so.kv_connector_metadata
        self.load_jobs += len(meta.load_jobs) if meta is not None else 0
        recving: set[str] = set()
        invalid: set[int] = set()
        metas = []
        for conn in self.workers:
            conn.handle_preemptions(meta)
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)
        self._forward(so)  # after the loads were started, as the model runner does
        for conn in self.workers:
            if so.total_num_scheduled_tokens > 0:
                conn.wait_for_save()
            conn.connector_worker.worker.drain()  # IO threads are real; make the test deterministic
            _, rec = conn.get_finished(so.finished_req_ids)
            invalid |= conn.get_block_ids_with_load_errors()
            for r in rec:
                self._recv_counts[r] = self._recv_counts.get(r, 0) + 1
                if self._recv_counts[r] == len(self.workers):
                    recving.add(r)
                    del self._recv_counts[r]
            wm = conn.build_connector_worker_meta()
            if wm is not None:
                metas.append(wm)
            conn.clear_connector_metadata()
        self.invalid_blocks |= invalid
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            req_ids.append(req_id)
            done_prefill = req.num_computed_tokens >= req.num_prompt_tokens
            sampled.append([7] if done_prefill else [])
        agg = reduce(lambda a, b: a.aggregate(b), metas) if metas else None  # vLLM sums ranks' job counts
        kvo = None if meta is None else KVConnectorOutput(finished_sending=set(), finished_recving=recving,
                                                          kv_connector_worker_meta=agg, invalid_block_ids=invalid)
        out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=kvo)
        self.scheduler.update_from_output(so, out)

    def run(self, max_steps: int = 50) -> None:
        """Step until no request is left and no transfer is pending."""
        for _ in range(max_steps):
            self.step()
            conn = self.scheduler.connector
            if not self.scheduler.requests and (conn is None or not conn.connector_scheduler.has_pending_push_work()):
                return
        reqs = [(r.request_id, r.status.name, r.num_computed_tokens) for r in self.scheduler.requests.values()]
        raise AssertionError(f"engine still busy after {max_steps} steps: requests {reqs}, "
                             f"manager {self.manager.stats()}")

    def shutdown(self) -> None:
        for conn in self.workers:
            conn.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
