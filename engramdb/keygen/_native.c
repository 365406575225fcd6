/* engramdb.keygen._native: the row ids of a batch of positions after each sequence's
 * look-back, in one pass.
 *
 * The vectorised numpy kernel (engramdb.keygen._core) costs ~40 ufunc calls per call
 * whatever its size: ~30 us for one step of 8 sequences and 2 layers alone, and 4-5x that
 * inside a decode step, where torch has just evicted numpy's code and data from the caches
 * (measured: 256-318 us a step at B=8 over two layers). This loop does the same arithmetic
 * per position (look-back blocking, the wrapping multiply-XOR mixes, the floor modulo per
 * head) without leaving C and without scratch arrays: 3-4x faster for a decode step, and
 * still 1.2-1.5x on long chunks, where numpy divides whole columns by one prime.
 *
 * Optional: without it (no C compiler, or ENGRAMDB_NATIVE=0) the numpy kernel serves.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_NGRAM 16  /* engramdb.keygen.native.MAX_NGRAM / MAX_GROUPS send larger layers */
#define MAX_GROUPS 64 /* to the numpy kernel */

static int get(PyObject *obj, Py_buffer *view, Py_ssize_t want, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->len != want) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd", name, view->len, want);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A layer's hash constants, checked (consts_load) and ready for hash_position. */
typedef struct {
    Py_ssize_t n_max, heads, cols;
    const int64_t *mult, *primes, *off; /* off NULL: local ids */
    Py_ssize_t first[MAX_NGRAM + 1];    /* groups reading the mix after term j: */
    Py_ssize_t order[MAX_GROUPS];       /*   order[first[j] .. first[j + 1]) */
} consts_t;

/* mult: int64 [N], 2 <= N <= MAX_NGRAM; group_step: int64 [G] (each in [0, N)); primes /
 * offsets (or None): int64 [C], C = G * heads, primes >= 1. Takes four views into v from
 * *held on (the caller releases them); -1 with an exception set when one is wrong. */
static int consts_load(consts_t *c, PyObject *o_mult, PyObject *o_step, PyObject *o_primes,
                       PyObject *o_off, Py_ssize_t heads, Py_buffer *v, int *held) {
    if (PyObject_GetBuffer(o_mult, &v[*held], PyBUF_C_CONTIGUOUS) < 0) return -1;
    Py_buffer *m = &v[(*held)++];
    c->n_max = m->len / 8;
    if (c->n_max < 2 || c->n_max > MAX_NGRAM || m->len % 8) {
        PyErr_Format(PyExc_ValueError, "2 to %d multipliers, got %zd bytes", MAX_NGRAM, m->len);
        return -1;
    }
    if (PyObject_GetBuffer(o_step, &v[*held], PyBUF_C_CONTIGUOUS) < 0) return -1;
    Py_buffer *g = &v[(*held)++];
    Py_ssize_t groups = g->len / 8;
    if (groups < 1 || groups > MAX_GROUPS || g->len % 8 || heads < 1) {
        PyErr_Format(PyExc_ValueError, "1 to %d head groups of >= 1 head", MAX_GROUPS);
        return -1;
    }
    const int64_t *step = (const int64_t *)g->buf;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < groups; i++) {
        if (step[i] < 0 || step[i] >= c->n_max) {
            PyErr_Format(PyExc_ValueError, "group %zd reads term %lld of %zd", i,
                         (long long)step[i], c->n_max);
            return -1;
        }
    }
    for (Py_ssize_t j = 0; j < c->n_max; j++) {
        c->first[j] = k;
        for (Py_ssize_t i = 0; i < groups; i++)
            if (step[i] == j) c->order[k++] = i;
    }
    c->first[c->n_max] = k;
    c->heads = heads;
    c->cols = groups * heads;
    c->mult = (const int64_t *)m->buf;
    if (get(o_primes, &v[*held], c->cols * 8, 0, "primes") < 0) return -1;
    c->primes = (const int64_t *)v[(*held)++].buf;
    for (Py_ssize_t i = 0; i < c->cols; i++) {
        if (c->primes[i] < 1) {
            PyErr_Format(PyExc_ValueError, "prime %zd is %lld", i, (long long)c->primes[i]);
            return -1;
        }
    }
    c->off = NULL;
    if (o_off != Py_None) {
        if (get(o_off, &v[*held], c->cols * 8, 0, "offsets") < 0) return -1;
        c->off = (const int64_t *)v[(*held)++].buf;
    }
    return 0;
}

