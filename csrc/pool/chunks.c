/* chunks.c -- KeyedExecutor.map's per-item bookkeeping for chunks, in C.
 *
 * map(fn, items, keys=..., chunksize=N) groups the items by key into chunks (a chunk
 * holds the keys of its items while it runs, so chunks of different keys run in
 * parallel), sends each chunk as one task, and puts each chunk's results back in input
 * order. Done in Python, that per-item work in the caller's process (grouping, building
 * the chunks' argument tuples, putting results back) cost more than the workers spend
 * running a trivial function. These three loops are all this module does; what a
 * chunk is and how it runs stays in
 * shmchan/pool/executor.py:
 *
 *   one_key_chunks(keys, size) -> list[list[int]] | None
 *       For items with one key each (keys[i] an int, str or bytes, exactly: a bool or a
 *       subclass gives None, and the caller takes its general path): each key's item
 *       indices in input order, cut every `size`, listed round by round -- every key's
 *       first chunk in order of first appearance, then every key's second, ... -- so the
 *       first chunks of all keys can run at once.
 *   pick(items, indices) -> tuple
 *       (items[indices[0]], items[indices[1]], ...): a chunk's arguments.
 *   scatter(results, indices, values) -> None
 *       results[indices[j]] = values[j] for every j: a chunk's results in their places.
 *
 * No shared memory is touched here. Every index is bounds-checked (IndexError), every
 * argument type-checked (TypeError), and lengths must match (ValueError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static int is_one_key(PyObject *k) {
    return PyLong_CheckExact(k) || PyUnicode_CheckExact(k) || PyBytes_CheckExact(k);
}

static PyObject *one_key_chunks(PyObject *self, PyObject *args) {
    PyObject *keys;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "O!n:one_key_chunks", &PyList_Type, &keys, &size)) return NULL;
    if (size < 1) {
        PyErr_Format(PyExc_ValueError, "size must be at least 1, got %zd", size);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!is_one_key(PyList_GET_ITEM(keys, i))) Py_RETURN_NONE;
    }
    /* Each key's items as a linked list through `next` (input order): head/tail/count
     * per group, groups numbered in order of first appearance. */
    Py_ssize_t *next = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    Py_ssize_t *head = NULL, *tail = NULL, *left = NULL;
    Py_ssize_t groups = 0, cap = 0;
    PyObject *index_of = PyDict_New(); /* key -> its group number */
    PyObject *out = NULL;
    if (next == NULL || index_of == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        PyObject *g = PyDict_GetItemWithError(index_of, k); /* borrowed */
        Py_ssize_t gi;
        if (g != NULL) {
            gi = PyLong_AsSsize_t(g);
            next[tail[gi]] = i;
            tail[gi] = i;
            left[gi]++;
        } else {
            if (PyErr_Occurred()) goto fail;
            if (groups == cap) {
                cap = cap ? 2 * cap : 64;
                Py_ssize_t *h = PyMem_Realloc(head, sizeof(Py_ssize_t) * (size_t)cap);
                if (h == NULL) goto fail;
                head = h;
                Py_ssize_t *t = PyMem_Realloc(tail, sizeof(Py_ssize_t) * (size_t)cap);
                if (t == NULL) goto fail;
                tail = t;
                Py_ssize_t *l = PyMem_Realloc(left, sizeof(Py_ssize_t) * (size_t)cap);
                if (l == NULL) goto fail;
                left = l;
            }
            gi = groups++;
            PyObject *num = PyLong_FromSsize_t(gi);
            if (num == NULL) goto fail;
            int rc = PyDict_SetItem(index_of, k, num);
            Py_DECREF(num);
            if (rc < 0) goto fail;
            head[gi] = tail[gi] = i;
            left[gi] = 1;
        }
        next[i] = -1;
    }
    out = PyList_New(0);
    if (out == NULL) goto fail;
    /* Round by round over the groups that still have items; `head` is reused as each
     * group's cursor and the live groups are kept packed at the front (in order). */
    Py_ssize_t live = groups;
    Py_ssize_t *order = tail; /* tail is no longer needed: it becomes the live list */
    for (Py_ssize_t g = 0; g < groups; g++) order[g] = g;
    while (live > 0) {
        Py_ssize_t kept = 0;
        for (Py_ssize_t j = 0; j < live; j++) {
            Py_ssize_t g = order[j];
            Py_ssize_t take = left[g] < size ? left[g] : size;
            PyObject *chunk = PyList_New(take);
            if (chunk == NULL) goto fail;
            Py_ssize_t at = head[g];
            for (Py_ssize_t c = 0; c < take; c++) {
                PyObject *num = PyLong_FromSsize_t(at);
                if (num == NULL) {
                    Py_DECREF(chunk);
                    goto fail;
                }
                PyList_SET_ITEM(chunk, c, num);
                at = next[at];
            }
            int rc = PyList_Append(out, chunk);
            Py_DECREF(chunk);
            if (rc < 0) goto fail;
            head[g] = at;
            left[g] -= take;
            if (left[g] > 0) order[kept++] = g;
        }
        live = kept;
    }
    PyMem_Free(next);
    PyMem_Free(head);
    PyMem_Free(tail);
    PyMem_Free(left);
    Py_DECREF(index_of);
    return out;
