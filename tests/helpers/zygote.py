"""Start test daemons by forking a process that has already imported torch and hivemind.

A ``node join`` spends ~3.5 s of CPU importing torch, ``torch._dynamo`` (the first optimizer imports it)
and hivemind (with scipy) before it does anything; ``make test`` starts ~150 daemons, and on 2 cores
those imports were a third of the suite's CPU. The zygote (``python -m tests.helpers.zygote``, one per
pytest process) imports them once, runs no torch op and no thread, and forks on request: each child
starts its own session, points stdout and stderr at its log, takes the environment and folder it was
given and runs ``python -m MODULE ARGS`` as a fresh interpreter would (the project's own modules are
imported in the child, so a ``LOCOMESH_*`` variable read at import time still takes effect; Python's
``random`` is reseeded by the fork itself). Children are real processes with their own p2pd; only
their parent is the zygote, which reaps them and reports each exit code. Reports name a child by the
number of its request, never by its pid alone: with ``pid_max`` 32768 and torch's threads taking ids from
the same space, a suite reuses pids, and a new daemon must not read an old one's exit code.

``LOCOMESH_TEST_EXEC=1`` starts every daemon with a plain ``exec`` instead (to rule the zygote out).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# what a daemon imports that costs the most, in the order it imports them; the project's modules are not
# preloaded (they read the environment and must see each child's own)
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "hivemind", "uvloop", "msgpack", "pydantic", "prometheus_client",
           "typer", "rich", "safetensors", "tokenizers", "pyarrow")


def _serve() -> dict[str, Any] | None:
    """The zygote's loop: fork a child per request line, report starts and exits. Returns the request in
    a child (which then runs it), ``None`` in the zygote once its client has gone."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the zygote itself prints goes to stderr, never into the report stream
    children: dict[int, int] = {}  # pid -> the number of the request that started it
    requests = 0
    pending = b""
    report.write("ready\n")
    while True:
        readable, _, _ = select.select([0], [], [], 0.1)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                job = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    report.close()
                    return job
                children[pid] = requests
                report.write(f"started {requests} {pid}\n")
                requests += 1
        for pid, request in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del children[pid]
                report.write(f"exit {request} {os.waitstatus_to_exitcode(status)}\n")


def _become(job: dict[str, Any]) -> None:
    """In a forked child: turn into ``python -m MODULE ARGS`` with the job's session, folder, output and
    environment, and run it (its ``SystemExit`` ends this interpreter as it would a fresh one)."""
    import runpy

    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, path in ((1, job["log"]), (2, job.get("stderr"))):
        if path is None:
            os.dup2(1, 2)  # stderr into the log too
            continue
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = [job["module"], *job["args"]]
    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)


class ForkedProcess:
    """What tests use of :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``, ``send_signal``,
    ``returncode``) for a child of the zygote, whose exit the zygote reports."""

    def __init__(self, zygote: "Zygote", request: int, pid: int) -> None:
        self.zygote, self.request, self.pid = zygote, request, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.request, self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.zygote.changed:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
                self.zygote.changed.wait(left if left is not None else 1.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The client side: one zygote process, started on first use, stopped when this process exits."""

    def __init__(self) -> None:
        root = Path(__file__).resolve().parents[2]
        self.process = subprocess.Popen([sys.executable, "-m", "tests.helpers.zygote"], cwd=root, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
        self.changed = threading.Condition()
        self.exits: dict[int, int] = {}  # request number -> exit code
        self.started: dict[int, int] = {}  # request number -> pid
        self.requests = 0
        self.spawning = threading.Lock()
        if self.process.stdout.readline().strip() != b"ready":  # type: ignore[union-attr]
            raise RuntimeError(f"the test zygote did not start (exit {self.process.poll()})")
        threading.Thread(target=self._read, name="zygote-reports", daemon=True).start()
        atexit.register(self.close)

    def _read(self) -> None:
        for raw in self.process.stdout:  # type: ignore[union-attr]
            kind, request, value = raw.decode().split()
            with self.changed:
                (self.started if kind == "started" else self.exits)[int(request)] = int(value)
                self.changed.notify_all()
        with self.changed:  # the zygote is gone: nothing more will be reported
            self.changed.notify_all()

    def exit_code(self, request: int, pid: int) -> int | None:
        with self.changed:
            if request in self.exits:
                return self.exits[request]
        if self.process.poll() is not None and not Path(f"/proc/{pid}").exists():
            return -signal.SIGKILL  # reaped by init after the zygote died: its code is lost
        return None

    def spawn(self, module: str, args: list[str], env: dict[str, str], log: Path, cwd: Path | None = None,
              stderr: Path | None = None) -> ForkedProcess:
        """Fork ``python -m MODULE ARGS`` with stdout in ``log`` and stderr there too, or in ``stderr``."""
        job = {"module": module, "args": [str(a) for a in args], "env": env, "log": str(log), "cwd": str(cwd or Path.cwd()),
               "stderr": str(stderr) if stderr else None}
        with self.spawning, self.changed:
            self.process.stdin.write(json.dumps(job).encode() + b"\n")  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
            request, self.requests = self.requests, self.requests + 1
            while request not in self.started:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the test zygote exited with {self.process.returncode}")
                self.changed.wait(1.0)
            return ForkedProcess(self, request, self.started.pop(request))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # type: ignore[union-attr]
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()


_zygote: Zygote | None = None
_lock = threading.Lock()


def launch(module: str, args: list[str], env: dict[str, str], log: Path,
           stderr: Path | None = None) -> "subprocess.Popen | ForkedProcess":
    """``python -m MODULE ARGS`` in its own session with stdout in ``log`` and stderr there too (or in
    ``stderr``): forked from the zygote, or exec'd when ``LOCOMESH_TEST_EXEC=1``."""
    global _zygote
    if os.environ.get("LOCOMESH_TEST_EXEC") == "1":
        with open(log, "w") as out, open(stderr or os.devnull, "w") as err:
            return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out,
                                    stderr=err if stderr else subprocess.STDOUT, start_new_session=True, env=env)
    with _lock:
        if _zygote is None or _zygote.process.poll() is not None:
            _zygote = Zygote()
    return _zygote.spawn(module, args, env, log, stderr=stderr)


def run(args: list[str], env: dict[str, str] | None = None, timeout: float | None = None,
        module: str = "node") -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, MODULE, *ARGS], capture_output=True, text=True)`` through :func:`launch`;
    past ``timeout`` the command's session is killed and ``TimeoutExpired`` raised."""
    with tempfile.TemporaryDirectory(prefix="zygote-run-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = launch(module, args, dict(os.environ) if env is None else env, out, stderr=err)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
            raise
        return subprocess.CompletedProcess([module, *args], code, out.read_text(), err.read_text())


if __name__ == "__main__":
    todo = _serve()
    if todo is not None:
        _become(todo)
