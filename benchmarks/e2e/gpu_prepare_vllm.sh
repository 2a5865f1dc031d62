#!/usr/bin/env bash
# On the GPU machine, from the repository root: keep the vLLM bundle part(s) carried in .e2e/ (or
# .e2e-vllm-parts/) under /var/tmp/hgds-vllm, and once every part of the MANIFEST is there and the
# whole checks out (sha256), unpack it, install this checkout's hicache-gds and hicache-gds-vllm
# beside it (offline), and check that vLLM's serve path imports. Idempotent; safe with any part, or none.
#
#   bash benchmarks/e2e/gpu_prepare_vllm.sh && source /var/tmp/hgds-vllm/env.sh
#
# NIXL comes from .gpu/setup.sh (`../shared/device/wheels.sh nixl`, carried in its own call), which
# installs into /tmp/site; env.sh puts /tmp/site after the bundle. Exit status: 0 when the machine is
# ready, 3 while parts are missing, 1 on a bad bundle or a failed import.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${E2E_VLLM_HOME:-/var/tmp/hgds-vllm}
mkdir -p "$D/parts"
for src in .e2e .e2e-vllm-parts; do  # staged by stage.sh, or carried straight from bundle_vllm.sh's output
  if [ -f $src/MANIFEST ] && grep -qx 'bundle vllm' $src/MANIFEST; then
    cp $src/MANIFEST "$D/MANIFEST"
    cp $src/bundle.part.* "$D/parts/" 2>/dev/null || true
  fi
done
[ -f "$D/MANIFEST" ] || { echo "[prepare-vllm] no vLLM MANIFEST carried yet (.e2e/MANIFEST from bundle_vllm.sh)"; exit 3; }
want=$(awk '$1=="sha256"{print $2}' "$D/MANIFEST")
if [ ! -f "$D/READY" ] || [ "$(cat "$D/READY")" != "$want" ]; then
  missing=0
  while read -r sum name; do
    if [ ! -f "$D/parts/$name" ]; then echo "[prepare-vllm] waiting for $name"; missing=1
    elif [ "$(sha256sum "$D/parts/$name" | cut -d' ' -f1)" != "$sum" ]; then
      echo "[prepare-vllm] $name is damaged; carry it again"; rm -f "$D/parts/$name"; missing=1
    fi
  done < <(grep -E '^[0-9a-f]{64}  bundle\.part\.' "$D/MANIFEST")
  [ $missing = 0 ] || exit 3
  got=$(cat "$D"/parts/bundle.part.* | sha256sum | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "[prepare-vllm] bundle sha256 $got != $want" >&2; exit 1; }
  rm -rf "$D/site" && mkdir -p "$D/site"
  t=$(date +%s)
  cat "$D"/parts/bundle.part.* | xz -d -T0 | tar -x -C "$D/site"
  echo "[prepare-vllm] unpacked $(du -sh "$D/site" | cut -f1) in $(( $(date +%s) - t )) s"
  echo "$want" > "$D/READY"
  rm -f "$D"/parts/bundle.part.*  # the disk is small; the site is what is needed now
fi
# This checkout's packages, for their metadata; the checkout itself comes first on PYTHONPATH.
python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --upgrade --target "$D/site" \
  . ./plugins/vllm 2>&1 | grep -v -e '^WARNING' -e 'already exists' || true
cat > "$D/env.sh" <<EOF
export PYTHONPATH=$PWD:$PWD/plugins/vllm:$D/site:/tmp/site\${PYTHONPATH:+:\$PYTHONPATH}
export PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not in the bundle
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
EOF
# shellcheck disable=SC1091
source "$D/env.sh"
python3 - <<'EOF'
import importlib, importlib.metadata as m, sys, torch
mods = ["vllm.entrypoints.openai.api_server", "vllm.v1.engine.core", "vllm.v1.worker.gpu_model_runner",
        "vllm.v1.attention.backends.flash_attn", "vllm.model_executor.models.llama",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", "hicache_gds_vllm.connector"]
bad = []
for mod in mods:
    try:
        importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001
        bad.append(f"{mod}: {type(exc).__name__}: {exc}")
try:
    import nixl_cu13  # noqa: F401
    nixl = m.version("nixl-cu13")
except Exception as exc:  # noqa: BLE001
    nixl = f"missing ({type(exc).__name__}); carry ../shared/device/wheels.sh nixl and source .gpu/setup.sh"
print("[prepare-vllm] ready:" if not bad else "[prepare-vllm] NOT ready:", torch.cuda.get_device_name(0),
      "torch", torch.__version__, "| vllm", m.version("vllm"), "| nixl-cu13", nixl, "| hicache-gds-vllm",
      m.version("hicache-gds-vllm"))
for b in bad:
    print("[prepare-vllm] import failed:", b)
sys.exit(1 if bad else 0)
EOF
