#!/usr/bin/env bash
# Here, before a GPU window: the wheels the lent device lacks, for kvfit and for the vLLM bundle, into two ignored
# folders that travel with `carry`:
#   .gpu/   kvfit's own needs (pyproject's dependencies the device image does not hold, for Python 3.12)
#   .gpu2/  what ../shared/peers/vllm's bundle lacks (compressed-tensors imports loguru; vLLM's FP8 config fails
#           without it)
# On the device, first call: python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .gpu/*.whl
# after vLLM's install: python3 -m pip install -q --no-index --no-deps --no-compile --target /root/vllm/deps .gpu2/*.whl
# then PYTHONPATH=/root/site:/root/vllm/site:/root/vllm/deps (kvfit's llguidance >= 1.9 first; fastapi is pinned to
# the bundle's 0.136.0, the rest are the newest, as the bundle's are).
set -euo pipefail
cd "$(dirname "$0")/.."
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$@"
}
for dir in .gpu .gpu2; do grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude; done
mkdir -p .gpu .gpu2
dl .gpu "llguidance>=1.9,<2" httptools msgspec pyzmq "fastapi==0.136.0" starlette pydantic pydantic_core \
  annotated_types typing_inspection uvicorn
dl .gpu2 loguru
du -sh .gpu .gpu2
