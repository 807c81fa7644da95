/* allocators._release: frees of slots in one C pass (the cache's own frees, and the checked
 * public free of ids a caller hands back).
 *
 * When the radix cache evicts a node it hands the node's own slots back to the allocator
 * (``free_owned``: no misuse checks, the cache holds them). In numpy that is a tensor -> array
 * conversion, a ring-buffer slice write and a fancy-index write of the free mask: three
 * dispatches of about a microsecond each, more than the work on ~1,000 slots. This module
 * does the ring write and the mask write in one loop over the node's raw int64 memory.
 *
 * The Python side (allocators/free_list.py) passes a pointer it took from a CPU, contiguous
 * int64 buffer (a node's array('q'): ``buffer_info()[0]``, or a tensor's ``data_ptr()``),
 * with its length; the ring and the mask are numpy arrays passed as buffers,
 * so every id is checked against their lengths here before anything is written. The numpy
 * path of FreeList.release_owned is the reference this must agree with
 * (tests/radix/test_compiled.py runs both on the same inputs).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* release(src, n, page_size, ring, start, free) -> int
 *
 *   src        address of n int64 slots (n a multiple of page_size)
 *   page_size  slots per page: the id of a page is its first slot / page_size
 *   ring       writable int64 buffer of capacity entries (the free list's ring)
 *   start      ring position of the first id written (0 <= start < capacity); writes wrap
 *   free       writable bool / uint8 buffer of capacity + 1 entries: free[id] = 1 for each id
 *
 * Every id must lie in 1 .. capacity (ValueError otherwise, nothing written). Writes the
 * n / page_size ids, in order, at ring[start], ring[start + 1], ... (mod capacity) and marks
 * them free. Returns the number of ids written. Repeats and ids already free are not checked
 * (the caller holds the slots: the free list's check() finds misuse).
 *
 * checked(src, n, ring, start, free) -> int
 *
 * The public free of ids a caller hands back (page size 1: ids as given): every id must lie
 * in 1 .. capacity, be in use (free[id] == 0) and appear once. The mask is set id by id, so a
 * repeat is seen as "already free"; on the first bad id the marks made so far are undone and
 * -1 is returned with nothing changed (the caller then names the error: FreeList's numpy
 * check is the reference for the messages). Else the ids are written to the ring as above
 * and n is returned.
 *
 * release_held(src, n, page_size, held, held_bytes, ring, capacity, start, free) -> int
 *
 * The radix cache's free of one node's slots as it leaves the tree: the ids (as in release():
 * the first slot of each page / page_size) are cleared in the KV component's held marks,
 * marked free and appended to the ring, in one call: a read-only check pass over the node's
 * memory, then the writes (page size 1: the marks and the held bits in one loop, the ring as
 * one memcpy). Every id must lie in 1 .. capacity and inside the marks, be held (its bit set)
 * and in use (free[id] == 0), and appear once; else -1 is returned with nothing changed (a
 * repeat, seen while marking, undoes the marks: every id was held and in use) and the caller
 * takes its general path (unmark, free_owned), whose behaviour on such slots is the
 * reference. Else returns the number of ids written.
 *
 * lowest_free(free, num_groups, group, group_free, g0, k, skip, out) -> int
 *
 * The arena KV free list's search for its k lowest free ids (allocators/arena.py,
 * _LowestFirst.lowest_free, whose numpy path is the reference): the ids 0 .. num_groups *
 * group - 1 fall in num_groups groups of group consecutive ids; group_free[g] (int64) counts
 * the free ids of group g. From group g0 on, groups with no free id or skip[g] != 0 are
 * passed over, a wholly free group (group_free[g] == group) gives its ids without reading
 * the mask, any other is read byte by byte; the ids are written ascending to out until k are
 * found or the groups end. Reads only; returns the number written (<= k). free (num_groups *
 * group bytes), group_free (num_groups int64), skip (num_groups bytes, or 0: none) and out
 * (k int64) are raw addresses, as below.
 *
 * held, ring and free are raw addresses, like src, not buffers: the held marks (held_bytes
 * writable bytes, one bit per id, bit id & 7 of byte id >> 3), the free list's ring
 * (capacity int64 entries) and its free mask (capacity + 1 bytes). Three buffer requests
 * would cost more than the pass over a small node; the callers (FreeList.release_held_at and
 * the KV component) take the addresses from arrays that live as long as they do and are
 * never reallocated.
 */
