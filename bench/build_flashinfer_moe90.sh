#!/bin/bash
# Build FlashInfer's SM90 fused-MoE module (fused_moe_90.so) on a CPU host, restricted to the path
# bench/peer_flashinfer_moe.py uses: MXFP4 weights x bf16 activations
# (`flashinfer.fused_moe.cutlass_fused_moe(..., use_w4_group_scaling=True)`), for sm_90a (H100/H200).
#
#     [PTXAS_VERSION=12.9] bench/build_flashinfer_moe90.sh FLASHINFER [OUT_DIR] [WORK_DIR]
#
# FLASHINFER: the flashinfer_python wheel (the apache_tvm_ffi wheel is taken from the same folder) or
# a site folder that already holds flashinfer/ and tvm_ffi/. OUT_DIR (default ./fi-out) receives
# fused_moe_90/fused_moe_90.so and fused_moe_90.so.xz; WORK_DIR (default /tmp/fi-build) holds the
# Python packages (~5 GB), the generated sources and the objects. Re-running resumes: ninja skips
# the objects already built.
#
# Why a subset: FlashInfer's JIT build of this module (`gen_cutlass_fused_moe_sm90_module(
# use_fast_build=True)`) is 247 objects, 219 of them generated CUTLASS instantiations, hours on a few
# cores. The MXFP4 x bf16 path needs 38: the 15 fixed sources that are not another dtype's GEMM
# runner (moe_gemm_kernels_<a>_<w>.cu other than bf16_fp4: 13 left out) and the 23 generated
# `<__nv_bfloat16, SafeFP4>` grouped-GEMM instantiations. tvm_ffi loads modules with lazy binding,
# so the other dtypes' runner methods may stay undefined: they are reached only through calls (PLT
# slots) and fail only if called. The check at the end enforces exactly that. About 50 minutes on
# two cores.
#
# Requires: Python 3.12 (PYTHON=..., default python3.12), pip reaching PyPI (or its mirror), g++
# (nvcc 13.0 takes gcc <= 15), binutils (nm, readelf, c++filt), xz. pip installs into WORK_DIR:
# torch 2.11.0 (flashinfer imports it; its CUDA 13 libraries come along) and cuda-toolkit 13.0.2's
# nvcc 13.0.88, crt, nvvm, cccl, cudart, cuBLAS, cuRAND and NVRTC (headers and libraries, all in
# nvidia/cu13, which serves as CUDA_HOME), plus flashinfer's pure-Python imports. No GPU is used.
#
# PTXAS_VERSION=12.9 (default 13.0) assembles the device code with CUDA 12.9's ptxas (12.9.86, pip
# nvidia-cuda-nvcc-cu12, into WORK_DIR/ptxas-12.9) instead of 13.0's; everything else stays CUDA
# 13.0 (nvcc, cicc, headers, libcudart.so.13), so the module needs nothing new on the GPU host. No
# full CUDA 12.9 nvcc is on PyPI: nvidia-cuda-nvcc-cu12 ships ptxas, libnvvm and the crt headers
# only (no nvcc, cicc, cudafe++, fatbinary). CUDA_HOME is then WORK_DIR/cuda-ptxas-12.9: symlinks to
# nvidia/cu13, but bin/ptxas (nvcc runs the ptxas beside it) is a wrapper that rewrites the PTX
# file's ".version 9.0" (cicc 13.0's PTX ISA) to 8.8, the newest ptxas 12.9 takes, and calls ptxas
# 12.9. Give each version its own WORK_DIR: switching in one rebuilds every object.
#
# Install on the GPU host (sm_90, torch 2.11+cu130, same flashinfer 0.6.18.post1): copy the .so to
#     <site-packages>/flashinfer/data/aot/fused_moe_90/fused_moe_90.so
# (`xz -dk fused_moe_90.so.xz` first if you carried the compressed copy). FlashInfer loads a module
# from data/aot by name before it would JIT-build it; set FLASHINFER_DISABLE_JIT=1 so that a failed
# load raises instead of starting the hours-long build. Calling another dtype's path through this
# module ends the process with an undefined-symbol error.
set -euo pipefail

