/* components._claim: the insert's slot claim in one C pass.
 *
 * KVComponent.claim validates the caller's KV slots the tree is about to adopt, marks them
 * held and copies them into the tensor the new node keeps. In numpy that is a tensor -> array
 * conversion, a copy, a few gathers and scatters, and an array -> tensor conversion: each call
 * costs about a microsecond of dispatch, more than the work on ~1,000 slots. This module does
 * the same checks, marks and copy in one loop over raw int64 memory.
 *
 * The Python side (components/kv.py) owns the pointers it passes: it takes them from CPU,
 * contiguous int64 tensors it has checked or made, with the length. The copy goes into the
 * node's own new array('q') (zeros, _ZERO * n in kv.py, passed as a writable buffer of exactly n
 * int64: its length is checked here; about 64 bytes of header per node, against about 450
 * for a tensor). The marks
 * and the free mask are numpy arrays passed as buffers, so their lengths are checked here.
 * The numpy claim in kv.py is the reference this must agree with (tests/radix/test_compiled.py
 * runs both on the same inputs).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Runs of at least RUN_MIN consecutive ids are checked and marked as ranges: the free mask
 * and the held bits are read a word at a time. A run is strictly increasing, so it repeats
 * no id of its own; a repeat of an id marked before (by an earlier run or slot) finds its
 * bit. */
#define RUN_MIN 16

/* Whether any of the len bytes at p is nonzero. */
static int
any_byte(const uint8_t *p, int64_t len)
{
    uint64_t acc = 0;
    int64_t k = 0;
    for (; k + 8 <= len; k += 8) {
        uint64_t w;
        memcpy(&w, p + k, 8);
        acc |= w;
    }
    for (; k < len; k++)
        acc |= p[k];
    return acc != 0;
}

/* Whether any bit of ids [a, b) is set in the bit array h. */
static int
any_bit(const uint8_t *h, int64_t a, int64_t b)
{
    for (; a < b && (a & 7); a++)
        if ((h[a >> 3] >> (a & 7)) & 1)
            return 1;
    while (b > a && (b & 7)) {
        b--;
        if ((h[b >> 3] >> (b & 7)) & 1)
            return 1;
    }
    return b > a && any_byte(h + (a >> 3), (b - a) >> 3);
}

/* Set the bits of ids [a, b) in the bit array h. */
static void
set_bits(uint8_t *h, int64_t a, int64_t b)
{
    for (; a < b && (a & 7); a++)
        h[a >> 3] |= (uint8_t)(1u << (a & 7));
    while (b > a && (b & 7)) {
        b--;
        h[b >> 3] |= (uint8_t)(1u << (b & 7));
    }
    if (b > a)
        memset(h + (a >> 3), 0xFF, (size_t)((b - a) >> 3));
}

/* Clear the bits of ids [a, b) in the bit array h. */
static void
clear_bits(uint8_t *h, int64_t a, int64_t b)
{
    for (; a < b && (a & 7); a++)
        h[a >> 3] &= (uint8_t)~(1u << (a & 7));
    while (b > a && (b & 7)) {
        b--;
        h[b >> 3] &= (uint8_t)~(1u << (b & 7));
    }
    if (b > a)
        memset(h + (a >> 3), 0, (size_t)((b - a) >> 3));
}

/* claim(src, n, dst, page_size, low, high, held, free) -> int
 *
 *   src        address of n int64 slots
 *   dst        0, the address of n writable int64, or a writable buffer of exactly n int64
 *              (an array('q')), not overlapping src: the slots' copy is written there
 *   page_size  slots per page (n is a multiple of it when held is given)
 *   low, high  the pool's slot range [low, high)
 *   held       None, or a writable uint8 buffer of bits: bit id (byte id >> 3, bit id & 7)
 *              is 0 while no node holds id
 *   free       None, or a uint8/bool buffer: free[id] != 0 while id is free in the allocator
 *              (given with held; id = slot / page_size)
 *
 * Every slot must lie in [low, high). With held (and free), also: each page is page_size
 * consecutive slots from a multiple of page_size, and each id is in both buffers, not free,
 * not held, and not repeated (a repeat finds the mark this call just set).
 *
 * Returns, on success, -1, every id marked (its bit set) and the copy written. Otherwise the
 * marks this call set are cleared and the position of the first page that fails is returned
 * (the caller explains it with its numpy reference, and drops dst, which may be partly
 * written).
 */
static PyObject *claim_into(const int64_t *src, Py_ssize_t n, int64_t *dst, long long ps,
                            long long low, long long high, PyObject *held_obj,
                            PyObject *free_obj, int have_marks);

