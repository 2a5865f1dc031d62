#!/usr/bin/env bash
# On the GPU machine, from the repository root: keep the bundle part(s) carried in .e2e/ (or
# .e2e-parts/) under /var/tmp/hgds-e2e, and once every part of the MANIFEST is there and the whole
# checks out (sha256), unpack it and install hicache-gds and hicache-gds-sglang beside it (offline, so
# SGLang's plugin entry point is registered). Idempotent; safe to call with any part, or none.
#
#   bash benchmarks/e2e/gpu_prepare.sh && source /var/tmp/hgds-e2e/env.sh
#
# Exit status: 0 when the machine is ready, 3 while parts are missing, 1 on a bad bundle.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${E2E_HOME:-/var/tmp/hgds-e2e}
mkdir -p "$D/parts"
for src in .e2e .e2e-parts; do  # staged by stage.sh, or carried straight from bundle.sh's output
  [ -f $src/MANIFEST ] && cp $src/MANIFEST "$D/MANIFEST"
  cp $src/bundle.part.* "$D/parts/" 2>/dev/null || true
done
[ -f "$D/MANIFEST" ] || { echo "[prepare] no MANIFEST carried yet (.e2e/MANIFEST)"; exit 3; }
want=$(awk '$1=="sha256"{print $2}' "$D/MANIFEST")
if [ ! -f "$D/READY" ] || [ "$(cat "$D/READY")" != "$want" ]; then
  missing=0
  while read -r sum name; do
    if [ ! -f "$D/parts/$name" ]; then echo "[prepare] waiting for $name"; missing=1
    elif [ "$(sha256sum "$D/parts/$name" | cut -d' ' -f1)" != "$sum" ]; then
      echo "[prepare] $name is damaged; carry it again"; rm -f "$D/parts/$name"; missing=1
    fi
  done < <(grep -E '^[0-9a-f]{64}  bundle\.part\.' "$D/MANIFEST")
  [ $missing = 0 ] || exit 3
  got=$(cat "$D"/parts/bundle.part.* | sha256sum | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "[prepare] bundle sha256 $got != $want" >&2; exit 1; }
  rm -rf "$D/site" && mkdir -p "$D/site"
  t=$(date +%s)
  cat "$D"/parts/bundle.part.* | xz -d | tar -x -C "$D/site"
  echo "[prepare] unpacked $(du -sh "$D/site" | cut -f1) in $(( $(date +%s) - t )) s"
  echo "$want" > "$D/READY"
fi
# Wheels carried beside the bundle (.e2e/extra/*.whl or .e2e-parts/extra/*.whl): additions made
# after the bundle was built, or tools a diagnostic needs (cufile-python).
extra=$(ls .e2e/extra/*.whl .e2e-parts/extra/*.whl 2>/dev/null || true)
if [ -n "$extra" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target "$D/site" $extra 2>&1 \
    | grep -v -e '^WARNING' -e 'already exists' || true
fi
# This checkout's hicache-gds and plugin: installed for their metadata (SGLang finds the plugin
# through its entry point); the checkout itself comes first on PYTHONPATH, so edits need no reinstall.
python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --upgrade --target "$D/site" \
  . ./plugins/sglang 2>&1 | grep -v -e '^WARNING' -e 'already exists' || true
cat > "$D/env.sh" <<EOF
export PYTHONPATH=$PWD:$PWD/plugins/sglang:$D/site\${PYTHONPATH:+:\$PYTHONPATH}
export PYTHONUNBUFFERED=1
EOF
# shellcheck disable=SC1091
source "$D/env.sh"
python3 - <<'EOF'
import importlib.metadata as m, torch
print("[prepare] ready:", torch.cuda.get_device_name(0), "torch", torch.__version__, "| sglang", m.version("sglang"),
      "| sglang-kernel", m.version("sglang-kernel"), "| hicache-gds-sglang", m.version("hicache-gds-sglang"),
      "| entry points:", [e.name for e in m.entry_points(group="sglang.srt.plugins")])
EOF