fail:
    if (!PyErr_Occurred()) PyErr_NoMemory();
    PyMem_Free(next);
    PyMem_Free(head);
    PyMem_Free(tail);
    PyMem_Free(left);
    Py_XDECREF(index_of);
    Py_XDECREF(out);
    return NULL;
}

/* indices[j] as an index into a sequence of length n, or -1 with IndexError/TypeError. */
static Py_ssize_t index_at(PyObject *indices, Py_ssize_t j, Py_ssize_t n) {
    PyObject *o = PyList_GET_ITEM(indices, j);
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "indices must be ints, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    Py_ssize_t i = PyLong_AsSsize_t(o);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0 || i >= n) {
        PyErr_Format(PyExc_IndexError, "index %zd out of range for %zd items", i, n);
        return -1;
    }
    return i;
}

static PyObject *pick(PyObject *self, PyObject *args) {
    PyObject *items, *indices;
    if (!PyArg_ParseTuple(args, "O!O!:pick", &PyList_Type, &items, &PyList_Type, &indices))
        return NULL;
    Py_ssize_t m = PyList_GET_SIZE(indices);
    PyObject *out = PyTuple_New(m);
    if (out == NULL) return NULL;
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_ssize_t i = index_at(indices, j, PyList_GET_SIZE(items));
        if (i < 0) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *item = PyList_GET_ITEM(items, i);
        Py_INCREF(item);
        PyTuple_SET_ITEM(out, j, item);
    }
    return out;
}

static PyObject *scatter(PyObject *self, PyObject *args) {
    PyObject *results, *indices, *values;
    if (!PyArg_ParseTuple(args, "O!O!O!:scatter", &PyList_Type, &results, &PyList_Type,
                          &indices, &PyList_Type, &values))
        return NULL;
    Py_ssize_t m = PyList_GET_SIZE(indices);
    if (PyList_GET_SIZE(values) != m) {
        PyErr_Format(PyExc_ValueError, "%zd indices but %zd values", m,
                     PyList_GET_SIZE(values));
        return NULL;
    }
    /* Checked first, so that a bad index leaves `results` untouched. The values they
     * replace are released last: a destructor that runs then sees the work done (and
     * cannot pull a list from under the loop). */
    for (Py_ssize_t j = 0; j < m; j++) {
        if (index_at(indices, j, PyList_GET_SIZE(results)) < 0) return NULL;
    }
    PyObject **old = PyMem_Malloc(sizeof(PyObject *) * (size_t)(m ? m : 1));
    if (old == NULL) return PyErr_NoMemory();
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(indices, j));
        PyObject *v = PyList_GET_ITEM(values, j);
        Py_INCREF(v);
        old[j] = PyList_GET_ITEM(results, i);
        PyList_SET_ITEM(results, i, v);
    }
    for (Py_ssize_t j = 0; j < m; j++) Py_XDECREF(old[j]);
    PyMem_Free(old);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"one_key_chunks", one_key_chunks, METH_VARARGS,
     "one_key_chunks(keys: list, size: int) -> list[list[int]] | None: item indices grouped\n"
     "by key (int, str or bytes keys), cut every size, listed round by round; None when a\n"
     "key is of another type."},
    {"pick", pick, METH_VARARGS, "pick(items: list, indices: list[int]) -> tuple"},
    {"scatter", scatter, METH_VARARGS,
     "scatter(results: list, indices: list[int], values: list): results[indices[j]] = "
     "values[j]"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shmchan_chunks",
    "KeyedExecutor.map's per-item chunk bookkeeping (see csrc/pool/chunks.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__shmchan_chunks(void) { return PyModule_Create(&module); }
