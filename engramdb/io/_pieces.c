/* engramdb.io._pieces: one background-warm piece in one call, the GIL released once.
 *
 * Beside a decode loop the background warm reads a table in 1 MiB pieces, in the loop's
 * gaps (engramdb.io.foreground.read_in_gaps). Read from Python, a piece is several calls
 * that each release the GIL and take it back (the advice, the populate, the pacing wait);
 * torch releases the GIL in every op, so each take lands in the middle of the model's
 * compute and the engine's thread then waits for it (docs/probes.md, 34th stop). Here the
 * advice, the wait for the piece and the pacing sleep run without the GIL: the warm takes
 * it back once a piece.
 *
 * Optional: the package works without it (read_in_gaps then makes the calls one by one).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

#define SLICE_NS 10000000LL /* the pacing sleep looks at the stop flag this often */

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* read_piece(fd, offset, length, address, wake_ns, stop) -> int
 *   WILLNEED advice for [offset, offset + length) of fd, then the wait for it: the populate
 *   of the same bytes mapped at address (MADV_POPULATE_READ; MADV_WILLNEED on a kernel
 *   without it), or with address 0 a read of the piece's last byte. Then, with wake_ns > 0,
 *   a sleep until that CLOCK_MONOTONIC time (time.monotonic() * 1e9), in slices that end
 *   early once stop (a writable buffer, or None) holds a non-zero first byte. Returns the
 *   nanoseconds the advice and the read took (the sleep not counted); OSError where the
 *   populate or the read failed (EFAULT: an unreadable page), nothing slept then. */
static PyObject *read_piece(PyObject *self, PyObject *args) {
    int fd;
    long long offset, wake_ns;
    Py_ssize_t length;
    unsigned long long address;
    PyObject *o_stop;
    if (!PyArg_ParseTuple(args, "iLnKLO", &fd, &offset, &length, &address, &wake_ns, &o_stop))
        return NULL;
    if (length <= 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "read_piece: length must be > 0, offset >= 0");
        return NULL;
    }
    Py_buffer stop;
    int held = 0;
    if (o_stop != Py_None) {
        if (PyObject_GetBuffer(o_stop, &stop, PyBUF_WRITABLE) < 0) return NULL;
        held = 1;
        if (stop.len < 1) {
            PyBuffer_Release(&stop);
            PyErr_SetString(PyExc_ValueError, "read_piece: stop must hold a byte");
            return NULL;
        }
    }
    volatile const unsigned char *flag = held ? (volatile const unsigned char *)stop.buf : NULL;
    int err = 0;
    long long took = 0;
    Py_BEGIN_ALLOW_THREADS
    long long t0 = now_ns();
    (void)posix_fadvise(fd, (off_t)offset, (off_t)length, POSIX_FADV_WILLNEED);
    if (address) {
        if (madvise((void *)(uintptr_t)address, (size_t)length, MADV_POPULATE_READ) != 0) {
            err = errno;
            if (err == EINVAL) /* a kernel before 5.14: the advice only starts the reads */
                err = madvise((void *)(uintptr_t)address, (size_t)length, MADV_WILLNEED) != 0
                          ? errno
                          : 0;
        }
    } else {
        unsigned char b;
        if (pread(fd, &b, 1, (off_t)(offset + length - 1)) < 0) err = errno;
    }
    took = now_ns() - t0;
    while (!err && wake_ns > 0 && !(flag && *flag)) {
        long long left = wake_ns - now_ns();
        if (left <= 0) break;
        if (left > SLICE_NS) left = SLICE_NS;
        struct timespec ts = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
        nanosleep(&ts, NULL);
    }
    Py_END_ALLOW_THREADS
    if (held) PyBuffer_Release(&stop);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(took);
}

static PyMethodDef methods[] = {
    {"read_piece", read_piece, METH_VARARGS,
     "read_piece(fd, offset, length, address, wake_ns, stop) -> int. A warm piece's advice,\n"
     "the wait for it (populate at address, or its last byte read) and the pacing sleep until\n"
     "wake_ns, the GIL released once; the read's nanoseconds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pieces",
    "A background-warm piece (advice, wait, pacing sleep) in one call without the GIL.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__pieces(void) { return PyModule_Create(&module); }