static PyObject *
claim(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "claim() takes 8 arguments");
        return NULL;
    }
    const int64_t *src = (const int64_t *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    long long ps = PyLong_AsLongLong(args[3]);
    long long low = PyLong_AsLongLong(args[4]);
    long long high = PyLong_AsLongLong(args[5]);
    int have_marks = args[6] != Py_None;
    if (PyErr_Occurred())
        return NULL;
    if (n < 0 || ps < 1 || (have_marks && n % ps != 0) || (n > 0 && src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "claim(): bad length, page size or source");
        return NULL;
    }
    /* the destination: an address, or a buffer of its own (held until the end) */
    Py_buffer db;
    int have_db = 0;
    int64_t *dst;
    if (PyLong_Check(args[2])) {
        dst = (int64_t *)PyLong_AsVoidPtr(args[2]);
        if (PyErr_Occurred())
            return NULL;
    }
    else {
        if (PyObject_GetBuffer(args[2], &db, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return NULL;
        have_db = 1;
        if (db.itemsize != 8 || db.len != (Py_ssize_t)n * 8) {
            PyBuffer_Release(&db);
            PyErr_SetString(PyExc_ValueError, "claim(): dst must be a buffer of n int64");
            return NULL;
        }
        dst = (int64_t *)db.buf;
    }
    PyObject *res = claim_into(src, n, dst, ps, low, high, args[6], args[7], have_marks);
    if (have_db)
        PyBuffer_Release(&db);
    return res;
}

static PyObject *
claim_into(const int64_t *src, Py_ssize_t n, int64_t *dst, long long ps, long long low,
           long long high, PyObject *held_obj, PyObject *free_obj, int have_marks)
{
    Py_ssize_t bad = -1, i;
    if (!have_marks) { /* an allocator without a free mask: the range check only */
        for (i = 0; i < n; i++) {
            if (src[i] < low || src[i] >= high) {
                bad = i;
                break;
            }
        }
        if (bad < 0 && dst != NULL && n > 0)
            memcpy(dst, src, (size_t)n * sizeof(int64_t));
        goto done;
    }
    Py_buffer hb, fb;
    if (PyObject_GetBuffer(held_obj, &hb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(free_obj, &fb, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&hb);
        return NULL;
    }
    if (hb.itemsize != 1 || fb.itemsize != 1) {
        PyBuffer_Release(&hb);
        PyBuffer_Release(&fb);
        PyErr_SetString(PyExc_TypeError, "claim(): held must be uint8 bits, free must be bool");
        return NULL;
    }
    uint8_t *held = (uint8_t *)hb.buf;
    const uint8_t *free_ = (const uint8_t *)fb.buf;
    Py_ssize_t held_len = hb.len * 8, free_len = fb.len; /* ids each buffer covers */
    if (ps == 1) { /* one slot per id: no page checks, no divisions (the common case) */
        int64_t lim = high;
        if (lim > held_len)
            lim = held_len;
        if (lim > free_len)
            lim = free_len;
        for (i = 0; i < n;) {
            /* the run of consecutive ids from src[i] (what an allocator mostly hands out) */
            int64_t first = src[i];
            Py_ssize_t j = i + 1;
            while (j < n && (uint64_t)src[j] == (uint64_t)first + (uint64_t)(j - i))
                j++;
            int64_t len = (int64_t)(j - i);
            if (len >= RUN_MIN && first >= low && first < lim && len <= lim - first
                && !any_byte(free_ + first, len) && !any_bit(held, first, first + len)) {
                set_bits(held, first, first + len); /* the whole run at once */
                if (dst != NULL) /* copied while the run is in cache (a failure drops it) */
                    memcpy(dst + i, src + i, (size_t)len * sizeof(int64_t));
                i = j;
                continue;
            }
            for (; i < j; i++) { /* slot by slot: a short run, or one that fails */
                int64_t id = src[i];
                if (id < low || id >= lim || free_[id] || (held[id >> 3] >> (id & 7)) & 1) {
                    bad = i;
                    break;
                }
                held[id >> 3] |= (uint8_t)(1u << (id & 7));
                if (dst != NULL)
                    dst[i] = id;
            }
            if (bad >= 0)
                break;
        }
        goto marked;
    }
    for (i = 0; i < n; i += ps) {
        int64_t first = src[i];
        if (first < low || first >= high || first - first / ps * ps != 0) {
            bad = i;
            break;
        }
        int64_t id = first / ps; /* (first % ps was checked: one division per page) */
        if (id >= held_len || id >= free_len || free_[id] || (held[id >> 3] >> (id & 7)) & 1) {
            bad = i;
            break;
        }
        long long j;
        for (j = 1; j < ps; j++) {
            if (src[i + j] != first + j)
                break;
        }
        if (j < ps) {
            bad = i;
            break;
        }
        held[id >> 3] |= (uint8_t)(1u << (id & 7));
        if (dst != NULL) {
            for (j = 0; j < ps; j++)
                dst[i + j] = first + j;
        }
    }
marked:
    if (bad >= 0) { /* every page before `bad` passed, so this call marked it */
        for (i = 0; i < bad; i += ps) {
            int64_t id = src[i] / ps;
            held[id >> 3] &= (uint8_t)~(1u << (id & 7));
        }
    }
    PyBuffer_Release(&hb);
    PyBuffer_Release(&fb);
done:
    return PyLong_FromSsize_t(bad);
}

/* unmark(src, n, page_size, held) -> None
 *
 * Clear the held marks of the n slots at address src (the bit of id slot / page_size, for the
 * first slot of each page): a node's slots leave the tree. The caller passes a node's own,
 * contiguous int64 slots (claimed, so every id lies inside held); ids are still checked
 * against held's length (ValueError, nothing cleared, when one falls outside). With one slot
 * per id, runs of at least RUN_MIN consecutive ids are cleared as bit ranges (a word at a time).
 */
static PyObject *
unmark(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "unmark() takes 4 arguments");
        return NULL;
    }
    const int64_t *src = (const int64_t *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    long long ps = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 0 || ps < 1 || n % ps != 0 || (n > 0 && src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "unmark(): bad length, page size or source");
        return NULL;
    }
    Py_buffer hb;
    if (PyObject_GetBuffer(args[3], &hb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (hb.itemsize != 1) {
        PyBuffer_Release(&hb);
        PyErr_SetString(PyExc_TypeError, "unmark(): held must be uint8 bits");
        return NULL;
    }
    uint8_t *held = (uint8_t *)hb.buf;
    Py_ssize_t held_ids = hb.len * 8;
    Py_ssize_t i;
    if (ps == 1) { /* token slots: branch-free range check, then the clears */
        int64_t lo = INT64_MAX, hi = INT64_MIN;
        for (i = 0; i < n; i++) {
            int64_t id = src[i];
            lo = id < lo ? id : lo;
            hi = id > hi ? id : hi;
        }
        if (n > 0 && (lo < 0 || hi >= held_ids)) {
            PyBuffer_Release(&hb);
            PyErr_SetString(PyExc_ValueError, "unmark(): a slot outside the held marks");
            return NULL;
        }
        for (i = 0; i < n;) { /* runs of consecutive ids as ranges, as claim marks them */
            int64_t first = src[i];
            Py_ssize_t j = i + 1;
            while (j < n && (uint64_t)src[j] == (uint64_t)first + (uint64_t)(j - i))
                j++;
            if (j - i >= RUN_MIN) {
                clear_bits(held, first, first + (int64_t)(j - i));
                i = j;
                continue;
            }
            for (; i < j; i++)
                held[src[i] >> 3] &= (uint8_t)~(1u << (src[i] & 7));
        }
        PyBuffer_Release(&hb);
        Py_RETURN_NONE;
    }
    for (i = 0; i < n; i += ps) { /* check every id first: nothing changes on a bad one */
        int64_t id = src[i] / ps;
        if (id < 0 || id >= held_ids) {
            PyBuffer_Release(&hb);
            PyErr_SetString(PyExc_ValueError, "unmark(): a slot outside the held marks");
            return NULL;
        }
    }
    for (i = 0; i < n; i += ps) {
        int64_t id = src[i] / ps;
        held[id >> 3] &= (uint8_t)~(1u << (id & 7));
    }
    PyBuffer_Release(&hb);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"unmark", (PyCFunction)(void (*)(void))unmark, METH_FASTCALL,
     "unmark(src, n, page_size, held) -> None: clear the held marks of n slots"},
    {"claim", (PyCFunction)(void (*)(void))claim, METH_FASTCALL,
     "claim(src, n, dst, page_size, low, high, held, free) -> -1 (the copy written to dst "
     "unless 0), or the first bad position"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_claim", "The insert's slot claim in one C pass.", -1, methods,
};

PyMODINIT_FUNC
PyInit__claim(void)
{
    return PyModule_Create(&module);
}
