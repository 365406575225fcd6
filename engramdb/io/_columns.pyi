from collections.abc import Sequence

from numpy import ndarray

def take(out: ndarray, ids: ndarray, columns: Sequence[tuple[ndarray, int]]) -> int: ...