/* The free list's ring (int64, capacity entries) and free mask (one byte per id 0 .. capacity)
 * as writable buffers, checked for k ids written from ring position start. Returns the
 * capacity, or -1 with an exception set and no buffer held. */
static Py_ssize_t
open_free_list(const char *fn, PyObject *ring, PyObject *free, Py_ssize_t k, Py_ssize_t start,
               Py_buffer *rb, Py_buffer *fb)
{
    if (PyObject_GetBuffer(ring, rb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (PyObject_GetBuffer(free, fb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(rb);
        return -1;
    }
    Py_ssize_t cap = rb->len / 8;
    if (rb->itemsize != 8 || fb->itemsize != 1 || fb->len != cap + 1) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): ring must be int64 and free one byte per id 0 .. capacity", fn);
    } else if (k > cap || start < 0 || (cap > 0 && start >= cap) || (cap == 0 && k > 0)) {
        PyErr_Format(PyExc_ValueError, "%s(): more ids than the ring holds, or bad start", fn);
    } else {
        return cap;
    }
    PyBuffer_Release(fb);
    PyBuffer_Release(rb);
    return -1;
}

/* Write the n ids at src to the ring from position start, wrapping (one or two memcpy). */
static void
write_ring(int64_t *ring, Py_ssize_t cap, Py_ssize_t start, const int64_t *src, Py_ssize_t n)
{
    Py_ssize_t first = cap - start < n ? cap - start : n; /* up to the ring's end */
    memcpy(ring + start, src, (size_t)first * sizeof(int64_t));
    memcpy(ring, src + first, (size_t)(n - first) * sizeof(int64_t));
}

static PyObject *
release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "release() takes 6 arguments");
        return NULL;
    }
    const int64_t *src = (const int64_t *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    long long ps = PyLong_AsLongLong(args[2]);
    Py_ssize_t start = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 0 || ps < 1 || n % ps != 0 || (n > 0 && src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "release(): bad length, page size or source");
        return NULL;
    }
    Py_buffer rb, fb;
    Py_ssize_t k = n / ps;
    Py_ssize_t cap = open_free_list("release", args[3], args[5], k, start, &rb, &fb);
    if (cap < 0)
        return NULL;
    PyObject *result = NULL;
    int64_t *ring = (int64_t *)rb.buf;
    uint8_t *mask = (uint8_t *)fb.buf;
    Py_ssize_t i;
    if (ps == 1) { /* token slots: the ids are the slots (branch-free loops, one memcpy) */
        int64_t lo = INT64_MAX, hi = INT64_MIN;
        for (i = 0; i < n; i++) { /* check every id first: nothing changes on a bad one */
            int64_t id = src[i];
            lo = id < lo ? id : lo;
            hi = id > hi ? id : hi;
        }
        if (n > 0 && (lo < 1 || hi > cap)) {
            PyErr_Format(PyExc_ValueError, "release(): id %lld is not in 1..%zd",
                         (long long)(lo < 1 ? lo : hi), cap);
            goto done;
        }
        write_ring(ring, cap, start, src, n);
        for (i = 0; i < n; i++)
            mask[src[i]] = 1;
    } else {
        for (i = 0; i < n; i += ps) { /* check every id first: nothing changes on a bad one */
            int64_t id = src[i] / ps;
            if (id < 1 || id > cap) {
                PyErr_Format(PyExc_ValueError, "release(): id %lld is not in 1..%zd",
                             (long long)id, cap);
                goto done;
            }
        }
        Py_ssize_t pos = start;
        for (i = 0; i < n; i += ps) {
            int64_t id = src[i] / ps;
            ring[pos] = id;
            if (++pos == cap)
                pos = 0;
            mask[id] = 1;
        }
    }
    result = PyLong_FromSsize_t(k);
done:
    PyBuffer_Release(&fb);
    PyBuffer_Release(&rb);
    return result;
}

