/* engramdb.io._submitter: a thread that submits a ring's entries for the engine, asleep
 * between steps.
 *
 * A decode step's O_DIRECT reads cost ~1.8 us each in the kernel inside io_uring_enter
 * (256 reads at B=8: ~460 us on the engine's thread). The kernel's polling thread (SQPOLL)
 * moves that work to another core but spins between steps; on two CPUs the spinning stalled
 * the engine. A Python thread would need the GIL to make the system call and hand it back.
 * This loop runs without the GIL and calls io_uring_enter for the entries the engine hands
 * over (`notify`). A value >= STOP written to its eventfd ends it.
 *
 * Waking a sleeping thread costs the engine's thread 20-60 us here (eventfd_write and the
 * inter-processor interrupt behind it, inside a model step). Decode steps come at a steady
 * pace, so the loop learns the interval between hand-overs, sleeps on a timer until just
 * before the next is due and then watches a shared word for a short window: a hand-over
 * that comes inside it costs the engine an atomic add and a load, no system call. Outside
 * the window (or with spin_ns 0) the engine rings the eventfd, as a doorbell. The loop
 * watches by spinning, or (nap_ns > 0, for hosts with few CPUs, where a spinning thread
 * takes the core the kernel's I/O work needs) by short timed sleeps: the hand-over then
 * waits up to a nap before its reads start, and the engine still makes no system call.
 *
 * The shared words (int64, `state`): [PUSHED] entries handed over in all (the engine adds),
 * [AWAKE] 1 while the loop watches (the engine then skips the doorbell), [CAUGHT] / [RUNG]
 * hand-overs the watch caught / the doorbell woke it for, [SPUN_NS] time spent watching,
 * [AT_NS] the engine's clock at its last hand-over (the pace is learnt from it), [FIRST]
 * how many of the hand-over's entries go first, [HELD] hand-overs it held entries of back,
 * [LEAD] / [AFTER] the hand-over's place among other rings' (below).
 * The loop clears AWAKE and then reads PUSHED; the engine adds to PUSHED and then reads
 * AWAKE, both sequentially consistent: one of the two always sees the other's write, so a
 * hand-over is never left waiting for the next.
 *
 * A step's reads in layer order. Handed a whole step at once, the device serves its reads
 * interleaved: with two layers' 128 reads each, the first layer's were all in after
 * 1.8 ms at p50 (2.3 ms at p90), against 1.0 ms (1.1-1.2 ms) with the second layer's
 * submitted only once they were in, and the whole step took as long either way. So the
 * engine may say how many of a hand-over's entries go first (FIRST, written before
 * PUSHED): the loop submits those, waits until as many completions have been posted (the
 * completion queue's tail, read between naps; at most HOLD_NS, and no longer once another
 * hand-over or the doorbell comes), then submits the rest. The completions are posted by
 * this thread (it submitted the reads), so its naps end on time to see them.
 *
 * Readers of separate rings (a torch module per layer, each prefetching its rows right
 * after sampling) order their reads the same way across rings: the first layer's hand-over
 * carries a lead number (LEAD), and its loop, once that hand-over's reads are all in,
 * publishes the number (`landed`, one word for the process); a later layer's hand-over
 * carries the number it comes after (AFTER), and its loop submits only once `landed` has
 * reached it (again at most HOLD_NS, or until another hand-over or the doorbell).
 *
 * Entries it does not get to stay in the ring: the engine's own wait for completions
 * submits whatever is still pending (the kernel serializes the two), so nothing depends on
 * this thread for progress. Its submissions stop at the end of what was handed over (the
 * queue's head against its tail at the start plus PUSHED): a hold's deferred rest, once
 * the engine's wait has taken it, never takes the next step's entries, whose order their
 * own hand-over gives.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define STOP (1ULL << 62)
enum {
    PUSHED = 0, AWAKE = 1, CAUGHT = 2, RUNG = 3, SPUN_NS = 4, AT_NS = 5, FIRST = 6, HELD = 7,
    LEAD = 8, AFTER = 9, STATE_WORDS = 16
};
/* The newest lead number whose reads a loop of this process saw in (see the top of the
 * file): the rings of several readers (one per layer) order their reads through it. */
static int64_t landed = 0;
/* The longest a hand-over's later entries wait for its first part's reads (FIRST). */
#define HOLD_NS 3000000LL
/* How often a held hand-over looks at the completion queue, where the watch spins. */
#define HOLD_NAP_NS 20000LL

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* The submission queue's head, written by the kernel as it consumes entries, and the
 * queue's tail when the loop started (`run`): every entry pushed since was handed over, so
 * the entries handed over in all (PUSHED) end at tail0 + PUSHED. NULL: not known. */
typedef struct {
    const uint32_t *head;
    uint32_t tail0;
} Queue;

/* Of n entries handed over up to `pushed`, those the kernel has not consumed yet (the
 * engine's wait may have submitted some): a submission never reaches past them into
 * entries pushed but not handed over yet (the next step's, whose order the next hand-over
 * gives). */
static int64_t still_pending(const Queue *q, int64_t n, int64_t pushed) {
    if (q->head == NULL) return n;
    int32_t left = (int32_t)((uint32_t)(q->tail0 + (uint64_t)pushed) -
                             __atomic_load_n(q->head, __ATOMIC_ACQUIRE));
    return left <= 0 ? 0 : (left < n ? left : n);
}

/* Submit n entries: how many this call submitted (fewer where the engine's wait took some),
 * or -errno of a failed io_uring_enter. */
static long submit(int ring_fd, int64_t n) {
    int64_t sent = 0;
    while (sent < n) {
        int64_t left = n - sent;
        long s = syscall(__NR_io_uring_enter, ring_fd,
                         (unsigned)(left > 0xFFFFFFFFLL ? 0xFFFFFFFFu : (uint64_t)left), 0u, 0u,
                         NULL, (size_t)0);
        if (s < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EBUSY) break; /* the engine's wait submits */
            return -errno;
        }
        if (s == 0) break; /* nothing pending: the engine's wait took them */
        sent += s;
    }
    return (long)sent;
}

/* Sleep up to nap_ns or until the eventfd is readable: 1 if it is (the doorbell or STOP),
 * 0 after the nap, -errno of a failed poll. */
static int nap_on(int efd, int64_t nap_ns) {
    struct timespec ts = {(time_t)(nap_ns / 1000000000LL), (long)(nap_ns % 1000000000LL)};
    struct pollfd pfd = {efd, POLLIN, 0};
    int r = ppoll(&pfd, 1, &ts, NULL);
    if (r < 0) return errno == EINTR ? 0 : -errno;
    return r > 0;
}

