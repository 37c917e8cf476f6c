#!/usr/bin/env bash
# Nsight Compute on the production kernels (run on the device machine): why is a kernel slow?
# Speed of light, warp stall reasons, scheduler and memory sections for one launch of each.
#
#   bash tools/gpu_ncu.sh                                   # w4a16.mma and w4a8.gemv at their target shapes
#   KERNELS="w4a8.mma" SHAPE=512x4096x4096 bash tools/gpu_ncu.sh
#   NCU_SET=full KERNELS="w4a16.wgmma_rs" bash tools/gpu_ncu.sh          # every section (pipes, shared memory, source counters)
#   PEERS="512x4096x4096" KERNELS="w4a16.wgmma_rs" bash tools/gpu_ncu.sh  # also cuBLAS fp16 (torch) at that shape
#   SOURCE=1 KERNELS="w4a16.wgmma_rs" bash tools/gpu_ncu.sh   # + per-SASS-instruction stall samples (CSV; summarize
#                                                             #   with tools/ncu_source_top.py); DEFINES="RS_STAGES=3" for a variant
# Exit status: 0 only if every compile, profile and import succeeded; PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/ncu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QGEMM_CACHE_DIR=${QGEMM_CACHE_DIR:-/tmp/qgemm-cache}
PY=${PYTHON:-python3}
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
[ -n "$NCU" ] || { echo "ncu not found (set NCU=/path/to/ncu)" >&2; exit 2; }
[ "${SOURCE:-0}" = 0 ] && SOURCE=  # SOURCE=1 turns the per-instruction samples on, SOURCE=0 (or unset) off
rc=0  # the script's status: any failed compile, profile or import, not only the last grep
run() {  # kernel shape
    local name=$1 shape=$2 entry
    # the kernel's entry point: a variant (w4a16.skinny_f16) shares its float32 kernel's source and entry;
    # run_tool makes a misspelt name one line on stderr, not a traceback
    entry=$($PY -c "import sys; from qgemm import registry; from qgemm.errors import run_tool; \
sys.exit(run_tool(lambda: print(registry.spec(sys.argv[1]).entry), 'gpu_ncu'))" "$name") || { rc=1; return 1; }
    local rep="$OUT/ncu-${name}-${shape}${DEFINES:+-${DEFINES//[=,]/_}}"
    $PY -m qgemm compile "$name" > /dev/null || { echo "!! $name: qgemm compile failed" >&2; rc=1; return 1; }  # outside the profiled process
    # DEFINES (KEY=INT,...) go on top of the launch configuration (tools/probe_defines.py does the launch)
    local cmd=($PY -m qgemm profile "$name" --shape "$shape" --warmup 0 --iters 1 --no-peers)
    [ -n "${DEFINES:-}" ] && cmd=($PY tools/probe_defines.py "$name" "$shape" "v=${DEFINES//,/;}" --reps 1 --iters 1)
    "$NCU" --target-processes all -k "regex:^${entry}\$" -c 1 \
        ${NCU_SET:+--set $NCU_SET} --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
        ${SOURCE:+--section SourceCounters --import-source no -o "$rep" -f} \
        "${cmd[@]}" > "$rep.txt" 2>&1 || { echo "!! $name $shape: ncu or the profiled command failed (see $rep.txt)" >&2; rc=1; }
    if [ -n "${SOURCE:-}" ]; then
        "$NCU" --import "$rep.ncu-rep" >> "$rep.txt" 2>&1 || rc=1
        "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2>&1 || rc=1
    fi
    echo "== $name $shape"; grep -E "Duration|Throughput|Achieved Occupancy|Stall|Issue Slot|Shared|Tensor|Pipe|Bank|Hit Rate" \
        "$rep.txt" | head -30
}
peer() {  # cuBLAS through torch at the same shape: its kernel name says its tile and cluster shape
    local shape=$1 m n k
    IFS=x read -r m n k <<< "$shape"
    "$NCU" --target-processes all -k "regex:gemm|nvjet|xmma|cutlass" -c 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
        $PY -c "import torch; a = torch.randn($m, $k, device='cuda', dtype=torch.half); w = torch.randn($n, $k, device='cuda', dtype=torch.half); torch.cuda.synchronize(); c = a @ w.T; torch.cuda.synchronize()" \
        > "$OUT/ncu-cublas-fp16-${shape}.txt" 2>&1 || { echo "!! cuBLAS peer $shape failed" >&2; rc=1; }
    echo "== cuBLAS fp16 $shape"; grep -E "gemm|nvjet|xmma|Duration|Throughput|Cluster|Block Size|Grid Size|Registers|Shared Memory Config" \
        "$OUT/ncu-cublas-fp16-${shape}.txt" | head -30
}
if [ -n "${PEERS:-}" ]; then for s in $PEERS; do peer "$s"; done; fi
if [ -n "${KERNELS:-}" ]; then
    for k in $KERNELS; do run "$k" "${SHAPE:-512x4096x4096}"; done
elif [ -z "${PEERS:-}" ]; then
    run w4a16.mma 512x4096x4096
    run w4a8.gemv 8x4096x4096
fi
exit $rc
