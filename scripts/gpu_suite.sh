#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md in one call on a lent H200 (torch 2.11, no torchdata/torchrec: the torchdata
# wheel travels in .whl/). Writes everything under $OUT (default ./out/gpu). Usage: bash scripts/gpu_suite.sh
set -u
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== 1. freescale train on CUDA, 1 rank under torchrun (the GPU machine's torch)"
timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m pipelines.train --device cuda \
  --steps 20 --mode freescale --no-progress --summary-json "$OUT/train_cuda.json" 2>&1 | tail -12

echo "== 2. bench e2e: 2 ranks sharing the H200 over the host transport"
timeout 230 python3 -m pipelines.cli bench e2e --device cuda --nproc 2 --steps 16 --model small --uih-cap 4096 \
  --batch-size 16 --modes sync,sdd,freescale,replicated --json "$OUT/e2e_gpu.json" 2>&1 | grep -v "^\[bench" | tail -14

echo "== 3. replay simulation (real forward+backward timings of the reference model on this GPU)"
timeout 280 python3 -m pipelines.replay --device cuda --replay-kernel padded,jagged --replay-jitter residual,repeat \
  --replay-ranks 64,256 --batch-size 128 --max-uih 21000 --partitioner none,fbs,vbs,kk --steps 30 --warmup 10 \
  --replay-timings 400 --replay-time-budget 60 --json "$OUT/replay_h200.json" 2>&1 | tail -40