/* The pace of hand-overs: a running mean of the interval and of its deviation, from the
 * engine's clock at each (t); *last 0 before the first. */
static void learn_pace(int64_t *last, int64_t *period, int64_t *dev, int64_t t) {
    if (*last) {
        int64_t d = t - *last;
        if (*period == 0 || d > 4 * *period || 4 * d < *period) {
            *period = d, *dev = d / 8; /* a new pace (the first, or a jump) */
        } else {
            int64_t e = d - *period;
            *period += e / 8;
            *dev += ((e < 0 ? -e : e) - *dev) / 8;
        }
    }
    *last = t;
}

/* How wide a window to watch either side of the next hand-over where the pace is steady
 * (two deviations, at least 50 us and two naps, at most spin_max). */
static int64_t watch_width(int64_t dev, int64_t nap, int64_t spin_max) {
    int64_t w = 2 * dev + 20000;
    if (w < 50000) w = 50000;
    if (w < 2 * nap) w = 2 * nap; /* a napping watch: at least two naps either side */
    return w > spin_max ? spin_max : w;
}

/* The sleep before the watch of a hand-over due at `due` (window w) into *ts, or NULL (sleep
 * until the doorbell) where the pace is unknown or the window passed. */
static struct timespec *sleep_before(struct timespec *ts, int64_t due, int64_t w, int64_t period) {
    int64_t t = now_ns();
    if (!(w > 0 && period > 0 && period < 200000000LL && t < due + w)) return NULL;
    int64_t sleep_ns = due - w - t;
    if (sleep_ns < 0) sleep_ns = 0;
    ts->tv_sec = (time_t)(sleep_ns / 1000000000LL);
    ts->tv_nsec = (long)(sleep_ns % 1000000000LL);
    return ts;
}

/* Watch PUSHED (AWAKE set: the engine skips the doorbell) until it moves past done or the
 * window ending at `end` closes (at least 2 w from now), by spinning or by naps of nap ns;
 * the doorbell or STOP ends a napping watch at once. 0, or -errno of a failed poll. */
static long watch(int64_t *st, int64_t done, int64_t end, int64_t w, int64_t nap, int efd) {
    long result = 0;
    __atomic_store_n(&st[AWAKE], 1, __ATOMIC_SEQ_CST);
    int64_t t0 = now_ns();
    if (end < t0 + 2 * w) end = t0 + 2 * w; /* woken late: still a whole window */
    int caught = 0;
    for (unsigned k = 1;; k++) {
        if (__atomic_load_n(&st[PUSHED], __ATOMIC_SEQ_CST) != done) {
            caught = 1;
            break;
        }
        if (nap > 0) {
            if (now_ns() >= end) break;
            int n = nap_on(efd, nap);
            if (n < 0) result = n;
            if (n != 0) break;
            continue;
        }
        relax();
        if ((k & 255) == 0) { /* another ring's loop on this CPU gets its turn */
            if (now_ns() >= end) break;
            sched_yield();
        }
    }
    if (caught) __atomic_add_fetch(&st[CAUGHT], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&st[SPUN_NS], now_ns() - t0, __ATOMIC_RELAXED);
    return result;
}

/* Sleep on the doorbell until the timer (tsp; NULL: none) ends: BELL_TIMER once it has,
 * BELL_AGAIN after the doorbell (counted in RUNG) or an interrupted call, BELL_STOP on a
 * value >= STOP, or -errno of a failed poll or read. */
enum { BELL_TIMER = 0, BELL_AGAIN = 1, BELL_STOP = 2 };
static long sleep_on_bell(int efd, struct timespec *tsp, int64_t *st) {
    struct pollfd pfd = {efd, POLLIN, 0};
    int r = ppoll(&pfd, 1, tsp, NULL);
    if (r < 0) return errno == EINTR ? BELL_AGAIN : -errno;
    if (r == 0) return BELL_TIMER;
    uint64_t v = 0;
    ssize_t n = read(efd, &v, sizeof v);
    if (n != (ssize_t)sizeof v) {
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) return BELL_AGAIN;
        return n < 0 ? -errno : -EIO;
    }
    if (v >= STOP) return BELL_STOP;
    __atomic_add_fetch(&st[RUNG], 1, __ATOMIC_RELAXED);
    return BELL_AGAIN;
}

/* Inside hand_over: nap until `ready` holds, for at most HOLD_NS, or until a hand-over
 * past `pushed`, the doorbell or STOP comes (the main loop reads those); a failed poll
 * returns its -errno from hand_over. */
#define HOLD_UNTIL(ready)                                                                   \
    do {                                                                                    \
        int64_t end_ = now_ns() + HOLD_NS, step_ = nap > 0 ? nap : HOLD_NAP_NS;             \
        __atomic_store_n(&st[AWAKE], 0, __ATOMIC_SEQ_CST); /* a hand-over now rings */      \
        while (!(ready) && __atomic_load_n(&st[PUSHED], __ATOMIC_SEQ_CST) == pushed &&      \
               now_ns() < end_) {                                                           \
            int r_ = nap_on(efd, step_);                                                    \
            if (r_ < 0) return r_;                                                          \
            if (r_ > 0) break;                                                              \
        }                                                                                   \
    } while (0)

/* Completions posted since the completion-queue tail was tail0. */
#define READ_SINCE(tail0) \
    ((int64_t)(uint32_t)(__atomic_load_n(cq_tail, __ATOMIC_ACQUIRE) - (tail0)))

/* Submit a hand-over of n entries in order (see the top of the file): after the lead it
 * comes after has landed, the first `first` alone and the rest once they are read (0: all
 * at once), and publish its own lead once all its reads are in. 1 if it held entries back
 * (for a lead, or between two submissions), 0 if not, -errno of a failed enter or poll. */
static long hand_over(int ring_fd, int efd, int64_t *st, const uint32_t *cq_tail,
                      const Queue *q, int64_t n, int64_t first, int64_t lead, int64_t after,
                      int64_t pushed, int64_t nap) {
    uint32_t tail0 = __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE);
    int held = 0;
    if (after > 0 && __atomic_load_n(&landed, __ATOMIC_ACQUIRE) < after) {
        HOLD_UNTIL(__atomic_load_n(&landed, __ATOMIC_ACQUIRE) >= after);
        held = 1;
    }
    long sent = 0;
    if (first > 0 && first < n) {
        sent = submit(ring_fd, still_pending(q, first, pushed));
        if (sent < 0) return sent;
        if (sent == first) { /* else the engine's wait took some: no reason to hold the rest */
            HOLD_UNTIL(READ_SINCE(tail0) >= first);
            held = 1;
        }
    }
    /* (after a hold, the engine's wait may have taken the rest, and pushed the next step) */
    long r = submit(ring_fd, still_pending(q, n - sent, pushed));
    if (r < 0) return r;
    if (lead > 0) {
        HOLD_UNTIL(READ_SINCE(tail0) >= n);
        int64_t was = __atomic_load_n(&landed, __ATOMIC_RELAXED);
        while (was < lead &&
               !__atomic_compare_exchange_n(&landed, &was, lead, 0, __ATOMIC_RELEASE,
                                            __ATOMIC_RELAXED)) {
        }
    }
    return held;
}

