#!/usr/bin/env bash
# The one script for GPU work (run it on the device machine): by default `qgemm info` and
# `compile --all`, the GPU tests, `qgemm validate --all` (plus the 1x1x32 per-block breakdown), the
# live tutorial, a profile of every kernel at 512x4096x4096 (hot and cold), `qgemm bench`, the issue's
# target shapes timed llama.cpp's way (`qgemm bench --sustain 1`) and docs/performance.md's
# regeneration (report), with logs under $OUT.
#
#   bash tools/gpu_check.sh                 # the default steps: info tests validate tutorial profile bench sustained report
#   QGEMM_CHECK="tests profile" bash tools/gpu_check.sh   # tests: the whole suite (with two GPUs: QGEMM_DEVICE too)
#   QGEMM_CHECK="skinny decode ncu" bash tools/gpu_check.sh    # decode path: tests, tune, bench M <= 64, ncu
#   QGEMM_CHECK="i8" bash tools/gpu_check.sh                   # int8 decode kernels: tests, every config vs fp16, whole op
#   QGEMM_CHECK="q8" bash tools/gpu_check.sh                   # int8 small batch on Q8_1: tests, every config, whole op
#   QGEMM_CHECK="rs" bash tools/gpu_check.sh                   # Hopper prefill: wgmma_rs vs wgmma, tests, tune
#   QGEMM_CHECK="l2" bash tools/gpu_check.sh                   # prefill: warpgroups per CTA, L2 throughput (ncu) vs cuBLAS
#   QGEMM_CHECK="kvcache" bash tools/gpu_check.sh              # Mustafar: its GPU tests, the kvcache bench vs dense torch
#   QGEMM_CHECK="xtypes" bash tools/gpu_check.sh               # float32 / float16 / bfloat16 activations: whole op, configurations
#   QGEMM_CHECK="sanitize" bash tools/gpu_check.sh             # the GPU tests under compute-sanitizer (memcheck, racecheck, synccheck, initcheck)
#   QGEMM_CHECK="map" bash tools/gpu_check.sh                  # decode on models' weight matrices vs the copy bandwidth (tools/decode_map.py)
#   QGEMM_CHECK="wquant" bash tools/gpu_check.sh               # weight quantizers (float -> Q4_0 / Q8_0 on the GPU): tests, speed vs numpy
#   other steps: precompile (every default configuration of the bench shapes, in parallel: run it
#   first on a fresh machine), order (hot rows vs what ran before them), tune-dry, rs-quick, rs-tunes
#   (docs/perf/tunes-h100 again: QGEMM_RS_TUNE_SHAPES, default every stored shape), decode-tunes
#   (docs/perf/tunes-h100/decode: QGEMM_DECODE_TUNE_PAIRS, kernel@shape), pdl,
#   pack (the GPU repacking: its tests and matmul on blocks against packed weights), host (an eager
#   qgemm.matmul call's host time against torch's: docs/pytorch.md's table), ab (below)
#
#   QGEMM_CHECK=ab QGEMM_AB_OLD=out/oldtree QGEMM_AB_SHAPES=300x4096x14336,300x4096x14336@cold \
#       bash tools/gpu_check.sh    # whole op of an older tree (`git archive REV | tar -x -C out/oldtree`,
#                                  # carried) against this one, alternating twice; tools/ab_report.py
#                                  # tabulates it (QGEMM_AB_X: activation types, default f32;
#                                  # QGEMM_AB_FMTS: weight formats, default q4_0,q8_0)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu_check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the ab step runs tools from another tree's directory
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export QGEMM_CACHE_DIR=${QGEMM_CACHE_DIR:-/tmp/qgemm-cache}
PY=${PYTHON:-python3}
STEPS=${QGEMM_CHECK:-"info tests validate tutorial profile bench sustained report"}
SHAPE=${QGEMM_SHAPE:-512x4096x4096}
RS_SHAPES=${QGEMM_RS_SHAPES:-64x4096x4096,128x4096x4096,512x4096x4096,2048x4096x4096,512x4096x14336}
I8_SHAPES=${QGEMM_I8_SHAPES:-1x4096x4096,1x4096x14336,2x4096x4096,4x4096x4096,8x4096x4096}
Q8_SHAPES=${QGEMM_Q8_SHAPES:-2x4096x4096,4x4096x4096,8x4096x4096,16x4096x4096,32x4096x4096,8x4096x14336}
TUNE_PAIRS=${QGEMM_TUNE_PAIRS:-"w4a16.skinny@8x4096x4096 w8a16.skinny@8x4096x4096 w4a16.skinny@4x4096x4096 w4a16.wgmma_rs@64x4096x4096 w8a16.wgmma_rs@64x4096x4096"}
TUNE_SHAPES=${QGEMM_TUNE_SHAPES:-1x4096x4096,8x4096x4096,1x4096x14336,8x4096x14336,16x4096x4096,32x4096x4096,64x4096x4096}
LOG="$OUT/gpu_check.log"
rc=0
# without a usable GPU every GPU test skips and pytest still exits 0: the script would read PASS
# (QGEMM_CHECK_WITHOUT_GPU=1 runs the steps anyway: tests of the script's own checks use it)
if [ "${QGEMM_CHECK_WITHOUT_GPU:-0}" != 1 ] && ! $PY -c "import sys, qgemm; sys.exit(0 if qgemm.gpu_available() else 1)" 2>/dev/null; then
  echo "gpu_check: needs an NVIDIA GPU: $($PY -c 'import qgemm.runtime as r; print(r.gpu_unavailable_reason())' 2>&1 | tail -1)" >&2
  exit 2
