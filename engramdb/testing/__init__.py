"""Reusable contract tests (need the ``dev`` extra: pytest).

`BackendContract` is the suite every I/O backend passes; subclass it per backend.
"""

from __future__ import annotations

from engramdb.testing.backends import BackendContract, DataFile

__all__ = ["BackendContract", "DataFile"]
