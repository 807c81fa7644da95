/* radix._match: the walk's key comparison in C.
 *
 * RadixTree.walk compares a node's segment with the key at the walk's position. In Python
 * that is an array slice (a copy) and an element-wise comparison, plus a binary search over
 * more slices when they differ. Here it is one memcmp over the two buffers, and a scan for the
 * first difference only when there is one. radix.tree._common_prefix_len_py is the Python
 * reference (used when this module is not built; tests/radix/test_compiled.py runs both).
 *
 * walk_from runs the walk's whole loop below the root: per node one attribute read of its key,
 * one memcmp, and one dict lookup of the next page among its children, with no Python frame.
 * radix.tree._walk_from_py is its reference.
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

/* walk_from(child, key, end, page_size) -> (path, partial, partial_len, matched_len)
 *
 * The walk of key[:end] (int64 buffer, end a page multiple <= len(key)) from `child`, the
 * root's child filed under the key's first page (a node: attributes `key`, an int64 buffer,
 * and `children`, a dict). Nodes matched whole go to `path` (shallowest first); `partial` is
 * the node the key leaves inside its segment (or None) with `partial_len` tokens of it matched
 * (a page multiple); `matched_len` is the tokens matched. A child is looked up by the next
 * token (page size 1, an int) or the next page's bytes.
 */
static PyObject *str_key, *str_children;

static PyObject *
walk_from(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "walk_from() takes 4 arguments");
        return NULL;
    }
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    Py_ssize_t ps = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer kb;
    if (PyObject_GetBuffer(args[1], &kb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (kb.itemsize != 8 || ps < 1 || end < 0 || end > kb.len / 8 || end % ps != 0) {
        PyBuffer_Release(&kb);
        PyErr_SetString(PyExc_ValueError,
                        "walk_from(): an int64 key, a page size >= 1 and a page-multiple end "
                        "inside the key expected");
        return NULL;
    }
    const int64_t *key = (const int64_t *)kb.buf;
    PyObject *path = PyList_New(0);
    PyObject *child = args[0];
    PyObject *result = NULL;
    Py_ssize_t pos = 0;
    if (path == NULL)
        goto fail;
    if (child != Py_None)
        Py_INCREF(child);
    while (child != Py_None) {
        PyObject *seg = PyObject_GetAttr(child, str_key);
        if (seg == NULL)
            goto fail_child;
        Py_buffer sb;
        if (PyObject_GetBuffer(seg, &sb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            Py_DECREF(seg);
            goto fail_child;
        }
        Py_ssize_t seg_len = sb.len / 8;
        Py_ssize_t limit = pos + seg_len <= end ? seg_len : end - pos;
        Py_ssize_t n;
        int ok = sb.itemsize == 8;
        if (ok) {
            const int64_t *s = (const int64_t *)sb.buf;
            const int64_t *k = key + pos;
            if (memcmp(s, k, (size_t)limit * 8) == 0)
                n = limit;
            else
                for (n = 0; s[n] == k[n]; n++)
                    ;
        }
        PyBuffer_Release(&sb);
        Py_DECREF(seg);
        if (!ok) {
            PyErr_SetString(PyExc_TypeError, "walk_from(): a node key is not an int64 buffer");
            goto fail_child;
        }
        if (n != seg_len) { /* the key leaves inside this node (n >= one page: its index) */
            n -= n % ps;
            result = Py_BuildValue("(NNnn)", path, child, n, pos + n);
            path = NULL;
            goto done;
        }
        if (PyList_Append(path, child) < 0)
            goto fail_child;
        pos += seg_len;
        if (pos >= end) {
            Py_DECREF(child);
            break;
        }
        PyObject *children = PyObject_GetAttr(child, str_children);
        Py_DECREF(child);
        if (children == NULL)
            goto fail;
        if (!PyDict_Check(children)) {
            Py_DECREF(children);
            PyErr_SetString(PyExc_TypeError, "walk_from(): a node's children is not a dict");
            goto fail;
        }
        PyObject *page = ps == 1 ? PyLong_FromLongLong(key[pos])
                                 : PyBytes_FromStringAndSize((const char *)(key + pos), ps * 8);
        if (page == NULL) {
            Py_DECREF(children);
            goto fail;
        }
        child = PyDict_GetItemWithError(children, page); /* borrowed */
        Py_DECREF(page);
        if (child == NULL) {
            Py_DECREF(children);
            if (PyErr_Occurred())
                goto fail;
            child = Py_None;
            break;
        }
        Py_INCREF(child);
        Py_DECREF(children);
    }
    result = Py_BuildValue("(NOin)", path, Py_None, 0, pos);
    path = NULL;
    goto done;
fail_child:
    Py_DECREF(child);
fail:
    Py_XDECREF(path);
    path = NULL;
done:
    PyBuffer_Release(&kb);
    return result;
}

static PyMethodDef methods[] = {
    {"walk_from", (PyCFunction)(void (*)(void))walk_from, METH_FASTCALL,
     "walk_from(child, key, end, page_size) -> (path, partial, partial_len, matched_len)"},
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
    str_key = PyUnicode_InternFromString("key");
    str_children = PyUnicode_InternFromString("children");
    if (str_key == NULL || str_children == NULL)
        return NULL;
    return PyModule_Create(&module);
}
