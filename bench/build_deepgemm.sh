#!/bin/bash
# Build DeepGEMM (SGLang's tvm-ffi fork) against this machine's torch, into its own site folder,
# then check it on two small FP8 GEMMs against a dequantised torch reference.
#
# Why: the sgl_deep_gemm 0.2.0 wheel's deep_gemm/_C.so links libtorch and was compiled against
# another torch's C++ headers. It turns each tvm-ffi TensorView into an at::Tensor
# (torch::from_blob) and reads it through inline TensorImpl accessors, so under torch 2.11 every
# call fails its first check (`dim == 2 or dim == 3`, utils/layout.hpp). The 0.2.0 C++ sources
# are not published, so this builds the sgl-project/DeepGEMM release/v0.1.2 tree carried in
# .gpu/dg/src (csrc, Python package, kernel headers, fmt), with the CUTLASS/CuTe headers taken
# from the 0.2.0 wheel (byte-identical to the CUTLASS commit v0.1.2 pins).
#
# Usage, on the device from the repo root after `source .gpu/setup.sh`:
#     bash bench/build_deepgemm.sh [--force] [--layout-only] [--no-smoke]
#     DG_SITE=/tmp/dg-site python -m pdserve.bench.kernels --sections gemm
# --force rebuilds even if the site already holds a build for this torch; --no-smoke skips the
# GPU smoke test (an image build has no GPU; the build itself needs none); --layout-only stops
# after laying out the source tree (no CUDA needed). Environment: DG_SITE (default /tmp/dg-site),
# DG_SRC (default .gpu/dg/src), PYTHON (default python3), CUDA_HOME (default: from nvcc).
# The last line printed is `DG_SITE=<path>`. DeepGEMM JIT-compiles its kernels with nvcc on first
# use and caches them in $DG_JIT_CACHE_DIR (default ~/.deep_gemm).
set -euo pipefail

die() { echo "build_deepgemm: ERROR: $*" >&2; exit 1; }
log() { echo "build_deepgemm: [$((SECONDS - t_start))s] $*"; }

force=0
layout_only=0
smoke=1
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    --layout-only) layout_only=1 ;;
    --no-smoke) smoke=0 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) die "unknown argument '$arg' (expected --force, --layout-only or --no-smoke)" ;;
  esac
done

t_start=$SECONDS
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
site=${DG_SITE:-/tmp/dg-site}
src=${DG_SRC:-$repo/.gpu/dg/src}
py=${PYTHON:-python3}
first_file() { for f in "$@"; do [ -f "$f" ] && { echo "$f"; return 0; }; done; return 0; }
dg_wheel=$(first_file "$repo"/.gpu/wheels/sgl_deep_gemm-0.2.0-*.whl)
tvm_wheel=$(first_file "$repo"/.gpu/dg/apache_tvm_ffi-0.1.11-*.whl)

if [ -f "$src/csrc/tvm_ffi_api.cpp" ]; then
  # a git clone: git clone --recursive -b release/v0.1.2 https://github.com/sgl-project/DeepGEMM
  dg=$src
  fmt_inc=$src/third-party/fmt/include
  cutlass_inc=$src/third-party/cutlass/include
  [ -f "$cutlass_inc/cutlass/version.h" ] || die "CUTLASS submodule missing under $src (clone with --recursive)"
  commit=$(git -C "$src" rev-parse HEAD 2>/dev/null || cat "$src/COMMIT")
  tvm_spec=${tvm_wheel:-apache-tvm-ffi==0.1.11}  # from PyPI when no wheel is at hand
else
  # the unpacked layout: $src/deepgemm (sources) + $src/fmt, CUTLASS from the 0.2.0 wheel
  dg=$src/deepgemm
  fmt_inc=$src/fmt/include
  cutlass_inc=
  [ -f "$dg/csrc/tvm_ffi_api.cpp" ] \
    || die "DeepGEMM sources not found under $src (a clone of sgl-project/DeepGEMM release/v0.1.2, or $src/deepgemm)"
  [ -n "$dg_wheel" ] || die "sgl_deep_gemm-0.2.0 wheel (CUTLASS headers) not found in .gpu/wheels"
  [ -n "$tvm_wheel" ] || die "apache_tvm_ffi-0.1.11 wheel not found in .gpu/dg"
  commit=$(cat "$dg/COMMIT")
  tvm_spec=$tvm_wheel