fi
# gguf (ggml's Python package: the GGUF tests and `--gguf`) is not on the device image and the device
# has no network: a wheel carried under out/wheels (`pip download --no-deps gguf -d out/wheels`,
# carry ["out"]) is installed into a private directory, so the GGUF GPU tests run instead of skipping
if ! $PY -c "import gguf" 2>/dev/null; then
  for whl in out/wheels/gguf-*.whl; do
    [ -f "$whl" ] || continue
    $PY -m pip install -q --no-deps --target /tmp/qgemm-gguf "$whl" >/dev/null 2>&1 \
      && export PYTHONPATH="$PYTHONPATH:/tmp/qgemm-gguf" && echo "gguf from $whl" | tee -a "$LOG"
  done
fi
run() { echo "+ $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG"; local r=${PIPESTATUS[0]}; [ "$r" = 0 ] || { echo "!! exit $r: $*" | tee -a "$LOG"; rc=1; }; }
# the same in another source tree, with only that tree's qgemm importable
run_in() { local tree=$1; shift; echo "+ (in $tree) $*" | tee -a "$LOG"; (cd "$tree" && PYTHONPATH="$tree" "$@") 2>&1 | tee -a "$LOG"
           local r=${PIPESTATUS[0]}; [ "$r" = 0 ] || { echo "!! exit $r: $*" | tee -a "$LOG"; rc=1; }; }

