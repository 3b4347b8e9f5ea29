"""The node's networking thread: one asyncio (uvloop) loop that owns p2pd, the DHT and every protocol.

The training loop lives on the main thread and hands work to this loop with :meth:`NetworkThread.run`
(blocking, interruptible by a stop event) or :meth:`NetworkThread.submit` (fire and forget).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import tempfile
import threading
import time
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import uvloop
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from node.runtime import reachability as reach
from node.errors import UserError
from node.runtime.orphans import guard_child, release
from protocol import ids
from protocol.hivemind_transport import Transport
from protocol.peer_identity import IdentityError, OwnedRecordValidator, bind, load_identity, write_identity
from protocol.ratelimit import RateLimits
from protocol.relay import relay_routes, relays_in
from gossip.rendezvous import watch_records

logger = logging.getLogger(__name__)
T = TypeVar("T")
COMPUTE_GRACE_S = 6.0  # how long a stopping node waits for the codec/outer-step work in flight


def diagnose_peer(maddr: str, timeout: float = 3.0) -> str:
    """Why a bootstrap peer may not have answered, found by a plain TCP connect to its address."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[3] != "tcp":
        return "not a TCP multiaddr (expected /ip4/HOST/tcp/PORT/p2p/PEER_ID)"
    try:
        socket.create_connection((parts[2], int(parts[4])), timeout=timeout).close()
    except socket.timeout:
        return f"no answer within {timeout:.0f}s (a firewall drops the packets, or the host is down)"
    except OSError as e:
        return (e.strerror or str(e)).lower()
    return "its port accepts connections, but its libp2p node did not answer (another program on that port, or it is still starting)"


def peer_id_of(maddr: str) -> str:
    """The peer id at the end of a ``.../p2p/<id>`` multiaddr."""
    return str(maddr).rstrip("/").rsplit("/p2p/", 1)[-1]


def learn_routes(transport: Transport, records: dict[str, Any]) -> None:
    """Keep ``transport``'s relay routes in step with the peers' records: a private peer is reached
    through the relays in its announced circuit addresses (see protocol.relay)."""
    routes = relay_routes({peer: rec.maddrs for peer, rec in records.items() if rec.reachability == "private"})
    for peer in records:
        if peer in routes:
            transport.routes[peer] = routes[peer]
        else:
            transport.routes.pop(peer, None)


class Interrupted(Exception):
    """The stop event fired while the main thread waited on network work."""


class DaemonThreadExecutor(concurrent.futures.Executor):
    """Runs each call on a daemon thread of its own: the loop's ``to_thread`` work (codecs, aggregation,
    outer steps) never keeps a stopping node alive, as the default executor's joined threads would."""

    def __init__(self) -> None:
        self._running: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:
            try:
                if not future.set_running_or_notify_cancel():
                    return
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:
                    future.set_exception(e)
                else:
                    future.set_result(result)
            finally:
                with self._lock:
                    self._running.discard(thread)

        thread = threading.Thread(target=work, name="locomesh-compute", daemon=True)
        with self._lock:
            self._running.add(thread)
        thread.start()
        return future

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the calls in flight to return; False if some still run.

        A process must not exit while one of them is inside a torch kernel: the C++ runtime's teardown
        under a running kernel aborts the process ("terminate called without an active exception")."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                running = list(self._running)
            if not running:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            running[0].join(timeout=left)


