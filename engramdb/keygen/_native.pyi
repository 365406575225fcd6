from numpy import ndarray

def rows(
    ids: ndarray,
    bar: ndarray | None,
    dead: ndarray | None,
    hist_ids: ndarray,
    hist_bar: ndarray,
    out: ndarray,
    new_ids: ndarray,
    new_bar: ndarray,
    mult: ndarray,
    primes: ndarray,
    offsets: ndarray | None,
    group_step: ndarray,
    heads: int,
    fill: int,
    peft: bool,
) -> None: ...

def step(
    ids: ndarray,
    hist_ids: ndarray,
    hist_bar: ndarray,
    out: ndarray,
    mult: ndarray,
    primes: ndarray,
    offsets: ndarray | None,
    group_step: ndarray,
    heads: int,
    fill: int,
    peft: bool,
    check: bool,
    lo: int,
    hi: int,
    local: ndarray | None = None,
) -> int: ...
