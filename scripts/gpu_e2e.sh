#!/usr/bin/env bash
# The kvlife <-> vLLM end-to-end test on a CUDA GPU: a virtualenv with the CUDA `vllm`
# wheel (same version as the CPU build the default suite uses), kvlife installed into it,
# then the same tests as on CPU (tests/vllm/test_connector_e2e.py: exactness, restart
# from the disk tier, a flipped byte recomputed, isolation) and `kvlife bench vllm`.
#
#   scripts/gpu_e2e.sh            # venv in .venv-vllm-gpu, results in gpu-e2e/
#   KVLIFE_E2E_DTYPE=bfloat16 scripts/gpu_e2e.sh
#
# FlashAttention does not run float32, so the GPU run uses float16 by default (the CPU
# suite uses float32). Nothing here runs without a GPU; see docs/vllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm-gpu}
OUT=${OUT:-gpu-e2e}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
export KVLIFE_E2E_DTYPE=${KVLIFE_E2E_DTYPE:-float16}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "vllm==$VLLM_VERSION"
  "$VENV/bin/pip" install --quiet --no-deps -e .
  "$VENV/bin/pip" install --quiet msgpack xxhash pytest pytest-timeout hypothesis
fi
mkdir -p "$OUT"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/versions.txt"
"$VENV/bin/python" -m pytest -q tests/vllm/test_connector_e2e.py -p no:cacheprovider 2>&1 | tee "$OUT/e2e.txt"
if [ -d "${HOME}/.cache/kvlife/smollm2-135m-instruct" ]; then
  KVLIFE_VLLM_PYTHON="$VENV/bin/python" "$VENV/bin/python" -m kvlife.cli bench vllm --json "$OUT/bench-vllm.json" 2>&1 | tee "$OUT/bench.txt"
else
  echo "no converted SmolLM2 copy in ~/.cache/kvlife (run \`make demo\` once on this machine): bench skipped" | tee "$OUT/bench.txt"
fi
