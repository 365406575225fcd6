"""The companion process of a `engramdb.decode_process.DecoderProcess`: the shared memory's
layout, and the loop that runs each hand-over of the engine on a `Decoder` of its own.

Started as ``python -m engramdb.decode_companion FDS`` by the engine's process (never by a
user): the descriptors of its control pipe, its reply pipe, the shared memory and the two
eventfds, inherited. It exits on STOP, when the engine's process exits, or when its pipes
close.
"""

from __future__ import annotations

import mmap
import os
import pickle
import sys
from typing import Any

import numpy as np

from engramdb.database import open as open_db
from engramdb.decode import Decoder
from engramdb.errors import InvalidArgument, ProcessExited
from engramdb.io.foreground import background_idle
from engramdb.io.sqpoll import (
    SQPOLL_ENV,
    SUBMITTER_ENV,
    held_submits,
    hold_in_caller,
    step_compiled,
)
from engramdb.read.autorule import PrefetchRule
from engramdb.read.decode_fill import mapped_tables
from engramdb.read.prefetch import take_kept
from engramdb.read.step_plan import StepTicket
from engramdb.read.steps import StepReader
from engramdb.read.table import LocalTable

# The shared words (int64): notify's layout (`engramdb.io._submitter`: PUSHED 0, AWAKE 1,
# AT_NS 5, the pace 10-12), then the command of the last hand-over, the hand-over whose ids
# are in, the hand-over that failed, the hand-over the companion has taken (its command and
# tokens read: the next may overwrite them), and from DONE on one word per layer: its rows.
PUSHED, CMD, KEYED, FAIL, TAKEN, DONE = 0, 16, 17, 18, 19, 32
STEP, CONTROL = 1, 2
STOP = 1 << 62  # `_submitter.STOP`: a value >= it written to the doorbell ends the companion
SWITCH_S = 0.0002  # the companion's GIL switch interval
WAIT_NS = 200_000_000  # how long a wait spins before it checks the companion is alive


def _align(n: int) -> int:
    return (n + 63) & ~63


class Layout:
    """Where the shared memory holds the words, the tokens, each layer's local and global ids
    and each layer's rows (offsets 64-byte aligned)."""

    def __init__(self, layers: int, tokens: int, ids: int, row_bytes: int):
        self.layers, self.tokens, self.ids, self.row_bytes = layers, tokens, ids, row_bytes
        self.words = DONE + layers
        at = _align(8 * self.words)
        self.tok_at = at
        at = _align(at + 8 * tokens)
        self.local_at = [at + i * _align(8 * ids) for i in range(layers)]
        at += layers * _align(8 * ids)
        self.rows_at = [at + i * _align(8 * ids) for i in range(layers)]
        at += layers * _align(8 * ids)
        self.data_at = [at + i * _align(ids * row_bytes) for i in range(layers)]
        self.size = max(at + layers * _align(ids * row_bytes), mmap.PAGESIZE)

    def views(self, mm: mmap.mmap) -> tuple[Any, ...]:
        """(words, tokens, local ids per layer, global ids per layer, rows per layer)."""
        words = np.frombuffer(mm, np.int64, self.words, 0)
        tok = np.frombuffer(mm, np.int64, self.tokens, self.tok_at)
        local = [np.frombuffer(mm, np.int64, self.ids, a) for a in self.local_at]
        rows = [np.frombuffer(mm, np.int64, self.ids, a) for a in self.rows_at]
        n = self.ids * self.row_bytes
        data = [np.frombuffer(mm, np.uint8, n, a) for a in self.data_at]
        return words, tok, local, rows, data


