#!/usr/bin/env bash
# Off-device preparation for scripts/device_run.sh: the compute_61 (Pascal) kernel bundle, built
# with NVRTC 12 here because the device's NVRTC 13 cannot target sm_61. Carry .bundle61.
set -euo pipefail
cd "$(dirname "$0")/.."
# --stale: images still current (same NVRTC, module unchanged) are kept; only changed modules compile
python3 -m gpuops build --arch 61 --kind ptx --out .bundle61 --stale