/* run(ring_fd, event_fd, state, spin_ns, nap_ns, cq_tail, sq_head, sq_tail0) -> 0 once told
 * to stop, or -errno of a failed read, poll or enter. state: the address of the shared words
 * (kept alive by the caller); spin_ns: the widest watch window (0: never watch, the doorbell
 * only); nap_ns: 0 to watch by spinning, else the length of each sleep of a napping watch;
 * cq_tail: the address of the ring's completion-queue tail (kept mapped by the caller; 0:
 * hand-overs are never held, FIRST is ignored); sq_head: the address of its submission
 * queue's head and sq_tail0 that queue's tail before the first hand-over (0: submissions
 * not bounded by what was handed over). */
static PyObject *run(PyObject *self, PyObject *args) {
    int ring_fd, efd;
    unsigned long long addr, tail_addr = 0, head_addr = 0;
    unsigned int tail0 = 0;
    long long spin_max, nap = 0;
    if (!PyArg_ParseTuple(args, "iiKL|LKKI", &ring_fd, &efd, &addr, &spin_max, &nap, &tail_addr,
                          &head_addr, &tail0))
        return NULL;
    int64_t *st = (int64_t *)(uintptr_t)addr;
    const uint32_t *cq_tail = (const uint32_t *)(uintptr_t)tail_addr;
    Queue q = {(const uint32_t *)(uintptr_t)head_addr, (uint32_t)tail0};
    long result = 0;
    Py_BEGIN_ALLOW_THREADS
    /* timed sleeps end when asked (the default slack of 50 us is a napping watch's length) */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    /* the words start at 0: anything handed over before this loop first looks (the engine
     * may notify before the new thread gets here) is still to submit */
    int64_t done = 0;
    int64_t last = 0, period = 0, dev = 0;
    for (;;) {
        int64_t p = __atomic_load_n(&st[PUSHED], __ATOMIC_SEQ_CST);
        if (p != done) {
            /* the pace from the engine's own clock at its hand-over: when this loop saw it
             * lags by a wake-up, a nap or a submission, and a late pace misses the next */
            int64_t t = __atomic_load_n(&st[AT_NS], __ATOMIC_RELAXED);
            if (t == 0) t = now_ns();
            int64_t first = __atomic_exchange_n(&st[FIRST], 0, __ATOMIC_ACQUIRE);
            int64_t lead = __atomic_exchange_n(&st[LEAD], 0, __ATOMIC_ACQUIRE);
            int64_t after = __atomic_exchange_n(&st[AFTER], 0, __ATOMIC_ACQUIRE);
            if (cq_tail != NULL && (first > 0 || lead > 0 || after > 0)) {
                long h = hand_over(ring_fd, efd, st, cq_tail, &q, p - done, first, lead, after,
                                   p, nap);
                if (h > 0) __atomic_add_fetch(&st[HELD], 1, __ATOMIC_RELAXED);
                result = h < 0 ? h : 0;
            } else {
                long s = submit(ring_fd, still_pending(&q, p - done, p));
                result = s < 0 ? s : 0;
            }
            if (result < 0) break;
            done = p;
            learn_pace(&last, &period, &dev, t);
            continue;
        }
        /* nothing handed over: watch around the next hand-over where the pace is steady
         * (two deviations either side, at least 50 us, at most spin_ns) */
        int64_t w = watch_width(dev, nap, spin_max), due = last + period;
        struct timespec ts;
        struct timespec *tsp = sleep_before(&ts, due, w, period);
        __atomic_store_n(&st[AWAKE], 0, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&st[PUSHED], __ATOMIC_SEQ_CST) != done) continue;
        long b = sleep_on_bell(efd, tsp, st);
        if (b < 0) {
            result = b;
            break;
        }
        if (b == BELL_STOP) break;
        if (b == BELL_AGAIN) continue;
        /* the timer: watch until the window closes */
        result = watch(st, done, due + w, w, nap, efd);
        if (result < 0) break;
    }
    __atomic_store_n(&st[AWAKE], 0, __ATOMIC_SEQ_CST);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* notify(state, event_fd, count, first=0, lead=0, after=0) -> 1 if it rang the doorbell,
 * 0 if the watching loop takes the entries, -errno of a failed eventfd write. first: how
 * many of the count go first (their completions are waited for before the rest is
 * submitted; 0: all at once); lead: a number (> 0) the loop publishes once these reads are
 * all in; after: a lead number these reads wait for (0: none). */
static PyObject *notify(PyObject *self, PyObject *args) {
    unsigned long long addr;
    int efd;
    long long count, first = 0, lead = 0, after = 0;
    if (!PyArg_ParseTuple(args, "KiL|LLL", &addr, &efd, &count, &first, &lead, &after))
        return NULL;
    int64_t *st = (int64_t *)(uintptr_t)addr;
    __atomic_store_n(&st[AT_NS], now_ns(), __ATOMIC_RELAXED); /* seen with PUSHED's add */
    __atomic_store_n(&st[FIRST], first > 0 && first < count ? first : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&st[LEAD], lead > 0 ? lead : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&st[AFTER], after > 0 ? after : 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&st[PUSHED], count, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&st[AWAKE], __ATOMIC_SEQ_CST)) return PyLong_FromLong(0);
    uint64_t one = 1;
    if (write(efd, &one, sizeof one) != (ssize_t)sizeof one) return PyLong_FromLong(-errno);
    return PyLong_FromLong(1);
}


/* hand_rows(state, event_fd, ids_address, n, bounds, offsets, dest_address, cmd_index, cmd,
 *           count_index, request_index, request) -> 1 or 0 as notify, 2: an id out of its
 *   head's range or n not a multiple of the heads (nothing written), -errno: the doorbell.
 *   A module's prefetch handed to its prefetch process in one call: the n int64 local ids at
 *   ids_address (id i of head i % H, checked below bounds[head] as unsigned: a negative id
 *   is huge) plus their head's offset written to the int64 slot at dest_address, then the
 *   words cmd_index = cmd, count_index = n, request_index = request, and one hand-over
 *   (notify's, count 1). */