static PyObject *
checked(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "checked() takes 5 arguments");
        return NULL;
    }
    const int64_t *src = (const int64_t *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 0 || (n > 0 && src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "checked(): bad length or source");
        return NULL;
    }
    Py_buffer rb, fb;
    Py_ssize_t cap = open_free_list("checked", args[2], args[4], n, start, &rb, &fb);
    if (cap < 0)
        return NULL;
    PyObject *result = NULL;
    int64_t *ring = (int64_t *)rb.buf;
    uint8_t *mask = (uint8_t *)fb.buf;
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        int64_t id = src[i];
        if (id < 1 || id > cap || mask[id])
            break;
        mask[id] = 1;
    }
    if (i < n) { /* a bad id: undo the marks made so far, change nothing */
        while (i-- > 0)
            mask[src[i]] = 0;
        result = PyLong_FromLong(-1);
        goto done;
    }
    write_ring(ring, cap, start, src, n);
    result = PyLong_FromSsize_t(n);
done:
    PyBuffer_Release(&fb);
    PyBuffer_Release(&rb);
    return result;
}

static PyObject *
release_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "release_held() takes 9 arguments");
        return NULL;
    }
    const int64_t *src = (const int64_t *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    long long ps = PyLong_AsLongLong(args[2]);
    uint8_t *held = (uint8_t *)PyLong_AsVoidPtr(args[3]);
    Py_ssize_t held_len = PyLong_AsSsize_t(args[4]);
    int64_t *ring = (int64_t *)PyLong_AsVoidPtr(args[5]);
    Py_ssize_t cap = PyLong_AsSsize_t(args[6]);
    Py_ssize_t start = PyLong_AsSsize_t(args[7]);
    uint8_t *mask = (uint8_t *)PyLong_AsVoidPtr(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 0 || ps < 1 || n % ps != 0 || (n > 0 && src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "release_held(): bad length, page size or source");
        return NULL;
    }
    Py_ssize_t k = n / ps;
    if (held == NULL || held_len < 1 || ring == NULL || mask == NULL || cap < 1 || k > cap
            || start < 0 || start >= cap) {
        PyErr_SetString(PyExc_ValueError, "release_held(): bad buffers, or more ids than the "
                        "ring holds, or bad start");
        return NULL;
    }
    /* the highest id both the free list and the held marks cover */
    int64_t top = (int64_t)cap < (int64_t)held_len * 8 - 1 ? (int64_t)cap : (int64_t)held_len * 8 - 1;
    PyObject *result = NULL;
    Py_ssize_t i, pos;
    if (ps == 1) { /* token slots: the ids are the slots (branch-free loops, one memcpy) */
        if (n == 0) {
            result = PyLong_FromLong(0);
            goto done;
        }
        unsigned bad = 0;
        for (i = 0; i < n; i++) { /* every id in range, held and in use (read only; an id out
                                   * of range reads id 0's entries instead, and is refused) */
            int64_t id = src[i];
            if ((i & 7) == 0) /* a cold node: ask for its slots a few lines ahead */
                __builtin_prefetch(src + i + 64);
            unsigned out = (unsigned)(id < 1) | (unsigned)(id > top);
            id = out ? 0 : id;
            bad |= out | (~(unsigned)held[id >> 3] >> (id & 7) & 1u) | mask[id];
        }
        if (bad)
            goto refuse;
        Py_ssize_t fresh = 0;
        int64_t byte = src[0] >> 3; /* (n > 0 here) */
        unsigned bits = 0;
        for (i = 0; i < n; i++) { /* mark; a repeat finds its mark already set */
            int64_t id = src[i];
            fresh += 1 - mask[id];
            mask[id] = 1;
            if (id >> 3 != byte) { /* the held bits are cleared one byte at a time: a node's
                                    * slots come in runs, and a store per slot would wait on
                                    * the one before it */
                held[byte] &= (uint8_t)~bits;
                byte = id >> 3;
                bits = 0;
            }
            bits |= 1u << (id & 7);
        }
        held[byte] &= (uint8_t)~bits;
        if (fresh != n) { /* a repeat: every id was held and in use, so restore exactly that */
            for (i = 0; i < n; i++) {
                int64_t id = src[i];
                held[id >> 3] |= (uint8_t)(1u << (id & 7));
                mask[id] = 0;
            }
            goto refuse;
        }
        write_ring(ring, cap, start, src, n);
        result = PyLong_FromSsize_t(n);
        goto done;
    }
    for (i = 0; i < n; i += ps) { /* pages: check every id first (range, held, in use) */
        int64_t id = src[i] / ps;
        if (id < 1 || id > top || !(held[id >> 3] >> (id & 7) & 1u) || mask[id])
            goto refuse;
    }
    for (i = 0, pos = start; i < n; i += ps) {
        int64_t id = src[i] / ps;
        if (mask[id]) { /* a repeat: undo the ids before it (all were held and in use) */
            while (i > 0) {
                i -= ps;
                id = src[i] / ps;
                held[id >> 3] |= (uint8_t)(1u << (id & 7));
                mask[id] = 0;
            }
            goto refuse;
        }
        held[id >> 3] &= (uint8_t)~(1u << (id & 7));
        mask[id] = 1;
        ring[pos] = id; /* past the free list's end until the caller moves the count */
        if (++pos == cap)
            pos = 0;
    }
    result = PyLong_FromSsize_t(k);
    goto done;
refuse: /* nothing changed */
    result = PyLong_FromLong(-1);
done:
    return result;
}

