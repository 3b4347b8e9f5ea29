#!/bin/bash
# The GPU checks of docs/benchmarks.md "On a GPU: one H100", run from the repository root on a machine whose
# python3 has a CUDA torch. OUT: the folder for the results. .whl: wheels (cp312) of the compiled packages that
# machine lacked (pydantic_core, cffi, cryptography, blake3, mmh3); .gpu/site: the pure-Python ones (hivemind with
# its p2pd, pydantic, multiaddr and their needs) copied from this project's virtual environment.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site:$PWD/.gpu/site
chmod +x .gpu/site/hivemind/hivemind_cli/p2pd
L=$OUT/log.txt
{ nvidia-smi -L; python3 -c "import torch,hivemind,numpy; from multiaddr import Multiaddr; print(Multiaddr('/p2p/QmbJpuKH8yHEMbdTgQBZZ7ZgDNgyoeFUXk4pgMGuHDYkjk')); print('torch',torch.__version__,torch.cuda.get_device_name(0),'numpy',numpy.__version__)"; } >$L 2>&1
echo "== replicas $(date +%T)" >>$L
timeout 100 python3 -m node swarm --nodes 2 --duration 50 --model small --device cuda --inner-steps 20 --report $OUT/swarm_replicas_cuda.json --checkpoint-dir /tmp/swr >>$L 2>&1; echo "rc $?" >>$L; tail -15 /tmp/swr/node0/log.txt >>$L
echo "== pipeline $(date +%T)" >>$L
timeout 100 python3 -m node swarm --nodes 3 --stages 2 --duration 50 --model small --device cuda --report $OUT/swarm_pipeline_cuda.json --checkpoint-dir /tmp/swp >>$L 2>&1; echo "rc $?" >>$L; tail -8 /tmp/swp/node2/log.txt >>$L
echo "== throughput $(date +%T)" >>$L
timeout 170 python3 -m benchmarks.throughput --model small,medium,llama-150m --device cuda --steps 30 --warmup 5 --timeout 120 --out $OUT/throughput_h100.json >>$L 2>&1; echo "rc $?" >>$L
echo "== unit $(date +%T)" >>$L
timeout 100 python3 -m pytest tests/unit -q -rf --maxfail=30 -n 14 -p no:cacheprovider >$OUT/unit.txt 2>&1; echo "rc $?" >>$L
echo "== end $(date +%T)" >>$L
