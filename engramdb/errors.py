"""Every exception EngramDB raises.

`EngramDBError` is the root. Each subclass also inherits the builtin exception that a caller
would naturally catch for that kind of violation (``IndexError`` for an out-of-range id,
``TypeError`` for a wrong dtype, ``OSError`` for a corrupt file), so code written against
plain numpy keeps working.
"""

from __future__ import annotations


class EngramDBError(Exception):
    """Root of every EngramDB error."""


# --- caller input -------------------------------------------------------------------------
class InvalidArgument(EngramDBError, ValueError):
    """A value is outside what the call accepts (bad size, bad name, bad option)."""


class InvalidDtype(EngramDBError, TypeError):
    """An array has the wrong dtype, or a non-array was given where an array is required."""


class InvalidLayout(EngramDBError, TypeError):
    """An array has the right dtype but the wrong memory layout (non-contiguous, read-only)."""


class ShapeMismatch(EngramDBError, ValueError):
    """An array's shape does not match what the call requires."""


class RowIdOutOfRange(EngramDBError, IndexError):
    """A row id is negative or not below the table's (or head's) row count."""


class TokenIdOutOfRange(EngramDBError, IndexError):
    """A token id is outside the model's vocabulary."""


# --- database state -----------------------------------------------------------------------
class TableNotFound(EngramDBError, KeyError):
    """No table (or view) of that name in the database."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class TableExists(EngramDBError, FileExistsError):
    """The table already exists and the call did not ask to replace it."""


class DatabaseNotFound(EngramDBError, FileNotFoundError):
    """The path holds no EngramDB database."""


class IndexNotFound(EngramDBError, FileNotFoundError):
    """The table has no `engramdb index` output (run ``engramdb index DB CORPUS`` first)."""


class SourceError(EngramDBError, ValueError):
    """A build source cannot be used as given (wrong size, unknown format, missing tensor)."""


class InvalidSafetensors(SourceError):
    """A safetensors header breaks the format's rules (length bound, offsets, dtype/shape)."""


class StoreClosed(EngramDBError, ValueError):
    """The database or store was closed."""


class StaleView(EngramDBError, ValueError):
    """A view was built from a different version of its table."""


# --- file integrity -----------------------------------------------------------------------
class CorruptFile(EngramDBError, OSError):
    """A file's contents disagree with what the manifest or format requires."""


class CorruptManifest(CorruptFile):
    """The manifest cannot be parsed or violates the format."""


class TruncatedFile(CorruptFile):
    """A file is shorter than the manifest says."""


class SourceChanged(CorruptFile):
    """A source file of an attached table is not the file that was attached (size, mtime,
    inode, header or sampled bytes differ); the message names the file and what changed."""


class ChecksumMismatch(CorruptFile):
    """A file's checksum differs from the manifest's."""


class ReadError(EngramDBError, OSError):
    """A read failed (EIO, EBADF, short read) at a named file and offset."""


class MemoryLockRefused(EngramDBError, OSError):
    """``mlock`` was refused (``RLIMIT_MEMLOCK``, no ``CAP_IPC_LOCK``); the message names the
    limit and how to raise it."""


class BackendUnavailable(EngramDBError, RuntimeError):
    """An I/O backend cannot run here (kernel, sandbox, platform); the message says why."""


class ProcessExited(EngramDBError, RuntimeError):
    """A companion process (`engramdb.decode_process.DecoderProcess`) exited or stopped
    answering."""


class MissingDependency(EngramDBError, ImportError):
    """An optional extra is needed; the message names it."""


# --- engine adapters ----------------------------------------------------------------------
# The Mooncake EngramStore binding raises RuntimeError for most lookup failures; these classes
# also inherit RuntimeError so callers written against it keep catching what they caught.
class UnknownLayer(EngramDBError, ValueError, RuntimeError):
    """An operation named a layer id the EngramStore was not configured with."""


class LayerNotReady(EngramDBError, RuntimeError):
    """The layer is configured but has no table yet (not populated, not bound)."""


class LayerExists(EngramDBError, FileExistsError, RuntimeError):
    """populate/bind on a layer that already has tables (populate is create-only)."""


class LookupTypeError(InvalidDtype, RuntimeError):
    """A lookup or populate argument has the wrong type, dtype or memory layout."""


class LookupShapeError(ShapeMismatch, RuntimeError):
    """A lookup or populate argument has the wrong shape."""


class LookupBoundsError(RowIdOutOfRange, RuntimeError):
    """A per-head row id is outside ``[0, N_h)``."""
