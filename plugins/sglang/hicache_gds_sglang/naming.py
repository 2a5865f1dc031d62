"""What SGLang's settings mean to hicache-gds: configuration, key suffixes, namespace identities.

Three rules live here and nowhere else:

* **Configuration.** ``--hicache-storage-backend-extra-config`` keys that are hicache-gds
  `Config` keys win over the environment (``ENABLE_GDS``, ``GDS_PATH``, ``HICACHE_GDS_*``), which
  wins over defaults. SGLang's own keys (`SGLANG_KEYS`) are ignored; any other key is an error at
  construction, naming the key.
* **Keys.** A page key is SGLang's 64-hex page hash plus HiCacheFile's suffix, exactly
  (``hicache_storage.py`` ``HiCacheFile.__init__``): ``_{model}_{tp_rank}_{tp_size}`` for MHA,
  ``_{model}`` for MLA (TP ranks share one copy), ``_{pp_size}_{pp_rank}`` with PP,
  ``_cp{rank}_{size}`` with attention CP, the DCP tail with DCP; sidecar pools use
  ``{hash}.{pool}`` and Mamba state always carries the TP rank. So a key names the same page in
  both backends.
* **Namespaces.** Every pool gets its own PageStore namespace whose identity holds what makes the
  bytes meaningful: model, the rank suffix (TP / PP / attention-CP rank and sizes), the pool, its
  kind, dtype, page geometry and the *byte order* of a page (`PoolGeometry.page_order`). Nothing
  else: the DP rank is not in it, so data-parallel replicas -- and any other server on the node
  with the same model, parallel layout and pool geometry -- open the same namespaces and share
  their pages (a namespace has any number of writer processes). Layouts with the same byte order
  (``layer_first`` and ``page_first_direct``) share pages; others never see each other's, and
  ``HICACHE_GDS_NAMESPACE`` keeps tenants apart.

SGLang 0.5.17's HiCacheFile keys MLA Mamba state without the TP rank; we keep the rank: every TP
rank writes its own shard of that state, in 0.5.17 as in 0.5.23.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping

from hicache_gds import Config, ConfigError

__all__ = ["SGLANG_KEYS", "SCHEMA", "load_config", "KeyScheme", "namespace_identity", "server_topology"]

SCHEMA = "hicache-gds-sglang/2"  # 2: the DP rank left the identity (replicas share)

# Keys SGLang itself reads, injects or passes through in the extra config; never ours.
SGLANG_KEYS = (
    "backend_name", "module_path", "class_name", "interface_v1",  # the `dynamic` loader
    "file_storage_path",  # injected for every backend from --file-storage-path
    "allocator",  # host allocator choice (get_allocator_type)
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",  # popped by the controller
    "prefetch_timeout_max",  # 0.5.17's; its hybrid-model controller leaves it in the config
)


def load_config(extra_config: Mapping[str, Any] | None) -> Config:
    """The hicache-gds `Config` for one backend: extra-config keys > environment > defaults. The
    prefetch policy's keys (`policy_config.POLICY_KEYS`) are the plugin's, read by `policy_config.PolicyConfig`."""
    from .policy_config import POLICY_KEYS, check_removed
    check_removed(extra_config)
    try:
        cfg = Config.load(dict(extra_config or {}), ignore=SGLANG_KEYS + POLICY_KEYS)
    except ConfigError as exc:
        raise ConfigError(f"hicache-gds (--hicache-storage-backend-extra-config): {exc}. SGLang's own keys "
                          f"({', '.join(SGLANG_KEYS)}) are ignored; the prefetch policy's are "
                          f"{', '.join(POLICY_KEYS)}") from exc
    if not cfg.gds_path:
        raise ConfigError("hicache-gds: no storage directory; set GDS_PATH (comma-separated, one per NVMe "
                          "drive) or put \"gds_path\" in --hicache-storage-backend-extra-config")
    return cfg


@dataclass(frozen=True)
class KeyScheme:
    """HiCacheFile's key suffixes for one rank (see the module docstring)."""

    model: str
    config_suffix: str
    """Suffix of KV and rank-replicated sidecar keys (no TP rank under MLA)."""
    tp_config_suffix: str
    """Suffix of TP-sharded state (always has the TP rank)."""

    @classmethod
    def from_storage_config(cls, sc: Any) -> "KeyScheme":
        model = "-".join(sc.model_name.split("/")) if sc.model_name else ""
        shard = f"_{sc.pp_size}_{sc.pp_rank}" if sc.pp_size > 1 else ""
        if sc.attn_cp_size > 1:
            shard += f"_cp{sc.attn_cp_rank}_{sc.attn_cp_size}"
        tp_suffix = f"_{model}_{sc.tp_rank}_{sc.tp_size}{shard}"
        suffix = f"_{model}{shard}" if sc.is_mla_model else tp_suffix
        if getattr(sc, "dcp_size", 1) > 1:
            dcp = f"_tp{sc.tp_size}_dcp{sc.dcp_rank}_{sc.dcp_size}_page{sc.logical_page_size}"
            suffix += dcp
            tp_suffix += dcp
        return cls(model, suffix, tp_suffix)

    def suffix_for(self, pool: str) -> str:
        """Mamba state is TP-sharded even when the model's MLA KV is replicated."""
        return self.tp_config_suffix if pool == "mamba" else self.config_suffix

    def key(self, key: str, pool: str = "kv") -> str:
        """The stored key of page `key` of `pool`: HiCacheFile's file stem for the same page."""
        base = key if pool == "kv" else f"{key}.{pool}"
        return base + self.suffix_for(pool)

    def keys(self, keys: list[str], pool: str = "kv") -> list[str]:
        suffix = self.suffix_for(pool)
        if pool == "kv":
            return [k + suffix for k in keys]
        return [f"{k}.{pool}{suffix}" for k in keys]


