/* engramdb.io._columns: one pass over a batch of row ids that assembles each output row
 * from several column sources (an attached table's 256 B weight row + 8 B scale row).
 *
 * numpy has no gather into a strided destination: np.take needs a contiguous `out`, so a
 * row made of two columns costs a gather per column plus a strided copy of each (~0.6-0.75x
 * of one gather of whole rows here). This loop copies every column of row i straight into
 * place and prefetches the source lines of row i + AHEAD, so the extra random access of the
 * second column overlaps the first's (~0.9-0.97x of one whole-row gather).
 *
 * Optional: the package works without it (engramdb.io.gather falls back to numpy chunks).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_COLUMNS 8
#define AHEAD 12 /* rows ahead whose source lines are prefetched */

typedef struct {
    const uint8_t *base;
    Py_ssize_t width;
    Py_ssize_t rows;
    Py_ssize_t start;
} column_t;

static void release_all(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* take(out, ids, columns) -> -1 when every id was in range, else the position of the first
 * id out of range of some column (rows before it are written, none after).
 *   out:     writable C-contiguous buffer of len(ids) * row_bytes bytes
 *   ids:     C-contiguous buffer of int64 row ids
 *   columns: sequence of (source, width) in row order: source a C-contiguous buffer of
 *            rows * width bytes; row_bytes is the sum of the widths, and each column's
 *            bytes follow the previous column's in an output row. */
static PyObject *take(PyObject *self, PyObject *args) {
    PyObject *out_obj, *ids_obj, *cols_obj;
    if (!PyArg_ParseTuple(args, "OOO", &out_obj, &ids_obj, &cols_obj)) return NULL;
    PyObject *seq = PySequence_Fast(cols_obj, "columns must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k < 1 || k > MAX_COLUMNS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "1 to %d columns, got %zd", MAX_COLUMNS, k);
        return NULL;
    }
    Py_buffer views[MAX_COLUMNS + 2];
    int held = 0;
    column_t cols[MAX_COLUMNS];
    Py_ssize_t row_bytes = 0;
    for (Py_ssize_t c = 0; c < k; c++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, c);
        PyObject *src;
        Py_ssize_t width;
        if (!PyArg_ParseTuple(item, "On", &src, &width)) goto fail;
        if (PyObject_GetBuffer(src, &views[held], PyBUF_C_CONTIGUOUS) < 0) goto fail;
        held++;
        if (width <= 0 || views[held - 1].len % width != 0) {
            PyErr_Format(PyExc_ValueError,
                         "column %zd: width %zd does not tile a source of %zd bytes", c, width,
                         views[held - 1].len);
            goto fail;
        }
        cols[c].base = (const uint8_t *)views[held - 1].buf;
        cols[c].width = width;
        cols[c].rows = views[held - 1].len / width;
        cols[c].start = row_bytes;
        row_bytes += width;
    }
    if (PyObject_GetBuffer(ids_obj, &views[held], PyBUF_C_CONTIGUOUS) < 0) goto fail;
    held++;
    Py_buffer *ids_view = &views[held - 1];
    if (PyObject_GetBuffer(out_obj, &views[held], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto fail;
    held++;
    Py_buffer *out_view = &views[held - 1];
    if (ids_view->len % 8 != 0 || out_view->len != ids_view->len / 8 * row_bytes) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, %zd ids of %zd bytes need %zd",
                     out_view->len, ids_view->len / 8, row_bytes,
                     ids_view->len / 8 * row_bytes);
        goto fail;
    }
    const int64_t *ids = (const int64_t *)ids_view->buf;
    uint8_t *out = (uint8_t *)out_view->buf;
    Py_ssize_t n = ids_view->len / 8;
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            int64_t q = ids[i + AHEAD];
            for (Py_ssize_t c = 0; c < k; c++) {
                if ((uint64_t)q >= (uint64_t)cols[c].rows) continue;
                const uint8_t *p = cols[c].base + q * cols[c].width;
                for (Py_ssize_t b = 0; b < cols[c].width; b += 64) __builtin_prefetch(p + b);
                __builtin_prefetch(p + cols[c].width - 1);
            }
        }
        int64_t r = ids[i];
        uint8_t *dst = out + i * row_bytes;
        for (Py_ssize_t c = 0; c < k; c++) {
            if ((uint64_t)r >= (uint64_t)cols[c].rows) {
                bad = i;
                break;
            }
        }
        if (bad >= 0) break;
        for (Py_ssize_t c = 0; c < k; c++)
            memcpy(dst + cols[c].start, cols[c].base + r * cols[c].width, (size_t)cols[c].width);
    }
    Py_END_ALLOW_THREADS
    release_all(views, held);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(bad);
fail:
    release_all(views, held);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"take", take, METH_VARARGS,
     "take(out, ids, columns) -> -1, or the position of the first id out of range.\n"
     "Rows of int64 ids assembled from (source, width) columns into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_columns",
    "One-pass gather of rows assembled from several column sources.", -1, methods,
};

PyMODINIT_FUNC PyInit__columns(void) { return PyModule_Create(&module); }