/* One position's row ids into o[C] (and, where lo is not NULL, its local ids, the rows less
 * the heads' offsets, into lo[C]): tok[b] is the (fill-blocked) id b back, tok[0] the
 * position's own; peft: term j is the id N-1-j back (engram-peft), else j back (DeepSeek). */
static inline void hash_position(const consts_t *c, const uint64_t *tok, int peft, int64_t *o,
                                 int64_t *lo) {
    Py_ssize_t n_max = c->n_max;
    uint64_t acc = 0;
    for (Py_ssize_t j = 0; j < n_max; j++) {
        uint64_t term = tok[peft ? n_max - 1 - j : j] * (uint64_t)c->mult[j];
        acc = j ? acc ^ term : term;
        int64_t mix = (int64_t)acc;
        for (Py_ssize_t e = c->first[j]; e < c->first[j + 1]; e++) {
            Py_ssize_t c0 = c->order[e] * c->heads;
            for (Py_ssize_t i = c0; i < c0 + c->heads; i++) {
                int64_t r = mix % c->primes[i];
                if (r < 0) r += c->primes[i];
                o[i] = c->off ? r + c->off[i] : r;
                if (lo) lo[i] = r;
            }
        }
    }
}

#define GET(obj, want, wr, name)                                       \
    do {                                                               \
        if (get((obj), &v[held], (want), (wr), (name)) < 0) goto done; \
        held++;                                                        \
    } while (0)

/* rows(ids, bar, dead, hist_ids, hist_bar, out, new_ids, new_bar, mult, primes, offsets,
 *      group_step, heads, fill, peft)
 *   ids:        int64 [S, T]   encoded token ids of the pushed positions
 *   bar, dead:  bool [S, T] or None   barrier flags (a position blocks look-backs reaching it
 *               or older) and dead positions (their own n-grams read the fill id)
 *   hist_ids:   int64 [S, N-1] the look-back before the push, oldest first; hist_bar: bool
 *   out:        int64 [S, T, C] row ids (local when offsets is None)
 *   new_ids / new_bar: the look-back after the push ([S, N-1], may not alias hist_*)
 *   mult:       int64 [N]; primes / offsets: int64 [C]; group_step: int64 [G], C = G * heads:
 *               head group g reads the mix after term group_step[g]
 *   peft:       0: term j is the id j back (DeepSeek); 1: term j is the id N-1-j back */