FI=${1:?usage: $0 FLASHINFER_WHEEL_OR_SITE [OUT_DIR] [WORK_DIR]}
OUT=$(mkdir -p "${2:-fi-out}" && cd "${2:-fi-out}" && pwd)
W=${3:-/tmp/fi-build}
PYTHON=${PYTHON:-python3.12}
mkdir -p "$W"
W=$(cd "$W" && pwd)
start=$(date +%s)
log() { echo "[$(( $(date +%s) - start ))s] $*"; }

# --- 1. Python packages: flashinfer + tvm_ffi (no deps) and the toolchain (by name, pinned) ---
if [ -f "$FI" ]; then
  SITE=$W/site
  if [ ! -d "$SITE/flashinfer" ]; then
    log "installing $(basename "$FI") and the tvm_ffi wheel beside it into $SITE"
    "$PYTHON" -m pip install -q --no-deps --no-compile --target "$SITE" \
      "$FI" "$(dirname "$FI")"/apache_tvm_ffi-*.whl
  fi
else
  SITE=$(cd "$FI" && pwd)
fi
DEPS=$W/deps
if [ ! -x "$DEPS/nvidia/cu13/bin/nvcc" ]; then
  log "installing torch, nvcc and the CUDA 13.0 headers into $DEPS"
  "$PYTHON" -m pip install -q --no-compile --target "$DEPS" torch==2.11.0 \
    "cuda-toolkit[nvcc,crt,nvvm,cccl,cudart,cublas,curand,nvrtc]==13.0.2" \
    numpy packaging einops click requests tabulate tqdm nvidia-ml-py ninja
fi
export CUDA_HOME=$DEPS/nvidia/cu13
case ${PTXAS_VERSION:=13.0} in
  13.0) ;;
  12.9)
    P129=$W/ptxas-12.9/nvidia/cuda_nvcc/bin/ptxas
    if [ ! -x "$P129" ]; then
      log "installing CUDA 12.9's ptxas into $W/ptxas-12.9"
      "$PYTHON" -m pip install -q --no-deps --no-compile --target "$W/ptxas-12.9" nvidia-cuda-nvcc-cu12==12.9.86
    fi
    CU13=$CUDA_HOME
    export CUDA_HOME=$W/cuda-ptxas-12.9
    mkdir -p "$CUDA_HOME/bin"
    for f in "$CU13"/*; do [ "${f##*/}" = bin ] || ln -sfn "$f" "$CUDA_HOME/"; done
    ln -sf "$CU13"/bin/* "$CUDA_HOME/bin/"
    rm "$CUDA_HOME/bin/ptxas"
    cat > "$CUDA_HOME/bin/ptxas" <<EOF
#!/bin/bash
# ptxas 12.9 on the PTX of nvcc 13.0's cicc, its ".version 9.0" rewritten to 8.8 (ptxas 12.9's newest)
args=() tmp=()
for a in "\$@"; do
  if [[ \$a == *.ptx ]]; then
    t=\${a%.ptx}.isa88.ptx
    sed '0,/^\.version 9\.0\$/s//.version 8.8/' "\$a" > "\$t"
    a=\$t tmp+=("\$t")
  fi
  args+=("\$a")
done
"$P129" "\${args[@]}"; rc=\$?
rm -f "\${tmp[@]}"
exit \$rc
EOF
    chmod +x "$CUDA_HOME/bin/ptxas" ;;
  *) echo "PTXAS_VERSION must be 13.0 or 12.9" >&2; exit 2 ;;
esac
export PATH=$CUDA_HOME/bin:$DEPS/bin:$PATH
export PYTHONPATH=$SITE:$DEPS
export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=$W/ws
nvcc --version | tail -2
ptxas --version | tail -2

# FlashInfer links with -L$cuda_home/lib64 -L$cuda_home/lib64/stubs -lcudart -lcuda -lnvrtc (and
# gcc passes --as-needed). The wheels have lib/ with versioned names only and no libcuda: add the
# unversioned names and a link stub libcuda.so with the driver's soname that defines every driver API
# function cuda.h declares, as the toolkit's lib64/stubs/libcuda.so does, so that the module records
# NEEDED libcuda.so.1 for the cu* functions it calls (the GPU host's driver provides them).
LIB=$CUDA_HOME/lib
ln -sfn lib "$CUDA_HOME/lib64"
ln -sf libcudart.so.13 "$LIB/libcudart.so"
ln -sf libnvrtc.so.13 "$LIB/libnvrtc.so"
mkdir -p "$LIB/stubs"
gcc -E -P "$CUDA_HOME/include/cuda.h" | grep -oE '\bCUresult\s+cu\w+\s*\(' | sed -E 's/CUresult\s+(\w+).*/void \1(void) {}/' \
  | sort -u | gcc -shared -x c - -Wl,-soname,libcuda.so.1 -o "$LIB/stubs/libcuda.so"