fi
[ -f "$fmt_inc/fmt/format.h" ] || die "fmt headers not found under $fmt_inc"
torch_version=$("$py" -c "import torch; print(torch.__version__)") \
  || die "'$py' cannot import torch"
stamp="torch=$torch_version deepgemm=$commit"

if [ "$layout_only" = 0 ]; then
  if [ -z "${CUDA_HOME:-}" ]; then
    nvcc_path=$(command -v nvcc) || die "nvcc not on PATH and CUDA_HOME not set"
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")
  fi
  export CUDA_HOME
  [ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)"
  [ -f "$CUDA_HOME/include/cuda.h" ] || die "no CUDA headers under $CUDA_HOME/include"
  command -v ninja >/dev/null || die "ninja not on PATH (tvm_ffi.cpp.build needs it)"
  command -v "${CXX:-c++}" >/dev/null || die "no C++ compiler '${CXX:-c++}' on PATH"
fi

if [ "$force" = 0 ] && [ "$layout_only" = 0 ] && [ -f "$site/deep_gemm/_C.so" ] \
   && [ "$(cat "$site/deep_gemm/BUILD_STAMP" 2>/dev/null)" = "$stamp" ]; then
  log "reusing the build in $site ($stamp); --force rebuilds"
else
  # ---- lay out the tree where deep_gemm/__init__.py's _build_module expects it:
  # <site>/csrc/tvm_ffi_api.cpp, <site>/third-party/{cutlass,fmt}/include, <site>/deep_gemm/include
  log "laying out $site ($stamp)"
  if [ -e "$site" ] && [ ! -d "$site/third-party/cutlass" ] && [ -n "$(ls -A "$site")" ]; then
    die "refusing to replace $site: not empty and not a DeepGEMM site made by this script"
  fi
  rm -rf "$site"
  mkdir -p "$site/third-party/cutlass/include" "$site/third-party/fmt" "$site/deep_gemm/include"
  no_index=--no-index
  [ -f "$tvm_spec" ] || no_index=
  "$py" -m pip install -q $no_index --no-deps --no-compile --no-cache-dir \
      --target "$site" "$tvm_spec" || die "pip install of $tvm_spec failed"
  if [ -n "$cutlass_inc" ]; then
    cp -r "$cutlass_inc/cute" "$cutlass_inc/cutlass" "$site/third-party/cutlass/include/"
  else
  # CUTLASS/CuTe headers from the 0.2.0 wheel (a zip; no unzip binary needed)
  "$py" - "$dg_wheel" "$site/third-party/cutlass/include" <<'PY' || die "extracting CUTLASS headers failed"
import os, shutil, sys, zipfile
wheel, dest = sys.argv[1:3]
prefix, n = "deep_gemm/include/", 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        rel = info.filename[len(prefix):]
        if info.filename.startswith(prefix) and rel.startswith(("cute/", "cutlass/")) and not info.is_dir():
            path = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with z.open(info) as fin, open(path, "wb") as fout:
                shutil.copyfileobj(fin, fout)
            n += 1
if n < 500:
    sys.exit(f"only {n} CUTLASS/CuTe headers found in {wheel}")
