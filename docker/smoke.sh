#!/usr/bin/env bash
# Smoke test of the Docker setup (slow, not part of `make test`; `make docker-smoke`):
# builds the images (docker/build.sh, cached), starts a Docker engine if none runs, runs the compose
# swarm (bootstrap + SMOKE_VOLUNTEERS volunteers + Prometheus; Grafana is not started: its image
# comes from a registry), trains SMOKE_SECONDS, then checks through Prometheus's HTTP API that every
# node was scraped, is healthy, averaged with all the others and that its loss fell. Everything is
# torn down again; exit 0 with PASS, 1 with FAIL.
#
# Environment: SMOKE_SECONDS (training window, default 180), SMOKE_VOLUNTEERS (default 2),
# KEEP_DOCKERD=1 (leave an engine this script started running), and build.sh's variables.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
CACHE=${LOCOMESH_DOCKER_CACHE:-/var/tmp/locomesh-docker}
TRAIN_S=${SMOKE_SECONDS:-180}
VOLUNTEERS=${SMOKE_VOLUNTEERS:-2}
NODES=$((VOLUNTEERS + 1))
PROJECT=locomesh-smoke
LOGS=$CACHE/smoke-logs
t0=$(date +%s)
phase_t=$t0
timings=()
started_dockerd=""
up=""

