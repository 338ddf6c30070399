#!/usr/bin/env bash
# One device call built from scripts/device_run.sh's stages, each under its own $OUT subfolder,
# everything tarred into $OUT/all.tgz at the end (the device returns only a few files). Set what
# to run through the environment (thirty-second session, runs 187-192):
#   TESTS="tests/test_a.py ..."   every GPU test of those files, natively and on compute_61
#   IDS_FILE=path                 the node ids listed there (one per line), on both archs
#   BENCH="--ops a,b --graph"     `gpuops bench` with these arguments
#   NCU="target,..."              Nsight Compute on targets of benchmarks/experiments/ncu_targets.py
#   EXPS="script.py args;..."     experiments under benchmarks/experiments/
# Bundles: GPUOPS_KERNEL_BUNDLE defaults to .bundle90ga, BUNDLE61 to .bundle61ga (carried packed
# as .bundle90gax/bundle90ga.tar.xz etc.; unpacked here). Shard sizes: SHARDS (per arch),
# FILE_TIMEOUT (s per shard); BENCH_TIMEOUT, NCU_TIMEOUT, EXP_TIMEOUT (s per stage).
#   TESTS="tests/test_norms.py" BENCH="--ops layer_norm --graph" bash scripts/device_call.sh
set -u
S=${OUT:?OUT must be set}
export GPUOPS_KERNEL_BUNDLE=${GPUOPS_KERNEL_BUNDLE:-$PWD/.bundle90ga}
B61=${BUNDLE61:-.bundle61ga}
for packed in .bundle*x/bundle*.tar.xz; do
  [ -f "$packed" ] || continue
  name=$(basename "$packed" .tar.xz)
  [ -f ".$name/manifest.json" ] || tar xJf "$packed"
done
step() { echo "=== $(date -u +%T) $*"; }
if [ -n "${TESTS:-}" ]; then
  step "tests ($TESTS)"
  OUT=$S/tests BUNDLE61=$B61 SHARDS=${SHARDS:-10} FILE_TIMEOUT=${FILE_TIMEOUT:-280} \
    TEST_FILES="$TESTS" bash scripts/device_run.sh shards 2>&1 | tail -40
fi
if [ -n "${IDS_FILE:-}" ]; then
  step "tests ($IDS_FILE)"
  OUT=$S/tests_ids BUNDLE61=$B61 SHARDS=${SHARDS:-8} FILE_TIMEOUT=${FILE_TIMEOUT:-200} \
    TEST_IDS_FILE=$IDS_FILE bash scripts/device_run.sh shards 2>&1 | tail -25
fi
if [ -n "${BENCH:-}" ]; then
  step bench
  OUT=$S/bench STAGE_TIMEOUT=${BENCH_TIMEOUT:-200} BENCH_ARGS="$BENCH" \
    bash scripts/device_run.sh bench 2>&1 | grep -v "^  *$" | tail -60
fi
if [ -n "${NCU:-}" ]; then
  step "ncu ($NCU)"
  OUT=$S/ncu STAGE_TIMEOUT=${NCU_TIMEOUT:-200} NCU_TARGETS="$NCU" \
    bash scripts/device_run.sh ncu 2>&1 | tail -30
fi
if [ -n "${EXPS:-}" ]; then
  step exp
  OUT=$S/exp STAGE_TIMEOUT=${EXP_TIMEOUT:-150} EXPERIMENTS="$EXPS" \
    bash scripts/device_run.sh exp 2>&1 | tail -80
fi
step done
cd "$S" && cat tests*/tests_summary.txt 2>/dev/null | grep -v "^ *$" | tail -20
tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz "$S/all.tgz"
