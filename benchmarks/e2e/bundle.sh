#!/usr/bin/env bash
# Build, on a machine with PyPI, the SGLang server bundle for a GPU machine without a package index
# (Python 3.12, torch 2.11.0+cu130 already there): every wheel of gpu-wheels.txt unpacked into one
# site directory, trimmed of what a server never loads, in one xz tarball split into parts that fit
# one device call each.
#
#   bash benchmarks/e2e/bundle.sh [--arch sm90] [--part-mib 60]    # -> .e2e-parts/ (git-ignored)
#
# Trimmed (each only read by code this benchmark never runs; listed in MANIFEST too):
#   sglang-kernel: FlashAttention-3, FlashMLA and InfLLM ops and the kernel builds of other GPU
#     architectures than --arch (the server runs --attention-backend triton);
#   xgrammar's static library, jedi's typeshed stubs, sglang's diffusion (multimodal_gen) and test
#   packages, UCX's perftest libraries, NIXL plugins other than POSIX / GDS / GDS_MT / UCX, NIXL's
#   telemetry exporters, zstandard's cffi backend, debug info of every shared library.
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCH=sm90
PART_MIB=60
while [ $# -gt 0 ]; do
  case $1 in
    --arch) ARCH=$2; shift 2 ;;
    --part-mib) PART_MIB=$2; shift 2 ;;
    *) echo "usage: $0 [--arch sm90] [--part-mib 60]" >&2; exit 2 ;;
  esac
done
WORK=${E2E_WORK:-/var/tmp/hgds-e2e-build}
OUT=.e2e-parts
mkdir -p "$WORK/wheels" "$OUT"
grep -qx '/.e2e-parts/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.e2e-parts/' >> .git/info/exclude; }
grep -qx '/.e2e/' .git/info/exclude 2>/dev/null || echo '/.e2e/' >> .git/info/exclude

PLAT=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 any; do PLAT+=(--platform "$p"); done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${PLAT[@]}")

echo "[bundle] downloading $(grep -c '==' benchmarks/e2e/gpu-wheels.txt) wheels into $WORK/wheels"
python3 -m pip download -q --no-deps "${TARGET[@]}" -d "$WORK/wheels" \
  -r <(grep -v '^#' benchmarks/e2e/gpu-wheels.txt) 2>&1 | grep -v '^WARNING' || true

SITE=$WORK/site
rm -rf "$SITE"
echo "[bundle] unpacking into $SITE"
python3 -m pip install -q --no-deps --no-compile --ignore-requires-python "${TARGET[@]}" --target "$SITE" \
  "$WORK"/wheels/*.whl 2>&1 | grep -v '^WARNING' || true

echo "[bundle] trimming (keeping sgl_kernel/$ARCH)"
cd "$SITE"
rm -f sgl_kernel/flash_ops*.so sgl_kernel/flashmla_ops*.so sgl_kernel/infllm_ops*.so
for d in sgl_kernel/sm*; do [ "$(basename "$d")" = "$ARCH" ] || rm -rf "$d"; done
rm -rf xgrammar/lib jedi/third_party sglang/multimodal_gen sglang/test \
       nixl_ep nixl_ep_cu13 nixl_cu13.libs/ucx/libucx_perftest* nixl_cu13.libs/nixl/libtelemetry_exporter_* \
       zstandard/_cffi*.so
for f in nixl_cu13.libs/nixl/libplugin_*.so; do
  case $(basename "$f") in libplugin_POSIX.so|libplugin_GDS.so|libplugin_GDS_MT.so|libplugin_UCX.so) ;; *) rm -f "$f" ;; esac
done
find . -name __pycache__ -prune -exec rm -rf {} +
find . -name '*.so*' -type f -exec strip --strip-debug {} + 2>/dev/null || true
cd - >/dev/null

echo "[bundle] compressing $(du -sh "$SITE" | cut -f1) (xz -9e, a few minutes)"
rm -f "$OUT"/bundle.part.* "$OUT"/MANIFEST
tar -cf - -C "$SITE" . | xz -T0 -9e > "$WORK/bundle.tar.xz"
# as few parts as fit PART_MIB each, of equal size (each call then carries about the same)
nparts=$(( ($(stat -c %s "$WORK/bundle.tar.xz") + PART_MIB * 1048576 - 1) / (PART_MIB * 1048576) ))
split -n "$nparts" -d -a 2 "$WORK/bundle.tar.xz" "$OUT/bundle.part."
{
  echo "sha256 $(sha256sum "$WORK/bundle.tar.xz" | cut -d' ' -f1)"
  echo "parts $(ls "$OUT"/bundle.part.* | wc -l)"
  echo "arch $ARCH"
  (cd "$OUT" && sha256sum bundle.part.*)
  echo "# wheels"
  ls "$WORK/wheels"
} > "$OUT/MANIFEST"
ls -la "$OUT"
echo "[bundle] next: for each part N, stage it with 'bash benchmarks/e2e/stage.sh N' and run"
echo "         'bash benchmarks/e2e/gpu_prepare.sh' on the GPU machine carrying .e2e (see benchmarks/e2e/README.md)"
