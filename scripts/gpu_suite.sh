#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md (torch with CUDA; where torchdata is not installed, its wheel may travel in .whl/,
# see docs/tuning.md). The suite comes in parts of at most about ten minutes each:
#   bash scripts/gpu_suite.sh check      # GPU tests under TORCH_CUDA_SANITIZER=1 + the kernels bench (~5 min)
#   bash scripts/gpu_suite.sh e2e        # bench embedding + bench e2e, 2 ranks sharing the GPU (~6 min)
#   bash scripts/gpu_suite.sh replay     # the replay simulation on whole local batches of the jagged model (~2.5 min)
#   bash scripts/gpu_suite.sh trace      # light and heavy case traces of sync and freescale, split by phase and thread (~2 min)
#   bash scripts/gpu_suite.sh pairs      # sync and freescale, 4 interleaved paired runs per case: the spread of the ratios (~5 min)
#   bash scripts/gpu_suite.sh allreduce  # heavy case, --dense-sync.allreduce-start compute against backward, 2 interleaved pairs each (~3 min)
#   bash scripts/gpu_suite.sh stalls     # heavy freescale twice with per-step records: the steps that stall, beside
#                                        # their GC pauses and pinned allocations (~1.5 min)
#   bash scripts/gpu_suite.sh transport  # host paths' GPU tests, bench transport tcp vs shm, a jagged training run (~6 min)
#   bash scripts/gpu_suite.sh exclusive  # heavy case, --embeddings.exclusive-start backward against forward, 3 interleaved pairs each,
#                                        # with every step's exposed parts (~4 min)
#   bash scripts/gpu_suite.sh attention  # varlen and FlexAttention against the per-sample twin and the jagged model against
#                                        # the padded one on CUDA, then bench attention (~4 min, most of it compiling)
#   bash scripts/gpu_suite.sh hstu       # the HSTU attention's GPU tests, then bench hstu at dim 64 beside generative-
#                                        # recommenders' kernel from $HSTU_REFERENCE (default .ref/genrec_hstu) (~6 min)
#   bash scripts/gpu_suite.sh hstu-dims  # bench hstu at head dims 128 and 256 (~4 min)
#   bash scripts/gpu_suite.sh hstu-replay  # the memory probe's GPU test, then the replay simulation at 64 and 256 ranks
#                                          # on whole local batches of the HSTU model (hstu-large), with the noise floor (~6 min)
#   bash scripts/gpu_suite.sh hstu-e2e   # bench e2e heavy (twice: NE run to run) and light on the HSTU model (hstu-large), sync
#                                        # vs freescale, 2 ranks sharing the GPU; then a job with --memory-budget auto (~8 min)
#   bash scripts/gpu_suite.sh hstu-step  # the HSTU model's training step, hstu-large, B=32, rab on/off, the residual
#                                        # stream in fp32 and bf16, the item table by rows and dense: TFLOP/s, MFU,
#                                        # time by part (~4 min)
#   bash scripts/gpu_suite.sh hstu-tiles # the attention's launch configurations at head dim 256, shape c, rab off with
#                                        # dK/dV candidates beyond the table, then rab on (~6 min)
#   bash scripts/gpu_suite.sh deterministic  # freescale = sync bit for bit in --deterministic, end to end, softmax and HSTU models (~6 min)
#   bash scripts/gpu_suite.sh long       # bench e2e on long histories (cap 16,384), sync vs freescale, paired (~5 min)
# Everything is written under $OUT (default ./out/gpu).
set -u -o pipefail
PART=${1:?usage: bash scripts/gpu_suite.sh check|hstu|hstu-dims|hstu-step|hstu-tiles|hstu-replay|hstu-e2e|e2e|replay|trace|pairs|allreduce|stalls|exclusive|attention|deterministic|long|transport}
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# heavy_ab TABLE.KNOB "VALUES" REPEATS: the heavy case's sync and freescale under each value of --TABLE.KNOB,
# interleaved; the JSON files are named by the knob's first word (allreduce_backward_r1.json)
heavy_ab() {
  local name=${1#*.}
  for rep in $(seq "$3"); do
    for value in $2; do
      timeout 120 python3 -m benchmarks e2e --device cuda --nproc 2 --model small --uih-cap 4096 --batch-size 16 \
        --cases heavy --modes sync,freescale "--$1" "$value" --json "$OUT/${name%%-*}_${value}_r$rep.json" 2>&1 \
        | grep -E "^heavy|^stalled" | sed "s/^/$value /"
    done
  done
}

case "$PART" in
  check)
    echo "== GPU tests (prioritized vs sync on CUDA under the stream sanitizer; the host transport on CUDA)"
    TORCH_CUDA_SANITIZER=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/fsembed/test_prioritized_gpu.py tests/fsdata/test_device_copy_gpu.py 2>&1 | tail -15
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/fsembed/test_optim.py 2>&1 | tail -3
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/fscomm/test_host_gpu.py 2>&1 | tail -5
    echo "== no device sync in the model's forward nor in the embedding hub's id check; the dense block through pinned memory"
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/pipelines/test_model.py tests/fsembed/test_swap.py tests/pipelines/test_dense_sync.py 2>&1 | tail -3
    echo "== bench kernels"
    timeout 330 python3 -m benchmarks kernels --device cuda --world-sizes 8,32,128,512 --json "$OUT/kernels.json" 2>&1 | tail -36
    ;;
  e2e)
    echo "== bench embedding: exposed embedding communication, sync vs prioritized"
    timeout 150 python3 -m benchmarks embedding --nproc 2 --device cuda --max-uih 2048 --batch-size 64 --dim 128 \
      --compute-ms 30 --steps 5 --warmup 3 --collisions 0,0.05,0.2 --json "$OUT/embedding_gpu.json" 2>&1 | tail -9
    echo "== bench e2e: every mode, 2 ranks sharing the GPU over the host transport"
    timeout 400 python3 -m benchmarks e2e --device cuda --nproc 2 --steps 45 --model small --uih-cap 4096 \
      --batch-size 16 --modes sync,sdd,semisync,freescale,replicated --json "$OUT/e2e_gpu.json" 2>&1 | grep -v "^\[bench" | tail -14
    ;;
  replay)
    echo "== replay simulation: whole local batches of the partitioners' plans, timed on this GPU"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 370 python3 -m benchmarks replay --device cuda \
      --replay-kernel jagged --replay-jitter repeat --replay-ranks 64,256 --batch-size 128 --max-uih 21000 \
      --partitioner none,fbs,kk --steps 30 --warmup 10 --replay-timing-ranks 64 --replay-timings 300 \
      --replay-repeats 3 --replay-time-budget 120 --replay-mem-gib 110 --json "$OUT/replay.json" 2>&1 | grep -v "^replay timing" | tail -50
    ;;
  trace)
    echo "== traces: 24 steps per run (15 of warm-up and schedule probe), 5 profiled, then each rank's step split by phase and thread"
    timeout 300 python3 -m benchmarks e2e --device cuda --nproc 2 --steps 24 --model small --uih-cap 4096 \
      --batch-size 16 --modes sync,freescale --trace "$OUT/traces" --json "$OUT/traces_e2e.json" 2>&1 | grep -v "^\[bench" | tail -6
    python3 -m pipelines.cli trace "$OUT"/traces/*.rank*.json --json "$OUT/traces.json"
    echo "== the profiled steps (15-19), each with its bubbles and exposed parts, to find a congested one in the traces"
    python3 - "$OUT/traces_e2e.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    for i in range(15, min(20, len(r["bubbles_ms"]))):
        parts = {k: round(v[i], 2) for k, v in r["exposed_per_step_ms"].items() if v[i] and v[i] > 0.05}
        print(f"  {r['case']} {r['mode']} step {i}: {r['step_times_ms'][i]:.1f} ms, bubbles {r['bubbles_ms'][i]:.2f} ms {parts}")
PY
    gzip -f "$OUT"/traces/*.json
    ;;
  pairs)
    echo "== bench e2e: sync and freescale, 4 interleaved paired runs per case (45 steps: 15 of warm-up and schedule probe, the last left out)"
    timeout 540 python3 -m benchmarks e2e --device cuda --nproc 2 --steps 45 --model small --uih-cap 4096 \
      --batch-size 16 --modes sync,freescale --repeats 4 --json "$OUT/e2e_pairs.json" 2>&1 | grep -v "^\[bench" | tail -40
    ;;
  allreduce)
    echo "== bench e2e, heavy case: the dense all-reduce's last bucket launched after the host saw the backward end, or at once"
    heavy_ab dense-sync.allreduce-start "compute backward" 2
    ;;
  stalls)
    echo "== heavy freescale, per-step records: steps with over 5 ms of bubbles, and what else happened in them"
    for run in 1 2; do
      timeout 120 python3 -m pipelines.cli train --device cuda --nproc 2 --steps 45 --model small --preset kuairand-1k \
        --uih-cap 4096 --max-uih 4096 --batch-size 16 --num-samples 1000000 --no-progress --warmup-steps 15 \
        --metrics-jsonl "$OUT/stalls_$run.jsonl" 2>&1 | tail -3
      python3 - "$OUT/stalls_$run.jsonl" <<'PY'
import json, sys
from pipelines.job.run.accounting import stall_clues as _stall_clues
rows = [json.loads(line) for line in open(sys.argv[1])]
clues = _stall_clues(rows)
for i, r in enumerate(rows):
    if i and r["bubble_s"] > 5e-3:
        grew = {k: clues[k][i] for k in ("new_relay_blocks", "new_pinned_blocks") if clues[k] is not None}
        print(f"  step {r['step']:>2} {r.get('schedule')}: bubbles {1e3 * r['bubble_s']:.1f} ms, gc {1e3 * r['gc_s']:.1f} ms, "
              f"new pinned blocks {grew}, exposed " + str({k: round(1e3 * v, 1) for k, v in r["exposed_s"].items() if v and v > 1e-3}))
PY
    done
    ;;
  exclusive)
    echo "== bench e2e, heavy case: the deferred exclusive gradients sent at the backward or with the next forward"
    heavy_ab embeddings.exclusive-start "backward forward" 3
    ;;
  attention)
    echo "== GPU tests: varlen and FlexAttention against the per-sample twin, empty keys, reproducible backward; the model"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_attention_gpu.py tests/pipelines/test_model.py 2>&1 | tail -15
    echo "== bench attention: varlen, FlexAttention (and both in the deterministic mode) against padded SDPA, fwd+bwd, bf16"
    timeout 300 python3 -W ignore -m benchmarks attention --device cuda --json "$OUT/attention.json" 2>&1 \
      | tee "$OUT/attention.log" | grep -v "^ \|^Traceback" | tail -40
    ;;
  hstu)
    echo "== GPU tests: the Triton HSTU attention against its twin (bf16/fp32, dims 64-256, rab, targets, window), repro"
    FREESCALE_HSTU_AUTOTUNE=0 timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=line -rf tests/kernels/test_hstu_attention_gpu.py 2>&1 | tail -12
    echo "== generative-recommenders' Triton HSTU attention (the outside baseline), shapes a, b, c at dim 64"
    REF=${HSTU_REFERENCE:-.ref/genrec_hstu}
    if [ -f "$REF/bench_hstu.py" ]; then
      OUT_ABS=$(cd "$OUT" && pwd)
      (cd "$REF" && PYTHONPATH=. timeout 300 python3 bench_hstu.py --dims 64 --skip-ref-timing --out "$OUT_ABS/genrec64.json" 2>&1 | tail -12)
    else
      echo "no reference at $REF (copy ../shared/reference/genrec_hstu there): the table has no reference columns"
    fi
    echo "== bench hstu: ours (rab off, on) and the padded twin at dim 64, against the reference"
    timeout 300 python3 -m benchmarks hstu --dims 64 --reference "$OUT/genrec64.json" --json "$OUT/hstu64.json" 2>&1 | tail -30
    ;;
  hstu-dims)
    echo "== bench hstu: head dims 128 and 256 (the reference stops with an illegal memory access at 128: not run)"
    timeout 420 python3 -m benchmarks hstu --dims 128,256 --variants triton,triton-rab --json "$OUT/hstu_dims.json" 2>&1 | tail -20
    ;;
  hstu-step)
    echo "== GPU test: fsembed's fused row update (the step's item table) against its torch twin"
    timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/fsembed/test_optim.py 2>&1 | tail -2
    echo "== bench hstu-step: BENCHMARKS.md's table (hstu-large, B=32, Zipf(1.2) lengths to 4,096, 1-8 candidates), rab off/on, where the time goes"
    FLAGS="hstu-step --device cuda --preset hstu-large --batch-size 32 --compile on --reps 6 --warmup 2"
    timeout 250 python3 -m benchmarks $FLAGS --rab off,on --breakdown --gaps 6 --json "$OUT/hstu_step_default.json" 2>&1 | grep -v Warn | tail -70
    echo "== the same steps with the residual stream in bf16 (--residual bf16)"
    timeout 200 python3 -m benchmarks $FLAGS --rab off,on --breakdown --residual bf16 --json "$OUT/hstu_step_residual_bf16.json" 2>&1 | grep -v Warn | tail -40
    echo "== the same step, rab off, the whole item table under dense Adam (--table-update dense)"
    timeout 100 python3 -m benchmarks $FLAGS --rab off --table-update dense --json "$OUT/hstu_step_dense_table.json" 2>&1 | grep -v Warn | tail -4
    ;;
  hstu-tiles)
    echo "== the forward's and the dK/dV pass's launch configurations at head dim 256, shape c, rab off, deterministic mode"
    timeout 300 python3 scripts/tune_kernels.py --hstu-dim 256 --hstu-shapes c --hstu-try dkdv:32x64x8x3 \
      --hstu-try dkdv:64x64x4x2 --hstu-try dkdv:128x64x8x1 --hstu-try dkdv:16x64x4x3 2>&1 | grep -v Warn
    echo "== the same, rab on"
    timeout 200 python3 scripts/tune_kernels.py --hstu-dim 256 --hstu-shapes c --hstu-variant triton-rab 2>&1 | grep -v Warn
    ;;
  hstu-replay)
    echo "== GPU test: --memory-budget auto's probe on the HSTU model predicts a 16-copy batch's peak"
    FREESCALE_HSTU_AUTOTUNE=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/pipelines/test_memory_probe.py 2>&1 | tail -3
    echo "== replay simulation on the HSTU model (hstu-large: d=1024, 8 layers, 4 heads of 256), cap 4,096, B=32"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 400 python3 -m benchmarks replay --device cuda \
      --replay-model-preset hstu-large --replay-jitter repeat --replay-ranks 64,256 --batch-size 32 --max-uih 4096 \
      --partitioner none,fbs,kk --steps 20 --warmup 5 --replay-timing-ranks 64 --replay-timings 150 \
      --replay-repeats 2 --replay-time-budget 80 --replay-mem-gib 110 --json "$OUT/replay_hstu.json" 2>&1 | grep -v "^replay timing" | tail -20
    ;;
  hstu-e2e)
    echo "== bench e2e on the HSTU model (hstu-large): heavy twice (NE run to run), light once; 2 ranks sharing the GPU"
    timeout 220 python3 -m benchmarks e2e --device cuda --nproc 2 --steps 20 --model hstu-large --uih-cap 4096 \
      --batch-size 16 --cases heavy --modes sync,freescale --repeats 2 --json "$OUT/e2e_hstu_heavy.json" 2>&1 | grep -v "^\[bench" | tail -10
    timeout 150 python3 -m benchmarks e2e --device cuda --nproc 2 --steps 30 --model hstu-large --uih-cap 4096 \
      --batch-size 16 --cases light --modes sync,freescale --json "$OUT/e2e_hstu_light.json" 2>&1 | grep -v "^\[bench" | tail -6
    echo "== freescale train --model hstu-large --memory-budget auto: the budget's memory model probed on the HSTU model"
    timeout 150 python3 -m pipelines.cli train --device cuda --nproc 2 --steps 12 --model hstu-large --preset kuairand-1k \
      --uih-cap 4096 --max-uih 4096 --batch-size 16 --num-samples 1000000 --memory-budget auto --no-progress \
      --summary-json "$OUT/train_hstu_auto.json" 2>&1 | tee "$OUT/train_hstu_auto.log" | grep -E "^\[freescale\] --memory-budget|Error"
    tail -4 "$OUT/train_hstu_auto.log"
    ;;
  deterministic)
    echo "== the deterministic mode end to end, softmax and HSTU models: freescale = sync bit for bit without the balancer, and run to run"
    timeout 540 python3 -m pytest -q -p no:cacheprovider tests/pipelines/test_deterministic_gpu.py 2>&1 | tail -8
    ;;
  long)
    echo "== bench e2e, long histories (cap 16,384, small model): sync and freescale, 2 interleaved paired runs"
    timeout 400 python3 -m benchmarks e2e --device cuda --nproc 2 --steps 30 --cases long --modes sync,freescale \
      --repeats 2 --json "$OUT/e2e_long.json" 2>&1 | grep -v "^\[bench" | tail -20
    ;;
  transport)
    echo "== GPU tests: the host paths (shared memory, TCP) with a GPU rank; the device copy of loader items"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/fscomm/test_shm_gpu.py tests/fscomm/test_host_gpu.py tests/fsdata/test_device_copy_gpu.py 2>&1 | tail -5
    echo "== bench transport: a GPU rank and a CPU peer, host-tcp against host-shm, beside the copy floor (D2H + H2D)"
    timeout 150 python3 -m benchmarks transport --device cuda --nproc 2 --sizes 4194304,33554432 --backends host-tcp,host-shm \
      --reps 10 --pairs 7 --timeout 60 --json "$OUT/transport_gpu.json" 2>&1 | grep -v "^\[bench" | tail -30
    echo "== the softmax model (jagged attention, plans from the loader) trains on the GPU: 2 ranks sharing it"
    timeout 150 python3 -m pipelines.cli train --device cuda --nproc 2 --steps 12 --model small --uih-cap 4096 --batch-size 16 \
      --no-progress --summary-json "$OUT/train_gpu.json" 2>&1 | tail -12
    ;;
  *)
    echo "unknown part $PART: choose check, hstu, hstu-dims, hstu-step, hstu-tiles, hstu-replay, hstu-e2e, e2e, replay, trace, pairs, allreduce, stalls, exclusive, attention, deterministic, long or transport" >&2; exit 2
    ;;
esac
