# Source on the GPU host, from the repo root: install the vLLM stack (once per host) and dspark-calib itself.
# Needs the wheel parts already received (recv.sh) and the tar's sha256 in $WHEELS_SHA256.
set -e
bash benchmarks/h200/install.sh "${WHEELS_SHA256:?set WHEELS_SHA256 (prepare-wheels.sh prints it)}" >&2
. benchmarks/h200/env.sh
if [ ! -f /tmp/site/.dspark_calib ]; then
  # --no-build-isolation: the host has setuptools but no network. The entry point
  # (vllm.general_plugins) is what makes vLLM load our plugin in every process.
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >&2
  touch /tmp/site/.dspark_calib
fi
export PATH=/tmp/site/bin:$PATH
export VLLM_USE_V2_MODEL_RUNNER=1
python3 -c "from importlib.metadata import entry_points as e; print('plugins:', [p.name for p in e(group='vllm.general_plugins')])"