print(f"build_deepgemm: {n} CUTLASS/CuTe headers from {os.path.basename(wheel)}")
PY
  fi
  cp -r "$fmt_inc" "$site/third-party/fmt/include"
  cp -r "$dg/csrc" "$site/csrc"
  # the Python package as the sgl wheel lays it out: sgl_deep_gemm/__init__.py is the package root
  cp "$dg/sgl_deep_gemm/__init__.py" "$site/deep_gemm/__init__.py"
  tr -d '[:space:]' < "$dg/sgl_deep_gemm/VERSION" > "$site/deep_gemm/VERSION"
  cp "$dg/LICENSE" "$site/deep_gemm/LICENSE"
  for sub in utils testing legacy mega; do
    cp -r "$dg/deep_gemm/$sub" "$site/deep_gemm/$sub"
  done
  cp -r "$dg/deep_gemm/include/deep_gemm" "$site/deep_gemm/include/deep_gemm"
  # the runtime JIT compiles kernels with -I<package>/include: cute and cutlass must be there too
  ln -s ../../third-party/cutlass/include/cute "$site/deep_gemm/include/cute"
  ln -s ../../third-party/cutlass/include/cutlass "$site/deep_gemm/include/cutlass"
  for f in csrc/tvm_ffi_api.cpp deep_gemm/__init__.py deep_gemm/VERSION \
           deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh \
           deep_gemm/include/cute/tensor.hpp deep_gemm/include/cutlass/version.h \
           third-party/cutlass/include/cutlass/version.h third-party/fmt/include/fmt/format.h \
           tvm_ffi/__init__.py; do
    [ -f "$site/$f" ] || die "layout incomplete: $site/$f missing"
  done
  log "layout done: sgl-deep-gemm $(cat "$site/deep_gemm/VERSION") sources, tvm-ffi 0.1.11"
  if [ "$layout_only" = 1 ]; then
    echo "DG_SITE=$site"
    exit 0
  fi

  # ---- build _C.so: importing the package without _C.so runs its own _build_module
  # (tvm_ffi.cpp.build: one C++ translation unit against this torch's headers and libraries)
  log "compiling deep_gemm/_C.so with $("${CXX:-c++}" --version | head -n 1), CUDA_HOME=$CUDA_HOME"
  t_build=$SECONDS
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" - "$site" <<'PY' || die "compiling _C.so failed (compiler output above)"
import os, sys
site = sys.argv[1]
import tvm_ffi
if not os.path.abspath(tvm_ffi.__file__).startswith(os.path.abspath(site)):
    sys.exit(f"tvm_ffi resolves to {tvm_ffi.__file__}, not the copy in {site}")
try:
    import deep_gemm
except Exception as e:  # tvm_ffi.cpp.build puts the whole compiler log in the message
    text = str(e)
    print(text[-12000:], file=sys.stderr)
    sys.exit(f"{type(e).__name__} while building/importing deep_gemm")
if not os.path.abspath(deep_gemm.__file__).startswith(os.path.abspath(site)):
    sys.exit(f"deep_gemm resolves to {deep_gemm.__file__}, not the build in {site}")
print(f"build_deepgemm: built {os.path.join(os.path.dirname(deep_gemm.__file__), '_C.so')}")
PY
  rm -rf "$site/deep_gemm/_C_build"
  echo "$stamp" > "$site/deep_gemm/BUILD_STAMP"
  log "compiled in $((SECONDS - t_build))s"
fi

if [ "$smoke" = 0 ]; then
  log "done (no smoke test)"
  echo "DG_SITE=$site"
  exit 0
fi
# ---- smoke test in a fresh process (loads the built _C.so; JIT-compiles two kernels)
log "smoke test (first use JIT-compiles kernels with nvcc; cache: ${DG_JIT_CACHE_DIR:-~/.deep_gemm})"
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" - "$site" <<'PY' || die "smoke test failed"
import os, sys, time
import torch

site = sys.argv[1]
import deep_gemm
import tvm_ffi

if not os.path.abspath(deep_gemm.__file__).startswith(os.path.abspath(site)):
    sys.exit(f"deep_gemm resolves to {deep_gemm.__file__}, not the build in {site}")