static PyObject *hand_rows(PyObject *self, PyObject *args) {
    unsigned long long addr, ids_addr, dest_addr;
    int efd;
    Py_ssize_t n;
    Py_buffer b, off;
    long long cmd_i, cmd, count_i, req_i, req;
    if (!PyArg_ParseTuple(args, "KiKny*y*KLLLLL", &addr, &efd, &ids_addr, &n, &b, &off,
                          &dest_addr, &cmd_i, &cmd, &count_i, &req_i, &req))
        return NULL;
    Py_ssize_t h = b.len / 8;
    const int64_t *ids = (const int64_t *)(uintptr_t)ids_addr;
    int ok = h > 0 && off.len == b.len && n > 0 && n % h == 0 && ids != NULL && dest_addr;
    if (ok) {
        const uint64_t *bounds = (const uint64_t *)b.buf;
        const int64_t *offs = (const int64_t *)off.buf;
        for (Py_ssize_t i = 0; ok && i < n; i += h)
            for (Py_ssize_t j = 0; j < h; j++)
                if ((uint64_t)ids[i + j] >= bounds[j]) {
                    ok = 0;
                    break;
                }
        if (ok) {
            int64_t *dst = (int64_t *)(uintptr_t)dest_addr;
            for (Py_ssize_t i = 0; i < n; i += h)
                for (Py_ssize_t j = 0; j < h; j++)
                    dst[i + j] = (int64_t)((uint64_t)ids[i + j] + (uint64_t)offs[j]);
        }
    }
    PyBuffer_Release(&off);
    PyBuffer_Release(&b);
    if (!ok) return PyLong_FromLong(2);
    int64_t *st = (int64_t *)(uintptr_t)addr;
    __atomic_store_n(&st[cmd_i], cmd, __ATOMIC_RELAXED);
    __atomic_store_n(&st[count_i], (int64_t)n, __ATOMIC_RELAXED);
    __atomic_store_n(&st[req_i], req, __ATOMIC_RELAXED);
    __atomic_store_n(&st[AT_NS], now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(&st[FIRST], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&st[LEAD], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&st[AFTER], 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&st[PUSHED], 1, __ATOMIC_SEQ_CST); /* releases the ids and words */
    if (__atomic_load_n(&st[AWAKE], __ATOMIC_SEQ_CST)) return PyLong_FromLong(0);
    uint64_t one = 1;
    if (write(efd, &one, sizeof one) != (ssize_t)sizeof one) return PyLong_FromLong(-errno);
    return PyLong_FromLong(1);
}

/* The words a decode process's loop keeps its pace in (after notify's, below STATE_WORDS). */
enum { PACE_LAST = 10, PACE_PERIOD = 11, PACE_DEV = 12 };

/* wait_pushed(state, event_fd, done, spin_ns, nap_ns) -> PUSHED once it is past done, -1
 * once a value >= STOP was written to the eventfd, or -errno of a failed read or poll.
 *   The loop of a process (engramdb.decode_process) that does each hand-over's work
 *   itself, in Python, between calls: waits as `run` does, without the GIL (sleeps until
 *   just before the next hand-over is due at the pace learnt in the state's PACE_ words,
 *   then watches, so that a hand-over inside the window costs the engine no system call). */
static PyObject *wait_pushed(PyObject *self, PyObject *args) {
    unsigned long long addr;
    int efd;
    long long done, spin_max, nap;
    if (!PyArg_ParseTuple(args, "KiLLL", &addr, &efd, &done, &spin_max, &nap)) return NULL;
    int64_t *st = (int64_t *)(uintptr_t)addr;
    long long result = 0;
    Py_BEGIN_ALLOW_THREADS
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    for (;;) {
        int64_t p = __atomic_load_n(&st[PUSHED], __ATOMIC_SEQ_CST);
        if (p != done) {
            int64_t t = __atomic_load_n(&st[AT_NS], __ATOMIC_RELAXED);
            if (!t) t = now_ns();
            /* a hand-over within an eighth of the pace (and 0.5 ms) of the last is part of
             * the same step (a module's prefetch of each layer): the step's pace is kept */
            int64_t d = t - st[PACE_LAST];
            if (!(st[PACE_PERIOD] && st[PACE_LAST] && d >= 0 && 8 * d < st[PACE_PERIOD] &&
                  d < 500000))
                learn_pace(&st[PACE_LAST], &st[PACE_PERIOD], &st[PACE_DEV], t);
            result = p;
            /* busy: the caller reads PUSHED again (this call's first test) before it
             * sleeps, so a hand-over meanwhile needs no doorbell */
            __atomic_store_n(&st[AWAKE], 1, __ATOMIC_SEQ_CST);
            Py_BLOCK_THREADS
            return PyLong_FromLongLong(result);
        }
        int64_t w = watch_width(st[PACE_DEV], nap, spin_max);
        int64_t due = st[PACE_LAST] + st[PACE_PERIOD];
        struct timespec ts;
        struct timespec *tsp = sleep_before(&ts, due, w, st[PACE_PERIOD]);
        __atomic_store_n(&st[AWAKE], 0, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&st[PUSHED], __ATOMIC_SEQ_CST) != done) continue;
        long b = sleep_on_bell(efd, tsp, st);
        if (b < 0 || b == BELL_STOP) {
            result = b < 0 ? b : -1;
            break;
        }
        if (b == BELL_AGAIN) continue;
        long wr = watch(st, done, due + w, w, nap, efd);
        if (wr < 0) {
            result = wr;
            break;
        }
    }
    __atomic_store_n(&st[AWAKE], 0, __ATOMIC_SEQ_CST);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(result);
}

/* wait_word(state, index, value, fail, timeout_ns) -> 1 once state[index] >= value, -1 once
 *   state[fail] >= value (fail < 0: none), 0 after timeout_ns. Spins without the GIL (the
 *   engine's thread waiting for a decode process's rows, which are normally in already). */