say() { printf '[smoke %s] %s\n' "$(date +%T)" "$*"; }
phase() { local now; now=$(date +%s); timings+=("$1 $((now - phase_t))s"); phase_t=$now; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
if command -v docker-compose >/dev/null; then compose_cmd=(docker-compose); else compose_cmd=(docker compose); fi
compose() { "${compose_cmd[@]}" -p "$PROJECT" -f "$here/compose.yaml" "$@"; }

finish() {
    local verdict=$1
    trap - EXIT INT TERM
    if [ -n "$up" ]; then
        mkdir -p "$LOGS"
        compose logs --no-color >"$LOGS/compose.log" 2>&1
        if [ "$verdict" != PASS ]; then
            say "last lines of the nodes' logs (all in $LOGS/compose.log):"
            grep -E '^(bootstrap|volunteer)' "$LOGS/compose.log" | tail -40
        fi
        say "tearing down"
        compose down --volumes --remove-orphans --timeout 30 >"$LOGS/down.log" 2>&1
        phase teardown
    fi
    if [ -n "$started_dockerd" ] && [ -z "${KEEP_DOCKERD:-}" ]; then
        kill "$started_dockerd" 2>/dev/null
        for _ in $(seq 30); do kill -0 "$started_dockerd" 2>/dev/null || break; sleep 1; done
    fi
    echo
    echo "timings: ${timings[*]}"
    echo "$verdict: docker smoke test, $NODES nodes, ${TRAIN_S}s of training, total $(($(date +%s) - t0))s"
    [ "$verdict" = PASS ]
    exit $?
}
trap 'finish FAIL' EXIT INT TERM

# 1. a Docker engine
if ! docker info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || { say "no Docker engine runs and only root can start one"; finish FAIL; }
    command -v dockerd >/dev/null || { say "no dockerd: apt-get install docker.io docker-compose"; finish FAIL; }
    mkdir -p "$CACHE"
    say "starting dockerd (vfs storage, no iptables), log in $CACHE/dockerd.log"
    dockerd --storage-driver=vfs --iptables=false >"$CACHE/dockerd.log" 2>&1 &
    started_dockerd=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { say "dockerd did not come up"; tail -20 "$CACHE/dockerd.log"; finish FAIL; }
fi
phase engine

# 2. images
"$here/build.sh" || { say "build failed"; finish FAIL; }
phase build

# 3. the swarm
export LOCOMESH_RUN_ID=smoke LOCOMESH_MODEL=nano LOCOMESH_DEVICE=cpu LOCOMESH_THREADS=1 LOCOMESH_INNER_STEPS=25
LOCOMESH_PORT=$(free_port) PROMETHEUS_PORT=$(free_port)
export LOCOMESH_PORT PROMETHEUS_PORT
export PROM=http://127.0.0.1:$PROMETHEUS_PORT NODES
compose down --volumes --remove-orphans >/dev/null 2>&1  # a previous run's leftovers
say "starting bootstrap + $VOLUNTEERS volunteers + prometheus (model nano, 1 thread each)"
up=1
compose up -d --no-build --scale volunteer="$VOLUNTEERS" bootstrap volunteer prometheus >"$CACHE/up.log" 2>&1 \
    || { cat "$CACHE/up.log"; finish FAIL; }
phase start

check() { python3 - "$@" <<'EOF'
import json, math, os, sys, time, urllib.parse, urllib.request

PROM, NODES = os.environ["PROM"], int(os.environ["NODES"])

def api(path, **params):
    url = f"{PROM}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)["data"]

def by_instance(expr):
    return {s["metric"]["instance"]: float(s["value"][1]) for s in api("query", query=expr)["result"]}

def table(rows):
    for inst in sorted(rows, key=lambda i: (not i.startswith("bootstrap"), i)):
        print("   ", f"{inst:<22}", "  ".join(rows[inst]))

if sys.argv[1] == "ready":  # every node scraped and training
    try:
        losses = by_instance("locomesh_train_loss > 0")
        sys.exit(0 if len(losses) >= NODES else 1)
    except OSError:
        sys.exit(1)

if sys.argv[1] == "progress":
    steps, loss = by_instance("locomesh_inner_steps_total"), by_instance("locomesh_train_loss")
    rnd, group = by_instance("locomesh_outer_round"), by_instance("locomesh_group_size")
    table({i: [f"step {steps[i]:6.0f}", f"loss {loss.get(i, math.nan):.3f}", f"round {rnd.get(i, 0):4.0f}",
               f"group {group.get(i, 0):.0f}"] for i in steps})
    sys.exit(0)

# final checks
start = float(sys.argv[2])
failures, rows = [], {}
targets = api("targets")["activeTargets"]
healthy = [t for t in targets if t["health"] == "up"]
print(f"  prometheus targets up: {len(healthy)}/{len(targets)} (expected {NODES})")
if len(healthy) != NODES or len(targets) != NODES:
    failures.append(f"{len(healthy)} of {len(targets)} targets up, expected {NODES}")
window = f"{int(time.time() - start) + 60}s"
samples = by_instance(f"count_over_time(locomesh_train_loss[{window}])")
group = by_instance(f"max_over_time(locomesh_group_size[{window}])")
completed = by_instance('locomesh_outer_rounds_total{result="completed"}')
steps = by_instance("locomesh_inner_steps_total")
val = by_instance("locomesh_val_loss > 0")
series = {s["metric"]["instance"]: [float(v) for _, v in s["values"] if 0 < float(v) < math.inf]
          for s in api("query_range", query="locomesh_train_loss", start=start, end=time.time(), step=5)["result"]}
if len(samples) != NODES:
    failures.append(f"samples from {len(samples)} nodes, expected {NODES}")
lasts = []
for inst, n in samples.items():
    values = series.get(inst, [])
    first = sum(values[:3]) / max(len(values[:3]), 1) if values else math.nan
    last = sum(values[-3:]) / max(len(values[-3:]), 1) if values else math.nan
    lasts.append(last)
    rows[inst] = [f"samples {n:4.0f}", f"steps {steps.get(inst, 0):6.0f}", f"loss {first:.3f} -> {last:.3f}",
                  f"val {val.get(inst, math.nan):.3f}", f"rounds ok {completed.get(inst, 0):3.0f}",
                  f"max group {group.get(inst, 0):.0f}"]
    if n < 10:
        failures.append(f"{inst}: only {n:.0f} loss samples")
    if not last < first:
        failures.append(f"{inst}: loss did not fall ({first:.3f} -> {last:.3f})")
    if group.get(inst, 0) < NODES:
        failures.append(f"{inst}: never averaged with all {NODES} nodes (max group {group.get(inst, 0):.0f})")
print("  per node (train loss: mean of the first 3 samples -> of the last 3):")
table(rows)
if lasts and not sum(lasts) / len(lasts) < 3.0:
    failures.append(f"mean final loss {sum(lasts) / len(lasts):.3f} is not below 3.0 (untrained: ln 256 = 5.545)")
for f in failures:
    print("  FAIL:", f)
sys.exit(1 if failures else 0)
EOF
}

# 4. wait until every node is scraped and training, then train
say "waiting for $NODES nodes to train and be scraped (Prometheus on 127.0.0.1:$PROMETHEUS_PORT)"
deadline=$(($(date +%s) + 600))
until check ready; do
    if [ "$(date +%s)" -gt "$deadline" ]; then say "the swarm did not come up within 600 s"; finish FAIL; fi
    sleep 5
done
train_start=$(date +%s)
phase "until-training"
say "all $NODES nodes train; training for ${TRAIN_S}s"
while [ $(($(date +%s) - train_start)) -lt "$TRAIN_S" ]; do
    sleep 30
    say "after $(($(date +%s) - train_start))s:"
    check progress || true
done
phase training

# 5. checks
say "checks"
ok=1
check final "$t0" || ok=""
for c in $(compose ps -q bootstrap volunteer); do
    read -r name health restarts < <(docker inspect -f '{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.RestartCount}}' "$c")
    echo "  container ${name#/}: health $health, restarts $restarts"
    [ "$health" = healthy ] && [ "$restarts" = 0 ] || { echo "  FAIL: ${name#/} is $health after $restarts restarts"; ok=""; }
done
phase checks
[ -n "$ok" ] && finish PASS || finish FAIL