class RowsLayout:
    """A `engramdb.prefetch_process.PrefetchProcess`'s shared memory: the words (from
    `DONE` on, per table: the request its rows answer, then the request each table's ids
    belong to, then how many ids), and per table room for ``max_rows`` ids and their rows."""

    def __init__(self, row_bytes: list[int], max_rows: int):
        n = self.slots = len(row_bytes)
        self.max_rows, self.row_bytes = max_rows, row_bytes
        self.words = DONE + 3 * n
        self.req, self.count = DONE + n, DONE + 2 * n
        at = _align(8 * self.words)
        self.ids_at = [at + i * _align(8 * max_rows) for i in range(n)]
        at += n * _align(8 * max_rows)
        self.data_at = []
        for rb in row_bytes:
            self.data_at.append(at)
            at += _align(max_rows * rb)
        self.size = max(at, mmap.PAGESIZE)

    def views(self, mm: mmap.mmap) -> tuple[Any, ...]:
        """(words, ids per table, rows ``[max_rows, row bytes]`` per table)."""
        words = np.frombuffer(mm, np.int64, self.words, 0)
        ids = [np.frombuffer(mm, np.int64, self.max_rows, a) for a in self.ids_at]
        data = [
            np.frombuffer(mm, np.uint8, self.max_rows * rb, a).reshape(self.max_rows, rb)
            for a, rb in zip(self.data_at, self.row_bytes)
        ]
        return words, ids, data


def portable(e: Exception) -> Exception:
    """``e`` where it pickles (the engine raises that very error), else `ProcessExited`."""
    try:
        pickle.dumps(e)
    except Exception:
        return ProcessExited(f"{type(e).__name__}: {e}")
    return e


class _DecodeJob:
    """A `DecoderProcess`'s side: each hand-over's tokens through a `Decoder`."""

    def __init__(self, c: _Companion, cfg: dict[str, Any]):
        self.c = c
        n, tokens, ids, rb = cfg["layout"]
        lay = Layout(n, tokens, ids, rb)
        c.map(lay.size, lay.words)
        _, self.tok, local, rows, data = lay.views(c.mm)
        tables = {lay_: c.db[name] for lay_, name in cfg["tables"].items()}
        dec = self.dec = Decoder(
            tables, cfg["preset"], batch=cfg["batch"], prefetch=cfg["prefetch"],
            compressed=cfg["compressed"],
        )  # fmt: skip
        shape = dec.layer_shape
        self.local = [a.reshape(shape[:-1]) for a in local]
        self.rows = [a.reshape(shape[:-1]) for a in rows]
        self.data = [d.reshape(shape) for d in data]
        self.single = cfg["batch"] is None

    def step(self, seq: int) -> None:
        dec, put = self.dec, self.c.put
        tok = int(self.tok[0]) if self.single else self.tok.copy()
        put(TAKEN, seq)  # the engine may write the next step's tokens now
        rows = dec.push(tok)
        for j, lay in enumerate(dec.layers):
            np.copyto(self.local[j], dec.local_ids(lay).reshape(self.local[j].shape))
            np.copyto(self.rows[j], rows[j].reshape(self.rows[j].shape))
        put(KEYED, seq)
        for j, lay in enumerate(dec.layers):
            dec.fill(self.data[j], layer=lay)
            put(DONE + j, seq)

    def control(self, msg: tuple[Any, ...]) -> Any:
        dec = self.dec
        if msg[0] == "reset":
            dec.reset()
            return None
        if msg[0] == "stats":
            return {
                "steps": dec.steps, "prefetched": dec.prefetched,
                "auto_switches": dec.auto_switches, "held_submits": held_submits(),
                **_table_stats(dec.stores),
            }  # fmt: skip
        if msg[0] == "prefill":
            rows = dec.prefill(msg[1])
            local = [dec.local_ids(lay).copy() for lay in dec.layers]
            data = []
            for lay in dec.layers:
                buf = np.empty(dec.layer_shape, np.uint8)
                dec.fill(buf, layer=lay)
                data.append(buf)
            return rows, local, data, dec.layer_shape, dec.pending_shape
        raise InvalidArgument(f"unknown control message {msg[0]!r}")

    def close(self) -> None:
        self.dec.reset()


def _table_stats(stores: list[Any]) -> dict[str, Any]:
    return {
        "counters": [s.counters() for s in stores],
        "warm": [s.memory()["warm"] for s in stores],
    }