static PyObject *wait_word(PyObject *self, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t index, fail;
    long long value, timeout;
    if (!PyArg_ParseTuple(args, "KnLnL", &addr, &index, &value, &fail, &timeout)) return NULL;
    const int64_t *st = (const int64_t *)(uintptr_t)addr;
    if (__atomic_load_n(&st[index], __ATOMIC_ACQUIRE) >= value) return PyLong_FromLong(1);
    int result = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t end = now_ns() + timeout;
    for (unsigned k = 1;; k++) {
        if (__atomic_load_n(&st[index], __ATOMIC_ACQUIRE) >= value) {
            result = 1;
            break;
        }
        if (fail >= 0 && __atomic_load_n(&st[fail], __ATOMIC_ACQUIRE) >= value) {
            result = -1;
            break;
        }
        relax();
        if ((k & 255) == 0) {
            if (now_ns() >= end) break;
            sched_yield();
        }
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* publish(state, index, value) -> None: state[index] = value, after every earlier store of
 * this thread (the rows and ids a decode process wrote before it). */
static PyObject *publish(PyObject *self, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t index;
    long long value;
    if (!PyArg_ParseTuple(args, "KnL", &addr, &index, &value)) return NULL;
    __atomic_store_n(&((int64_t *)(uintptr_t)addr)[index], value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* An id buffer of a step into b (C-contiguous int64); -1 with an exception set otherwise
 * (b then released). */
static int get_ids(PyObject *o, Py_buffer *b) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_ValueError, "ids must be int64");
        return -1;
    }
    return 0;
}

/* A step's id buffers as a fast sequence, once its geometry is checked; NULL with an
 * exception set otherwise. */
static PyObject *step_ids(long long rb, long long align, Py_ssize_t pos, PyObject *o_ids) {
    if (rb < 1 || align < 1 || (align & (align - 1)) || pos < 0) {
        PyErr_SetString(PyExc_ValueError, "rb >= 1, align a power of two, pos >= 0");
        return NULL;
    }
    return PySequence_Fast(o_ids, "ids must be a sequence of buffers");
}

/* A step's output buffer into b, at least need bytes (writable where asked); -1 with an
 * exception set otherwise (b then released). */
static int get_out(PyObject *o, Py_buffer *b, Py_ssize_t need, int writable, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (b->len < need) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError, "%s holds too few", what);
        return -1;
    }
    return 0;
}

/* Request k of a step, at file offset o: its offset, aligned start, the row's place in the
 * read and the read's length into the plan's columns, and the start and length into its
 * submission entry e (bytes 8 and 24, the 32 bits above the length 0). The length. */
static inline int64_t put_span(uint8_t *e, int64_t o, int64_t rb, int64_t align, int64_t *off,
                               int64_t *start, int64_t *ip, int64_t *span, Py_ssize_t k) {
    int64_t mask = ~(align - 1);
    int64_t st = o & mask;
    int64_t in = o - st;
    int64_t len = (in + rb + align - 1) & mask;
    off[k] = o;
    start[k] = st;
    ip[k] = in;
    span[k] = len;
    uint64_t uo = (uint64_t)st, ul = (uint64_t)len;
    memcpy(e + 8, &uo, 8);
    memcpy(e + 24, &ul, 8);
    return len;
}

/* spans(ids, base, rb, align, off, start, ip, span, sqes, pos, totals, n) -> the step's bytes
 *   A decode step's reads, one per row, written into a ring's submission entries in one pass
 *   (the numpy version is a dozen calls, each slow inside a model step whose compute has
 *   just evicted numpy from the CPU caches).
 *   ids:   sequence of C-contiguous int64 row id buffers (the step's layers, in order), n ids
 *          in all (any other count or item type: ValueError, nothing written)
 *   base:  int64 [n] each row's file base offset; rb: row bytes; align: a power of two
 *   off / start / ip / span: int64 [n] outputs: the row's file offset, its aligned read's
 *          start, the row's offset inside that read, and the read's length (ip + rb rounded
 *          up to align)
 *   sqes:  the ring's entries (64 B each), writable; entries pos .. pos + n - 1 get their
 *          offset (byte 8) and length (byte 24, the 32 bits above it 0); their other fields
 *          were written before
 *   totals: int64 [parts] output: the bytes asked for each id buffer's rows. */
static PyObject *spans(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_base, *o_off, *o_start, *o_ip, *o_span, *o_sqes, *o_tot;
    long long rb, align;
    Py_ssize_t pos, expect;
    if (!PyArg_ParseTuple(args, "OOLLOOOOOnOn", &o_ids, &o_base, &rb, &align, &o_off, &o_start,
                          &o_ip, &o_span, &o_sqes, &pos, &o_tot, &expect))
        return NULL;
    PyObject *seq = step_ids(rb, align, pos, o_ids);
    if (seq == NULL) return NULL;
    Py_ssize_t parts = PySequence_Fast_GET_SIZE(seq);
    Py_buffer idv[64];
    Py_buffer v[7];
    int nid = 0, held = 0;
    PyObject *result = NULL;
    Py_ssize_t n = 0;
    if (parts > 64) {
        PyErr_SetString(PyExc_ValueError, "at most 64 id buffers");
        goto done;
    }
    for (Py_ssize_t i = 0; i < parts; i++) {
        if (get_ids(PySequence_Fast_GET_ITEM(seq, i), &idv[nid]) < 0) goto done;
        n += idv[nid++].len / 8;
    }
    if (n != expect) {
        PyErr_Format(PyExc_ValueError, "%zd ids, the plan has %zd", n, expect);
        goto done;
    }
    PyObject *outs[5] = {o_base, o_off, o_start, o_ip, o_span};
    for (int i = 0; i < 5; i++) {
        if (get_out(outs[i], &v[held], n * 8, i, "base / off / start / ip / span") < 0) goto done;
        held++;
    }
    if (get_out(o_sqes, &v[held], (pos + n) * 64, 1, "the ring's entries") < 0) goto done;
    held++;
    if (get_out(o_tot, &v[held], (Py_ssize_t)nid * 8, 1, "totals") < 0) goto done;
    held++;
    int64_t *totals = (int64_t *)v[6].buf;
    const int64_t *base = (const int64_t *)v[0].buf;
    int64_t *off = (int64_t *)v[1].buf, *start = (int64_t *)v[2].buf;
    int64_t *ip = (int64_t *)v[3].buf, *span = (int64_t *)v[4].buf;
    uint8_t *sq = (uint8_t *)v[5].buf + pos * 64;
    int64_t total = 0;
    Py_ssize_t k = 0;
    for (int p = 0; p < nid; p++) {
        const int64_t *ids = (const int64_t *)idv[p].buf;
        Py_ssize_t m = idv[p].len / 8;
        int64_t part = 0;
        for (Py_ssize_t i = 0; i < m; i++, k++)
            part += put_span(sq + k * 64, ids[i] * rb + base[k], rb, align, off, start, ip, span, k);
        totals[p] = part;
        total += part;
    }
    result = PyLong_FromLongLong(total);
done:
    for (int i = 0; i < nid; i++) PyBuffer_Release(&idv[i]);
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    Py_DECREF(seq);
    return result;
}