def namespace_identity(scheme: KeyScheme, pool: str, geometry: Mapping[str, Any]) -> dict[str, str]:
    """Identity of one pool's namespace on one rank (rank-replicated MLA pools: same on every TP rank).

    Shared by every process whose pages mean the same bytes: the DP rank is not in it, so DP
    replicas and other servers of the same model and layout use one copy."""
    ident = {"schema": SCHEMA, "model": scheme.model, "pool": pool, "suffix": scheme.suffix_for(pool)}
    ident.update(geometry)
    return {str(k): str(v) for k, v in ident.items()}


def server_topology(server_args: Any, params: Any, rank_replicated: bool) -> SimpleNamespace:
    """Ranks and model name as SGLang's HiCache controller computes them (`_generate_storage_config`),
    so the keys and namespaces of `linker.GDSLinker` match HiCacheGDS's."""
    tp_rank, tp_size, dcp_size = 0, 1, 1
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.runtime_context import get_parallel
        par = get_parallel()
        if is_dp_attention_enabled():
            tp_rank, tp_size = par.attn_tp_rank, par.attn_tp_size
        else:
            tp_rank, tp_size = par.tp_rank, par.tp_size
        dcp_size = par.attn_dcp_size
    except Exception:  # noqa: BLE001 -- no SGLang runtime (tests, tools): the TP group, if any
        import torch
        group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
        if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            tp_rank, tp_size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    try:
        from sglang.srt.runtime_context import get_serving
        model = get_serving().served_model_name
    except Exception:  # noqa: BLE001
        model = getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", "")
    return SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, pp_rank=getattr(params, "pp_rank", 0),
                           pp_size=getattr(params, "pp_size", 1), attn_cp_rank=getattr(params, "attn_cp_rank", 0),
                           attn_cp_size=getattr(params, "attn_cp_size", 1), is_mla_model=rank_replicated,
                           model_name=model, dcp_size=dcp_size, dcp_rank=0, logical_page_size=None)