class _RowsJob:
    """A `PrefetchProcess`'s side: each table's latest requested ids read into its rows,
    by the same rule and step reader a `Decoder` uses (resident rows gathered from the
    mapping, cold ones read with ``O_DIRECT``)."""

    def __init__(self, c: _Companion, cfg: dict[str, Any]):
        self.c = c
        lay = self.lay = RowsLayout(cfg["row_bytes"], cfg["max_rows"])
        c.map(lay.size, lay.words)
        self.words, self.ids, self.data = lay.views(c.mm)
        self.stores = [c.db[name] for name in cfg["tables"]]
        local = [s if isinstance(s, LocalTable) else None for s in self.stores]
        self.local = local
        self.rule = PrefetchRule(local, "auto", 0.1)
        self.direct, _, _ = mapped_tables(local)
        self.reader: StepReader | None = None
        self.reader_ok = StepReader.available()
        self.taken = [0] * lay.slots
        self.requests = self.read = self.gathered = 0
        self.joint = 0  # hand-overs whose cold rows of several tables were read as one step

    def step(self, seq: int) -> None:
        words, lay = self.words, self.lay
        new = []
        for j in range(lay.slots):
            req = int(words[lay.req + j])
            if req > self.taken[j]:
                self.taken[j] = req
                n = int(words[lay.count + j])
                new.append((j, req, self.ids[j][:n].copy()))
        self.c.put(TAKEN, max([seq, *(x[1] for x in new)]))  # their slots may be rewritten
        done: list[int] = []
        try:
            self.serve(new, done)
        except Exception as e:  # raised to the engine by each request that has no rows
            e = portable(e)
            for j, req, _ in new:
                if j not in done:
                    self.c.send(("error", req, e))
            self.c.put(FAIL, max(req for _, req, _ in new))

    def serve(self, new: list[tuple[int, int, np.ndarray]], done: list[int]) -> None:
        """Read each request's rows into its table's slot, publishing each as it lands."""
        jobs: list[Any] = []
        plan = []
        for j, req, flat in new:
            self.requests += 1
            store = self.local[j]
            t: Any = None
            if store is not None and self.rule.want(j, store, flat):
                if self.rule.cold[j] and self.reader_ok and self.direct[j] is not None:
                    t = StepTicket(flat)
                    jobs.append((store, flat, t))
                else:
                    t = store.prefetcher.submit_trusted(flat, keep_rows=True)
            plan.append((j, req, flat, t))
        if jobs:
            reader = self.reader
            if reader is None:
                reader = self.reader = StepReader()
            if not reader.submit(jobs, ordered=True):
                plan = [(j, r, f, None if type(t) is StepTicket else t) for j, r, f, t in plan]
            elif len(jobs) > 1:
                self.joint += 1
        for j, req, flat, t in plan:
            dest = self.data[j][: flat.size]
            self.finish(j, flat, t, dest)
            self.c.put(DONE + j, req)
            done.append(j)

    def finish(self, j: int, flat: np.ndarray, t: Any, dest: np.ndarray) -> None:
        store = self.local[j]
        reader = self.reader
        if type(t) is StepTicket and reader is not None:
            if reader.finish_into(dest.reshape(dest.shape[0], -1, reader.step_unit), t):
                self.read += 1
                return
        elif t is not None and not t.cancel():  # (one still queued is withdrawn: read below)
            t.wait()  # raises a failed read's error
            if take_kept(t, flat, dest):
                self.read += 1
                return
        self.gathered += 1
        if store is not None:
            store.gather_small(flat, dest)
        else:
            self.stores[j].gather(flat, dest)

    def control(self, msg: tuple[Any, ...]) -> Any:
        if msg[0] == "stats":
            return {
                "requests": self.requests, "read": self.read, "gathered": self.gathered,
                "auto_switches": self.rule.switches, "joint_reads": self.joint,
                "held_submits": held_submits(),
                **_table_stats(self.stores),
            }  # fmt: skip
        raise InvalidArgument(f"unknown control message {msg[0]!r}")

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


