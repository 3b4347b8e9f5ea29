"""Run ``node`` command lines inside this process (the imports are paid once) and report each one's exit
code, stdout and stderr.

``python -m tests.helpers.cli_batch JSON`` with a JSON list of argument lists prints a JSON list of
``{"code", "stdout", "stderr"}``. Used by ``tests/integration/test_user_errors.py``; the light client's
checks (``tests.helpers.lite_checks``) run their commands through :func:`call` and :func:`run` too.
Nothing heavy is imported here: ``node.cli.app`` is imported when the first command runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def call(args: list[str]) -> int | str | None:
    """Run ``node ARGS``; its exit code: 0 when it returns, ``SystemExit``'s code when it exits, or
    ``"uncaught <type>"`` when it raises (the traceback goes to stderr)."""
    from node.cli.app import main

    try:
        main(args)
    except SystemExit as e:
        return e.code
    except BaseException as e:  # what would have been a traceback
        import traceback

        traceback.print_exc(file=sys.stderr)
        return f"uncaught {type(e).__name__}"
    return 0


def run(args: list[str]) -> dict:
    """Run ``node ARGS`` with stdout and stderr captured: ``{"code", "stdout", "stderr"}``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = call(args)
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    print(json.dumps([run(args) for args in json.loads(sys.argv[1])]))