static PyObject *
lowest_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "lowest_free() takes 8 arguments");
        return NULL;
    }
    const uint8_t *mask = (const uint8_t *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t num_groups = PyLong_AsSsize_t(args[1]);
    Py_ssize_t group = PyLong_AsSsize_t(args[2]);
    const int64_t *gf = (const int64_t *)PyLong_AsVoidPtr(args[3]);
    Py_ssize_t g0 = PyLong_AsSsize_t(args[4]);
    Py_ssize_t k = PyLong_AsSsize_t(args[5]);
    const uint8_t *skip = (const uint8_t *)PyLong_AsVoidPtr(args[6]);
    int64_t *out = (int64_t *)PyLong_AsVoidPtr(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (mask == NULL || gf == NULL || num_groups < 0 || group < 1 || g0 < 0 || k < 0
            || (k > 0 && out == NULL)) {
        PyErr_SetString(PyExc_ValueError, "lowest_free(): bad buffers, sizes or start");
        return NULL;
    }
    Py_ssize_t w = 0;
    for (Py_ssize_t g = g0; g < num_groups && w < k; g++) {
        int64_t f = gf[g];
        if (f == 0 || (skip != NULL && skip[g]))
            continue;
        int64_t base = (int64_t)g * group;
        if (f == group) { /* wholly free: no mask to read */
            Py_ssize_t n = group < k - w ? group : k - w;
            for (Py_ssize_t j = 0; j < n; j++)
                out[w++] = base + j;
            continue;
        }
        const uint8_t *m = mask + base;
        for (Py_ssize_t j = 0; j < group && w < k; j++)
            if (m[j])
                out[w++] = base + j;
    }
    return PyLong_FromSsize_t(w);
}

static PyMethodDef methods[] = {
    {"checked", (PyCFunction)(void (*)(void))checked, METH_FASTCALL,
     "checked(src, n, ring, start, free) -> ids written, or -1 (nothing changed) when an id is "
     "out of range, already free or repeated: the public free in one pass"},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL,
     "release(src, n, page_size, ring, start, free) -> ids written: append a node's ids to a "
     "free ring and mark them free"},
    {"release_held", (PyCFunction)(void (*)(void))release_held, METH_FASTCALL,
     "release_held(src, n, page_size, held, held_bytes, ring, capacity, start, free) -> ids "
     "written, or -1 (nothing "
     "changed) when an id is outside, not held or already free: a node's slots leave the tree "
     "(held marks cleared, ids appended to the free ring and marked free) in one pass"},
    {"lowest_free", (PyCFunction)(void (*)(void))lowest_free, METH_FASTCALL,
     "lowest_free(free, num_groups, group, group_free, g0, k, skip, out) -> ids written: the "
     "k lowest free ids from group g0 on, outside the skipped groups, ascending (reads only)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_release", "The cache's free of a node's slots in one C pass.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__release(void)
{
    return PyModule_Create(&module);
}
