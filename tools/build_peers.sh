#!/usr/bin/env bash
# The peer contenders' packages for the GPU machine (docs/benchmarks.md, "Setting up the GPU
# machine"), into .peers/: DeepSpeed built from its PyPI sdist with DS_BUILD_OPS=0 (its ops
# JIT-compile on the GPU machine), its pure and binary dependencies for the GPU image's Python,
# torchao's wheel, and Debian's libaio packages (unpacked there into a folder, never installed).
#   bash tools/build_peers.sh                 # -> .peers/
#   PY_VERSION=3.12 DS_VERSION=0.19.8 TORCHAO_VERSION=0.18.0 bash tools/build_peers.sh
set -euo pipefail
out="$(cd "$(dirname "$0")/.." && pwd)/.peers"
py="${PY_VERSION:-3.12}"
ds="${DS_VERSION:-0.19.8}"
ao="${TORCHAO_VERSION:-0.18.0}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "deepspeed==$ds"
tar -xzf "$work"/deepspeed-"$ds".tar.gz -C "$work"
# the sdist's setup.py imports torch; a CPU torch here is enough with no op built
(cd "$work/deepspeed-$ds" && DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation \
    -w "$out" .)
python3 -m pip download -q --only-binary :all: --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --no-deps -d "$out" \
    hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions \
    "torchao==$ao"
(cd "$out" && apt-get download libaio1 libaio-dev >/dev/null)
ls -1 "$out"