/* spans_files(ids, parts, rb, align, off, start, ip, span, fd, src_fd, sqes, pos, totals, n)
 *   -> total bytes
 *   `spans` for a step whose tables may each span several files (a built table's shards):
 *   each row's file found by its id as well, its descriptor written into its entry (byte 4)
 *   and into fd / src_fd (int32 [n]: the O_DIRECT descriptor read, the table's own).
 *   parts: one (rows_per_file, base, dfds, fds) per id buffer: row r of the table is at
 *          base + (r % rows_per_file) * rb of file r // rows_per_file (rows_per_file 0: one
 *          file, row r at base + r * rb); dfds / fds: int32, a descriptor per file
 *   A negative id or one past the table's files: ValueError (entries up to it written, the
 *   ring's tail not moved: the caller reads the step another way). */
static PyObject *spans_files(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_parts, *o_off, *o_start, *o_ip, *o_span, *o_fd, *o_src, *o_sqes, *o_tot;
    long long rb, align;
    Py_ssize_t pos, expect;
    if (!PyArg_ParseTuple(args, "OOLLOOOOOOOnOn", &o_ids, &o_parts, &rb, &align, &o_off,
                          &o_start, &o_ip, &o_span, &o_fd, &o_src, &o_sqes, &pos, &o_tot,
                          &expect))
        return NULL;
    PyObject *seq = step_ids(rb, align, pos, o_ids);
    if (seq == NULL) return NULL;
    PyObject *pseq = PySequence_Fast(o_parts, "parts must be a sequence of tuples");
    if (pseq == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t parts = PySequence_Fast_GET_SIZE(seq);
    Py_buffer idv[16], dv[16], fv[16], v[8];
    long long rpf[16], base[16];
    int nid = 0, nd = 0, nf = 0, held = 0;
    PyObject *result = NULL;
    Py_ssize_t n = 0;
    if (parts > 16 || PySequence_Fast_GET_SIZE(pseq) != parts) {
        PyErr_SetString(PyExc_ValueError, "at most 16 id buffers, one part each");
        goto done;
    }
    for (Py_ssize_t i = 0; i < parts; i++) {
        if (get_ids(PySequence_Fast_GET_ITEM(seq, i), &idv[nid]) < 0) goto done;
        n += idv[nid++].len / 8;
        PyObject *dfds, *fds;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(pseq, i), "LLOO", &rpf[i], &base[i], &dfds,
                              &fds))
            goto done;
        if (get_out(dfds, &dv[nd], 4, 0, "a part's O_DIRECT descriptors") < 0) goto done;
        nd++;
        if (get_out(fds, &fv[nf], dv[i].len, 0, "a part's descriptors") < 0) goto done;
        nf++;
        if (rpf[i] < 0 || dv[i].len != fv[i].len || dv[i].len % 4) {
            PyErr_SetString(PyExc_ValueError, "a part's descriptors: int32, one per file");
            goto done;
        }
    }
    if (n != expect) {
        PyErr_Format(PyExc_ValueError, "%zd ids, the plan has %zd", n, expect);
        goto done;
    }
    PyObject *outs[6] = {o_off, o_start, o_ip, o_span, o_fd, o_src};
    for (int i = 0; i < 6; i++) {
        if (get_out(outs[i], &v[held], n * (i < 4 ? 8 : 4), 1, "off / start / ip / span / fd") < 0)
            goto done;
        held++;
    }
    if (get_out(o_sqes, &v[held], (pos + n) * 64, 1, "the ring's entries") < 0) goto done;
    held++;
    if (get_out(o_tot, &v[held], (Py_ssize_t)nid * 8, 1, "totals") < 0) goto done;
    held++;
    int64_t *off = (int64_t *)v[0].buf, *start = (int64_t *)v[1].buf;
    int64_t *ip = (int64_t *)v[2].buf, *span = (int64_t *)v[3].buf;
    int32_t *fd_out = (int32_t *)v[4].buf, *src_out = (int32_t *)v[5].buf;
    uint8_t *sq = (uint8_t *)v[6].buf + pos * 64;
    int64_t *totals = (int64_t *)v[7].buf;
    int64_t total = 0;
    Py_ssize_t k = 0;
    for (int p = 0; p < nid; p++) {
        const int64_t *ids = (const int64_t *)idv[p].buf;
        const int32_t *dfd = (const int32_t *)dv[p].buf, *sfd = (const int32_t *)fv[p].buf;
        int64_t files = dv[p].len / 4, per = rpf[p];
        Py_ssize_t m = idv[p].len / 8;
        int64_t part = 0;
        for (Py_ssize_t i = 0; i < m; i++, k++) {
            int64_t r = ids[i], file = per ? r / per : 0;
            if (r < 0 || file >= files) {
                PyErr_Format(PyExc_ValueError, "row id %lld is past the table's files",
                             (long long)r);
                goto done;
            }
            uint8_t *e = sq + k * 64;
            part += put_span(e, (r - file * per) * rb + base[p], rb, align, off, start, ip, span, k);
            fd_out[k] = dfd[file];
            src_out[k] = sfd[file];
            memcpy(e + 4, &dfd[file], 4);
        }
        totals[p] = part;
        total += part;
    }
    result = PyLong_FromLongLong(total);
done:
    for (int i = 0; i < nid; i++) PyBuffer_Release(&idv[i]);
    for (int i = 0; i < nd; i++) PyBuffer_Release(&dv[i]);
    for (int i = 0; i < nf; i++) PyBuffer_Release(&fv[i]);
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    Py_DECREF(seq);
    Py_DECREF(pseq);
    return result;
}

/* About how many lines of the rows ahead copy_out asks for before it copies the row at hand
 * (many more than the CPU keeps in flight only queue): 128 rows of 320 B from device-written
 * slots in 16-17 us instead of 26-27 (probes/copy_out.py) */
#define COPY_AHEAD_LINES 64

/* Asks for the lines of a w-byte row at p, for one read (prefetchnta). */
static inline void prefetch_row(const uint8_t *p, Py_ssize_t w) {
    for (Py_ssize_t b = 0; b < w; b += 64) __builtin_prefetch(p + b, 0, 0);
    __builtin_prefetch(p + w - 1, 0, 0);
}

/* copy_out(dest, buf, slot, ip, lo) -> None
 *   Rows lo .. lo + R - 1 of a step, out of the reader's staging buffer into dest (one
 *   memcpy each, in place of an index computation and a gather of units).
 *   dest: writable uint8 array whose last two axes hold one row contiguously (k, unit:
 *         strides unit and 1) and whose leading axes (any strides) are the R rows' grid, in
 *         submission order when walked in C order
 *   buf:  the staging buffer; slot / ip: int64 [n] each request's slot and the row's offset
 *         inside it (row i is at buf + slot[i] + ip[i]). */
