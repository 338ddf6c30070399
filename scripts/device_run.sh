#!/usr/bin/env bash
# Everything one GPU session needs, in one call (see README "GPU runs"):
#   1. the GPU tests on the device's own arch,
#   2. the GPU tests again on the compute_61 (Pascal) bundle built off-device (.bundle61),
#   3. the benchmarks (`python -m gpuops bench --runtime`), and any experiments named.
# Logs and JSON go to $OUT. Stages (default: tests tests61 bench):
#   tests      the whole test suite on the device's arch
#   gputests   only the GPU tests on the device's arch ($TEST_ARGS appended to pytest)
#   tests61    the GPU tests again on the compute_61 bundle (.bundle61, carried)
#   alltests   gputests and tests61 together, one pool of $JOBS pytest processes
#   shards     every GPU test of $TEST_FILES (default: all), natively (on the prebuilt native
#              bundle) and on the compute_61 bundle, each arch's tests dealt round-robin into
#              $SHARDS pytest processes, all at once: the whole suite in one call's 10 minutes
#              (one file alone, test_gemm or test_attention, took ~9 minutes in a file pool);
#              SHARD_TAGS="native" (or "sm61") runs one arch only; TEST_IDS_FILE: the node ids
#              to run (one per line) instead of collecting $TEST_FILES
#   bench      every op, torch eager and Liger peers, --runtime (dispatch cost, module loads)
#   benchfull  every op with torch.compile peers and every extra shape (long rows, decode)
#   xent       benchmarks/experiments/cross_entropy_memory.py (time and peak memory)
#   decode     benchmarks/experiments/decode_graphs.py (per call back to back and in a CUDA graph)
#   gemm       benchmarks/experiments/gemm_ladder.py (every GEMM variant against cuBLAS)
#   sweep, dispatch   experiments of the elementwise family
#   ncu        Nsight Compute counters of one call of each of $NCU_TARGETS (ncu_targets.py)
#   exp        each of $EXPERIMENTS (';'-separated "script.py args" under benchmarks/experiments/),
#              run with --json detail/exp_<script>.json; logs detail/exp_<script>.log
# Wheels in .whl (carried; e.g. liger-kernel) are installed into /tmp/site first.
#   bash scripts/device_run.sh                 # all default stages
#   bash scripts/device_run.sh bench sweep     # only these
set -uo pipefail
OUT=${OUT:-/tmp/gpuops-out}
mkdir -p "$OUT"
# per-file logs and XML go to $DETAIL and come back as one tarball (the device returns at most 8 files)
DETAIL=$OUT/detail
mkdir -p "$DETAIL"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GPUOPS_CACHE_DIR=${GPUOPS_CACHE_DIR:-/tmp/gpuops-cache}
# the driver's JIT cache holds the compute_61 PTX compiled for this GPU, shared by the test processes
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
# bundles travel packed (scripts/prepare_device_run.sh: the compute_61 bundle's 54 MB of PTX are
# 4 MB as xz): .bundleNAMEx/bundleNAME.tar.xz unpacks into .bundleNAME unless that travelled too
for packed in .bundle*x/bundle*.tar.xz; do
  [ -f "$packed" ] || continue
  name=$(basename "$packed" .tar.xz)
  [ -f ".$name/manifest.json" ] || tar xJf "$packed"