class NetworkThread:
    """Starts p2pd + a DHT node in a background loop and runs coroutines on it."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.compute = DaemonThreadExecutor()
        self.loop.set_default_executor(self.compute)
        self._thread = threading.Thread(target=self._serve, name="locomesh-network", daemon=True)
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self.transport: Transport | None = None
        self.validator: OwnedRecordValidator = None  # type: ignore[assignment]  # set by start(), from the identity
        self._tasks: list[asyncio.Task] = []
        self._watchdog = None
        self.reachability = reach.Reachability()
        self._initial_peers: list[str] = []

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
        join_timeout: float = 60.0,
        stop: threading.Event | None = None,
        reachability: str = "auto",
        relay_service: bool = True,
        limits: RateLimits | None = None,
        data_channel: tuple[str, int] | None = None,
    ) -> None:
        """Start p2pd and join the DHT (bootstrapping from ``initial_peers`` when given).

        ``reachability`` ``auto`` asks an initial peer to dial this node back (:mod:`node.runtime.reachability`)
        and restarts p2pd as a private, relayed peer when it could not; ``public``/``private`` skip the
        check. ``relay_service`` lets a public node relay circuits for private peers. ``limits``: the node's
        upload/download caps, shared by every stream (``protocol.ratelimit``). ``data_channel``: (host, port) of
        the direct channel for bulk streams (``protocol.datachannel``); None: every stream through p2pd.

        A bootstrap peer may be restarting: failed attempts are retried with backoff (a log line each,
        naming every peer and why it failed) for ``join_timeout`` seconds, then :class:`UserError`
        names each peer tried and why."""
        key, check_taken = self._identity(identity)
        self.validator = OwnedRecordValidator(key, swarm_key=swarm_key)
        self._thread.start()
        self._initial_peers = list(initial_peers)

        async def _p2p(mode: str) -> None:
            nonlocal check_taken
            # p2pd reads its identity file once, at start: a node without --identity hands it one that
            # lives only that long (its DHT records are signed with the same key, see peer_identity)
            with tempfile.TemporaryDirectory(prefix="locomesh-id-") as folder:
                path = identity
                if path is None:
                    path = f"{folder}/identity"
                    write_identity(path, key)
                self.p2p = await reach.create_p2p(mode, initial_peers, relay_service, host_maddrs=listen,
                                                  announce_maddrs=announce or None, identity_path=path,
                                                  check_if_identity_free=check_taken, startup_timeout=timeout)
            check_taken = False  # a restart (as a private peer) reuses the identity it just checked
            child = getattr(self.p2p, "_child", None)  # hivemind keeps the p2pd process here
            if child is not None:
                self._watchdog = guard_child(child.pid)
            self.transport = Transport(self.p2p, on_bytes=on_bytes, on_error=on_error, swarm_key=swarm_key,
                                       idle_timeout=stream_timeout, limits=limits, identity=key)
            me = self.p2p.peer_id.to_base58()
            self.transport.own_relays = lambda: set(relays_in(self.reachability.relays, me))
            await self.transport.serve(ids.DIALBACK, reach.serve_dialback)
            await self.transport.enable_relays(serve_relay=relay_service and mode != "private")
            if data_channel is not None:
                await self.transport.enable_data_channel(*data_channel)

        async def _start() -> None:
            await _p2p("private" if reachability == "private" else "public")
            if reachability != "auto":
                self.reachability = reach.Reachability(reachability, "set by --reachability")
            elif not initial_peers:
                self.reachability = reach.Reachability("unknown", "no initial peer to dial this node back; "
                                                                  "assumed public (the first node must be dialable)")
            else:
                own = [str(a) for a in await self.p2p.get_visible_maddrs()] + list(announce)
                self.reachability = await reach.detect(self.transport, [peer_id_of(p) for p in initial_peers],
                                                       reach.tcp_ports(own))
                if self.reachability.state == "private":
                    logger.info("this node is not dialable from outside (%s): restarting p2pd as a private "
                                "peer reached through relays", self.reachability.detail)
                    await self._discard_partial_start()
                    await _p2p("private")
            self.dht = await DHTNode.create(
                p2p=self.p2p,
                initial_peers=initial_peers or None,
                record_validator=self.validator,
                client_mode=self.reachability.state == "private",
                wait_timeout=5,
            )
            bind(self.dht, self.validator)
            watch_records(self.dht, self._learn_routes)

        deadline = time.monotonic() + join_timeout
        delay, attempt = 1.0, 0
        while True:
            attempt += 1
            try:
                self.call(_start(), timeout=timeout + 30)
                return
            except Exception as e:
                if not initial_peers:
                    raise
                self.call(self._discard_partial_start(), timeout=30)
                reasons = "; ".join(f"{peer}: {diagnose_peer(peer)}" for peer in initial_peers)
                if time.monotonic() + delay > deadline or (stop is not None and stop.is_set()):
                    raise UserError(f"could not join through --initial-peers after {attempt} attempts in {join_timeout:.0f}s: "
                                    f"{reasons}. Check the address and that the node runs, or raise --join-timeout") from None
                logger.warning("bootstrap attempt %d failed (%s): %s; retrying in %.0fs", attempt,
                               str(e).splitlines()[0][:120] if str(e) else type(e).__name__, reasons, delay)
                if stop is not None and stop.wait(delay):
                    raise UserError("stopped while waiting for the bootstrap peers") from None
                if stop is None:
                    time.sleep(delay)
                delay = min(2 * delay, 10.0)

    @staticmethod
    def _identity(identity: str | None) -> tuple[RSAPrivateKey, bool]:
        """The node's RSA identity key (from ``identity``, created there if missing, or a new one for
        this run), and whether to check that no live peer uses it already (an existing file only)."""
        if identity is None:
            return RSAPrivateKey(), False
        try:
            if os.path.exists(identity):
                return load_identity(identity), True
            return write_identity(identity), False
        except IdentityError as e:
            raise UserError(f"--identity: {e}") from None
        except OSError as e:
            raise UserError(f"--identity {identity}: cannot read or write it ({e.strerror or e}); "
                            f"give a writable path or leave --identity out") from None

    async def _discard_partial_start(self) -> None:
        """Undo a start-up that failed half-way (p2pd may be running without a DHT)."""
        if self.transport is not None and self.transport.data_channel is not None:
            await self.transport.data_channel.close()
        if self.dht is not None:
            await self.dht.shutdown()
        if self.p2p is not None:
            await self.p2p.shutdown()
        if self._watchdog is not None:
            release(self._watchdog)
        self.p2p = self.dht = self.transport = self._watchdog = None

    def _learn_routes(self, records: dict[str, Any]) -> None:
        if self.transport is not None:
            learn_routes(self.transport, records)

    async def refresh_relays(self) -> list[str]:
        """This node's multiaddrs now, with a private node's circuit addresses (its reservations) also
        kept in ``reachability``. p2pd lists circuits only over relays with public IPs; a private node
        whose relays have none (a LAN, a lab) announces circuits over its initial peers instead, which
        locomesh's relay can serve as long as the connection to them stands."""
        assert self.p2p is not None
        maddrs = [str(a) for a in await self.p2p.get_visible_maddrs(latest=True)]
        circuits = reach.relay_addresses(maddrs)
        if self.reachability.state == "private" and not circuits:
            me = self.p2p.peer_id.to_base58()
            circuits = [f"{peer}/p2p-circuit/p2p/{me}" for peer in self._initial_peers if "/p2p/" in peer]
            maddrs += circuits
        self.reachability.relays = circuits
        return maddrs

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result; past ``timeout`` the work is cancelled (its
        streams closed, its buffers freed) before ``TimeoutError`` is raised, so a retry never runs
        beside the attempt it replaces."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

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
            if self.transport is not None and self.transport.data_channel is not None:
                await self.transport.data_channel.close()
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
        if not self.compute.wait_idle(COMPUTE_GRACE_S):
            logger.warning("a codec or outer step still runs %.0fs after the stop: the process will exit "
                           "without waiting for it", COMPUTE_GRACE_S)
