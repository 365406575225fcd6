"""The engine's side of a companion process (`DecoderProcess`, `PrefetchProcess`): starting it,
the shared memory, the doorbell, the control pipe and the waits for its words.

The companion (`engramdb.decode_companion`) is started as ``python -m
engramdb.decode_companion FDS`` with the descriptors of its control pipe, its reply pipe, the
shared memory and two eventfds. A hand-over writes its data into the shared memory, then adds
one to the shared word PUSHED (`engramdb.io._submitter.notify`: no system call while the
companion watches it); the companion publishes a word per result, which the engine waits
for without the GIL (`_submitter.wait_word`). Control messages (start, stats, reset...) go
through the pipes, pickled. Without the compiled ``_submitter`` (or ``ENGRAMDB_NATIVE=0``)
the hand-overs go through the eventfds both ways.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from engramdb.decode_companion import CMD, CONTROL, FAIL, PUSHED, STOP, TAKEN, WAIT_NS
from engramdb.errors import InvalidArgument, ProcessExited
from engramdb.io.sqpoll import spin_ns, step_compiled

#: the step errors kept for a later wait (the oldest go first)
_KEPT_ERRORS = 64


def checked_cpus(cpus: Any) -> None:
    """Refuse ``cpus`` that are not a non-empty subset of this process's CPUs."""
    if cpus is not None and not (cpus and set(cpus) <= os.sched_getaffinity(0)):
        mine = sorted(os.sched_getaffinity(0))
        raise InvalidArgument(f"cpus {cpus!r} must be some of this process's CPUs {mine}")


