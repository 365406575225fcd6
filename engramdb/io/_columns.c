/* engramdb.io._columns: compiled gathers of table rows.
 *
 * take_rows: rows of one table. np.take copies row after row, so its misses queue one row
 * at a time behind the CPU's own look-ahead; this loop asks for the source lines of the row
 * AHEAD rows on (into L2) while it copies the current one, so rows that miss the L2 arrive
 * sooner: 1.05x np.take on one thread for 256 B rows coming from memory, more where they
 * come from the last-level cache (figures: docs/io.md).
 *
 * take: rows assembled from several column sources (an attached table's 256 B weight row +
 * 8 B scale row). numpy has no gather into a strided destination: np.take needs a
 * contiguous `out`, so a row made of two columns costs a gather per column plus a strided
 * copy of each. This loop copies every column straight into place, source by source within
 * chunks of CHUNK rows (the chunk's output lines stay in L1/L2 between the sources'
 * passes), each source with its own prefetch stream. A column may also be a byte range of
 * wider source rows placed anywhere in the output row (source, width, stride, skip, dst):
 * an attached row's weight bytes less those kept in a RAM record, and that record's pieces
 * (engramdb.read.resident); columns of one source are copied in one pass.
 *
 * take_grid: take_rows into runs of rows a fixed stride apart (a decoder's layer slice).
 *
 * in_heads: a decode step's per-head bounds check of ids at a tensor's address; global_of:
 * that check, the ids' layout and their global rows in one pass; rows_match: whether such
 * ids are exactly the global rows a decoder filled.
 *
 * Optional: the package works without it (engramdb.io.gather falls back to numpy).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define MAX_COLUMNS 8
#define AHEAD 32 /* rows ahead whose source lines are prefetched */
#define CHUNK 256 /* rows per chunk of a several-column gather */

typedef struct {
    const uint8_t *src;  /* the source buffer */
    int joined;          /* same source and stride as the column before: copied in its pass */
    const uint8_t *base; /* row r's bytes start at base + r * stride */
    Py_ssize_t width;    /* bytes copied per row */
    Py_ssize_t stride;   /* bytes between the source's rows */
    Py_ssize_t rows;
    Py_ssize_t start;    /* where the bytes go in an output row */
} column_t;

/* Asks for the source lines of a row of w bytes at p (into L2: prefetcht2). */
static inline void prefetch_src(const uint8_t *p, Py_ssize_t w) {
    for (Py_ssize_t b = 0; b < w; b += 64) __builtin_prefetch(p + b, 0, 1);
    __builtin_prefetch(p + w - 1, 0, 1);
}

/* One source: rows of width w, the lines of row i + AHEAD asked for while row i is copied
 * (without prefetch, a plain copy loop: rows already in the CPU caches copy faster). Row i
 * goes to out + (i / group) * gstride + (i % group) * w: runs of group rows back to back,
 * the runs gstride bytes apart (take_one: one run, out contiguous). */
static Py_ssize_t take_runs(uint8_t *out, const uint8_t *base, Py_ssize_t rows, Py_ssize_t w,
                            const int64_t *ids, Py_ssize_t n, int prefetch, Py_ssize_t group,
                            Py_ssize_t gstride) {
    Py_ssize_t first = n < AHEAD ? n : AHEAD;
    if (prefetch)
        for (Py_ssize_t i = 0; i < first; i++)
            if ((uint64_t)ids[i] < (uint64_t)rows) prefetch_src(base + ids[i] * w, w);
    for (Py_ssize_t i = 0, k = 0; i < n; i++) {
        if (prefetch && i + AHEAD < n && (uint64_t)ids[i + AHEAD] < (uint64_t)rows)
            prefetch_src(base + ids[i + AHEAD] * w, w);
        if ((uint64_t)ids[i] >= (uint64_t)rows) return i;
        memcpy(out + k * w, base + ids[i] * w, (size_t)w);
        if (++k == group) {
            k = 0;
            out += gstride;
        }
    }
    return -1;
}

static Py_ssize_t take_one(uint8_t *out, const uint8_t *base, Py_ssize_t rows, Py_ssize_t w,
                           const int64_t *ids, Py_ssize_t n, int prefetch) {
    return take_runs(out, base, rows, w, ids, n, prefetch, n, n * w);
}

