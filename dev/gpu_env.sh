# Sourced by the dev/gpu_*.sh scripts on the GPU machine: installs the carried wheels (.whl/, and .whl/peer/
# when PEER=1) into .pysite and points Python, the jitattn cache and FlashInfer's workspace at local paths.
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .pysite "$@"; }
pip_target .whl/*.whl
if [ "${PEER:-0}" = 1 ] && ls .whl/peer/*.whl >/dev/null 2>&1; then pip_target .whl/peer/*.whl; fi
export PYTHONPATH=$PWD/.pysite:$PWD PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc FLASHINFER_WORKSPACE_BASE=/tmp/fi