# --- 2. FlashInfer's ninja file, restricted to the 38 objects of the MXFP4 x bf16 path ---
log "generating the CUTLASS instantiations and the ninja file"
BUILD=$("$PYTHON" - <<'EOF'
import re
from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

spec = gen_cutlass_fused_moe_sm90_module(use_fast_build=True)
generated = [s for s in spec.sources if "cutlass_instantiations" in str(s)]
fixed = [s for s in spec.sources if s not in generated]
other_runner = re.compile(r"moe_gemm_kernels_\w+_\w+\.cu$")
keep_fixed = [s for s in fixed if not other_runner.search(s.name) or s.name == "moe_gemm_kernels_bf16_fp4.cu"]
keep_gen = [s for s in generated if "Launcher<__nv_bfloat16, SafeFP4" in s.read_text()]
# every kept instantiation file must hold only bf16 x SafeFP4 launchers
for s in keep_gen:
    for line in s.read_text().splitlines():
        assert not line.startswith("template void") or "<__nv_bfloat16, SafeFP4" in line, (s, line)
import sys
print(f"{len(spec.sources)} sources: {len(fixed)} fixed (keeping {len(keep_fixed)}), "
      f"{len(generated)} generated (keeping {len(keep_gen)})", file=sys.stderr)
assert (len(keep_fixed), len(keep_gen)) == (15, 23), "FlashInfer's sources changed: re-check the selection"
spec.sources = keep_fixed + keep_gen
spec.write_ninja()
print(spec.build_dir)
EOF
)
BUILD=$(echo "$BUILD" | tail -1)
log "build dir $BUILD"

# --- 3. compile and link (FlashInfer's own rules and link line) ---
log "ninja -j${JOBS:-2}"
# ninja echoes each full nvcc command line when not on a terminal: keep "[n/N] output" only
rm -f "$BUILD/fused_moe_90.so"  # always relink (seconds): the link line's libraries are not ninja inputs
ninja -C "$BUILD" -j"${JOBS:-2}" | sed -E 's|^(\[[0-9]+/[0-9]+\]) .* -o (\S+).*|\1 \2|'
SO=$BUILD/fused_moe_90.so
log "linked $(du -h "$SO" | cut -f1) $SO"

# --- 4. undefined-symbol check ---
# Every dynamic symbol that the libraries it needs (NEEDED) do not define must be (a) libtvm_ffi's
# (tvm_ffi loads it globally before any module) or (b) a method of another dtype's MoeGemmRunner,
# reached only through PLT slots (bound lazily, on first call); no symbol of kind (b) may sit in a
# data relocation (those are bound at load time).
log "undefined-symbol check"
"$PYTHON" - "$SO" "$LIB" "$SITE/tvm_ffi/lib/libtvm_ffi.so" <<'EOF'
import collections, re, subprocess, sys

so, lib, tvm = sys.argv[1:]
run = lambda *a: subprocess.run(a, check=True, capture_output=True, text=True).stdout

def dynsyms(path, kinds):
    return {f[-1].split("@")[0] for f in map(str.split, run("nm", "-D", path).splitlines()) if f and f[-2] in kinds}

needed = re.findall(r"\(NEEDED\).*\[(.+)\]", run("readelf", "-d", so))
where = {"libcuda.so.1": f"{lib}/stubs/libcuda.so", "libcudart.so.13": f"{lib}/libcudart.so.13",
         "libnvrtc.so.13": f"{lib}/libnvrtc.so.13"}
provided = set()
for name in needed:
    provided |= dynsyms(where.get(name) or run("gcc", f"-print-file-name={name}").strip(), "TtWiVDBuRr")
missing = sorted(dynsyms(so, "U") - provided)  # weak ones (w: _ITM_*, __gmon_start__) may stay unresolved
demangled = dict(zip(missing, run("c++filt", *missing).splitlines())) if missing else {}
rel = collections.defaultdict(set)  # relocation types per symbol
for f in map(str.split, run("readelf", "-rW", so).splitlines()):
    if len(f) >= 5 and f[2].startswith("R_X86_64"):
        rel[f[4].split("@")[0]].add(f[2])
