#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the cp312 manylinux wheels that tools/gpu_run.sh installs on
# the GPU machine, whose image (python 3.12, torch, transformers, aiohttp, uvloop, ...) lacks them
# and reaches no package index; nvidia-cutlass carries the CUTLASS/CuTe headers the CUDA build
# includes. Versions are the ones installed in the environment running this script (the one the
# CPU tests passed in), so both machines test the same code.
#   tools/fetch_wheels.sh            then pass carry=[".whl"] to the device call
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(
  msgspec structlog cohere-melody llguidance
  opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
  opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
  opentelemetry-exporter-http-transport opentelemetry-proto opentelemetry-semantic-conventions
  googleapis-common-protos protobuf
  openai httpx2 httpcore2 truststore anyio h11 idna sniffio jiter typing-extensions
  pydantic pydantic-core annotated-types typing-inspection
  pytest pluggy iniconfig pytest-asyncio pytest-aiohttp pytest-timeout
  jsonschema jsonschema-specifications referencing rpds-py
  nvidia-cutlass
)
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p .whl
for name in "${packages[@]}"; do
  version=$(python3 -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  spec="$name${version:+==$version}"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$spec" 2>&1 | grep -v '^WARNING' || true
  compgen -G ".whl/$(echo "$name" | tr - _)-*" >/dev/null || { echo "fetch_wheels: no wheel for $spec" >&2; exit 1; }
done
du -sh .whl
