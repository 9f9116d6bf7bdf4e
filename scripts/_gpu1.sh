#!/usr/bin/env bash
set -u -o pipefail
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== GPU tests under the sanitizer"
TORCH_CUDA_SANITIZER=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fsembed/test_prioritized_gpu.py tests/fsdata/test_device_copy_gpu.py 2>&1 | tail -6
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/pipelines/test_model.py tests/fsembed/test_swap.py tests/pipelines/test_dense_sync.py tests/fscomm/test_host_gpu.py 2>&1 | tail -3
echo "== bench e2e sync,sdd,freescale x2"
timeout 330 python3 -m pipelines.cli bench e2e --device cuda --nproc 2 --model small --uih-cap 4096 --batch-size 16 \
  --modes sync,sdd,freescale --repeats 2 --json "$OUT/e2e_sched.json" 2>&1 | grep -v "^\[bench" | tail -22
