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
from engramdb.io.sqpoll import (
    SQPOLL_ENV,
    SUBMITTER_ENV,
    held_submits,
    hold_in_caller,
    step_compiled,
)

# The shared words (int64): notify's layout (`engramdb.io._submitter`: PUSHED 0, AWAKE 1,
# AT_NS 5, the pace 10-12), then the command of the last hand-over, the hand-over whose ids
# are in, the hand-over that failed, the hand-over the companion has taken (its command and
# tokens read: the next may overwrite them), and from DONE on one word per layer: its rows.
PUSHED, CMD, KEYED, FAIL, TAKEN, DONE = 0, 16, 17, 18, 19, 32
STEP, CONTROL = 1, 2
STOP = 1 << 62  # `_submitter.STOP`: a value >= it written to the doorbell ends the companion
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


class _Companion:
    """The companion's loop: waits for a hand-over, runs it on its `Decoder`, publishes."""

    def __init__(self, fds: list[int]):
        ctl_r, rep_w, mem, self.bell, self.back = fds
        self.ctl = os.fdopen(ctl_r, "rb")
        self.rep = os.fdopen(rep_w, "wb")
        self.mem = mem
        self.dec: Decoder | None = None
        self.done = 0

    def send(self, msg: tuple[Any, ...]) -> None:
        pickle.dump(msg, self.rep, protocol=pickle.HIGHEST_PROTOCOL)
        self.rep.flush()

    def start(self, cfg: dict[str, Any]) -> None:
        if cfg["cpus"]:
            os.sched_setaffinity(0, cfg["cpus"])
        # this thread is no engine's: it submits its step's reads itself (no submitter or
        # polling thread), the first layer's alone at `push`, the rest at the next layer's fill
        os.environ[SUBMITTER_ENV] = os.environ[SQPOLL_ENV] = "0"
        hold_in_caller(True)
        n, tokens, ids, rb = cfg["layout"]
        lay = Layout(n, tokens, ids, rb)
        self.mm = mmap.mmap(self.mem, lay.size)
        self.words, self.tok, local, rows, data = lay.views(self.mm)
        self.db = open_db(cfg["path"], **cfg["open_options"])
        tables = {lay_: self.db[name] for lay_, name in cfg["tables"].items()}
        dec = self.dec = Decoder(
            tables, cfg["preset"], batch=cfg["batch"], prefetch=cfg["prefetch"],
            compressed=cfg["compressed"],
        )  # fmt: skip
        shape = dec.layer_shape
        self.local = [a.reshape(shape[:-1]) for a in local]
        self.rows = [a.reshape(shape[:-1]) for a in rows]
        self.data = [d.reshape(shape) for d in data]
        self.single = cfg["batch"] is None
        self.native = cfg["native"]
        self.spin, self.nap = cfg["spin"], cfg["nap"]
        self.addr = self.words.ctypes.data
        self.publish = step_compiled("publish") if self.native else None
        self.wait_pushed = step_compiled("wait_pushed") if self.native else None

    def put(self, index: int, value: int) -> None:
        """Publish a word (after the rows and ids this process wrote before it)."""
        if self.publish is not None:
            self.publish(self.addr, index, value)
        else:
            self.words[index] = value
            os.eventfd_write(self.back, 1)

    def step(self, seq: int) -> None:
        dec = self.dec
        assert dec is not None
        tok = int(self.tok[0]) if self.single else self.tok.copy()
        self.put(TAKEN, seq)  # the engine may write the next step's tokens now
        rows = dec.push(tok)
        for j, lay in enumerate(dec.layers):
            np.copyto(self.local[j], dec.local_ids(lay).reshape(self.local[j].shape))
            np.copyto(self.rows[j], rows[j].reshape(self.rows[j].shape))
        self.put(KEYED, seq)
        for j, lay in enumerate(dec.layers):
            dec.fill(self.data[j], layer=lay)
            self.put(DONE + j, seq)

    def control(self, msg: tuple[Any, ...]) -> Any:
        dec = self.dec
        if msg[0] == "start":
            self.start(msg[1])
            return None
        assert dec is not None
        if msg[0] == "reset":
            dec.reset()
            return None
        if msg[0] == "stats":
            return {
                "steps": dec.steps, "prefetched": dec.prefetched,
                "auto_switches": dec.auto_switches, "held_submits": held_submits(),
                "counters": [s.counters() for s in dec.stores],  # type: ignore[attr-defined]
                "warm": [s.memory()["warm"] for s in dec.stores],  # type: ignore[attr-defined]
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

    def wait(self) -> int:
        """The next hand-over (PUSHED), or -1 on STOP."""
        if self.dec is None:  # before the start message: the doorbell only
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
                if self.dec is None or int(self.words[CMD]) == CONTROL:
                    reply = self.control(pickle.load(self.ctl))
                    self.put(TAKEN, seq)
                    self.send(("reply", seq, reply))
                else:
                    self.step(seq)
            except Exception as e:  # the engine raises it at its next wait for this step
                try:
                    pickle.dumps(e)
                except Exception:
                    e = ProcessExited(f"{type(e).__name__}: {e}")
                self.send(("error", seq, e))
                if self.dec is not None:
                    self.put(TAKEN, seq)
                    self.put(FAIL, seq)
        if self.dec is not None:
            self.dec.reset()
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
