# Sourced on a GPU host where this checkout is not pip-installed (after `source .gpu/setup.sh`):
# makes the checkout importable as `pdserve` (pdserve.engine -> ./engine, ...) through a folder of
# links on PYTHONPATH, which is what `pip install -e .` does through its import hook.
_pd_root=$(pwd)
_pd_shim=${PDSERVE_SHIM:-/tmp/pdserve-src}
mkdir -p "$_pd_shim/pdserve"
for _pd_d in engine kernels proto kvtransfer prefill_worker decode_worker router launch bench; do
  ln -sfn "$_pd_root/$_pd_d" "$_pd_shim/pdserve/$_pd_d"
done
export PYTHONPATH=$_pd_shim${PYTHONPATH:+:$PYTHONPATH}
