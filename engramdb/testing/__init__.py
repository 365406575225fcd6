"""Reusable contract tests (need the ``dev`` extra: pytest).

`BackendContract` is the suite every I/O backend passes; subclass it per backend.
`TableContract` is the suite every table handle (`RowTable`) passes; subclass it per handle.
"""

from __future__ import annotations

from engramdb.testing.backends import BackendContract, DataFile
from engramdb.testing.tables import TableContract

__all__ = ["BackendContract", "DataFile", "TableContract"]