print(f"build_deepgemm: deep_gemm {deep_gemm.__version__} from {os.path.dirname(deep_gemm.__file__)}, "
      f"tvm-ffi {tvm_ffi.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
torch.manual_seed(0)
dev = "cuda"
TOL = 1e-2  # bf16 output rounding gives ~3e-3; a wrong scale layout or K block gives O(1)


def fp8(*shape):
    return (torch.randn(*shape, device=dev) * 32).to(torch.float8_e4m3fn)


def dequant(x, s, k):
    """x fp8 [r, k]; s float32 [ceil(r/gr), ceil(k/128)] scales of gr x 128 blocks."""
    gr = -(-x.shape[0] // s.shape[0])
    full = s.repeat_interleave(gr, 0)[: x.shape[0]].repeat_interleave(128, 1)[:, :k]
    return x.float() * full


def rel(d, ref):
    return ((d.float() - ref).norm() / ref.norm()).item()


failed = []
# 1) plain GEMM, M x N x K = 256 x 512 x 512, 1x128 activation and 128x128 weight scales
m, n, k = 256, 512, 512
a, b = fp8(m, k), fp8(n, k)
sa = torch.rand(m, k // 128, device=dev) + 0.5
sb = torch.rand(n // 128, k // 128, device=dev) + 0.5
d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
t0 = time.time()
deep_gemm.fp8_gemm_nt((a, sa), (b, sb), d)
torch.cuda.synchronize()
err = rel(d, dequant(a, sa, k) @ dequant(b, sb, k).T)
print(f"build_deepgemm: fp8_gemm_nt {m}x{n}x{k}: rel err {err:.2e} (first call {time.time() - t0:.1f}s)")
if not err <= TOL:
    failed.append(f"fp8_gemm_nt rel err {err:.2e} > {TOL}")

# 2) m-grouped contiguous GEMM (the MoE layout the benchmark uses), 2 experts, K = 704 (not a
#    multiple of 128, like gpt-oss's 2880), each expert's rows padded to the M alignment with -1;
#    if that fails, again with K zero-padded to 768 to tell "no K tail" from "broken build"
align = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
counts, n, k = [100, 200], 256, 704
m_idx = torch.cat([torch.cat([torch.full((c,), e, dtype=torch.int32),
                              torch.full((-(-c // align) * align - c,), -1, dtype=torch.int32)])
                   for e, c in enumerate(counts)]).to(dev)
m, sk = m_idx.numel(), -(-k // 128)
a, b = fp8(m, k), fp8(len(counts), n, k)
sa = (torch.rand(sk, m, device=dev) + 0.5).t()  # MN-major, as DeepGEMM's SM90 kernel reads it
sb = torch.rand(len(counts), n // 128, sk, device=dev) + 0.5
refs = [dequant(a[m_idx == e], sa[m_idx == e], k) @ dequant(b[e], sb[e], k).T for e in range(len(counts))]


def grouped(k_tensor):
    """Run with the K dimension of the tensors zero-padded to k_tensor; max rel err per expert."""
    ap = torch.zeros(m, k_tensor, device=dev, dtype=a.dtype)
    bp = torch.zeros(len(counts), n, k_tensor, device=dev, dtype=b.dtype)
    ap[:, :k], bp[:, :, :k] = a, b
    d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    t0 = time.time()
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((ap, sa), (bp, sb), d, m_idx)
    torch.cuda.synchronize()
    err = max(rel(d[m_idx == e], r) for e, r in enumerate(refs))
    print(f"build_deepgemm: m_grouped_fp8_gemm_nt_contiguous 2 experts, N {n}, K {k} in tensors of "
          f"K {k_tensor}, M {m}: rel err {err:.2e} (first call {time.time() - t0:.1f}s)")
    return err


if not grouped(k) <= TOL:
    if grouped(-(-k // 128) * 128) <= TOL:
        print("build_deepgemm: WARNING: K not a multiple of 128 gives wrong results; pad K")
    else:
        failed.append(f"m-grouped GEMM rel err > {TOL}, also with K padded")
if failed:
    sys.exit("; ".join(failed))
PY
log "done"
echo "DG_SITE=$site"
