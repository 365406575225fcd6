from collections.abc import Sequence

from numpy import ndarray

def take(out: ndarray, ids: ndarray, columns: Sequence[tuple[ndarray, int]]) -> int: ...
def take_rows(
    out: ndarray, table: ndarray, width: int, ids: ndarray, prefetch: bool = True
) -> int: ...