class CompanionClient:
    """The engine's end of one companion process (subclasses add the job's surface)."""

    _closed = True
    _what = "companion process"
    _own_db = False
    _db: Any = None

    def _launch(self, size: int, words: int) -> None:
        """Shared memory of ``size`` bytes (its first ``words`` int64 the shared words), the
        doorbells and the control pipes; the companion started."""
        notify, wait = step_compiled("notify"), step_compiled("wait_word")
        if notify is None or wait is None:  # the eventfds both ways
            notify = wait = None
        self._notify, self._wait = notify, wait
        mem = os.memfd_create("engramdb-companion", os.MFD_CLOEXEC)
        os.ftruncate(mem, size)
        ctl_r, ctl_w = os.pipe()
        rep_r, rep_w = os.pipe()
        bell, back = os.eventfd(0, os.EFD_CLOEXEC), os.eventfd(0, os.EFD_CLOEXEC)
        self._fds = {"mem": mem, "ctl": ctl_w, "rep": rep_r, "bell": bell, "back": back}
        theirs = (ctl_r, rep_w, mem, bell, back)
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)  # this engramdb, in the companion
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "engramdb.decode_companion", ",".join(map(str, theirs))]
        try:
            self._proc = subprocess.Popen(
                argv, pass_fds=theirs, stdin=subprocess.DEVNULL, env=env, close_fds=True
            )
        except BaseException:
            for fd in (*self._fds.values(), ctl_r, rep_w):
                os.close(fd)
            raise
        os.close(ctl_r)
        os.close(rep_w)
        self._ctl = os.fdopen(ctl_w, "wb")
        self._rep = os.fdopen(rep_r, "rb")
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._ctl, self._rep,
                                           bell, back, mem)  # fmt: skip
        self._mm = mmap.mmap(mem, size)
        self._words = np.frombuffer(self._mm, np.int64, words, 0)
        self._addr = self._words.ctypes.data
        self._seq = 0  # hand-overs made (PUSHED)
        self._errors: dict[int, BaseException] = {}  # step errors received, by hand-over

    def _start_job(self, job: dict[str, Any], cpus: Any, open_options: Any) -> None:
        """Send the companion its start message (``job``: its kind and its own settings, plus
        what every companion takes); a refusal closes this side and raises."""
        self._closed = False
        config = {
            **job, "cpus": cpus, "open_options": dict(open_options or {}),
            "native": self._wait is not None, "spin": spin_ns(), "nap": 0,
        }  # fmt: skip
        try:
            self._control(("start", config))
        except BaseException:
            self.close()
            raise

    def _ring(self, cmd: int) -> int:
        """Hand over: the command, PUSHED up by one, the doorbell where not watched (the
        hand-over's data written already: after `_taken`). Returns the hand-over's number."""
        self._words[CMD] = cmd
        self._seq += 1
        if self._notify is not None:
            if self._notify(self._addr, self._fds["bell"], 1) < 0:
                raise ProcessExited(f"the {self._what}'s doorbell failed")
        else:
            self._words[PUSHED] = self._seq
            os.eventfd_write(self._fds["bell"], 1)
        return self._seq

    def _taken(self, seq: int | None = None) -> None:
        """Wait until the companion has taken hand-over ``seq`` (None: the last) so that the
        next may overwrite what it read."""
        seq = self._seq if seq is None else seq
        if seq and self._words[TAKEN] < seq:
            self._await(TAKEN, seq, fail=False)

    def _control(self, msg: tuple[Any, ...]) -> Any:
        """Send a control message and wait for its reply (raising the companion's error)."""
        self._check()
        self._taken()
        try:
            pickle.dump(msg, self._ctl, protocol=pickle.HIGHEST_PROTOCOL)
            self._ctl.flush()
        except OSError as e:  # the companion is gone (its end of the pipe closed)
            raise self._exited() from e
        seq = self._ring(CONTROL)
        while True:
            kind, s, value = self._receive()
            if kind == "error" and s != seq:  # a step's error, for its wait
                self._keep(s, value)
                continue
            if kind == "error":
                raise value
            return value

    def _keep(self, seq: int, error: BaseException) -> None:
        errors = self._errors
        errors[seq] = error
        while len(errors) > _KEPT_ERRORS:
            del errors[min(errors)]

    def _receive(self) -> tuple[str, int, Any]:
        try:
            return pickle.load(self._rep)  # type: ignore[no-any-return]
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            raise self._exited() from e

    def _exited(self) -> ProcessExited:
        code = self._proc.poll()
        return ProcessExited(f"the {self._what} exited (code {code})")

    def _check(self) -> None:
        if self._closed:
            raise InvalidArgument(f"the {type(self).__name__} is closed")

    def _await(self, index: int, seq: int, fail: bool = True) -> None:
        """Wait until word ``index`` reaches hand-over ``seq``; raise the error of that
        hand-over (``fail``)."""
        if fail and seq in self._errors:
            raise self._errors[seq]
        while True:
            if self._wait is not None:
                r = self._wait(self._addr, index, seq, FAIL if fail else -1, WAIT_NS)
            else:
                r = self._await_slow(index, seq, fail)
            if r == 1:
                return
            if r == -1:
                self._raise_failed(seq)
            if self._proc.poll() is not None:
                raise self._exited()

    def _await_slow(self, index: int, seq: int, fail: bool) -> int:
        words, back = self._words, self._fds["back"]
        while True:
            if words[index] >= seq:
                return 1
            if fail and words[FAIL] >= seq:
                return -1
            if not select.select([back], [], [], WAIT_NS / 1e9)[0]:
                return 0
            os.eventfd_read(back)

    def _raise_failed(self, seq: int) -> None:
        """Raise hand-over ``seq``'s error (the companion sent it before its FAIL word)."""
        while seq not in self._errors:
            kind, s, value = self._receive()
            if kind == "error":
                self._keep(s, value)
        raise self._errors[seq]

    def _close_companion(self) -> None:
        """Stop the companion and free the shared memory (the caller dropped its views)."""
        self._words = np.empty(0, np.int64)
        self._finalizer()

    def _release_views(self) -> None:
        """Drop this side's views of the shared memory (before it is unmapped)."""

    def _describe(self) -> str:
        return ""

    def close(self) -> None:
        """Stop the companion (it closes its database) and free the shared memory."""
        if self._closed:
            return
        self._closed = True
        self._release_views()
        self._close_companion()
        if self._own_db:
            self._db.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid {self._proc.pid}"
        return f"{type(self).__name__}({self._describe()}, {state})"

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _shutdown(proc: subprocess.Popen[bytes], ctl: Any, rep: Any, *fds: int) -> None:
    """Ring STOP, wait for the companion (killed after 5 s), close the descriptors."""
    bell = fds[0]
    try:
        os.eventfd_write(bell, STOP)
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
    for f in (ctl, rep):
        try:
            f.close()
        except OSError:
            pass
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
