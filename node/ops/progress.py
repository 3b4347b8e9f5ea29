"""What ``node swarm`` shows while it runs: each node's progress read from its Prometheus endpoint and
info file, as a table redrawn in place on a terminal or as one short line per node in logs and CI."""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol
from urllib.request import urlopen

from prometheus_client.parser import text_string_to_metric_families

COLUMNS = ("node", "role", "step", "loss", "tok/s", "round", "peers", "sent")


class Watched(Protocol):
    """A launched node as progress sees it (``node.ops.launcher.NodeProcess``)."""

    index: int
    metrics_port: int
    process: Any

    def read_info(self) -> dict[str, Any]: ...


def scrape(port: int, timeout: float = 1.0) -> dict[str, float]:
    """Flattened ``{name{labels}: value}`` of a node's /metrics, or {} if unreachable."""
    try:
        text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def total(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k == prefix or k.startswith(prefix + "{"))


def progress_rows(nodes: list[Watched]) -> list[dict[str, str]]:
    """One row per node: role, step, loss, tokens/s, outer round, peers, bytes sent."""
    rows = []
    for node in nodes:
        m, info = scrape(node.metrics_port), node.read_info()
        role = str(info.get("role") or "-") + (f" {info['stage']}" if info.get("stage") is not None else "")
        if not m:
            state = "exited" if node.process is not None and node.process.poll() is not None else "starting"
            rows.append({"node": str(node.index), "role": role, "step": state})
            continue
        rows.append({
            "node": str(node.index), "role": role, "step": f"{total(m, 'locomesh_inner_steps_total'):.0f}",
            "loss": f"{m.get('locomesh_train_loss', math.nan):.3f}", "tok/s": f"{m.get('locomesh_tokens_per_second', 0):.0f}",
            "round": f"{m.get('locomesh_outer_round', 0):.0f}", "peers": f"{m.get('locomesh_peers', 0):.0f}",
            "sent": f"{total(m, 'locomesh_bytes_sent_total') / 1e6:.1f} MB",
        })
    return rows


def progress_table(rows: list[dict[str, str]], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "role" else "right")
    for row in rows:
        table.add_row(*(row.get(col, "") for col in COLUMNS))
    return table


def progress_lines(rows: list[dict[str, str]], elapsed: float) -> list[str]:
    """Plain progress for logs and CI: one short line per node."""
    return [f"[{elapsed:5.0f}s] node {r['node']} {r['role']}: " + " ".join(f"{k} {r[k]}" for k in COLUMNS[2:] if k in r)
            for r in rows]


class LiveProgress:
    """A table redrawn in place on a terminal; log lines print above it while it runs."""

    def __init__(self, table: Any) -> None:
        from rich.live import Live
        from rich.logging import RichHandler

        self.live = Live(table, auto_refresh=False, transient=False)
        self.live.start()
        handler = RichHandler(console=self.live.console, show_path=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
        self.saved = logging.getLogger().handlers[:]
        logging.getLogger().handlers[:] = [handler]

    def update(self, table: Any) -> None:
        self.live.update(table, refresh=True)

    def stop(self, table: Any) -> None:
        self.update(table)
        self.live.stop()
        logging.getLogger().handlers[:] = self.saved
