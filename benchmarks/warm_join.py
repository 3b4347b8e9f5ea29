"""``node join`` with its imports done ahead of time, released when the bootstrap node is up.

    python -m benchmarks.warm_join --bootstrap MADDR [--timeout S] -- JOIN_ARGS...

Importing torch and hivemind and decoding the corpus take seconds on a small machine. A swarm launched
one node after the other (``node swarm`` waits for node 0 before it starts the rest) lets node 0 train
alone for that long, which at benchmark budgets is a large part of the run. This wrapper does that work
first, waits until the bootstrap node's TCP port (from MADDR, ``/ip4/A/tcp/P/p2p/ID``) accepts
connections, and runs the real CLI entry point, ``node.cli.app.main``, as
``node join JOIN_ARGS --initial-peers MADDR``.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True, help="multiaddr of the bootstrap node")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("join_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    join_args = args.join_args[1:] if args.join_args[:1] == ["--"] else args.join_args

    import node.cli.app  # the point: pay for the imports and the corpus before the release
    import node.replica.node  # noqa: F401
    from node.data.byte_corpus import load_corpus

    load_corpus(None)  # decoded once per process; the daemon's own load then only checks the digest
    parts = args.bootstrap.split("/")
    host, port = parts[2], int(parts[4])
    deadline = time.time() + args.timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline:
                sys.exit(f"warm_join: {host}:{port} did not accept connections within {args.timeout:.0f}s")
            time.sleep(0.05)
    sys.argv = ["node", "join", *join_args, "--initial-peers", args.bootstrap]
    node.cli.app.main()


if __name__ == "__main__":
    main()
