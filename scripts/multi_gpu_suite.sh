#!/usr/bin/env bash
# The multi-GPU figures on one host with several GPUs (H200s; the GPU count comes from `nvidia-smi -L`). The suite
# comes in parts of at most ten minutes each; `plan` prints the parts for this host:
#   bash scripts/multi_gpu_suite.sh plan                 # the parts to run here, in order, each under 10 minutes
#   bash scripts/multi_gpu_suite.sh check                # GPU tests of the peer transport + bench peer on 2 ranks (~3 min)
#   bash scripts/multi_gpu_suite.sh transport NPROC      # on NPROC GPUs: bench transport (host, nccl, nccl-ce, and peer
#                                                        # once registered) latency/bandwidth/compute slowdown, and
#                                                        # bench peer against plain peer copies (~5 min)
#   bash scripts/multi_gpu_suite.sh scaling NPROC CASE   # bench e2e on NPROC GPUs (one rank each), CASE heavy|light,
#                                                        # modes sync,sdd,freescale (~4-8 min)
#   bash scripts/multi_gpu_suite.sh replay               # the replay simulation at 8 ranks (and at the GPU count) on
#                                                        # the heavy case's workload, for the cross-check (~6 min)
#   bash scripts/multi_gpu_suite.sh table                # the scaling table and the replay cross-check from the JSON
#                                                        # written by the parts above (CPU only, seconds)
# --dry-run (first argument) prints the commands instead of running them; NGPUS=N stands in for nvidia-smi.
# Everything is written under $OUT (default ./out/multi_gpu). Environment knobs: E2E_FLAGS (the e2e workload,
# default the 2-GPU tables' "--model small --uih-cap 4096 --batch-size 16"), E2E_STEPS (45), REPEATS (1),
# E2E_TRANSPORT (bench e2e's --transport; default: peer where it is registered and bench e2e takes the flag).
set -u -o pipefail
usage="usage: bash scripts/multi_gpu_suite.sh [--dry-run] plan|check|transport NPROC|scaling NPROC heavy|light|replay|table"
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
PART=${1:-}
[ -n "$PART" ] || { echo "$usage" >&2; exit 2; }
OUT=${OUT:-out/multi_gpu}
PY=${PYTHON:-python3}
E2E_FLAGS=${E2E_FLAGS:---model small --uih-cap 4096 --batch-size 16}
E2E_STEPS=${E2E_STEPS:-45}
REPEATS=${REPEATS:-1}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

fail() { echo "multi_gpu_suite: $*" >&2; exit 2; }

# the GPU count: NGPUS, else nvidia-smi's list
if [ -n "${NGPUS:-}" ]; then
  case "$NGPUS" in ''|*[!0-9]*) fail "NGPUS must be a whole number, got '$NGPUS'";; esac
else
  command -v nvidia-smi >/dev/null 2>&1 || fail "no nvidia-smi here and no NGPUS given: cannot count the GPUs"
  NGPUS=$(nvidia-smi -L | grep -c '^GPU ')
fi
[ "$NGPUS" -ge 1 ] || fail "no GPU found (nvidia-smi -L lists none)"

# GPU counts of the scaling table: 1, 2, 4, 8 up to the host's count, and the count itself
counts() {
  local n=1 out=""
  while [ "$n" -le "$NGPUS" ] && [ "$n" -le 8 ]; do out="$out $n"; n=$((n * 2)); done
  case " $out " in *" $NGPUS "*) ;; *) out="$out $NGPUS";; esac
  echo $out
}

need_nproc() {
  case "${1:-}" in ''|*[!0-9]*) fail "$PART needs NPROC, a whole number of GPUs (1 to $NGPUS), got '${1:-}'";; esac
  [ "$1" -ge "$2" ] && [ "$1" -le "$NGPUS" ] || fail "$PART NPROC=$1: this host has $NGPUS GPU(s), and $PART needs $2 to $NGPUS"
}

run() {  # a command, or its echo under --dry-run
  if [ "$DRY" = 1 ]; then echo "+ $*"; else "$@"; fi
}

setup() {
  mkdir -p "$OUT"
  if [ "$DRY" = 1 ]; then
    echo "+ (dry run: $NGPUS GPU(s); the torchdata wheel from .whl/ would be installed to /tmp/site)"
    export PYTHONPATH=$PWD
  elif ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  if [ "$DRY" = 0 ]; then
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -n $((NGPUS + 1))
    "$PY" -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  fi
  # what the merged code offers: peer among the offered backends (fscomm.transport.BACKENDS; while it is
  # experimental, only EXPERIMENTAL_BACKENDS names it), in bench transport, --transport in bench e2e
  # (SUITE_OFFERS="1 1 1" or "0 0 0" stands in for the look, e.g. in a dry run)
  if [ -n "${SUITE_OFFERS:-}" ]; then
    read -r PEER_REGISTERED PEER_IN_BENCH E2E_TAKES_TRANSPORT <<< "$SUITE_OFFERS"
  else
    read -r PEER_REGISTERED PEER_IN_BENCH E2E_TAKES_TRANSPORT < <("$PY" - <<'PY' 2>/dev/null || echo "0 0 0"
import argparse
from fscomm.transport import BACKENDS
from benchmarks import e2e, transport
p = argparse.ArgumentParser()
e2e.add_arguments(p)
takes = any("--transport" in a.option_strings for a in p._actions)
print(int("peer" in BACKENDS), int("peer" in transport.PEER_KINDS), int(takes))
PY
)
  fi
}

backends() {  # bench transport's backends: the NCCL ones and host, and peer once registered there
  local b="host,nccl,nccl-ce"
  if [ "$PEER_REGISTERED" = 1 ] && [ "$PEER_IN_BENCH" = 1 ]; then b="$b,peer"; fi
  echo "$b"
}