done
PY=${PY:-python3}
stages=${*:-tests tests61 bench}
# every benchmark/experiment command is cut off after $STAGE_TIMEOUT seconds, so that one stuck
# stage cannot take the device call (and the logs tarred at the end) with it.
# TEST_K: a pytest -k expression for every test file (TEST_ARGS is split on spaces, so no -k there)
T="timeout ${STAGE_TIMEOUT:-3000}"
status=0

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import sys, torch, cupy, numpy; print(sys.version); print('torch', torch.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
  $PY -m gpuops info
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# benchmarks load kernels from a native bundle compiled in parallel first (one process per module),
# instead of compiling ~40 modules one after another in the benchmark's process
prebuilt=""
prebuild() {
  [ -n "$prebuilt" ] || [ -n "${GPUOPS_KERNEL_BUNDLE:-}" ] && return
  arch=$($PY -c "import cupy; d=cupy.cuda.Device(); print(d.compute_capability)") || { prebuilt=1; return; }
  # sm_90 also takes the arch-specific (90a: wgmma, TMA) modules, or the tests compile them in-process
  [ "$arch" = 90 ] && arch=90,90a
  start=$(date +%s)
  # PREBUILD_MODULES (comma-separated): only those (an experiment on a few modules; the rest compile
  # in-process as needed). Not with the bench stages: `gpuops bench` loads every module first and
  # compiling the rest in-process outlasts STAGE_TIMEOUT (run 78)
  $PY -m gpuops build --arch "$arch" --kind cubin --out /tmp/gpuops-native-bundle -j "$(nproc)" \
    ${PREBUILD_MODULES:+--modules "$PREBUILD_MODULES"} \
    > "$DETAIL/prebuild.log" 2>&1 && export GPUOPS_KERNEL_BUNDLE=/tmp/gpuops-native-bundle
  prebuilt=1
  echo "prebuilt sm_$arch bundle in $(( $(date +%s) - start ))s: $(tail -1 "$DETAIL/prebuild.log")"
}

for stage in $stages; do
  echo "=== $stage ==="
  case $stage in
    tests)
      # the whole suite: CPU tests also run their NumPy inputs through the GPU path here
      $PY -m pytest tests -q -rfEs --junitxml="$DETAIL/tests_native.xml" 2>&1 \
        | tee "$DETAIL/tests_native.log" | tail -25 || status=1 ;;
    gputests|tests61|alltests)
      # one pytest per test file, $JOBS files at once (NVRTC compiles are CPU-bound), each under
      # $FILE_TIMEOUT seconds: a kernel that hangs costs its own file (named in the log), not the run.
      # alltests: the native and the compute_61 files share one pool of $JOBS (one stage's wall time)
      case $stage in gputests) tags="native";; tests61) tags="sm61";; *) tags="native sm61";; esac
      # BUNDLE61: another compute_61 bundle (e.g. a subset of the modules, when the carry limit bites)
      b61=${BUNDLE61:-.bundle61}
      if [[ " $tags " == *" sm61 "* ]] && [ ! -f "$b61/manifest.json" ]; then
        echo "no $b61: build it off-device: bash scripts/prepare_device_run.sh"; status=1; continue
      fi
      for tag in $tags; do
        envs=()
        [ "$tag" = sm61 ] && envs=(GPUOPS_KERNEL_BUNDLE="$PWD/$b61" GPUOPS_ARCH=61)
        for f in ${TEST_FILES:-tests/test_*.py}; do
          while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-6}" ]; do sleep 0.5; done
          (
            name=$(basename "$f" .py); start=$(date +%s)
            env "${envs[@]}" timeout -k 5 "${FILE_TIMEOUT:-240}" $PY -m pytest -m gpu "$f" -q -rfE --tb=short \
              -p no:cacheprovider --junitxml="$DETAIL/${tag}_${name}.xml" ${TEST_ARGS:-} ${TEST_K:+-k "$TEST_K"} > "$DETAIL/${tag}_${name}.log" 2>&1
            rc=$?; [ $rc -eq 5 ] && rc=0   # 5: no GPU tests in the file
            echo "$tag $name rc=$rc $(( $(date +%s) - start ))s $(tail -1 "$DETAIL/${tag}_${name}.log")"
          ) &
        done
      done
      wait
      sleep 0.2
      for tag in $tags; do
        # the summary lines, then every failure's short traceback in one file
        grep -h "^FAILED\|^ERROR" "$DETAIL"/${tag}_*.log > "$OUT/failures_${tag}.txt" 2>/dev/null
        for l in "$DETAIL"/${tag}_*.log; do
          grep -q "^FAILED\|^ERROR\|rc=1[23]" "$l" && { echo "##### $l"; sed -n '/= FAILURES =/,$p;/= ERRORS =/,$p' "$l" | head -c 60000; }
        done >> "$OUT/failures_${tag}.txt"
        grep -q "^FAILED\|^ERROR" "$OUT/failures_${tag}.txt" && status=1
      done ;;
    shards)
      prebuild
      shard_tags=${SHARD_TAGS:-native sm61}
      b61=${BUNDLE61:-.bundle61}
      if [[ " $shard_tags " == *" sm61 "* ]] && [ ! -f "$b61/manifest.json" ]; then
        echo "no $b61: bash scripts/prepare_device_run.sh"; status=1; continue
      fi
      if [ -n "${TEST_IDS_FILE:-}" ]; then
        # node ids one per line (e.g. the tests an earlier call's timeout left unrun)
        grep '::' "$TEST_IDS_FILE" > "$DETAIL/gpu_test_ids.txt"
      else
        $PY -m pytest -m gpu --co -q -p no:cacheprovider ${TEST_FILES:-tests} ${TEST_K:+-k "$TEST_K"} 2>/dev/null \
          | grep '::' > "$DETAIL/gpu_test_ids.txt"
      fi
      # dealt in a shuffled order (fixed seed): pytest runs the ids in the order given, so each
      # shard gets a mix of every file instead of all shards starting on the slow attention
      # files (run 154: 460 s went on test_attention*, every other file NOT RUN)
      $PY -c "import random, sys; ids = open(sys.argv[1]).read().splitlines(); random.Random(0).shuffle(ids); print(*ids, sep=chr(10))" \
        "$DETAIL/gpu_test_ids.txt" > "$DETAIL/gpu_test_ids_dealt.txt"
      mapfile -t ids < "$DETAIL/gpu_test_ids_dealt.txt"
      n=${#ids[@]}; shards=${SHARDS:-7}
      echo "${n} GPU tests, ${shards} shards per arch"
      for tag in $shard_tags; do
        envs=()
        [ "$tag" = sm61 ] && envs=(GPUOPS_KERNEL_BUNDLE="$PWD/$b61" GPUOPS_ARCH=61)
        for ((s = 0; s < shards; s++)); do
          sel=()
          for ((i = s; i < n; i += shards)); do sel+=("${ids[i]}"); done
          (
            start=$(date +%s); log="$DETAIL/${tag}_shard$s.log"
            env "${envs[@]}" timeout -k 5 "${FILE_TIMEOUT:-540}" $PY -m pytest -v -rfE --tb=short \
              -p no:cacheprovider --durations=10 --junitxml="$DETAIL/${tag}_shard$s.xml" "${sel[@]}" > "$log" 2>&1
            echo "$tag shard$s rc=$? $(( $(date +%s) - start ))s $(tail -1 "$log")"
          ) &
        done
      done
      wait
      sleep 0.2
      for tag in $shard_tags; do
        grep -h "^FAILED\|^ERROR" "$DETAIL"/${tag}_shard*.log > "$OUT/failures_${tag}.txt" 2>/dev/null
        for l in "$DETAIL"/${tag}_shard*.log; do
          grep -q "^FAILED\|^ERROR" "$l" && { echo "##### $l"; sed -n '/= FAILURES =/,$p;/= ERRORS =/,$p' "$l" | head -c 60000; }
        done >> "$OUT/failures_${tag}.txt"
        grep -q "^FAILED\|^ERROR" "$OUT/failures_${tag}.txt" && status=1
      done
      # a shard cut off by its timeout prints no summary: its last test ids say where it stopped
      $PY scripts/shard_summary.py "$DETAIL" | tee "$OUT/tests_summary.txt" ;;
    bench)
      prebuild
      $T $PY -m gpuops bench ${BENCH_ARGS:---runtime} --json "$OUT/bench.json" 2>&1 | tee "$DETAIL/bench.log" || status=1 ;;
    benchfull)
      prebuild
      $T $PY -m gpuops bench --compile --all-shapes --json "$OUT/benchfull.json" ${BENCH_ARGS:-} 2>&1 \
        | tee "$DETAIL/benchfull.log" || status=1 ;;
    xent)
      prebuild
      $T $PY benchmarks/experiments/cross_entropy_memory.py --json "$OUT/xent.json" 2>&1 \
        | tee "$DETAIL/xent.log" || status=1 ;;
    decode)
      prebuild
      $T $PY benchmarks/experiments/decode_graphs.py --json "$OUT/decode.json" 2>&1 \
        | tee "$DETAIL/decode.log" || status=1 ;;
    gemm)
      prebuild
      $T $PY benchmarks/experiments/gemm_ladder.py --json "$OUT/gemm_ladder.json" ${GEMM_ARGS:-} 2>&1 \
        | tee "$DETAIL/gemm_ladder.log" || status=1 ;;
    sweep)
      $T $PY benchmarks/experiments/pointwise_sweep.py --json "$OUT/sweep.json" 2>&1 \
        | tee "$DETAIL/sweep.log" || status=1 ;;
    dispatch)
      $T $PY benchmarks/experiments/dispatch_costs.py --json "$OUT/dispatch.json" 2>&1 \
        | tee "$DETAIL/dispatch.log" || status=1 ;;
    ncu)
      # Nsight Compute on one call of each of $NCU_TARGETS (benchmarks/experiments/ncu_targets.py):
      # the clocks left alone (device METHOD.md), the full section set with per-instruction stall
      # samples; exported as the details page, every raw metric, and the SASS with its samples
      prebuild
      rep="$DETAIL/ncu"
      $T ncu --clock-control none --profile-from-start off --set full ${NCU_ARGS:-} -f -o "$rep" \
        $PY benchmarks/experiments/ncu_targets.py --targets "${NCU_TARGETS:-sgemm_cublas,sgemm_k16}" \
        > "$DETAIL/ncu.log" 2>&1 || status=1
      tail -20 "$DETAIL/ncu.log"
      ncu -i "$rep.ncu-rep" --page details --csv > "$DETAIL/ncu_details.csv" 2> "$DETAIL/ncu_export.log"
      ncu -i "$rep.ncu-rep" --page raw --csv > "$DETAIL/ncu_raw.csv" 2>> "$DETAIL/ncu_export.log"
      ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$DETAIL/ncu_sass.csv" \
        2>> "$DETAIL/ncu_export.log"
      ls -la "$DETAIL"/ncu* ; tail -5 "$DETAIL/ncu_export.log" ;;
    exp)
      prebuild
      IFS=';' read -ra exps <<< "${EXPERIMENTS:-}"
      for e in "${exps[@]}"; do
        read -ra words <<< "$e"
        [ ${#words[@]} -gt 0 ] || continue
        name=$(basename "${words[0]}" .py)
        # the same script twice (other arguments): exp_<script>_2, _3, ...
        k=2; base=$name; while [ -e "$DETAIL/exp_$name.log" ]; do name=${base}_$k; k=$((k + 1)); done
        echo "--- $e"
        $T $PY "benchmarks/experiments/${words[0]}" "${words[@]:1}" --json "$DETAIL/exp_$name.json" 2>&1 \
          | tee "$DETAIL/exp_$name.log" || status=1
      done ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
# named by the stages, so that a second device_run.sh in the same call keeps the first one's logs
tar czf "$OUT/detail_${stages// /_}.tgz" -C "$OUT" detail && rm -rf "$DETAIL"
exit $status
