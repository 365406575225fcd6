from collections.abc import Sequence

from numpy import ndarray

def take(out: ndarray, ids: ndarray, columns: Sequence[tuple[ndarray, int]]) -> int: ...
def in_heads(address: int, n: int, bounds: bytes) -> bool: ...
def global_of(ids: object, bounds: bytes, offsets: bytes, out: object) -> int: ...
def rows_match(address: int, n: int, rows: object, offsets: bytes) -> bool: ...
def take_rows(
    out: ndarray, table: ndarray, width: int, ids: ndarray, prefetch: bool = True
) -> int: ...
def take_grid(
    out: ndarray,
    offset: int,
    group: int,
    group_stride: int,
    table: ndarray,
    width: int,
    ids: ndarray,
    prefetch: bool = True,
    fd: int = -1,
    min_size: int = 0,
) -> int: ...
