#!/bin/bash
# The GPU checks of docs/benchmarks.md ("On a GPU"), in at most ~8 minutes on one GPU, from the repository root of a
# machine whose python3 has a CUDA build of torch. Results go to $OUT (default out/gpu):
#   loop_eager.json, loop_compiled.json  bare training loop of llama-150m, medium, small (benchmarks.throughput
#                                        --bare-only), eager against compiled, the compiled llama-150m profiled
#   replicas.json, replicas_overlap.json node swarm: 2 replicas of llama-150m on the one GPU (two processes), at the
#                                        defaults and with --overlap
#   unit.txt                             the unit suite
#   loop_1b.json, pipeline.json          llama-1b compiled and a 2-stage pipeline, when the budget leaves time
#   log.txt                              everything else the steps printed
# Needs .gpu/ from `python -m benchmarks.gpu_bundle --have benchmarks/gpu/have.txt` (what such a machine lacks:
# hivemind with its p2pd, pydantic, ...), carried beside the working tree. BUDGET_S (default 470) bounds the whole.
set -u
export PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
L=$OUT/log.txt
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
step() { echo "== $1 at $(date +%T), $(left) s left" >>"$L"; }
# run SECONDS CMD...: CMD under a timeout of at most SECONDS and what the budget leaves; skipped when under 30 s are left
run() {
  local limit=$1; shift
  local budget; budget=$(left)
  if [ "$budget" -lt 30 ]; then echo "skipped (budget): $*" >>"$L"; return; fi
  [ "$budget" -lt "$limit" ] && limit=$budget
  timeout "$limit" "$@" >>"$L" 2>&1
  echo "rc $? ($*)" >>"$L"
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl >>"$L" 2>&1 || exit 1
export PYTHONPATH=$PWD:/tmp/site:$PWD/.gpu/site
export TORCHINDUCTOR_CACHE_DIR=/tmp/locomesh-inductor
chmod +x .gpu/site/hivemind/hivemind_cli/p2pd
{ nvidia-smi -L; python3 -c "import torch, hivemind, pydantic; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'hivemind', hivemind.__version__, 'pydantic', pydantic.__version__)"; } >>"$L" 2>&1

LOOP="python3 -m benchmarks.throughput --device cuda --bare-only --steps 20 --warmup 3 --timeout 170"
step "bare loop, compiled (the default on CUDA)"
run 200 $LOOP --model llama-150m,medium,small --compile on --profile --out "$OUT/loop_compiled.json"
step "bare loop, eager"
run 100 $LOOP --model llama-150m,medium,small --compile off --out "$OUT/loop_eager.json"

SWARM="python3 -m node swarm --nodes 2 --model llama-150m --device cuda --duration 70"
step "2 replicas of llama-150m, defaults"
run 120 $SWARM --report "$OUT/replicas.json" --checkpoint-dir /tmp/gpu-replicas
tail -12 /tmp/gpu-replicas/node0/log.txt >>"$L" 2>/dev/null
step "2 replicas of llama-150m, --overlap"
run 120 $SWARM --overlap --report "$OUT/replicas_overlap.json" --checkpoint-dir /tmp/gpu-replicas-overlap
tail -12 /tmp/gpu-replicas-overlap/node0/log.txt >>"$L" 2>/dev/null

step "unit suite"
if [ "$(left)" -ge 60 ]; then
  timeout $(( $(left) < 150 ? $(left) : 150 )) python3 -m pytest tests/unit -q -rf --maxfail=40 -n 14 -p no:cacheprovider >"$OUT/unit.txt" 2>&1
  echo "rc $? (unit suite)" >>"$L"
fi

step "llama-1b, compiled, micro-batches of 4"
[ "$(left)" -ge 120 ] && run 150 $LOOP --model llama-1b --compile on --micro-batch-size 4 --steps 5 --warmup 2 --out "$OUT/loop_1b.json"
step "pipeline: 2 stages + trainer, small"
[ "$(left)" -ge 70 ] && run 80 python3 -m node swarm --nodes 3 --stages 2 --duration 40 --model small --device cuda \
  --report "$OUT/pipeline.json" --checkpoint-dir /tmp/gpu-pipeline
step "end"