static PyObject *rows(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_bar, *o_dead, *o_hid, *o_hbar, *o_out, *o_nid, *o_nbar;
    PyObject *o_mult, *o_primes, *o_off, *o_step;
    Py_ssize_t heads;
    long long fill;
    int peft;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOnLp", &o_ids, &o_bar, &o_dead, &o_hid, &o_hbar,
                          &o_out, &o_nid, &o_nbar, &o_mult, &o_primes, &o_off, &o_step, &heads,
                          &fill, &peft))
        return NULL;
    Py_buffer v[12];
    int held = 0;
    PyObject *result = NULL;
    consts_t c;
    if (consts_load(&c, o_mult, o_step, o_primes, o_off, heads, v, &held) < 0) goto done;
    Py_ssize_t n_max = c.n_max, h = n_max - 1, cols = c.cols;
    /* shapes from hist_ids ([S, N-1]) and ids ([S, T]) */
    if (PyObject_GetBuffer(o_hid, &v[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
    const int64_t *hid = (const int64_t *)v[held++].buf;
    Py_ssize_t n_seq = v[held - 1].len / 8 / h;
    if (v[held - 1].len != n_seq * h * 8) {
        PyErr_SetString(PyExc_ValueError, "hist_ids must be int64 [S, N-1] with N >= 2");
        goto done;
    }
    if (PyObject_GetBuffer(o_ids, &v[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
    const int64_t *ids = (const int64_t *)v[held++].buf;
    Py_ssize_t n_pos = n_seq ? v[held - 1].len / 8 / n_seq : 0;
    if (n_seq == 0 || v[held - 1].len != n_seq * n_pos * 8) {
        PyErr_SetString(PyExc_ValueError, "ids must be int64 [S, T]");
        goto done;
    }
    GET(o_hbar, n_seq * h, 0, "hist_bar");
    const uint8_t *hbar = (const uint8_t *)v[held - 1].buf;
    GET(o_out, n_seq * n_pos * cols * 8, 1, "out");
    int64_t *out = (int64_t *)v[held - 1].buf;
    GET(o_nid, n_seq * h * 8, 1, "new_ids");
    int64_t *nid = (int64_t *)v[held - 1].buf;
    GET(o_nbar, n_seq * h, 1, "new_bar");
    uint8_t *nbar = (uint8_t *)v[held - 1].buf;
    const uint8_t *bar = NULL, *dead = NULL;
    if (o_bar != Py_None) {
        GET(o_bar, n_seq * n_pos, 0, "bar");
        bar = (const uint8_t *)v[held - 1].buf;
    }
    if (o_dead != Py_None) {
        GET(o_dead, n_seq * n_pos, 0, "dead");
        dead = (const uint8_t *)v[held - 1].buf;
    }

    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < n_seq; s++) {
        const int64_t *hs = hid + s * h, *is = ids + s * n_pos;
        const uint8_t *hb = hbar + s * h;
        const uint8_t *bs = bar ? bar + s * n_pos : NULL, *ds = dead ? dead + s * n_pos : NULL;
        for (Py_ssize_t t = 0; t < n_pos; t++) {
            uint64_t tok[MAX_NGRAM];
            int blocked = ds ? ds[t] != 0 : 0;
            tok[0] = blocked ? (uint64_t)fill : (uint64_t)is[t];
            for (Py_ssize_t b = 1; b < n_max; b++) {
                Py_ssize_t q = h + t - b; /* position in [history, pushed] */
                int qbar = q < h ? hb[q] != 0 : (bs ? bs[q - h] != 0 : 0);
                blocked = blocked || qbar;
                int64_t id = q < h ? hs[q] : is[q - h];
                tok[b] = blocked ? (uint64_t)fill : (uint64_t)id;
            }
            hash_position(&c, tok, peft, out + (s * n_pos + t) * cols, NULL);
        }
        /* the look-back after the push: the last N-1 of [history, pushed] */
        for (Py_ssize_t i = 0; i < h; i++) {
            Py_ssize_t q = n_pos + i;
            nid[s * h + i] = q < h ? hs[q] : is[q - h];
            nbar[s * h + i] = q < h ? hb[q] : (bs ? bs[q - h] : 0);
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* step(ids, hist_ids, hist_bar, out, mult, primes, offsets, group_step, heads, fill, peft,
 *      check, lo, hi, local=None) -> int
 *   One decode step: one position per sequence, no barrier or dead flags (the DeepSeek and
 *   engram-peft kinds without a mask). ids: int64 [S]; hist_ids / hist_bar: the look-back
 *   ([S, N-1], oldest first), advanced in place; out: int64 [S, C]; local (or None): int64
 *   [S, C], the same ids less the offsets (a model's per-head ids), in the same pass. With
 *   check, every id must lie in [lo, hi): the index of the first that does not is returned
 *   before anything is written; -1 once the step is done. The arithmetic is rows()'s for
 *   T = 1. */
static PyObject *step(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_hid, *o_hbar, *o_out, *o_mult, *o_primes, *o_off, *o_step;
    PyObject *o_local = Py_None;
    Py_ssize_t heads;
    long long fill, lo, hi;
    int peft, check;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnLppLL|O", &o_ids, &o_hid, &o_hbar, &o_out, &o_mult,
                          &o_primes, &o_off, &o_step, &heads, &fill, &peft, &check, &lo, &hi,
                          &o_local))
        return NULL;
    Py_buffer v[9];
    int held = 0;
    PyObject *result = NULL;
    consts_t c;
    if (consts_load(&c, o_mult, o_step, o_primes, o_off, heads, v, &held) < 0) goto done;
    Py_ssize_t n_max = c.n_max, h = n_max - 1, cols = c.cols;
    if (PyObject_GetBuffer(o_ids, &v[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
    const int64_t *ids = (const int64_t *)v[held++].buf;
    Py_ssize_t n_seq = v[held - 1].len / 8;
    if (n_seq < 1 || v[held - 1].len % 8) {
        PyErr_SetString(PyExc_ValueError, "ids must be int64 [S], S >= 1");
        goto done;
    }
    GET(o_hid, n_seq * h * 8, 1, "hist_ids");
    int64_t *hid = (int64_t *)v[held - 1].buf;
    GET(o_hbar, n_seq * h, 1, "hist_bar");
    uint8_t *hbar = (uint8_t *)v[held - 1].buf;
    GET(o_out, n_seq * cols * 8, 1, "out");
    int64_t *out = (int64_t *)v[held - 1].buf;
    int64_t *local = NULL;
    if (o_local != Py_None) {
        GET(o_local, n_seq * cols * 8, 1, "local");
        local = (int64_t *)v[held - 1].buf;
    }
    if (check) {
        for (Py_ssize_t s = 0; s < n_seq; s++) {
            if (ids[s] < lo || ids[s] >= hi) {
                result = PyLong_FromSsize_t(s);
                goto done;
            }
        }
    }
    for (Py_ssize_t s = 0; s < n_seq; s++) {
        int64_t *hs = hid + s * h;
        uint8_t *hb = hbar + s * h;
        uint64_t tok[MAX_NGRAM];
        int blocked = 0;
        tok[0] = (uint64_t)ids[s];
        for (Py_ssize_t b = 1; b < n_max; b++) {
            Py_ssize_t q = h - b; /* b back: the look-back, newest last */
            blocked = blocked || hb[q] != 0;
            tok[b] = blocked ? (uint64_t)fill : (uint64_t)hs[q];
        }
        hash_position(&c, tok, peft, out + s * cols, local ? local + s * cols : NULL);
        /* advance the look-back: drop the oldest, append this position (no barrier) */
        for (Py_ssize_t i = 0; i + 1 < h; i++) {
            hs[i] = hs[i + 1];
            hb[i] = hb[i + 1];
        }
        hs[h - 1] = ids[s];
        hb[h - 1] = 0;
    }
    result = PyLong_FromLong(-1);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    return result;
}
#undef GET

static PyMethodDef methods[] = {
    {"rows", rows, METH_VARARGS,
     "rows(ids, bar, dead, hist_ids, hist_bar, out, new_ids, new_bar, mult, primes, offsets,\n"
     "     group_step, heads, fill, peft) -> None. Row ids of pushed positions after a\n"
     "look-back, and the look-back after them."},
    {"step", step, METH_VARARGS,
     "step(ids, hist_ids, hist_bar, out, mult, primes, offsets, group_step, heads, fill,\n"
     "     peft, check, lo, hi, local=None) -> int. One position per sequence, look-back\n"
     "advanced in place (and its local ids into local); the index of the first id outside\n"
     "[lo, hi) (nothing written), else -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Row ids of a few positions after each sequence's look-back, in one call.", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