static void release_all(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* The buffers of a one-table gather into views[0..2]: the table and the ids C-contiguous,
 * out C-contiguous and writable; *held counts those taken (release_all them). -1 on error. */
static int table_ids_out(PyObject *table, PyObject *ids, PyObject *out, Py_buffer *views,
                         int *held) {
    if (PyObject_GetBuffer(table, &views[*held], PyBUF_C_CONTIGUOUS) < 0) return -1;
    (*held)++;
    if (PyObject_GetBuffer(ids, &views[*held], PyBUF_C_CONTIGUOUS) < 0) return -1;
    (*held)++;
    if (PyObject_GetBuffer(out, &views[*held], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return -1;
    (*held)++;
    return 0;
}

/* take(out, ids, columns) -> -1 when every id was in range, else the position of the first
 * id out of range of some column (every id is checked first: then nothing is written, so a
 * caller may leave the bounds check to this call).
 *   out:     writable C-contiguous buffer of len(ids) * row_bytes bytes
 *   ids:     C-contiguous buffer of int64 row ids
 *   columns: sequence of (source, width) in row order: source a C-contiguous buffer of
 *            rows * width bytes; row_bytes is the sum of the widths, and each column's
 *            bytes follow the previous column's in an output row. Or, per column,
 *            (source, width, stride, skip, dst): width bytes at skip of each stride-byte
 *            row of source (rows * stride bytes) go to byte dst of an output row; once a
 *            column names its dst, row_bytes is out's own (len(out) / len(ids)), and bytes
 *            no column names are left alone. */
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
    Py_ssize_t row_bytes = 0, packed = 0;
    int placed = 0; /* some column names where its bytes go */
    for (Py_ssize_t c = 0; c < k; c++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, c);
        PyObject *src;
        Py_ssize_t width, stride = -1, skip = 0, dst = -1;
        if (!PyArg_ParseTuple(item, "On|nnn", &src, &width, &stride, &skip, &dst)) goto fail;
        if (stride < 0) stride = width;
        if (dst < 0) dst = packed;
        else placed = 1;
        if (PyObject_GetBuffer(src, &views[held], PyBUF_C_CONTIGUOUS) < 0) goto fail;
        held++;
        if (width <= 0 || skip < 0 || skip + width > stride || views[held - 1].len % stride != 0) {
            PyErr_Format(PyExc_ValueError,
                         "column %zd: %zd bytes at %zd of rows of %zd: the rows: stride does not tile a source "
                         "of %zd bytes", c, width, skip, stride, views[held - 1].len);
            goto fail;
        }
        cols[c].src = (const uint8_t *)views[held - 1].buf;
        cols[c].base = cols[c].src + skip;
        cols[c].joined = c > 0 && cols[c - 1].src == cols[c].src && cols[c - 1].stride == stride;
        cols[c].width = width;
        cols[c].stride = stride;
        cols[c].rows = views[held - 1].len / stride;
        cols[c].start = dst;
        packed += width;
        if (dst + width > row_bytes) row_bytes = dst + width;
    }
    if (PyObject_GetBuffer(ids_obj, &views[held], PyBUF_C_CONTIGUOUS) < 0) goto fail;
    held++;
    Py_buffer *ids_view = &views[held - 1];
    if (PyObject_GetBuffer(out_obj, &views[held], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto fail;
    held++;
    Py_buffer *out_view = &views[held - 1];
    if (placed && ids_view->len >= 8 && out_view->len % (ids_view->len / 8) == 0 &&
        out_view->len / (ids_view->len / 8) >= row_bytes)
        row_bytes = out_view->len / (ids_view->len / 8); /* placed columns: out's own rows */
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
    Py_ssize_t rows = cols[0].rows;
    for (Py_ssize_t c = 1; c < k; c++)
        if (cols[c].rows < rows) rows = cols[c].rows;
    for (Py_ssize_t i = 0; i < n; i++)
        if ((uint64_t)ids[i] >= (uint64_t)rows) {
            bad = i;
            n = 0; /* nothing written */
            break;
        }
    if (bad < 0 && k == 1 && cols[0].stride == cols[0].width && cols[0].width == row_bytes) {
        take_one(out, cols[0].base, cols[0].rows, cols[0].width, ids, n, 1);
        goto done;
    }
    /* source by source within chunks of CHUNK rows (their output lines stay in L1/L2
     * between the sources' passes): each pass is one source's gather with its own prefetch
     * stream, so a narrow column's misses do not queue behind a wide one's; columns of one
     * source (pieces of its rows: a RAM record's spill and scale) are copied in one pass */
    for (Py_ssize_t lo = 0; lo < n; lo += CHUNK) {
        Py_ssize_t hi = lo + CHUNK < n ? lo + CHUNK : n;
        for (Py_ssize_t c = 0, g; c < k; c = g) {
            Py_ssize_t first = cols[c].base - cols[c].src, last = first + cols[c].width;
            for (g = c + 1; g < k && cols[g].joined; g++) {
                Py_ssize_t a = cols[g].base - cols[g].src;
                if (a < first) first = a;
                if (a + cols[g].width > last) last = a + cols[g].width;
            }
            const uint8_t *pre = cols[c].src + first; /* the lines the pass reads */
            Py_ssize_t pw = last - first, s = cols[c].stride;
            if (lo == 0)
                for (Py_ssize_t i = 0; i < (n < AHEAD ? n : AHEAD); i++)
                    prefetch_src(pre + ids[i] * s, pw);
            for (Py_ssize_t i = lo; i < hi; i++) {
                if (i + AHEAD < n) prefetch_src(pre + ids[i + AHEAD] * s, pw);
                for (Py_ssize_t j = c; j < g; j++)
                    memcpy(out + cols[j].start + i * row_bytes, cols[j].base + ids[i] * s,
                           (size_t)cols[j].width);
            }
        }
    }
done:
    Py_END_ALLOW_THREADS
    release_all(views, held);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(bad);
fail:
    release_all(views, held);
    Py_DECREF(seq);
    return NULL;
}

/* take_rows(out, table, width, ids, prefetch=True) -> -1 when every id was in range, else the
 * position of the first id out of range (rows before it are written, none after). Without
 * prefetch a plain copy loop (np.take's speed, for rows already in the CPU caches).
 *   out:   writable C-contiguous buffer of len(ids) * width bytes
 *   table: C-contiguous buffer of rows * width bytes
 *   ids:   C-contiguous buffer of int64 row ids */
static PyObject *take_rows(PyObject *self, PyObject *args) {
    PyObject *out_obj, *table_obj, *ids_obj;
    Py_ssize_t width;
    int prefetch = 1;
    if (!PyArg_ParseTuple(args, "OOnO|p", &out_obj, &table_obj, &width, &ids_obj, &prefetch))
        return NULL;
    Py_buffer views[3];
    int held = 0;
    if (table_ids_out(table_obj, ids_obj, out_obj, views, &held) < 0) goto fail;
    if (width <= 0 || views[0].len % width != 0 || views[1].len % 8 != 0 ||
        views[2].len != views[1].len / 8 * width) {
        PyErr_Format(PyExc_ValueError,
                     "width %zd: table of %zd bytes, %zd bytes of ids, out of %zd bytes", width,
                     views[0].len, views[1].len, views[2].len);
        goto fail;
    }
    Py_ssize_t bad;
    {
        const uint8_t *base = (const uint8_t *)views[0].buf;
        const int64_t *ids = (const int64_t *)views[1].buf;
        uint8_t *out = (uint8_t *)views[2].buf;
        Py_ssize_t n = views[1].len / 8, rows = views[0].len / width;
        if (n * width >= (1 << 16)) {
            Py_BEGIN_ALLOW_THREADS
            bad = take_one(out, base, rows, width, ids, n, prefetch);
            Py_END_ALLOW_THREADS
        } else {
            bad = take_one(out, base, rows, width, ids, n, prefetch);
        }
    }
    release_all(views, held);
    return PyLong_FromSsize_t(bad);
fail:
    release_all(views, held);
    return NULL;
}

/* take_grid(out, offset, group, group_stride, table, width, ids, prefetch=True, fd=-1,
 * min_size=0) -> -1 when every id was in range, else the position of the first id out of
 * range (rows before it are written), or -2 (nothing read) when fd >= 0 and the file it
 * names now ends before min_size or cannot be sought: the mapped source of an attached
 * table checked before its mapping is read (a read past a truncated file's end raises
 * SIGBUS); the caller's own check then names the error.
 * take_rows into a grid of rows: row i goes to byte offset + (i / group) * group_stride +
 * (i % group) * width of out, so runs of group rows lie back to back and the runs
 * group_stride bytes apart: a decoder's layer slice [B, H, rb] of its [B, L, H, rb] buffer,
 * where np.take, which needs a contiguous out, gathers into a temporary and copies.
 *   out:   writable C-contiguous buffer holding every row's place (checked)
 *   table: C-contiguous buffer of rows * width bytes
 *   ids:   C-contiguous buffer of int64 row ids, a whole number of groups */
static PyObject *take_grid(PyObject *self, PyObject *args) {
    PyObject *out_obj, *table_obj, *ids_obj;
    Py_ssize_t offset, group, gstride, width;
    int prefetch = 1, fd = -1;
    long long min_size = 0;
    if (!PyArg_ParseTuple(args, "OnnnOnO|piL", &out_obj, &offset, &group, &gstride, &table_obj,
                          &width, &ids_obj, &prefetch, &fd, &min_size))
        return NULL;
    Py_buffer views[3];
    int held = 0;
    if (table_ids_out(table_obj, ids_obj, out_obj, views, &held) < 0) goto fail;
    Py_ssize_t n = views[1].len / 8;
    if (width <= 0 || group <= 0 || offset < 0 || views[0].len % width != 0 ||
        views[1].len % 8 != 0 || n % group != 0 || gstride < group * width ||
        (n > 0 && offset + (n / group - 1) * gstride + group * width > views[2].len)) {
        PyErr_Format(PyExc_ValueError,
                     "grid of %zd ids in groups of %zd, %zd-byte rows %zd apart from %zd: out "
                     "of %zd bytes, table of %zd",
                     n, group, width, gstride, offset, views[2].len, views[0].len);
        goto fail;
    }
    Py_ssize_t bad = -1;
    if (fd >= 0) {
        off_t end = lseek(fd, 0, SEEK_END);
        if (end < 0 || (long long)end < min_size) {
            release_all(views, held);
            return PyLong_FromLong(-2);
        }
    }
    bad = take_runs((uint8_t *)views[2].buf + offset, (const uint8_t *)views[0].buf,
                    views[0].len / width, width, (const int64_t *)views[1].buf, n, prefetch,
                    group, gstride);
    release_all(views, held);
    return PyLong_FromSsize_t(bad);
fail:
    release_all(views, held);
    return NULL;
}

/* in_heads(address, n, bounds) -> whether each of the n int64 ids at address is below its
 * head's bound: id i against bounds[i % H] (bounds: H uint64 bounds as bytes; read as
 * unsigned, a negative id is huge). For a decode step's ids inside a model's forward: the
 * caller passes the address of a C-contiguous CPU int64 tensor it holds (torch's
 * data_ptr()), so no numpy array is made to look at a few ids. False where n is not a
 * multiple of H. */
static PyObject *in_heads(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t n;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Kny*", &address, &n, &b)) return NULL;
    const int64_t *ids = (const int64_t *)(uintptr_t)address;
    const uint64_t *bounds = (const uint64_t *)b.buf;
    Py_ssize_t h = b.len / 8;
    int ok = h > 0 && n >= 0 && n % h == 0 && (n == 0 || ids != NULL);
    for (Py_ssize_t i = 0; ok && i < n; i += h)
        for (Py_ssize_t j = 0; j < h; j++)
            if ((uint64_t)ids[i + j] >= bounds[j]) {
                ok = 0;
                break;
            }
    PyBuffer_Release(&b);
    return PyBool_FromLong(ok);
}

/* global_of(ids, bounds, offsets, out) -> 1, 0 or -1: a decode step's validation and global
 * ids in one call. ids: a buffer (a CPU tensor's .numpy() view, an ndarray); bounds: H uint64
 * as bytes (id i against bounds[i % H], read as unsigned: a negative id is huge); offsets: H
 * int64 as bytes; out: a writable C-contiguous buffer of as many int64. 1 where ids is
 * C-contiguous int64 with a last axis of H and every id is in range (out then holds each id
 * plus its head's offset), 0 where an id is out of range (out partly written: discard it),
 * -1 where ids is not such a buffer or out is not its size (nothing written: the caller
 * takes its general path). Inside a model step, the checks of a tensor's dtype, device,
 * shape and layout through torch's attributes cost more than this whole call. */
static PyObject *global_of(PyObject *self, PyObject *args) {
    PyObject *ids_obj;
    Py_buffer v, b, off, o;
    if (!PyArg_ParseTuple(args, "Oy*y*w*", &ids_obj, &b, &off, &o)) return NULL;
    long r = -1;
    if (PyObject_GetBuffer(ids_obj, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        goto out;
    }
    Py_ssize_t h = b.len / 8, n = v.len / 8;
    const char *f = v.format == NULL ? "B" : v.format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    int int64 = v.itemsize == 8 && (f[0] == 'q' || f[0] == 'l') && f[1] == '\0';
    if (int64 && v.ndim >= 1 && h > 0 && off.len == b.len && v.shape[v.ndim - 1] == h &&
        o.len == v.len) {
        const int64_t *ids = (const int64_t *)v.buf;
        const uint64_t *bounds = (const uint64_t *)b.buf;
        const int64_t *offs = (const int64_t *)off.buf;
        int64_t *dst = (int64_t *)o.buf;
        r = 1;
        for (Py_ssize_t i = 0; r == 1 && i < n; i += h)
            for (Py_ssize_t j = 0; j < h; j++) {
                uint64_t x = (uint64_t)ids[i + j];
                if (x >= bounds[j]) {
                    r = 0;
                    break;
                }
                dst[i + j] = (int64_t)(x + (uint64_t)offs[j]);
            }
    }
    PyBuffer_Release(&v);
out:
    PyBuffer_Release(&o);
    PyBuffer_Release(&off);
    PyBuffer_Release(&b);
    return PyLong_FromLong(r);
}

/* rows_match(address, n, rows, offsets) -> whether the n int64 local ids at address plus
 * their head's offset (offsets: H int64 as bytes; id i is of head i % H) equal the int64
 * global row ids of the C-contiguous buffer rows (n of them): the pre-fetched-rows hook's
 * check that a layer asks for exactly the rows a decoder filled. Sums wrap as numpy's do
 * (a bijection: equal only when the id is exactly the row's local id). False where the
 * counts differ or rows is not a C-contiguous buffer. */
static PyObject *rows_match(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t n;
    PyObject *rows_obj;
    Py_buffer off, w;
    if (!PyArg_ParseTuple(args, "KnOy*", &address, &n, &rows_obj, &off)) return NULL;
    if (PyObject_GetBuffer(rows_obj, &w, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&off);
        Py_RETURN_FALSE;
    }
    const int64_t *ids = (const int64_t *)(uintptr_t)address;
    const int64_t *want = (const int64_t *)w.buf;
    const int64_t *offs = (const int64_t *)off.buf;
    Py_ssize_t h = off.len / 8;
    int ok = h > 0 && n >= 0 && n % h == 0 && w.len == n * 8 && (n == 0 || ids != NULL);
    for (Py_ssize_t i = 0; ok && i < n; i += h)
        for (Py_ssize_t j = 0; j < h; j++)
            if ((uint64_t)ids[i + j] + (uint64_t)offs[j] != (uint64_t)want[i + j]) {
                ok = 0;
                break;
            }
    PyBuffer_Release(&w);
    PyBuffer_Release(&off);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"take_rows", take_rows, METH_VARARGS,
     "take_rows(out, table, width, ids, prefetch=True) -> -1, or the position of the first id\n"
     "out of range.\n"
     "out[i] = row ids[i] of a table of width-byte rows, prefetching rows ahead."},
    {"take_grid", take_grid, METH_VARARGS,
     "take_grid(out, offset, group, group_stride, table, width, ids, prefetch=True, fd=-1,\n"
     "min_size=0) -> -1, the position of the first id out of range, or -2 when file fd ends\n"
     "before min_size. take_rows into runs of group rows group_stride bytes apart from byte\n"
     "offset of out."},
    {"in_heads", in_heads, METH_VARARGS,
     "in_heads(address, n, bounds) -> whether the n int64 ids at address are each below\n"
     "their head's bound (bounds: H uint64 as bytes; id i against bounds[i % H])."},
    {"global_of", global_of, METH_VARARGS,
     "global_of(ids, bounds, offsets, out) -> 1, 0 (an id out of range) or -1 (ids not a\n"
     "C-contiguous int64 buffer whose last axis is H, or out not its size): global_ids of a\n"
     "buffer."},
    {"rows_match", rows_match, METH_VARARGS,
     "rows_match(address, n, rows, offsets) -> whether the n int64 local ids at address plus\n"
     "their head's offset equal the global row ids of rows (offsets: H int64 as bytes)."},
    {"take", take, METH_VARARGS,
     "take(out, ids, columns) -> -1, or the position of the first id out of range (then\n"
     "nothing is written).\n"
     "Rows of int64 ids assembled from (source, width) or (source, width, stride, skip, dst)\n"
     "columns into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_columns",
    "One-pass gather of rows assembled from several column sources.", -1, methods,
};

PyMODINIT_FUNC PyInit__columns(void) { return PyModule_Create(&module); }
