#!/usr/bin/env bash
# Nsight Compute on the production kernels (run on the device machine): why is a kernel slow?
# Speed of light, warp stall reasons, scheduler and memory sections for one launch of each.
#
#   bash tools/gpu_ncu.sh                                   # w4a16.mma and w4a8.gemv at their target shapes
#   KERNELS="w4a8.mma" SHAPE=512x4096x4096 bash tools/gpu_ncu.sh
#   NCU_SET=full KERNELS="w4a16.wgmma_rs" bash tools/gpu_ncu.sh          # every section (pipes, shared memory, source counters)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/ncu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QGEMM_CACHE_DIR=${QGEMM_CACHE_DIR:-/tmp/qgemm-cache}
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
[ -n "$NCU" ] || { echo "ncu not found"; exit 2; }
run() {  # kernel shape
    local name=$1 shape=$2 entry=${1/./_}
    python3 -m qgemm compile "$name" > /dev/null  # compile outside the profiled process
    "$NCU" --target-processes all -k "regex:^${entry}\$" -c 1 \
        ${NCU_SET:+--set $NCU_SET} --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
        python3 -m qgemm profile "$name" --shape "$shape" --warmup 0 --iters 1 --no-peers \
        > "$OUT/ncu-${name}-${shape}.txt" 2>&1
    echo "== $name $shape"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Stall|Issue Slot|Shared|Tensor|Pipe|Bank" \
        "$OUT/ncu-${name}-${shape}.txt" | head -25
}
if [ -n "${KERNELS:-}" ]; then
    for k in $KERNELS; do run "$k" "${SHAPE:-512x4096x4096}"; done
else
    run w4a16.mma 512x4096x4096
    run w4a8.gemv 8x4096x4096
fi
