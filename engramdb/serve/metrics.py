"""Request counters and a latency histogram, rendered in the Prometheus text format.

One `Metrics.observe` call per request (dict increments and a bisect under one lock: about
1 us), from the event-loop thread and the wire-protocol lane. Rendering happens only when
``/metrics`` is scraped.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

#: Latency bucket upper bounds in seconds: 10 us .. 2.5 s, dense where a fetch lands.
LATENCY_BUCKETS = (
    10e-6,
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
    2.5,
)


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_COUNTER_HELP = {
    "engramdb_requests_total": "Requests answered, by endpoint and status.",
    "engramdb_rows_total": "Rows returned.",
    "engramdb_request_bytes_total": "Request body bytes received.",
    "engramdb_response_bytes_total": "Response body bytes sent.",
    "engramdb_errors_total": "Error responses, by error type.",
}


def _labels(**kv: Any) -> str:
    return "{" + ",".join(f'{k}="{_esc(str(v))}"' for k, v in kv.items()) + "}"


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def rss_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; 0 where absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        return 0


class _Histogram:
    __slots__ = ("counts", "sum", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self.total = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.total += 1


class Metrics:
    """Counters of one server. Thread-safe: the event loop and the wire-protocol lane both
    count into it (one uncontended lock per request, ~0.1 us)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.time()
        self.requests: dict[tuple[str, str, int], int] = {}
        self.rows: dict[tuple[str, str], int] = {}
        self.bytes_in: dict[tuple[str, str], int] = {}
        self.bytes_out: dict[tuple[str, str], int] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.latency: dict[str, _Histogram] = {}
        self.connections_total = 0

    def observe(
        self,
        endpoint: str,
        table: str,
        status: int,
        *,
        rows: int,
        bytes_in: int,
        bytes_out: int,
        seconds: float,
        error: str | None = None,
    ) -> None:
        """Count one finished request (``seconds`` from parsed request to response queued)."""
        et = (endpoint, table)
        with self.lock:
            key = (endpoint, table, status)
            self.requests[key] = self.requests.get(key, 0) + 1
            if rows:
                self.rows[et] = self.rows.get(et, 0) + rows
            self.bytes_in[et] = self.bytes_in.get(et, 0) + bytes_in
            self.bytes_out[et] = self.bytes_out.get(et, 0) + bytes_out
            if error is not None:
                ek = (endpoint, error)
                self.errors[ek] = self.errors.get(ek, 0) + 1
            h = self.latency.get(endpoint)
            if h is None:
                h = self.latency[endpoint] = _Histogram()
            h.observe(seconds)

    def count_error(self, endpoint: str, error: str) -> None:
        """Count an error that ended a connection before a request could be routed."""
        ek = (endpoint, error)
        with self.lock:
            self.errors[ek] = self.errors.get(ek, 0) + 1

    # -- rendering -----------------------------------------------------------------------------
    def render(
        self,
        *,
        connections_open: int,
        in_flight: int,
        store_stats: Iterable[dict[str, Any]] = (),
        view_stats: Iterable[dict[str, Any]] = (),
    ) -> str:
        """The Prometheus text exposition (format 0.0.4) of every counter.

        ``store_stats`` are the tables' ``Store.stats()`` dicts: each numeric field becomes
        ``engramdb_store_<field>{table=...}``, so cache hit/miss counters of a RAM tier show
        up here as soon as the store reports them. ``view_stats`` (``View.stats()``) become
        ``engramdb_view_<field>{table=...,view=...}`` (hits, misses, records, ...).
        """
        with self.lock:
            return self._render(connections_open, in_flight, store_stats, view_stats)

    def _render(
        self,
        connections_open: int,
        in_flight: int,
        store_stats: Iterable[dict[str, Any]],
        view_stats: Iterable[dict[str, Any]],
    ) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        et = ("endpoint", "table")
        for name, series, label_names in (
            ("engramdb_requests_total", self.requests, (*et, "code")),
            ("engramdb_rows_total", self.rows, et),
            ("engramdb_request_bytes_total", self.bytes_in, et),
            ("engramdb_response_bytes_total", self.bytes_out, et),
            ("engramdb_errors_total", self.errors, ("endpoint", "type")),
        ):
            family(name, "counter", _COUNTER_HELP[name])
            for key, n in sorted(series.items()):
                out.append(f"{name}{_labels(**dict(zip(label_names, key)))} {n}")
        family(
            "engramdb_request_duration_seconds",
            "histogram",
            "Server-side time from a parsed request to its queued response.",
        )
        for ep, h in sorted(self.latency.items()):
            acc = 0
            for bound, c in zip(LATENCY_BUCKETS, h.counts):
                acc += c
                out.append(
                    "engramdb_request_duration_seconds_bucket"
                    f"{_labels(endpoint=ep, le=repr(bound))} {acc}"
                )
            out.append(
                f"engramdb_request_duration_seconds_bucket{_labels(endpoint=ep, le='+Inf')} "
                f"{h.total}"
            )
            out.append(f"engramdb_request_duration_seconds_sum{_labels(endpoint=ep)} {h.sum!r}")
            out.append(f"engramdb_request_duration_seconds_count{_labels(endpoint=ep)} {h.total}")
        family("engramdb_connections_open", "gauge", "Open client connections.")
        out.append(f"engramdb_connections_open {connections_open}")
        family("engramdb_connections_total", "counter", "Client connections accepted.")
        out.append(f"engramdb_connections_total {self.connections_total}")
        family("engramdb_requests_in_flight", "gauge", "Requests being gathered off-loop.")
        out.append(f"engramdb_requests_in_flight {in_flight}")
        family("engramdb_process_resident_memory_bytes", "gauge", "Server resident set size.")
        out.append(f"engramdb_process_resident_memory_bytes {rss_bytes()}")
        family("engramdb_uptime_seconds", "gauge", "Seconds since the server started.")
        out.append(f"engramdb_uptime_seconds {time.time() - self.started:.3f}")
        fields: dict[str, list[str]] = {}
        for st in store_stats:
            table = str(st.get("table", ""))
            for k, v in st.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                name = "engramdb_store_" + "".join(c if c.isalnum() else "_" for c in k)
                fields.setdefault(name, []).append(f"{name}{_labels(table=table)} {_num(v)}")
        for st in view_stats:
            labels = _labels(table=st.get("table", ""), view=st.get("view", ""))
            for k, v in st.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                name = "engramdb_view_" + "".join(c if c.isalnum() else "_" for c in k)
                fields.setdefault(name, []).append(f"{name}{labels} {_num(v)}")
        for name in sorted(fields):
            source = "View" if name.startswith("engramdb_view_") else "Store"
            family(name, "gauge", f"{source}.stats() field, as reported.")
            out.extend(fields[name])
        return "\n".join(out) + "\n"