e2e_transport_flag() {  # E2E_TRANSPORT as asked; else peer where registered and bench e2e takes the flag
  if [ -n "${E2E_TRANSPORT:-}" ]; then echo "--transport $E2E_TRANSPORT"; return; fi
  if [ "$PEER_REGISTERED" = 1 ] && [ "$E2E_TAKES_TRANSPORT" = 1 ]; then echo "--transport peer"; fi
}

case "$PART" in
  plan)
    [ $# -eq 1 ] || fail "plan takes no arguments"
    echo "# $NGPUS GPU(s): one part per line (each under 10 minutes), then 'table' anywhere"
    echo "bash scripts/multi_gpu_suite.sh check"
    [ "$NGPUS" -ge 2 ] && echo "bash scripts/multi_gpu_suite.sh transport 2"
    [ "$NGPUS" -gt 2 ] && echo "bash scripts/multi_gpu_suite.sh transport $NGPUS"
    [ "$NGPUS" -ge 2 ] || echo "# (one GPU: no transport part; bench peer in 'check' shares GPU 0 between 2 ranks)"
    for c in heavy light; do for n in $(counts); do echo "bash scripts/multi_gpu_suite.sh scaling $n $c"; done; done
    echo "bash scripts/multi_gpu_suite.sh replay"
    echo "bash scripts/multi_gpu_suite.sh table"
    ;;
  check)
    [ $# -eq 1 ] || fail "check takes no arguments"
    setup
    echo "== GPU tests of the peer transport (2 ranks share GPU 0: CUDA IPC within one GPU)"
    run timeout 100 "$PY" -m pytest -q -p no:cacheprovider -s tests/fscomm/experimental/test_peer_gpu.py
    echo "== bench peer, 2 ranks ($([ "$NGPUS" -ge 2 ] && echo 'GPU 0 and GPU 1' || echo 'sharing GPU 0: not NVLink'))"
    run timeout 120 "$PY" -m benchmarks peer --nproc 2 --sizes 4194304,33554432 --json "$OUT/peer_2.json"
    ;;
  transport)
    [ $# -eq 2 ] || fail "transport takes one argument, NPROC"
    need_nproc "${2:-}" 2
    setup
    echo "== bench transport on $2 GPUs: $(backends), latency/bandwidth per block, compute slowdown (SDPA, GEMM)"
    run timeout 330 "$PY" -m benchmarks transport --device cuda --nproc "$2" --backends "$(backends)" \
      --sizes 4096,262144,4194304,33554432 --pairs 7 --json "$OUT/transport_$2.json"
    echo "== bench peer on $2 GPUs: all_to_all against a plain peer copy, kernels, compute slowdown"
    run timeout 200 "$PY" -m benchmarks peer --nproc "$2" --sizes 4194304,33554432 --pairs 7 --json "$OUT/peer_$2.json"
    ;;
  scaling)
    [ $# -eq 3 ] || fail "scaling takes two arguments, NPROC and CASE (heavy or light)"
    need_nproc "${2:-}" 1
    case "$3" in heavy|light) ;; *) fail "scaling CASE must be heavy or light, got '$3'";; esac
    setup
    flag=$(e2e_transport_flag)
    echo "== bench e2e, $3 case on $2 GPU(s), one rank each: sync, sdd, freescale (embedding transport: ${flag:-the default, host})"
    # shellcheck disable=SC2086  # E2E_FLAGS and the transport flag are lists of words
    run timeout 570 "$PY" -m benchmarks e2e --device cuda --nproc "$2" --cases "$3" --modes sync,sdd,freescale \
      --steps "$E2E_STEPS" --repeats "$REPEATS" $E2E_FLAGS $flag --json "$OUT/e2e_$3_$2.json"
    ;;
  replay)
    [ $# -eq 1 ] || fail "replay takes no arguments"
    setup
    ranks=8; [ "$NGPUS" -ne 8 ] && [ "$NGPUS" -ge 2 ] && ranks="8,$NGPUS"
    echo "== replay simulation at $ranks ranks on the heavy case's workload (kuairand-1k, UIH 4096, local batch 16, model small)"
    run env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 560 "$PY" -m benchmarks replay --device cuda \
      --replay-ranks "$ranks" --preset kuairand-1k --batch-size 16 --max-uih 4096 --replay-model-preset small \
      --partitioner none,fbs --replay-kernel padded --replay-jitter repeat --steps 40 --warmup 10 \
      --replay-timing-ranks 8 --replay-timings 300 --replay-time-budget 300 --replay-mem-gib 110 --json "$OUT/replay.json"
    ;;
  table)
    [ $# -eq 1 ] || fail "table takes no arguments"
    files=$(ls "$OUT"/e2e_heavy_*.json "$OUT"/e2e_light_*.json 2>/dev/null)
    [ -n "$files" ] || [ "$DRY" = 1 ] || fail "no e2e JSON under $OUT: run the scaling parts first"
    [ -n "$files" ] || files="$OUT/e2e_heavy_N.json $OUT/e2e_light_N.json"
    replay=""; { [ -f "$OUT/replay.json" ] || [ "$DRY" = 1 ]; } && replay="--replay $OUT/replay.json"
    export PYTHONPATH=${PYTHONPATH:-$PWD}
    # shellcheck disable=SC2086
    run "$PY" -m benchmarks scaling --e2e $files $replay --json "$OUT/scaling.json"
    ;;
  *)
    echo "unknown part '$PART'" >&2; echo "$usage" >&2; exit 2
    ;;
esac
