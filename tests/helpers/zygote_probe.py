"""What tests/unit/test_zygote.py runs in a forked child: prints what it sees as one JSON line, then
exits with the code given as its first argument, or sleeps until signalled when that is ``sleep``."""

import json
import os
import random
import sys
import time

if __name__ == "__main__":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("ZYGOTE_PROBE"),
                      "own_session": os.getsid(0) == os.getpid(), "modules": "torch" in sys.modules,
                      "random": random.random()}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[1]))
