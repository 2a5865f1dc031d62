#!/usr/bin/env bash
# Build, on a machine with PyPI, the vLLM server bundle for a GPU machine without a package index
# (Python 3.12, torch 2.11.0+cu130 already there): every wheel of vllm-wheels.txt unpacked into one
# site directory of its own (SGLang's bundle carries another fastapi), trimmed of what a server on
# Hopper never loads, in one xz tarball split into parts that each fit one device call with the
# working tree.
#
#   bash benchmarks/e2e/bundle_vllm.sh [--part-mib 52]      # -> .e2e-vllm-parts/ (git-ignored)
#
# Trimmed (each only loaded by code this benchmark never runs; listed in MANIFEST too):
#   vllm/vllm_flash_attn/_vllm_fa2_C (FlashAttention 2: Hopper runs FA3, vllm/v1/attention/backends/
#   fa_utils.py), _moe_C_stable_libtorch (MoE kernels; the models here are dense), _qutlass_C and
#   _flashmla* (FP4 / MLA kernels), the vllm-rs binary, console scripts (their shebangs name this
#   machine's python), __pycache__, debug info of every shared library.
# NIXL is not in it: carry `../shared/device/wheels.sh nixl`'s .whl/ and .gpu/ with one run.
set -euo pipefail
cd "$(dirname "$0")/../.."
PART_MIB=52
while [ $# -gt 0 ]; do
  case $1 in
    --part-mib) PART_MIB=$2; shift 2 ;;
    *) echo "usage: $0 [--part-mib 52]" >&2; exit 2 ;;
  esac
done
WORK=${E2E_WORK:-/var/tmp/hgds-vllm-build}
OUT=.e2e-vllm-parts
mkdir -p "$WORK/wheels" "$OUT"
EXCLUDE=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$EXCLUDE")"
for d in /.e2e-vllm-parts/ /.e2e/; do
  grep -qx "$d" "$EXCLUDE" 2>/dev/null || echo "$d" >> "$EXCLUDE"
done

PLAT=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 any; do PLAT+=(--platform "$p"); done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${PLAT[@]}")

echo "[bundle-vllm] downloading $(grep -c '==' benchmarks/e2e/vllm-wheels.txt) wheels into $WORK/wheels"
python3 -m pip download -q --no-deps "${TARGET[@]}" -d "$WORK/wheels" \
  -r <(grep -v '^#' benchmarks/e2e/vllm-wheels.txt) 2>&1 | grep -v '^WARNING' || true

SITE=$WORK/site
rm -rf "$SITE"
echo "[bundle-vllm] unpacking into $SITE"
python3 -m pip install -q --no-deps --no-compile --ignore-requires-python "${TARGET[@]}" --target "$SITE" \
  "$WORK"/wheels/*.whl 2>&1 | grep -v '^WARNING' || true

echo "[bundle-vllm] trimming"
cd "$SITE"
rm -f vllm/vllm_flash_attn/_vllm_fa2_C*.so vllm/_moe_C_stable_libtorch*.so vllm/_qutlass_C*.so vllm/_flashmla*.so \
      vllm/vllm-rs
rm -rf bin
find . -name __pycache__ -prune -exec rm -rf {} +
find . -name '*.so*' -type f -exec strip --strip-debug {} + 2>/dev/null || true
cd - >/dev/null

echo "[bundle-vllm] compressing $(du -sh "$SITE" | cut -f1) (xz -9e, several minutes)"
rm -f "$OUT"/bundle.part.* "$OUT"/MANIFEST
tar -cf - -C "$SITE" . | xz -T0 -9e > "$WORK/bundle.tar.xz"
nparts=$(( ($(stat -c %s "$WORK/bundle.tar.xz") + PART_MIB * 1048576 - 1) / (PART_MIB * 1048576) ))
split -n "$nparts" -d -a 2 "$WORK/bundle.tar.xz" "$OUT/bundle.part."
{
  echo "sha256 $(sha256sum "$WORK/bundle.tar.xz" | cut -d' ' -f1)"
  echo "parts $(ls "$OUT"/bundle.part.* | wc -l)"
  echo "bundle vllm"
  (cd "$OUT" && sha256sum bundle.part.*)
  echo "# trimmed: vllm_flash_attn/_vllm_fa2_C _moe_C_stable_libtorch _qutlass_C _flashmla* vllm-rs bin/ __pycache__ debug info"
  echo "# wheels"
  ls "$WORK/wheels"
} > "$OUT/MANIFEST"
ls -la "$OUT"
echo "[bundle-vllm] next: for each part N, 'E2E_PARTS=.e2e-vllm-parts bash benchmarks/e2e/stage.sh N' and run"
echo "              'bash benchmarks/e2e/gpu_prepare_vllm.sh' on the GPU machine carrying .e2e (see README.md)"
