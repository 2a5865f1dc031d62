#!/usr/bin/env bash
# Put bundle part N (and the MANIFEST) into .e2e/, the folder one device call carries.
#   bash benchmarks/e2e/stage.sh 0      # then carry [".e2e"] and run gpu_prepare.sh there
#   bash benchmarks/e2e/stage.sh none   # carry only the MANIFEST (later calls on a prepared machine)
# E2E_PARTS picks the bundle: .e2e-parts (SGLang, bundle.sh; the default) or .e2e-vllm-parts (vLLM,
# bundle_vllm.sh, prepared by gpu_prepare_vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:?usage: $0 <part number>|none}
PARTS=${E2E_PARTS:-.e2e-parts}
[ -f "$PARTS/MANIFEST" ] || { echo "no $PARTS/MANIFEST: build the bundle first (bundle.sh / bundle_vllm.sh)" >&2; exit 1; }
rm -rf .e2e && mkdir .e2e
cp "$PARTS/MANIFEST" .e2e/
if [ "$N" != none ]; then
  part=$(printf '%s/bundle.part.%02d' "$PARTS" "$N")
  [ -f "$part" ] || { echo "no $part" >&2; exit 1; }
  ln "$part" .e2e/ 2>/dev/null || cp "$part" .e2e/
fi
du -sh .e2e
