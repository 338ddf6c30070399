#!/usr/bin/env bash
# Off-device preparation for scripts/device_run.sh: the compute_61 (Pascal) kernel bundle, built
# with NVRTC 12 here because the device's NVRTC 13 cannot target sm_61. Carry .bundle61x: the
# bundle packed with xz (54 MB of PTX -> ~4 MB; the device's carry limit is 64 MiB with the tree),
# which device_run.sh unpacks into .bundle61 when no .bundle61 travelled.
set -euo pipefail
cd "$(dirname "$0")/.."
# --stale: images still current (same NVRTC, module unchanged) are kept; only changed modules compile
python3 -m gpuops build --arch 61 --kind ptx --out .bundle61 --stale
mkdir -p .bundle61x
tar cJf .bundle61x/bundle61.tar.xz .bundle61
ls -la .bundle61x/bundle61.tar.xz
