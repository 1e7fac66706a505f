# Sourced by the device drivers (bench/device_*.sh), after `source .gpu/setup.sh`: restores the
# build caches earlier device calls brought back into .gpu (FlashInfer JIT modules, Triton cache),
# unpacks the tvm-ffi release DeepGEMM's child process needs, and defines save_caches to write
# refreshed copies to $OUT for the next call. Uses the caller's `log`. The cache tarballs are read
# from $PDSERVE_GPU_CACHE (default .gpu).
source bench/device_pkg.sh
_cache=${PDSERVE_GPU_CACHE:-.gpu}
_site=${GPU_SITE:-/tmp/gpu-site}
_aot="$_site/flashinfer/data/aot"
mkdir -p "$_aot"
[ -f "$_cache/pdserve-fi-jit.tar.gz" ] && tar -xzf "$_cache/pdserve-fi-jit.tar.gz" -C "$_aot" && log "restored FlashInfer modules"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f "$_cache/pdserve-triton.tar.gz" ] && tar -xzf "$_cache/pdserve-triton.tar.gz" -C "$TRITON_CACHE_DIR" && log "restored Triton cache"
if ls .gpu/dg/apache_tvm_ffi-0.1.11*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tvm011 .gpu/dg/apache_tvm_ffi-0.1.11*.whl \
    && export DG_TVM_FFI_SITE=/tmp/tvm011
fi

save_caches() {  # FlashInfer modules built in this call and the Triton cache -> $OUT
  local ops
  ops=$(find "${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-ws}" -type d -name cached_ops 2>/dev/null | head -1)
  if [ -n "$ops" ]; then
    (cd "$ops" && tar -czf "$OUT/pdserve-fi-jit.tar.gz" $(ls -d */ 2>/dev/null | while read d; do d=${d%/}; [ -f "$d/$d.so" ] && echo "$d/$d.so"; done) 2>/dev/null)
  fi
  (cd "$TRITON_CACHE_DIR" && tar -czf "$OUT/pdserve-triton.tar.gz" . 2>/dev/null)
}
