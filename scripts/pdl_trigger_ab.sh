#!/usr/bin/env bash
# A/B of PDL's trigger on a GPU machine (sm_90+): runs a command twice, first on the tree as it
# is, then with the trigger line of pdl_start() (cuda_src/common/pdl.cuh) taken out, each on its
# own native build of $MODULES made here first (the same NVRTC for both), and puts pdl.cuh back.
# Runs 165 and 169 found this way that the trigger costs many-wave grids of the norms 4-20%
# (benchmarks/notes_norms.md, "Runs 163-170"); this is the check for every other pdl=True module.
#
#   MODULES=softmax.rows,copy.copy bash scripts/pdl_trigger_ab.sh \
#       python3 -m gpuops bench --family softmax --graph
#
# The command sees PDL_AB_VARIANT=with|without (e.g. for its JSON's name: quote it for bash -c).
# Modules not in $MODULES compile in-process from the same (patched or not) tree. Logs:
# $OUT/pdl_ab_with.log, $OUT/pdl_ab_without.log (and the builds' logs beside them). Wheels in
# .whl (e.g. liger-kernel, carried) are installed into /tmp/site first, as scripts/device_run.sh.
set -uo pipefail
OUT=${OUT:-/tmp/gpuops-out}
mkdir -p "$OUT"
: "${MODULES:?MODULES: the comma-separated kernel modules to build (python -m gpuops list)}"
[ $# -gt 0 ] || { echo "usage: MODULES=... bash scripts/pdl_trigger_ab.sh COMMAND..."; exit 2; }
unset GPUOPS_KERNEL_BUNDLE
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
pdl=cuda_src/common/pdl.cuh
saved=$(mktemp)
cp "$pdl" "$saved"
trap 'cp "$saved" "$pdl"; rm -f "$saved"' EXIT
arch=$(python3 -c "import cupy; print(cupy.cuda.Device().compute_capability)") || exit 1
status=0
for variant in with without; do
  if [ "$variant" = without ]; then
    python3 - "$pdl" <<'EOF' || exit 1
import sys
path = sys.argv[1]
text = open(path).read()
start = text.index("void pdl_start() {")
line = text.index("pdl_launch_dependents();", start)
open(path, "w").write(text[:line] + "/* pdl_trigger_ab.sh: no trigger */"
                      + text[line + len("pdl_launch_dependents();"):])
EOF
  fi
  bundle=/tmp/gpuops-pdl-ab-$variant
  rm -rf "$bundle"
  if ! python3 -m gpuops build --arch "$arch" --kind cubin --modules "$MODULES" --out "$bundle" \
      > "$OUT/pdl_ab_build_$variant.log" 2>&1; then
    echo "build ($variant) failed: $(tail -3 "$OUT/pdl_ab_build_$variant.log")"
    exit 1
  fi
  PDL_AB_VARIANT=$variant GPUOPS_KERNEL_BUNDLE=$bundle GPUOPS_CACHE_DIR=/tmp/gpuops-pdl-ab-cache-$variant "$@" \
    > "$OUT/pdl_ab_$variant.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$variant trigger: rc=$rc ($(tail -1 "$OUT/pdl_ab_$variant.log"))"
done
exit $status
