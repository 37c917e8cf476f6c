#!/usr/bin/env bash
# GPU check of the Mustafar sparse KV-cache kernels (mustafar.*): their GPU tests, `qgemm validate`
# on odd shapes, `qgemm profile` at decode size (cold), and `qgemm bench --suite kvcache`
# (QGEMM_KV_BENCH=quick|full|none). Logs and JSON under $OUT; a compact summary on stdout.
# QGEMM_KV_STEPS picks the steps (default "compile tests validate profile bench"; also "ab": the
# kernels of the source tree QGEMM_KV_OLD_SRC against this one, tools/kv_probe.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu_check_kvcache}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export QGEMM_CACHE_DIR=${QGEMM_CACHE_DIR:-/tmp/qc}
PY=${PYTHON:-python3}
BENCH=${QGEMM_KV_BENCH:-quick}
STEPS=${QGEMM_KV_STEPS:-"compile tests validate profile bench"}
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
rc=0
# a misspelt step or setting would otherwise run nothing and still say PASS
for s in $STEPS; do
  case $s in compile|tests|validate|profile|ab|bench) ;; *) echo "!! unknown step $s (compile tests validate profile ab bench)"; rc=1 ;; esac
done
case $BENCH in quick|full|none) ;; *) echo "!! QGEMM_KV_BENCH must be quick, full or none, got $BENCH"; rc=1 ;; esac
if has ab && [ -z "${QGEMM_KV_OLD_SRC:-}" ]; then echo "!! step ab needs QGEMM_KV_OLD_SRC (an older cuda_src tree)"; rc=1; fi
[ $rc = 0 ] || { echo "gpu_check_kvcache: FAIL"; exit 1; }
# without a usable GPU every GPU test skips and pytest still exits 0: the script would read PASS
if ! $PY -c "import sys, qgemm; sys.exit(0 if qgemm.gpu_available() else 1)" 2>/dev/null; then
  echo "gpu_check_kvcache: needs an NVIDIA GPU: $($PY -c 'import qgemm.runtime as r; print(r.gpu_unavailable_reason())' 2>&1 | tail -1)" >&2
  exit 2
fi
step() { local name=$1 lim=$2; shift 2; echo "== $name"; timeout "$lim" "$@" > "$OUT/$name.log" 2>&1; local r=$?; [ $r = 0 ] || { echo "!! $name exit $r"; rc=1; }; return $r; }

nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null | head -1
# compile the configurations the tests, validate, profile and bench use, in parallel (NVRTC only;
# version-2 windows are sized from the data, so the plans come from caches like theirs)
has compile && step compile 80 $PY - <<'PY'
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import qgemm
from qgemm import kvcache as kv
rng = np.random.default_rng(0)
cases = [(3, 333, d, 0.7, r) for d in (64, 128, 256) for r in (1, 4, 8, 32)] + \
        [(2, s, 128, sp, r) for s in (65, 4097) for sp, r in ((0.5, 4), (0.0, 33))] + \
        [(5, 1031, 128, 0.7, 32), (4, 4096, 128, 0.7, 4), (4, 4096, 128, 0.5, 4), (4, 4096, 128, 0.7, 32)]
jobs = set()
for b, s, d, sp, rows in cases:
    x = kv.prune(rng.standard_normal((b, s, d), dtype=np.float32).astype(np.float16), sp)
    for name in qgemm.list("mustafar"):
        runner = qgemm.get(name).spec.runner
        ck = kv._compress(x, runner.kind, runner.bits, None, runner.compact)
        p = kv.plan_for(runner.kind, runner.bits, ck.shape, rows, 132, kv.step_bytes_max(ck),
                       density=kv.density(ck))
        jobs.add((name, tuple(sorted(p.defines.items()))))
def go(j):
    qgemm.get(j[0]).compile("sm_90", dict(j[1]))
jobs = sorted(jobs)
go(jobs[0])  # imports cuda.core once, outside the threads
with ThreadPoolExecutor(16) as ex:
    list(ex.map(go, jobs[1:]))
print(len(jobs), "configurations compiled")
PY
has compile && tail -1 "$OUT/compile.log"

has tests && step tests ${QGEMM_KV_TESTS_LIMIT:-110} $PY -m pytest -q -m gpu tests/test_kvcache.py -p no:cacheprovider --maxfail=15
has tests && { tail -3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -20; }

has validate && step validate 25 $PY -m qgemm validate mustafar --shape 5x1031x128 --lq 8 --groups 4 --json "$OUT/validate.json"
has validate && grep -E "mustafar|FAIL" "$OUT/validate.log" | awk '{print $1, $2, $4, $6, $NF}' | head -12

has profile && step profile ${QGEMM_KV_PROFILE_LIMIT:-120} $PY -m qgemm profile ${QGEMM_KV_PROFILE:-mustafar} --shape 32x16384x128 --cold --json "$OUT/profile-16k-cold.json"
has profile && grep -E "mustafar|bandwidth" "$OUT/profile.log" | cut -c1-200

# side by side (tools/kv_probe.py, cold, checked), when QGEMM_KV_OLD_SRC names an older cuda_src
# tree: every 4/2-bit and fp16 kernel on that tree against this one
AB_SHAPE=${QGEMM_KV_AB_SHAPE:-32x16384x128}
AB_KERNELS=${QGEMM_KV_AB_KERNELS:-mustafar.key_q2,mustafar.key_q4,mustafar.key_q2c,mustafar.key_fp16,mustafar.value_q2,mustafar.value_q4,mustafar.value_q2c}
if has ab && [ -n "${QGEMM_KV_OLD_SRC:-}" ]; then
  for tree in old new; do
    src=$([ $tree = old ] && echo "$QGEMM_KV_OLD_SRC" || echo "$PWD/cuda_src")
    step ab-$tree 150 env QGEMM_CUDA_SRC="$src" $PY tools/kv_probe.py "$AB_KERNELS" "$AB_SHAPE" $tree --reps 3
    grep mustafar "$OUT/ab-$tree.log" | cut -c1-80
  done
fi

if has bench && [ "$BENCH" != none ]; then
  step bench ${QGEMM_KV_BENCH_LIMIT:-60} $PY -m qgemm bench --suite kvcache $([ "$BENCH" = quick ] && echo --quick) --iters 10 --out "$OUT/bench"
  grep -E "^- |MET" "$OUT/bench.log" | head -12
  grep -E "^(key|value) " "$OUT/bench.log" | sed 's/  */ /g' | cut -c1-170 | head -130
fi
echo "gpu_check_kvcache: $([ $rc = 0 ] && echo PASS || echo FAIL)"
exit $rc