class _Companion:
    """The companion's loop: waits for a hand-over, runs it on its job, publishes."""

    def __init__(self, fds: list[int]):
        ctl_r, rep_w, mem, self.bell, self.back = fds
        self.ctl = os.fdopen(ctl_r, "rb")
        self.rep = os.fdopen(rep_w, "wb")
        self.mem = mem
        self.job: _DecodeJob | _RowsJob | None = None
        self.done = 0

    def send(self, msg: tuple[Any, ...]) -> None:
        pickle.dump(msg, self.rep, protocol=pickle.HIGHEST_PROTOCOL)
        self.rep.flush()

    def map(self, size: int, words: int) -> None:
        """Map the shared memory (``size`` bytes, ``words`` of them the shared words)."""
        self.mm = mmap.mmap(self.mem, size)
        self.words = np.frombuffer(self.mm, np.int64, words, 0)
        self.addr = self.words.ctypes.data

    def start(self, cfg: dict[str, Any]) -> None:
        if cfg["cpus"]:
            os.sched_setaffinity(0, cfg["cpus"])
        # this thread is no engine's: it submits its reads itself (no submitter or polling
        # thread), a step's first layer (or table) alone, the rest at the wait for the next
        # layer's (table's) rows
        os.environ[SUBMITTER_ENV] = os.environ[SQPOLL_ENV] = "0"
        hold_in_caller(True)
        # the loop takes the GIL back within 0.2 ms of a hand-over where a library thread
        # (the tables' background warm) runs Python, not the default 5 ms
        sys.setswitchinterval(SWITCH_S)
        background_idle(True)  # the tables' warm never takes this CPU from the loop
        self.native = cfg["native"]
        self.spin, self.nap = cfg["spin"], cfg["nap"]
        self.publish = step_compiled("publish") if self.native else None
        self.wait_pushed = step_compiled("wait_pushed") if self.native else None
        self.db = open_db(cfg["path"], **cfg["open_options"])
        kind = _RowsJob if cfg["kind"] == "rows" else _DecodeJob
        self.job = kind(self, cfg)

    def put(self, index: int, value: int) -> None:
        """Publish a word (after the rows and ids this process wrote before it)."""
        if self.publish is not None:
            self.publish(self.addr, index, value)
        else:
            self.words[index] = value
            os.eventfd_write(self.back, 1)

    def control(self, msg: tuple[Any, ...]) -> Any:
        if msg[0] == "start":
            self.start(msg[1])
            return None
        assert self.job is not None
        return self.job.control(msg)

    def wait(self) -> int:
        """The next hand-over (PUSHED), or -1 on STOP."""
        if self.job is None:  # before the start message: the doorbell only
            v = os.eventfd_read(self.bell)
            return -1 if v >= STOP else self.done + 1
        fn = self.wait_pushed
        if fn is not None:
            return int(fn(self.addr, self.bell, self.done, self.spin, self.nap))
        while int(self.words[PUSHED]) == self.done:
            if os.eventfd_read(self.bell) >= STOP:
                return -1
        return int(self.words[PUSHED])

    def run(self) -> None:
        while True:
            seq = self.wait()
            if seq < 0:
                break
            self.done = seq
            try:
                if self.job is None or int(self.words[CMD]) == CONTROL:
                    reply = self.control(pickle.load(self.ctl))
                    self.put(TAKEN, seq)
                    self.send(("reply", seq, reply))
                else:
                    self.job.step(seq)
            except Exception as e:  # the engine raises it at its next wait for this step
                self.send(("error", seq, portable(e)))
                if self.job is not None:
                    self.put(TAKEN, seq)
                    self.put(FAIL, seq)
        if self.job is not None:
            self.job.close()
            self.db.close()


def main(argv: list[str]) -> None:
    import ctypes
    import signal

    parent = os.getppid()
    try:  # exit with the engine's process
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return
    _Companion([int(x) for x in argv[1].split(",")]).run()


if __name__ == "__main__":
    main(sys.argv)