static PyObject *copy_out(PyObject *self, PyObject *args) {
    PyObject *o_dest, *o_buf, *o_slot, *o_ip;
    Py_ssize_t lo;
    if (!PyArg_ParseTuple(args, "OOOOn", &o_dest, &o_buf, &o_slot, &o_ip, &lo)) return NULL;
    Py_buffer d, v[3];
    int held = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(o_dest, &d, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) return NULL;
    int nd = d.ndim;
    if (nd < 2 || nd > 16 || d.itemsize != 1 || d.strides[nd - 1] != 1 ||
        d.strides[nd - 2] != d.shape[nd - 1] || d.suboffsets != NULL) {
        PyErr_SetString(PyExc_ValueError, "dest must be uint8 [..., k, unit], rows contiguous");
        PyBuffer_Release(&d);
        return NULL;
    }
    Py_ssize_t rb = d.shape[nd - 2] * d.shape[nd - 1], rows = 1;
    for (int i = 0; i < nd - 2; i++) rows *= d.shape[i];
    PyObject *srcs[3] = {o_buf, o_slot, o_ip};
    for (int i = 0; i < 3; i++) {
        if (PyObject_GetBuffer(srcs[i], &v[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
        held++;
    }
    Py_ssize_t n = v[1].len / 8;
    if (lo < 0 || lo + rows > n || v[2].len / 8 < n) {
        PyErr_SetString(PyExc_ValueError, "rows past the step's requests");
        goto done;
    }
    const uint8_t *buf = (const uint8_t *)v[0].buf;
    const int64_t *slot = (const int64_t *)v[1].buf, *ip = (const int64_t *)v[2].buf;
    for (Py_ssize_t i = lo; i < lo + rows; i++) {
        if (slot[i] < 0 || ip[i] < 0 || slot[i] + ip[i] + rb > v[0].len) {
            PyErr_SetString(PyExc_ValueError, "a row past the staging buffer");
            goto done;
        }
    }
    Py_ssize_t idx[16] = {0};
    int lead = nd - 2;
    uint8_t *base = (uint8_t *)d.buf;
    /* the rows sit in lines a device wrote, not in this CPU's caches: their loads are asked
     * for `ahead` rows before their copy, so several rows' misses overlap */
    Py_ssize_t ahead = COPY_AHEAD_LINES / (rb / 64 + 2);
    if (ahead < 1) ahead = 1;
    if (rows < 2 * ahead) ahead = 0; /* a few rows: their misses overlap in the copies anyway */
    for (Py_ssize_t r = 0; r < rows && r < ahead; r++)
        prefetch_row(buf + slot[lo + r] + ip[lo + r], rb);
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t at = 0;
        for (int a = 0; a < lead; a++) at += idx[a] * d.strides[a];
        if (ahead && r + ahead < rows)
            prefetch_row(buf + slot[lo + r + ahead] + ip[lo + r + ahead], rb);
        memcpy(base + at, buf + slot[lo + r] + ip[lo + r], (size_t)rb);
        for (int a = lead - 1; a >= 0; a--) { /* the next row in C order */
            if (++idx[a] < d.shape[a]) break;
            idx[a] = 0;
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    PyBuffer_Release(&d);
    return result;
}

/* take_step(cq_head, cq_tail, cqes, left, total) -> 1, 0 or -1
 *   A step's completions taken at once when they are all in and whole: where the CQ holds
 *   exactly `left` completions (entries may wrap its end) and their results sum to `total`
 *   (the step's spans: no read returns more than it asked, so only whole reads meet it),
 *   the head moves past them and 1 is returned; 0: fewer are in (nothing taken); -1: more,
 *   or a read came back short or failed (nothing taken: the reader routes them one by one).
 *   cq_head / cq_tail: the ring's uint32 [1] head (writable) and tail; cqes: its entries
 *   (16 bytes: u64 user_data, s32 res, u32 flags), a power-of-two count. One call in place
 *   of the numpy reads of head and tail and a numpy sum (~10 us inside a model's step). */
static PyObject *take_step(PyObject *self, PyObject *args) {
    PyObject *o[3];
    long long left, total;
    if (!PyArg_ParseTuple(args, "OOOLL", &o[0], &o[1], &o[2], &left, &total)) return NULL;
    Py_buffer v[3];
    int held = 0;
    PyObject *result = NULL;
    for (int i = 0; i < 3; i++) {
        int flags = PyBUF_C_CONTIGUOUS | (i == 0 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(o[i], &v[held], flags) < 0) goto done;
        held++;
    }
    Py_ssize_t entries = v[2].len / 16;
    if (v[0].len < 4 || v[1].len < 4 || entries == 0 || (entries & (entries - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "take_step: bad head / tail / entries");
        goto done;
    }
    uint32_t *headp = (uint32_t *)v[0].buf;
    uint32_t head = *headp;
    uint32_t tail = __atomic_load_n((const uint32_t *)v[1].buf, __ATOMIC_ACQUIRE);
    long long count = (uint32_t)(tail - head);
    if (count != left) {
        result = PyLong_FromLong(count < left ? 0 : -1);
        goto done;
    }
    const uint8_t *cq = (const uint8_t *)v[2].buf;
    uint32_t mask = (uint32_t)(entries - 1);
    long long sum = 0;
    for (uint32_t i = 0; i < (uint32_t)count; i++) {
        int32_t res;
        memcpy(&res, cq + (size_t)((head + i) & mask) * 16 + 8, 4);
        sum += res;
    }
    if (sum != total) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    __atomic_store_n(headp, tail, __ATOMIC_RELEASE); /* the slots are free again */
    result = PyLong_FromLong(1);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* route(cq_head, cq_tail, cqes, got, ends, counts, sums=None) -> completions reaped
 *   Every completion now in a ring's CQ, in one pass: each read's result into
 *   got[user_data], its ticket's count (the first ticket whose end in ends is past the
 *   user_data) up by one, its result added to the ticket's sum where sums is given, and the
 *   slots freed (the head moved past them).
 *   cq_head / cq_tail: the ring's uint32 [1] head (writable) and tail; cqes: its CQ entries
 *   (16 bytes: u64 user_data, s32 res, u32 flags), a power-of-two count; got: int64 [n];
 *   ends: int64 [T], rising, the last the step's request count; counts, sums: writable
 *   int64 [T]. A ticket's reads all returned their whole spans exactly when its sum equals
 *   the sum of its spans (no read returns more than it asked): the reader checks a ticket
 *   with one comparison, not a numpy pass over its reads (~50 us inside a model's step).
 *   A user_data past the step's requests (or past got) is an error: nothing is written for
 *   it, the head still moves past it. */
static PyObject *route(PyObject *self, PyObject *args) {
    PyObject *o[7] = {NULL, NULL, NULL, NULL, NULL, NULL, Py_None};
    if (!PyArg_ParseTuple(args, "OOOOOO|O", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6]))
        return NULL;
    static const int writable[7] = {1, 0, 0, 1, 0, 1, 1};
    int nbuf = o[6] == Py_None ? 6 : 7;
    Py_buffer v[7];
    int held = 0;
    PyObject *result = NULL;
    for (int i = 0; i < nbuf; i++) {
        int flags = PyBUF_C_CONTIGUOUS | (writable[i] ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(o[i], &v[held], flags) < 0) goto done;
        held++;
    }
    Py_ssize_t entries = v[2].len / 16, n = v[3].len / 8, t = v[4].len / 8;
    if (v[0].len < 4 || v[1].len < 4 || entries == 0 || (entries & (entries - 1)) != 0 ||
        t == 0 || v[5].len < t * 8 || (nbuf == 7 && v[6].len < t * 8)) {
        PyErr_SetString(PyExc_ValueError,
                        "route: bad head / tail / entries / ends / counts / sums");
        goto done;
    }
    int64_t *sums = nbuf == 7 ? (int64_t *)v[6].buf : NULL;
    uint32_t *headp = (uint32_t *)v[0].buf;
    const uint32_t *tailp = (const uint32_t *)v[1].buf;
    const uint8_t *cq = (const uint8_t *)v[2].buf;
    int64_t *got = (int64_t *)v[3].buf, *counts = (int64_t *)v[5].buf;
    const int64_t *ends = (const int64_t *)v[4].buf;
    if (ends[t - 1] < n) n = ends[t - 1] < 0 ? 0 : ends[t - 1]; /* the step's requests */
    uint32_t head = *headp;
    uint32_t tail = __atomic_load_n(tailp, __ATOMIC_ACQUIRE); /* entries before it are written */
    uint32_t count = tail - head, mask = (uint32_t)(entries - 1), bad = 0;
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *e = cq + (size_t)((head + i) & mask) * 16;
        uint64_t ud;
        int32_t res;
        memcpy(&ud, e, 8);
        memcpy(&res, e + 8, 4);
        if (ud >= (uint64_t)n) {
            bad++;
            continue;
        }
        got[ud] = res;
        Py_ssize_t k = 0;
        while (k < t - 1 && (int64_t)ud >= ends[k]) k++;
        counts[k]++;
        if (sums) sums[k] += res;
    }
    __atomic_store_n(headp, tail, __ATOMIC_RELEASE); /* the slots are free again */
    if (bad) {
        PyErr_Format(PyExc_ValueError, "route: %u completions name no request", bad);
        goto done;
    }
    result = PyLong_FromUnsignedLong(count);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* landed() -> the newest lead number a loop of this process published. */
static PyObject *landed_lead(PyObject *self, PyObject *args) {
    return PyLong_FromLongLong(__atomic_load_n(&landed, __ATOMIC_ACQUIRE));
}

static PyMethodDef methods[] = {
    {"landed", landed_lead, METH_NOARGS,
     "landed() -> the newest lead number a loop of this process published (its reads in)."},
    {"run", run, METH_VARARGS,
     "run(ring_fd, event_fd, state, spin_ns, nap_ns=0, cq_tail=0, sq_head=0, sq_tail0=0) -> 0\n"
     "once a value >= STOP is written, or -errno.\n"
     "Submit the entries handed over (notify), watching around the next one where steady."},
    {"notify", notify, METH_VARARGS,
     "notify(state, event_fd, count, first=0, lead=0, after=0) -> 1: rang the doorbell,\n"
     "0: the watching loop takes them, -errno: the eventfd write failed. Hand count entries\n"
     "just pushed to the loop: the first `first` of them read before the rest is submitted,\n"
     "`lead` published once they are all read, none submitted before `after` was."},
    {"hand_rows", hand_rows, METH_VARARGS,
     "hand_rows(state, event_fd, ids, n, bounds, offsets, dest, cmd_index, cmd, count_index,\n"
     "request_index, request) -> 1 / 0 as notify, 2: ids out of range (nothing handed over),\n"
     "-errno. A module's prefetch: local ids checked and made global into a process's slot."},
    {"wait_pushed", wait_pushed, METH_VARARGS,
     "wait_pushed(state, event_fd, done, spin_ns, nap_ns) -> PUSHED once past done, -1 on\n"
     "STOP, -errno. A loop's wait for the engine's next hand-over (notify), at its pace."},
    {"wait_word", wait_word, METH_VARARGS,
     "wait_word(state, index, value, fail, timeout_ns) -> 1: state[index] >= value, -1:\n"
     "state[fail] >= value, 0: timed out. Spins without the GIL."},
    {"publish", publish, METH_VARARGS,
     "publish(state, index, value) -> None. A release store of one word."},
    {"spans_files", spans_files, METH_VARARGS,
     "spans_files(ids, parts, rb, align, off, start, ip, span, fd, src_fd, sqes, pos, totals, n)\n"
     "-> total bytes. spans for tables of several files: each row's descriptor written too."},
    {"spans", spans, METH_VARARGS,
     "spans(ids, base, rb, align, off, start, ip, span, sqes, pos, totals, n) -> total bytes.\n"
     "A step's row reads (offset, aligned start and length) into entries pos.. of a ring."},
    {"route", route, METH_VARARGS,
     "route(cq_head, cq_tail, cqes, got, ends, counts, sums=None) -> completions reaped.\n"
     "Every completion in a ring's CQ into got[user_data], its ticket's count and sum."},
    {"take_step", take_step, METH_VARARGS,
     "take_step(cq_head, cq_tail, cqes, left, total) -> 1: the step's `left` completions,\n"
     "whole (results summing to `total`), taken; 0: fewer are in; -1: more, or not whole."},
    {"copy_out", copy_out, METH_VARARGS,
     "copy_out(dest, buf, slot, ip, lo) -> None. A step's rows lo.. from the staging\n"
     "buffer into dest's grid of contiguous rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_submitter", "A ring submitter that sleeps between steps.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__submitter(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddObject(m, "STOP", PyLong_FromUnsignedLongLong(STOP)) < 0 ||
                      PyModule_AddIntConstant(m, "STATE_WORDS", STATE_WORDS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