for step in $STEPS; do
  case $step in
    info)     run $PY -m qgemm info; run $PY -m qgemm compile --all ;;
    precompile) # every GEMM kernel's untuned configuration at the profile and bench shapes, in parallel
              shapes=$(for k in 4096 14336; do for m in 1 2 4 8 16 32 64 128 256 512 1024 2048 4096; do printf "%sx4096x%s," $m $k; done; done)
              run $PY tools/precompile.py all --defaults-only --shapes "${shapes}$SHAPE" ;;
    tests)    # the whole suite: the CPU tests too (CI runs them without a GPU only; on one, plans and CLI
              # paths differ -- two such tests failed in session 26). One process takes over the 10
              # minutes a device call may run, so several run side by side (NVRTC compiles are CPU-bound;
              # H100, session 27: 4.6 / 8.7 / 4.4 / 2.9 minutes), each with its own log
              PT="$PY -m pytest -q -p no:cacheprovider -rfE --durations=8"
              GEMM_REFS=tests/test_gpu_kernels.py::test_gemm_matches_references
              # (the GEMM references in two: with N = 4097 among their shapes (session 34) one process took
              # 7.9 of the 10 minutes; "4097" names exactly the N = 4097 cases, no M or K is 4097)
              # (the other GPU kernel tests in three: in one process they took 8.3 of the 10 minutes in
              # session 36; the every-configuration sweeps and the tune test took 524 of the step's 585 s
              # in one process in session 54, the wgmma and wgmma_rs configurations >= 238 of them, so
              # those run apart)
              SWEEPS_WGMMA="wgmma_configurations"
              SWEEPS_OTHER="every_candidate_configuration or tune_stores"
              SWEEPS="$SWEEPS_WGMMA or $SWEEPS_OTHER"
              # (and the defaults' tests on large odd shapes apart too: with them the rest of the GPU
              # kernel tests took 565 of the 590 s in session 58, those two 264 s of it; the pattern
              # also takes session 59's test_decode_ladder_defaults_on_wide_weights; session 60's
              # test_decode_q4_0_long_k_splits joins them, and session 61's test_decode_q4_0_short_k_splits
              # and test_decode_q8_0_split_on_four_warps)
              DEFAULTS="fill_the_gpu or defaults_on_wide_weights or long_k_splits or short_k_splits or split_on_four_warps"
              # (the CPU-side rest in two as well: in one process it took 544 of the 585 s on a fresh
              # H100 machine in session 56 -- four of its six slowest tests are the registry / CLI and
              # tool tests -- and 440 + 289 s as two; the longest process of the step then took 528 s)
              REST_CLI="tests/test_cli_registry.py tests/test_tools.py"
              # (and torch.compile apart: the first compile in a process starts dynamo and inductor, about
              # a minute on the H100 in session 64, when the rest process already took 487 s)
              TORCH_T="tests/test_torch_ops.py tests/test_docs_pytorch.py"
              echo "+ tests: 10 pytest processes, logs $OUT/tests-*.log" | tee -a "$LOG"
              $PT $GEMM_REFS -k "not 4097" > "$OUT/tests-gemm.log" 2>&1 & p1=$!
              $PT $GEMM_REFS -k 4097 > "$OUT/tests-gemm-4097.log" 2>&1 & p5=$!
              $PT tests/test_gpu_kernels.py --deselect $GEMM_REFS -k "$SWEEPS_OTHER" > "$OUT/tests-gpu-sweeps.log" 2>&1 & p6=$!
              $PT tests/test_gpu_kernels.py --deselect $GEMM_REFS -k "$SWEEPS_WGMMA" > "$OUT/tests-gpu-sweeps-wgmma.log" 2>&1 & p7=$!
              $PT tests/test_gpu_kernels.py --deselect $GEMM_REFS -k "not ($SWEEPS or $DEFAULTS)" > "$OUT/tests-gpu.log" 2>&1 & p2=$!
              $PT tests/test_gpu_kernels.py --deselect $GEMM_REFS -k "$DEFAULTS" > "$OUT/tests-gpu-defaults.log" 2>&1 & p9=$!
              $PT tests/test_kvcache.py > "$OUT/tests-kvcache.log" 2>&1 & p3=$!
              $PT tests --ignore=tests/test_gpu_kernels.py --ignore=tests/test_kvcache.py $(printf ' --ignore=%s' $REST_CLI $TORCH_T) \
                  > "$OUT/tests-rest.log" 2>&1 & p4=$!
              $PT $REST_CLI > "$OUT/tests-rest-cli.log" 2>&1 & p8=$!
              $PT $TORCH_T > "$OUT/tests-torch.log" 2>&1 & p10=$!
              for p in $p1 $p2 $p3 $p4 $p5 $p6 $p7 $p8 $p9 $p10; do wait $p || rc=1; done
              tail -n 3 "$OUT"/tests-*.log | tee -a "$LOG"
              grep -hE '^(FAILED|ERROR)' "$OUT"/tests-*.log | tee -a "$LOG"
              # one log for both sweeps (a device call brings back at most 8 files)
              { echo; echo "=== wgmma configurations (a process of its own) ==="; cat "$OUT/tests-gpu-sweeps-wgmma.log"; } \
                  >> "$OUT/tests-gpu-sweeps.log" && rm -f "$OUT/tests-gpu-sweeps-wgmma.log"
              { echo; echo "=== $REST_CLI (a process of its own) ==="; cat "$OUT/tests-rest-cli.log"; } \
                  >> "$OUT/tests-rest.log" && rm -f "$OUT/tests-rest-cli.log"
              { echo; echo "=== $TORCH_T (a process of its own) ==="; cat "$OUT/tests-torch.log"; } \
                  >> "$OUT/tests-rest.log" && rm -f "$OUT/tests-torch.log"
              { echo; echo "=== $DEFAULTS (a process of its own) ==="; cat "$OUT/tests-gpu-defaults.log"; } \
                  >> "$OUT/tests-gpu.log" && rm -f "$OUT/tests-gpu-defaults.log" ;;
    skinny)   # the decode / small-batch path: precompile, its GPU tests, tune it (stored, so the bench below uses it)
              run $PY tools/precompile.py w4a16.skinny w8a16.skinny --shapes "1x33x160,9x4097x4128,57x47x32,$TUNE_SHAPES"
              run $PY -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider -k "skinny or packed or matmul"
              for s in ${TUNE_SHAPES//,/ }; do for k in w4a16.skinny w8a16.skinny; do
                  run $PY -m qgemm tune $k --shape $s --iters 10; done; done ;;
    i8)       # the int8 decode kernels (w4a8.skinny, w8a8.skinny) against the fp16 ones: precompile every
              # candidate, their GPU tests, every configuration timed side by side with the fp16 kernel's
              # (nothing stored), then the whole op through qgemm.matmul, default plan vs each path
              run $PY tools/precompile.py w4a8.skinny w8a8.skinny --shapes "1x33x160,3x47x32,8x4097x4128,1x100x14336,2x64x256,$I8_SHAPES"
              run $PY -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider -k "skinny_i8"
              for s in ${I8_SHAPES//,/ }; do for k in w4a8.skinny w8a8.skinny; do
                  run $PY -m qgemm tune $k --shape $s --iters 10 --dry-run; done; done
              run $PY tools/compare_paths.py --shapes "$I8_SHAPES" --repeats 3 \
                  --paths default,w4a16.skinny,w4a8.skinny,w8a16.skinny,w8a8.skinny --json "$OUT/i8_paths.json" ;;
    q8)       # the int8 small-batch kernels on Q8_1 activations (w4a8.skinny_q8_1, w8a8.skinny_q8_1): precompile
              # every candidate, their GPU tests (and the PDL chain), every configuration timed (nothing
              # stored), then the whole op through qgemm.matmul, default plan vs each path
              run $PY tools/precompile.py w4a8.skinny_q8_1 w8a8.skinny_q8_1 quantize.q8_1 quantize.q8_1_f16 \
                  --shapes "1x33x160,3x47x32,8x4097x4128,13x100x14336,32x33x160,27x257x1024,300x1056x1056,$Q8_SHAPES"
              run $PY -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider -k "skinny_q8_1 or chain or packed or overflow"
              for s in ${Q8_SHAPES//,/ }; do for k in w4a8.skinny_q8_1 w8a8.skinny_q8_1; do
                  run $PY -m qgemm tune $k --shape $s --iters 10 --dry-run; done; done
              run $PY tools/compare_paths.py --shapes "$Q8_SHAPES" --repeats 2 \
                  --paths default,w4a8.skinny_q8_1,w8a8.skinny_q8_1 --json "$OUT/q8_paths.json" ;;
    xtypes)   # activation types: the whole op with float32 / float16 / bfloat16 x and the ggml-blocks path
              # float16 x took before session 41 (docs/production.md's table: tools/compare_paths.py
              # --markdown), then, kernel alone, each 16-bit variant's own configuration
              # (registry._x16_config) against its float32 kernel's, and the float32 Q8_0 kernel at
              # 2-4 tokens with the variants' two-token configuration
              XT_SHAPES=${QGEMM_XT_SHAPES:-1x4096x4096,1x4096x4096@cold,1x4096x14336,2x4096x4096,8x4096x4096,16x4096x4096}
              run $PY tools/compare_paths.py --shapes "$XT_SHAPES" --x-dtypes f32,f16,bf16 --paths default,blocks@f16 \
                  --repeats 2 --iters 30 --json "$OUT/xtypes.json" --markdown "$OUT/xtypes.md"
              for x in f16 bf16; do
                  run $PY tools/probe_defines.py w8a16.skinny_$x 2x4096x4096 base f32cfg=@w8a16.skinny --reps 3
                  run $PY tools/probe_defines.py w4a16.skinny_$x 9x4096x4096,12x4096x4096,16x4096x4096 base f32cfg=@w4a16.skinny --reps 3
                  run $PY tools/probe_defines.py w4a8.skinny_$x 1x4096x4096,1x4096x14336 base f32cfg=@w4a8.skinny --reps 3
              done
              run $PY tools/probe_defines.py w8a16.skinny 2x4096x4096,3x4096x4096,4x4096x4096 base "xs=SK_XSMEM=1;SK_UNROLL=1;SK_ACC=1" --reps 3
              run $PY tools/probe_defines.py w8a16.skinny 2x4096x4096 base "xs=SK_XSMEM=1;SK_UNROLL=1;SK_ACC=1" --reps 3 --cold ;;
    pack)     # the weights' repacking on the GPU (pack.q4_0 / pack.q8_0): their GPU tests and the matmul
              # tests around them, then the kernels' speed and matmul on ggml blocks with and without
              # the per-call repacking (tools/repack_probe.py: the rule in qgemm.dispatch)
              run $PY -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_pack.py
              run $PY -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_kernels.py -k "packed or skinny_needs or graph or chain or kperm16"
              run $PY tools/repack_probe.py --json "$OUT/repack.json" ;;
    wquant)   # the weight quantizers (quantize.q4_0 / quantize.q8_0, float32 / float16 / bfloat16 in): their GPU
              # tests byte for byte against ggml's (numpy) quantizer, pack_weights and QuantLinear.from_linear
              # on float weights, their speed on a 14336x4096 weight (cold: against the copy bandwidth), and
              # pack_weights of float weights against numpy's quantizer + pack_weights of the blocks
              run $PY -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_kernels.py -k "quantizer"
              run $PY -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_pack.py -k "float"
              run $PY -m pytest -q -p no:cacheprovider -rfE tests/test_torch_ops.py -k "quantlinear"
              for k in quantize.q4_0 quantize.q4_0_f16 quantize.q4_0_bf16 quantize.q8_0 quantize.q8_0_bf16; do
                run $PY -m qgemm profile $k --shape 14336x1x4096 --cold
              done
              run $PY tools/quant_speed.py --shape 14336x4096 --json "$OUT/quant_speed.json" ;;
    order)    # does a decode row depend on what the sweep ran before it? the bench's per-shape sequence
              # (packed op, ggml-blocks op, torch peers) replayed, then the packed ops alone
              run $PY tools/sweep_order.py --shapes 1x4096x4096,8x4096x4096 --rounds 2 --clocks
              run $PY tools/sweep_order.py --shapes 1x4096x4096,8x4096x4096 --rounds 2 --no-peers --no-blocks --clocks ;;
    tune-dry) # every configuration of kernel@shape pairs timed side by side (nothing stored): do the
              # untuned defaults still hold after the kernels changed?
              for pair in $TUNE_PAIRS; do run $PY tools/precompile.py "${pair%@*}" --shapes "${pair#*@}"; done
              for pair in $TUNE_PAIRS; do run $PY -m qgemm tune "${pair%@*}" --shape "${pair#*@}" --iters 10 --dry-run; done ;;
    rs-tunes) # wgmma_rs's stored tunes (docs/perf/tunes-h100, against which a CPU test checks the defaults):
              # every candidate of both kernels at QGEMM_RS_TUNE_SHAPES (default: the stored shapes; all
              # twenty take ~9.5 min, so give a device call a subset) timed, nothing stored in the cache,
              # one `qgemm tune --json` file each, packed into $OUT/tunes.tgz (a device call brings back
              # at most 8 files), with tools/split_model.py's report of them in $OUT/split_model.md
              shapes=${QGEMM_RS_TUNE_SHAPES:-$(ls docs/perf/tunes-h100/*.json | sed 's|.*/w[48]a16-||; s|[.]json$||' | sort -u | paste -sd,)}
              run $PY tools/precompile.py w4a16.wgmma_rs w8a16.wgmma_rs --shapes "$shapes"
              rm -rf "$OUT/tunes"; mkdir -p "$OUT/tunes"
              for s in ${shapes//,/ }; do for k in w4a16 w8a16; do
                  run $PY -m qgemm tune $k.wgmma_rs --shape "$s" --iters 10 --dry-run --json "$OUT/tunes/$k-$s.json"
              done; done
              run $PY tools/split_model.py "$OUT"/tunes/*.json --markdown "$OUT/split_model.md"
              tar -C "$OUT" -czf "$OUT/tunes.tgz" tunes && rm -rf "$OUT/tunes" ;;
    decode-tunes) # the decode kernels' stored tunes (docs/perf/tunes-h100/decode, KERNEL-SHAPE.json, checked
              # by the same CPU test): each KERNEL@SHAPE of QGEMM_DECODE_TUNE_PAIRS (default: every stored
              # file; all twelve take ~2.5 min) timed as stored -- every candidate, 20 samples, nothing
              # stored in the cache -- into $OUT/tunes-decode.tgz
              pairs=${QGEMM_DECODE_TUNE_PAIRS:-$(ls docs/perf/tunes-h100/decode/*.json | sed 's|.*/||; s|[.]json$||; s|-\([0-9x]*\)$|@\1|' | paste -sd' ')}
              for k in $(printf '%s\n' $pairs | sed 's|@.*||' | sort -u); do
                  run $PY tools/precompile.py "$k" --shapes "$(printf '%s\n' $pairs | sed -n "s|^$k@||p" | paste -sd,)"
              done
              rm -rf "$OUT/decode"; mkdir -p "$OUT/decode"
              for p in $pairs; do
                  run $PY -m qgemm tune "${p%@*}" --shape "${p#*@}" --iters 20 --dry-run --json "$OUT/decode/${p%@*}-${p#*@}.json"
              done
              tar -C "$OUT" -czf "$OUT/tunes-decode.tgz" decode && rm -rf "$OUT/decode" ;;
    rs)       # the Hopper prefill kernels: register-A wgmma (wgmma_rs) against the shared-memory one (wgmma):
              # precompile every candidate, their GPU tests, both timed per shape, then tune wgmma_rs (stored)
              run $PY tools/precompile.py w4a16.wgmma_rs w8a16.wgmma_rs w4a16.wgmma w8a16.wgmma \
                  --shapes "129x4097x4128,7x33x32,300x257x1024,65x1000x2080,513x4097x4096,$RS_SHAPES"
              run $PY -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider -k "wgmma"
              for s in ${RS_SHAPES//,/ }; do
                  run $PY -m qgemm profile w4a16.wgmma w4a16.wgmma_rs w8a16.wgmma w8a16.wgmma_rs w4a16.mma --shape $s --iters 30
              done
              for s in ${RS_SHAPES//,/ }; do for k in w4a16.wgmma_rs w8a16.wgmma_rs; do
                  run $PY -m qgemm tune $k --shape $s --iters 10; done; done ;;
    rs-quick) # the Hopper prefill kernels' GPU tests (every configuration on odd shapes), then a side-by-side
              # timing of the configurations matching QGEMM_RS_ONLY at RS_SHAPES (nothing stored)
              run $PY tools/precompile.py w4a16.wgmma_rs w8a16.wgmma_rs --shapes "129x4097x4128,7x33x32,300x257x1024,65x1000x2080,$RS_SHAPES"
              run $PY -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider -k "wgmma_rs or chain"
              for s in ${RS_SHAPES//,/ }; do for k in w4a16.wgmma_rs w8a16.wgmma_rs; do
                  run $PY -m qgemm tune $k --shape $s --iters 10 --dry-run --only "${QGEMM_RS_ONLY:-RS_SPLITK=1}"; done; done ;;
    l2)       # prefill and L2 -> SM traffic: the register-A wgmma kernel with 1, 2 or 4 warpgroups (64-256
              # weight rows sharing each activation tile) timed side by side, and Nsight Compute's L2
              # throughput for it and for cuBLAS fp16 at the same shapes
              for s in 512x4096x4096 2048x4096x4096; do
                  run $PY -m qgemm tune w4a16.wgmma_rs --shape $s --iters 10 --dry-run --only RS_SPLITK=1,RS_STAGES=4
                  OUT="$OUT" KERNELS="w4a16.wgmma_rs" SHAPE=$s PEERS=$s run bash tools/gpu_ncu.sh; done ;;
    decode)   run $PY -m qgemm bench --m ${QGEMM_DECODE_M:-1,2,4,8,16,32,64} --k 4096,14336 --iters 20 --out "$OUT/decode"
              [ -f "$OUT/decode/bench.json" ] && mv "$OUT/decode/bench.json" "$OUT/bench-decode.json"; rm -rf "$OUT/decode" ;;
    pdl)      # whole op with and without programmatic dependent launch, same process order (hot; the
              # targets' shapes): what the overlap of consecutive ops is worth
              for v in 1 0; do QGEMM_PDL=$v run $PY -m qgemm bench --m 1,8,64,512,2048 --k 4096,14336 --iters 20 \
                  --hot-only --no-peers --out "$OUT/pdl$v"
                  [ -f "$OUT/pdl$v/bench.md" ] && mv "$OUT/pdl$v/bench.md" "$OUT/bench-pdl$v.md"; rm -rf "$OUT/pdl$v"; done ;;
    kvcache)  # the mustafar.* kernels: their GPU tests, then `qgemm bench --suite kvcache` (kvcache.json / .md:
              # docs/perf/kvcache-h100.json and docs/mustafar.md's tables come from it)
              run $PY -m pytest -q -m gpu tests/test_kvcache.py -p no:cacheprovider
              run $PY -m qgemm bench --suite kvcache --iters 10 --out "$OUT/kvcache" ;;
    sanitize) # compute-sanitizer over the GPU tests, several processes side by side, one log each
              # ($OUT/san-TOOL-PART.log): memcheck (out-of-bounds and misaligned accesses; qgemm allocates
              # every array at its exact size, so a read one element past an operand is reported, not
              # served from a neighbour), racecheck (shared-memory hazards between threads), synccheck
              # (barriers under divergence) and initcheck (reads of global memory nothing wrote).
              # QGEMM_SAN_JOBS picks some of TOOL:PART (default: all 43 below, which need three or four
              # 10-minute device calls on an H100: docs/debugging.md has each part's time and the results)
              SAN=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
              if [ ! -x "$SAN" ]; then echo "!! no compute-sanitizer at $SAN (set SANITIZER)" | tee -a "$LOG"; rc=1; continue; fi
              GK=tests/test_gpu_kernels.py
              REFS=$GK::test_gemm_matches_references
              EDU="fp32 or naive or tiled"  # the teaching kernels: slow under a sanitizer at the large shapes
              PATHS="matmul or packed or kperm16 or gemv or quantizer or activation_edges or chain or out_as_raw"
              san_args() {  # the pytest arguments of one part (the GEMM references and the configuration
                # sweeps in several parts: whole, none of them finished in nine minutes under memcheck)
                case $1 in
                  refs-edu)      echo "$REFS -k '($EDU) and not 4097'" ;;
                  refs-prod)     echo "$REFS -k 'not ($EDU) and not 4097'" ;;
                  refs4097-edu)  echo "$REFS -k '($EDU) and 4097'" ;;
                  refs4097-prod) echo "$REFS -k 'not ($EDU) and 4097'" ;;
                  skinny)        echo "$GK -k skinny_every_candidate_configuration" ;;
                  skinny-i8)     echo "$GK -k skinny_i8_every_candidate_configuration" ;;
                  skinny-q8)     echo "$GK -k skinny_q8_1_every_candidate_configuration" ;;
                  wgmma)         echo "$GK -k wgmma_configurations" ;;
                  wgmma-smem)    echo "$GK -k 'wgmma_configurations and not wgmma_rs'" ;;

                  mma)           echo "$GK -k 'mma_configurations and not wgmma'" ;;
                  paths)         echo "$GK --deselect $REFS -k '$PATHS'" ;;
                  kvcache)       echo "-m gpu tests/test_kvcache.py" ;;
                  pack)          echo "tests/test_gpu_pack.py" ;;
                  # cfg-*: tools/sanitize_configs.py, each configuration in its own process under the
                  # sanitizer -- the kernels no test sweeps (the teaching kernels and the 16-bit skinny
                  # variants at their default configuration; every candidate of the mma and GEMV kernels)
                  cfg-wgmma-rs)  echo "w4a16.wgmma_rs w8a16.wgmma_rs --shapes ${QGEMM_SAN_RS_SHAPES:-300x257x1024}" ;;
                  cfg-edu)       echo "fp32.tiled w4a16.tiled w8a16.tiled w4a8.tiled w4a8.dp4a w4a8.tiled_dp4a w4a8.vec_dp4a" \
                                      "w8a8.dp4a w8a8.tiled_dp4a w4a16.skinny_f16 w4a16.skinny_bf16 w8a16.skinny_f16" \
                                      "w8a16.skinny_bf16 w4a8.skinny_f16 w4a8.skinny_bf16 w8a8.skinny_f16 w8a8.skinny_bf16" \
                                      "--shapes 7x200x1024,70x200x1024 --defaults-only" ;;
                  cfg-mma-i8)    echo "w4a8.mma w8a8.mma --shapes 70x200x1024" ;;    # 126 configurations (102 in session 49)
                  cfg-mma-f16)   echo "w4a16.mma w8a16.mma --shapes 70x200x1024" ;;  # 126
                  cfg-gemv)      echo "w4a8.gemv w8a8.gemv --shapes 7x200x1024" ;;
                  *)             return 1 ;;
                esac; }
              # racecheck does not follow two synchronization rules the warp-specialized wgmma_rs relies on
              # (cuda_src/common/wgmma_rs_f16.cuh, RS_SAN_ARRIVALS): its configurations run one per process
              # with the arrivals it can follow (part cfg-wgmma-rs); pytest's racecheck takes the other wgmma kernels
              SWEEP_PARTS="skinny skinny-i8 skinny-q8 mma"
              CFG_PARTS="cfg-edu cfg-mma-i8 cfg-mma-f16 cfg-gemv"
              SAN_JOBS=${QGEMM_SAN_JOBS:-"$(for p in refs-edu refs-prod refs4097-edu refs4097-prod $SWEEP_PARTS wgmma paths kvcache pack $CFG_PARTS; do printf 'memcheck:%s ' $p; done)$(for p in $SWEEP_PARTS wgmma-smem cfg-wgmma-rs paths kvcache pack $CFG_PARTS; do printf 'racecheck:%s ' $p; done)$(for p in $SWEEP_PARTS wgmma paths kvcache pack $CFG_PARTS; do printf 'synccheck:%s ' $p; done)initcheck:paths initcheck:kvcache"}
              pids=(); names=()
              for job in $SAN_JOBS; do
                tool=${job%%:*}; part=${job#*:}
                case $tool in memcheck|racecheck|synccheck|initcheck) ;; *) echo "!! unknown sanitizer tool in $job" | tee -a "$LOG"; rc=1; continue ;; esac
                if ! args=$(san_args "$part"); then echo "!! unknown sanitize part in $job" | tee -a "$LOG"; rc=1; continue; fi
                if [ "${part#cfg-}" != "$part" ]; then  # the tool runs each configuration under the sanitizer itself
                  cmd="$PY tools/sanitize_configs.py $tool $args $([ $part = cfg-wgmma-rs ] && [ $tool = racecheck ] && echo -D RS_SAN_ARRIVALS=1) --sanitizer \"$SAN\" --jobs 6"
                else  # racecheck skips the wgmma_rs kernels some tests launch (the repacking's and matmul's
                      # tests): it cannot follow their production arrivals, and cfg-wgmma-rs checks them
                  cmd="\"$SAN\" --tool $tool $([ $tool = racecheck ] && echo --kernel-name-exclude kns=wgmma_rs) --error-exitcode 86 --print-limit 30 $PY -m pytest -q -p no:cacheprovider -rfE --durations=5 $args"
                fi
                echo "+ $cmd > $OUT/san-$tool-$part.log" | tee -a "$LOG"
                eval "timeout ${QGEMM_SAN_TIMEOUT:-540} $cmd" > "$OUT/san-$tool-$part.log" 2>&1 &
                pids+=($!); names+=("$tool:$part")
              done
              for i in "${!pids[@]}"; do
                wait "${pids[$i]}"; r=$?
                log="$OUT/san-${names[$i]/:/-}.log"
                case $r in 0) why=clean ;; 86) why="sanitizer errors" ;; 124) why="timed out" ;; *) why="failed (see the log)" ;; esac
                # exit 0 but no summary of the sanitizer (or of the tool running it): it checked nothing
                if [ "$r" = 0 ] && ! grep -qE 'ERROR SUMMARY|RACECHECK SUMMARY|clean and correct under' "$log"; then
                  r=1; why="no sanitizer summary in the log"; fi
                echo "== ${names[$i]}: exit $r, $why; $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY|clean and correct under' "$log" | tail -n 1); $(grep -hE '[0-9]+ (passed|failed)' "$log" | tail -n 1)" | tee -a "$LOG"
                [ "$r" = 0 ] || rc=1
              done ;;
    ncu)      OUT="$OUT" KERNELS="w4a16.skinny" SHAPE=8x4096x4096 run bash tools/gpu_ncu.sh
              OUT="$OUT" KERNELS="w4a16.mma" SHAPE=512x4096x4096 run bash tools/gpu_ncu.sh ;;
    validate) run $PY -m qgemm validate --all
              run $PY -m qgemm validate --all --shape 1x4096x4096
              run $PY -m qgemm validate --all --shape 513x4097x4128
              run $PY -m qgemm validate w4a8 w8a8 --shape 1x1x32 --verbose ;;
    map)      # decode on real models' weight matrices, cold, against the copy bandwidth, weakest first
              # (tools/decode_map.py; QGEMM_MAP_ARGS, e.g. "--models llama3-70b --m 9,16 --fmts q4_0")
              run $PY tools/decode_map.py ${QGEMM_MAP_ARGS:-} --markdown "$OUT/decode-map.md" ;;
    host)     # copy host-overhead.json to docs/perf/host-overhead-h100.json (or -h200), then
              # `python tools/host_overhead.py --table ...` gives docs/pytorch.md's table
              run $PY tools/host_overhead.py --json "$OUT/host-overhead.json" ;;
    tutorial) echo "+ qgemm tutorial 1 2 3 4 5 > $OUT/tutorial.log" | tee -a "$LOG"
              $PY -m qgemm tutorial 1 2 3 4 5 > "$OUT/tutorial.log" 2>&1 || { echo "!! tutorial failed" | tee -a "$LOG"; rc=1; } ;;
    profile)  run $PY -m qgemm profile --all --shape "$SHAPE" --json "$OUT/profile-hot.json"
              run $PY -m qgemm profile --all --shape "$SHAPE" --cold --no-peers --json "$OUT/profile-cold.json" ;;
    bench)    run $PY -m qgemm bench --out "$OUT/bench" --iters 20 --clocks
              for f in bench.json bench-hot.png bench-cold.png; do [ -f "$OUT/bench/$f" ] && mv "$OUT/bench/$f" "$OUT/$f"; done
              rm -rf "$OUT/bench" ;;  # bench.md is folded into performance.md (the device returns 8 files at most)
    sustained) # the issue's target shapes, every timing (qgemm's and torch's) back to back for >= 1 s, as
              # llama.cpp's perf mode measures its figures: the L2's steady state, the clock at the power limit
              run $PY -m qgemm bench --m 1,8,64,512,2048 --k 4096,14336 --hot-only --clocks --iters 20 --sustain 1 \
                  --out "$OUT/sustained"
              [ -f "$OUT/sustained/bench.json" ] && mv "$OUT/sustained/bench.json" "$OUT/bench-sustained.json"
              rm -rf "$OUT/sustained" ;;
    report)   # the bench sections from this run's JSON where the bench steps ran (perf_report refuses a missing file)
              sust=(); [ -f "$OUT/bench-sustained.json" ] && sust=(--sustained-bench "$OUT/bench-sustained.json")
              bnch=(); [ -f "$OUT/bench.json" ] && bnch=(--bench "$OUT/bench.json")
              run $PY tools/perf_report.py "$OUT/profile-hot.json" "$OUT/profile-cold.json" ${bnch[@]+"${bnch[@]}"} \
                  ${sust[@]+"${sust[@]}"} --notes docs/performance-notes.md -o "$OUT/performance.md" ;;
    ab)       # what a change of the defaults does to the whole op, prologue included: the tree in
              # QGEMM_AB_OLD against this one at QGEMM_AB_SHAPES, each timed twice, alternating, in this
              # one process pair (drift shows as a cell's range; session 52's and 53's rules were adopted so)
              old=${QGEMM_AB_OLD:-}; shapes=${QGEMM_AB_SHAPES:-}
              if [ -z "$old" ] || [ ! -f "$old/qgemm/__init__.py" ] || [ ! -f "$old/tools/compare_paths.py" ]; then
                  echo "!! step ab needs QGEMM_AB_OLD: a source tree with qgemm/ and tools/compare_paths.py (got '${old}')" | tee -a "$LOG"; rc=1; continue
              fi
              [ -n "$shapes" ] || { echo "!! step ab needs QGEMM_AB_SHAPES (MxNxK[@cold],...)" | tee -a "$LOG"; rc=1; continue; }
              old=$(cd "$old" && pwd)
              for tree in "$old" "$PWD"; do run_in "$tree" $PY tools/precompile.py all --defaults-only --shapes "${shapes//@cold/}"; done
              for r in 1 2; do for side in old new; do
                  tree=$([ $side = old ] && echo "$old" || echo "$PWD")
                  run_in "$tree" $PY tools/compare_paths.py --shapes "$shapes" --x-dtypes "${QGEMM_AB_X:-f32}" \
                      --fmts "${QGEMM_AB_FMTS:-q4_0,q8_0}" --repeats 1 \
                      --json "$OUT/ab-$side-$r.json"
              done; done
              run $PY tools/ab_report.py --old "$OUT/ab-old-1.json,$OUT/ab-old-2.json" --new "$OUT/ab-new-1.json,$OUT/ab-new-2.json" \
                  --markdown "$OUT/ab.md" ;;
    *) echo "unknown step $step" | tee -a "$LOG"; rc=1 ;;
  esac
done
echo "gpu_check: $([ $rc = 0 ] && echo PASS || echo FAIL)" | tee -a "$LOG"
exit $rc