tvm_syms = dynsyms(tvm, "TtWiVDBuRr")
own = re.compile(r"MoeGemmRunner<__nv_bfloat16, (cutlass::float_e2m1_t|__nv_fp4_e2m1), __nv_bfloat16\b")
runners, bad = collections.Counter(), []
for s in missing:
    d = demangled[s]
    if s in tvm_syms:
        continue
    if "MoeGemmRunner<" in d and not own.search(d) and rel[s] <= {"R_X86_64_JUMP_SLOT"}:
        runners[d.split(">::")[0].replace("tensorrt_llm::kernels::cutlass_kernels::", "") + ">"] += 1
    else:
        bad.append(f"  UNEXPECTED {d[:200]} {sorted(rel[s])}")
tvm_used = [s for s in missing if s in tvm_syms]
versions = sorted(set(re.findall(r"\b((?:GLIBC|GLIBCXX|CXXABI)_[\d.]+)", run("objdump", "-T", so))))
latest = {k: max((v for v in versions if v.startswith(k + "_")), key=lambda v: [int(x) for x in v.split("_")[1].split(".")])
          for k in ("GLIBC", "GLIBCXX", "CXXABI")}
print(f"NEEDED: {' '.join(needed)}; newest symbol versions: {' '.join(latest.values())}")
print(f"undefined beyond NEEDED: {len(missing)}: {len(tvm_used)} of libtvm_ffi "
      f"({sum(bool(rel[s] - {'R_X86_64_JUMP_SLOT'}) for s in tvm_used)} in data relocations), "
      f"{sum(runners.values())} methods of {len(runners)} other dtypes' runners (PLT slots only), {len(bad)} else")
for r, n in sorted(runners.items()):
    print(f"  {n:3d} x {r}")
print("\n".join(bad))
print("undefined-symbol check:", "FAIL" if bad else "PASS")
sys.exit(1 if bad else 0)
EOF

# --- 5. copy out, compressed copy ---
mkdir -p "$OUT/fused_moe_90"
cp "$SO" "$OUT/fused_moe_90/fused_moe_90.so"
xz -T2 -9 -c "$SO" > "$OUT/fused_moe_90.so.xz"
log "wrote $OUT/fused_moe_90/fused_moe_90.so ($(du -h "$OUT/fused_moe_90/fused_moe_90.so" | cut -f1))," \
    "$OUT/fused_moe_90.so.xz ($(du -h "$OUT/fused_moe_90.so.xz" | cut -f1))"

# --- 6. CPU load test: FlashInfer loads the module as a prebuilt (data/aot) one, with empty libcuda
# and libnvrtc stubs (no driver here); every exported function must resolve ---
log "load test"
mkdir -p "$W/empty-stubs"
for so in libcuda.so.1 libnvrtc.so.13; do
  echo | gcc -shared -x c - -Wl,-soname,$so -o "$W/empty-stubs/$so"
done
LD_LIBRARY_PATH=$W/empty-stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} FLASHINFER_DISABLE_JIT=1 \
  "$PYTHON" - "$OUT" <<'EOF'
import pathlib, subprocess, sys
import flashinfer
from flashinfer.jit import env as jit_env
from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module
from flashinfer.fused_moe.core import get_cutlass_fused_moe_module

jit_env.FLASHINFER_AOT_DIR = pathlib.Path(sys.argv[1])  # as <site>/flashinfer/data/aot on the GPU host
spec = gen_cutlass_fused_moe_sm90_module(use_fast_build=True)
assert spec.is_aot, spec.aot_path
mod = spec.try_load()
assert mod is not None, "FlashInfer could not load the prebuilt module"
names = sorted(l.split()[-1][len("__tvm_ffi_"):] for l in subprocess.run(
    ["nm", "-D", "--defined-only", str(spec.aot_path)], check=True, capture_output=True, text=True
).stdout.splitlines() if l.split()[-1].startswith("__tvm_ffi_"))
for n in names:
    mod.get_function(n)
print(f"flashinfer {flashinfer.__version__}: loaded {spec.aot_path}; exported functions: {', '.join(names)}")
get_cutlass_fused_moe_module("90")  # what cutlass_fused_moe calls first: loads it and calls set_deepgemm_jit_include_dirs
print("load test: PASS")
EOF
log "done"
