/* radix._match: the walk's key comparison in C.
 *
 * RadixTree.walk compares a node's segment with the key at the walk's position. In Python
 * that is an array slice (a copy) and an element-wise comparison, plus a binary search over
 * more slices when they differ. Here it is one memcmp over the two buffers, and a scan for the
 * first difference only when there is one. radix.tree._common_prefix_len_py is the Python
 * reference (used when this module is not built; tests/test_compiled.py runs both).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* common_prefix_len(seg, key, pos, limit) -> int
 *
 * The length of the common prefix of seg[:limit] and key[pos:pos + limit], both buffers of
 * int64 (array('q')). Raises ValueError when a range falls outside its buffer.
 */
static PyObject *
common_prefix_len(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "common_prefix_len() takes 4 arguments");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[2]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer sb, kb;
    if (PyObject_GetBuffer(args[0], &sb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &kb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    Py_ssize_t n = -1;
    if (sb.itemsize != 8 || kb.itemsize != 8) {
        PyErr_SetString(PyExc_TypeError, "common_prefix_len(): int64 buffers expected");
    }
    else if (pos < 0 || limit < 0 || limit > sb.len / 8 || pos > kb.len / 8 - limit) {
        PyErr_SetString(PyExc_ValueError, "common_prefix_len(): range outside a buffer");
    }
    else {
        const int64_t *s = (const int64_t *)sb.buf;
        const int64_t *k = (const int64_t *)kb.buf + pos;
        if (memcmp(s, k, (size_t)limit * 8) == 0) {
            n = limit;
        }
        else {
            for (n = 0; s[n] == k[n]; n++)
                ;
        }
    }
    PyBuffer_Release(&sb);
    PyBuffer_Release(&kb);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"common_prefix_len", (PyCFunction)(void (*)(void))common_prefix_len, METH_FASTCALL,
     "common_prefix_len(seg, key, pos, limit) -> tokens seg[:limit] and key[pos:pos+limit] "
     "share"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_match", "The walk's key comparison in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__match(void)
{
    return PyModule_Create(&module);
}
