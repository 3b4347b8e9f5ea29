#!/bin/sh
# Container entrypoint: `node join "$@"`, configured by LOCOMESH_* variables (see `node join --help`).
#
# Two conveniences for containers:
#  - LOCOMESH_BOOTSTRAP_INFO=PATH (the volunteers of docker/compose.yaml): when no
#    LOCOMESH_INITIAL_PEERS is given, wait until the bootstrap node's --info-file appears at PATH
#    (a shared volume) and its port answers, then join it at
#    /dns4/$LOCOMESH_BOOTSTRAP_HOST/tcp/<its port>/p2p/<its peer id>.
#  - Without LOCOMESH_SEED, each container gets its own data order, seeded from its hostname.
# A node's own info file from a previous run is removed first, so nobody reads a stale one.
set -eu

if [ -n "${LOCOMESH_INFO_FILE:-}" ]; then
    rm -f "$LOCOMESH_INFO_FILE"
fi
if [ -z "${LOCOMESH_SEED:-}" ]; then
    LOCOMESH_SEED=$(hostname | cksum | cut -d' ' -f1)
    export LOCOMESH_SEED
fi

if [ -z "${LOCOMESH_INITIAL_PEERS:-}" ] && [ -n "${LOCOMESH_BOOTSTRAP_INFO:-}" ]; then
    LOCOMESH_INITIAL_PEERS=$(python - <<'EOF'
import json, os, socket, sys, time

path = os.environ["LOCOMESH_BOOTSTRAP_INFO"]
host = os.environ.get("LOCOMESH_BOOTSTRAP_HOST", "bootstrap")
deadline = time.monotonic() + float(os.environ.get("LOCOMESH_BOOTSTRAP_WAIT", "600"))
said = False
while True:
    try:
        with open(path) as f:
            info = json.load(f)
        port = next(int(a.split("/")[4]) for a in info["multiaddrs"] if a.split("/")[3] == "tcp")
        if info.get("state") == "training":
            socket.create_connection((host, port), timeout=5).close()
            print(f"/dns4/{host}/tcp/{port}/p2p/{info['peer_id']}")
            break
    except (OSError, ValueError, KeyError, IndexError, StopIteration):
        pass
    if time.monotonic() > deadline:
        sys.exit(f"locomesh: no bootstrap node answered at {path} / {host}; set LOCOMESH_INITIAL_PEERS")
    if not said:
        print(f"locomesh: waiting for the bootstrap node ({path}, host {host})", file=sys.stderr)
        said = True
    time.sleep(2)
EOF
)
    export LOCOMESH_INITIAL_PEERS
    echo "locomesh: joining through $LOCOMESH_INITIAL_PEERS" >&2
fi

exec node join "$@"
