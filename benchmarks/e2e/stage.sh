#!/usr/bin/env bash
# Put bundle part N (and the MANIFEST) into .e2e/, the folder one device call carries.
#   bash benchmarks/e2e/stage.sh 0      # then carry [".e2e"] and run gpu_prepare.sh there
#   bash benchmarks/e2e/stage.sh none   # carry only the MANIFEST (later calls on a prepared machine)
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:?usage: $0 <part number>|none}
[ -f .e2e-parts/MANIFEST ] || { echo "no .e2e-parts/MANIFEST: run benchmarks/e2e/bundle.sh first" >&2; exit 1; }
rm -rf .e2e && mkdir .e2e
cp .e2e-parts/MANIFEST .e2e/
if [ "$N" != none ]; then
  part=$(printf '.e2e-parts/bundle.part.%02d' "$N")
  [ -f "$part" ] || { echo "no $part" >&2; exit 1; }
  ln "$part" .e2e/ 2>/dev/null || cp "$part" .e2e/
fi
du -sh .e2e
