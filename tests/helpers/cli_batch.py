"""Run many ``node`` command lines in one process (the imports are paid once) and report each one's
exit code, stdout and stderr: ``python -m tests.helpers.cli_batch JSON`` with a JSON list of argument lists;
prints a JSON list of ``{"code", "stdout", "stderr"}``. Used by ``tests/integration/test_user_errors.py``."""

from __future__ import annotations

import contextlib
import io
import json
import sys


def run(args: list[str]) -> dict:
    from node.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # what would have been a traceback
            import traceback

            traceback.print_exc(file=err)
            code = f"uncaught {type(e).__name__}"
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    print(json.dumps([run(args) for args in json.loads(sys.argv[1])]))
