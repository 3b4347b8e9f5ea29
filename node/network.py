"""The node's networking thread: one asyncio (uvloop) loop that owns p2pd, the DHT and every protocol.

The training loop lives on the main thread and hands work to this loop with :meth:`NetworkThread.run`
(blocking, interruptible by a stop event) or :meth:`NetworkThread.submit` (fire and forget).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import uvloop
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from node.orphans import guard_child, release
from protocol.hivemind_transport import Transport

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Interrupted(Exception):
    """The stop event fired while the main thread waited on network work."""


class NetworkThread:
    """Starts p2pd + a DHT node in a background loop and runs coroutines on it."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="locomesh-network", daemon=True)
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self.transport: Transport | None = None
        self.validator = RSASignatureValidator()
        self._tasks: list[asyncio.Task] = []
        self._watchdog = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(
        self,
        initial_peers: list[str],
        listen: list[str],
        announce: list[str],
        identity: str | None,
        on_bytes: Callable[[str, str, int], None],
        on_error: Callable[[str, str, str], None],
        swarm_key: bytes | None = None,
        stream_timeout: float = 30.0,
        timeout: float = 60.0,
    ) -> None:
        """Start p2pd and join the DHT (bootstrapping from ``initial_peers`` when given)."""
        self._thread.start()

        async def _start() -> None:
            self.p2p = await P2P.create(
                initial_peers=initial_peers or None,
                host_maddrs=listen,
                announce_maddrs=announce or None,
                identity_path=identity,
                startup_timeout=timeout,
            )
            child = getattr(self.p2p, "_child", None)  # hivemind keeps the p2pd process here
            if child is not None:
                self._watchdog = guard_child(child.pid)
            self.dht = await DHTNode.create(
                p2p=self.p2p,
                initial_peers=initial_peers or None,
                record_validator=self.validator,
                client_mode=False,
                wait_timeout=5,
            )
            self.transport = Transport(self.p2p, on_bytes=on_bytes, on_error=on_error, swarm_key=swarm_key,
                                       idle_timeout=stream_timeout)

        self.call(_start(), timeout=timeout + 30)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, coro: Coroutine[Any, Any, T], stop: threading.Event, poll: float = 0.2) -> T:
        """Like :meth:`call`, but cancels the work and raises :class:`Interrupted` once ``stop`` is set."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        while True:
            try:
                return future.result(timeout=poll)
            except concurrent.futures.TimeoutError:
                if stop.is_set():
                    future.cancel()
                    raise Interrupted() from None

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def every(self, interval: float, fn: Callable[[], Awaitable[None]], name: str) -> None:
        """Run ``fn`` every ``interval`` seconds until shutdown; its failures are logged, never fatal."""

        async def _loop() -> None:
            while True:
                try:
                    await fn()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("background task %s failed; retrying in %.0fs", name, interval)
                await asyncio.sleep(interval)

        async def _spawn() -> None:
            self._tasks.append(asyncio.create_task(_loop(), name=name))

        self.call(_spawn())

    def shutdown(self, timeout: float = 20.0) -> None:
        """Stop background tasks, leave the DHT, terminate p2pd and stop the loop."""
        if not self._thread.is_alive():
            return

        async def _stop() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.dht is not None:
                try:
                    await asyncio.wait_for(self.dht.shutdown(), timeout=10)
                except Exception as e:  # p2pd must still be stopped below
                    logger.warning("DHT shutdown: %s", e)
            if self.p2p is not None:
                await self.p2p.shutdown()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        try:
            self.call(_stop(), timeout=timeout)
        except Exception as e:
            logger.warning("network shutdown incomplete: %s", e)
            if self.p2p is not None:
                self.p2p._terminate()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if self._watchdog is not None:
            release(self._watchdog)
