STOP: int
STATE_WORDS: int

def run(
    ring_fd: int,
    event_fd: int,
    state: int,
    spin_ns: int,
    nap_ns: int = 0,
    cq_tail: int = 0,
    sq_head: int = 0,
    sq_tail0: int = 0,
) -> int: ...
def landed() -> int: ...
def notify(
    state: int, event_fd: int, count: int, first: int = 0, lead: int = 0, after: int = 0
) -> int: ...
def spans(
    ids: object,
    base: object,
    rb: int,
    align: int,
    off: object,
    start: object,
    ip: object,
    span: object,
    sqes: object,
    pos: int,
    totals: object,
    n: int,
) -> int: ...
def spans_files(
    ids: object,
    parts: object,
    rb: int,
    align: int,
    off: object,
    start: object,
    ip: object,
    span: object,
    fd: object,
    src_fd: object,
    sqes: object,
    pos: int,
    totals: object,
    n: int,
) -> int: ...
def copy_out(dest: object, buf: object, slot: object, ip: object, lo: int) -> None: ...
def take_step(cq_head: object, cq_tail: object, cqes: object, left: int, total: int) -> int: ...
def route(
    cq_head: object,
    cq_tail: object,
    cqes: object,
    got: object,
    ends: object,
    counts: object,
    sums: object = None,
) -> int: ...
