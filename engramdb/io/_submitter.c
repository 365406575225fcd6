/* engramdb.io._submitter: a thread that submits a ring's entries for the engine, asleep
 * between steps.
 *
 * A decode step's O_DIRECT reads cost ~1.8 us each in the kernel inside io_uring_enter
 * (256 reads at B=8: ~460 us on the engine's thread). The kernel's polling thread (SQPOLL)
 * moves that work to another core but spins between steps; on two CPUs the spinning stalled
 * the engine. A Python thread would need the GIL to make the system call and hand it back.
 * This loop runs without the GIL: it sleeps in read() on an eventfd, and each value the
 * engine writes there (the number of entries it has just put in the ring) wakes it to call
 * io_uring_enter. A value >= STOP ends it.
 *
 * Entries it does not get to stay in the ring: the engine's own wait for completions
 * submits whatever is still pending (the kernel serializes the two), so nothing depends on
 * this thread for progress.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define STOP (1ULL << 62)

/* run(ring_fd, event_fd) -> 0 once told to stop, or -errno of a failed read or enter. */
static PyObject *run(PyObject *self, PyObject *args) {
    int ring_fd, efd;
    if (!PyArg_ParseTuple(args, "ii", &ring_fd, &efd)) return NULL;
    long result = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        uint64_t v = 0;
        ssize_t r = read(efd, &v, sizeof v);
        if (r != (ssize_t)sizeof v) {
            if (r < 0 && errno == EINTR) continue;
            result = r < 0 ? -errno : -EIO;
            break;
        }
        if (v >= STOP) break;
        while (v > 0) {
            long s = syscall(__NR_io_uring_enter, ring_fd, (unsigned)(v > 0xFFFFFFFFu ? 0xFFFFFFFFu : v),
                             0u, 0u, NULL, (size_t)0);
            if (s < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN || errno == EBUSY) break; /* the engine's wait submits */
                result = -errno;
                goto out;
            }
            if (s == 0) break; /* nothing pending: the engine's wait took them */
            v = (uint64_t)s >= v ? 0 : v - (uint64_t)s;
        }
    }
out:
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS,
     "run(ring_fd, event_fd) -> 0 once a value >= STOP is written, or -errno.\n"
     "Submit a ring's pending entries each time a count is written to event_fd."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_submitter", "A ring submitter that sleeps between steps.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__submitter(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObject(m, "STOP", PyLong_FromUnsignedLongLong(STOP)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
