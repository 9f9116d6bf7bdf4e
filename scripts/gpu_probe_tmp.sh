set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests: kernel vs twin, odd lengths, ms timestamps; compiled model vs eager"
FREESCALE_HSTU_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/kernels/test_hstu_attention_gpu.py 2>&1 | tail -25
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/pipelines/test_hstu_model.py -k "triton or compiled" 2>&1 | tail -25
echo "== bench hstu-step"
timeout 330 python3 -m benchmarks hstu-step --device cuda --preset hstu-large --batch-size 32 --rab on,off --compile off,on \
  --breakdown --reps 10 --warmup 3 --json "$OUT/hstu_step.json" 2>&1 | grep -v Warning | tail -30
