#!/usr/bin/env bash
# A static fio (libaio engine) from Debian's source package, for machines without fio and
# without the network: `zeroio bench io --fio .dev/fio`. Needs deb-src in apt's sources,
# libaio-dev and a C compiler on the building machine (Debian bookworm here).
#   bash tools/build_fio.sh            # -> .dev/fio
set -euo pipefail
out="$(cd "$(dirname "$0")/.." && pwd)/.dev"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
cd "$work"
apt-get source -qq fio >/dev/null
cd fio-*/
./configure --build-static --disable-numa --disable-rdma --disable-gfapi --disable-rbd \
    --disable-pmem --disable-native >/dev/null
make -j"$(nproc)" fio >/dev/null
install -m 0755 fio "$out/fio"
"$out/fio" --version
