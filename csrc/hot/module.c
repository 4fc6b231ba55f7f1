/* module.c -- the _shmchan_hot module: bind() (the core's entry points and the Python
 * types and functions the hot path calls), the module's functions, the registration of
 * the five types, and the argument parsing the types share.
 *
 * bind() must run before any segment is bound (SegmentBase._bind refuses otherwise): the
 * Python layer calls it once at import with the addresses of the loaded cffi module's
 * functions, so the hot path and the Python layer call the same build of the core.
 */
#include "hot.h"

struct hot_core_fns hot_core;
PyTypeObject *hot_handle_type;
PyObject *hot_encode_payload_fn;
PyObject *hot_encode_keys_fn;
PyObject *hot_exc_invalid, *hot_exc_type;
PyObject *hot_s_maintain, *hot_s_send_slow, *hot_s_recv_slow, *hot_s_recv_many_slow,
    *hot_s_release_many_slow, *hot_s_released, *hot_s_payload_slow, *hot_s_data_slow,
    *hot_s_keys_slow, *hot_s_live;

/* Keyword-aware parsing for METH_FASTCALL: fills out[0..nmax) from positional and
 * keyword arguments; out[] holds the defaults on entry. */
int hot_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames, const char *const *names, int nreq, int nmax,
                   PyObject **out) {
    if (nargs > nmax) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fname, nmax,
                     nargs);
        return -1;
    }
    char given[8] = {0};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = args[i];
        given[i] = 1;
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *kw = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < nmax && PyUnicode_CompareWithASCIIString(kw, names[j]) != 0) j++;
        if (j == nmax) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname,
                         kw);
            return -1;
        }
        if (given[j]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                         names[j]);
            return -1;
        }
        out[j] = args[nargs + k];
        given[j] = 1;
    }
    for (int j = 0; j < nreq; j++) {
        if (!given[j]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname,
                         names[j]);
            return -1;
        }
    }
    return 0;
}

/* bind(addresses, handle_type, encode_payload, encode_keys): `addresses` maps the core
 * functions' names to their addresses in the loaded cffi module. */
static PyObject *bind(PyObject *mod, PyObject *args) {
    PyObject *addrs, *htype, *encp, *enck, *btype = (PyObject *)&BatchType;
    PyObject *einv = NULL, *etype = NULL;
    if (!PyArg_ParseTuple(args, "O!O!OO|O!OO", &PyDict_Type, &addrs, &PyType_Type, &htype, &encp,
                          &enck, &PyType_Type, &btype, &einv, &etype))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)htype, &HandleType))
        return PyErr_Format(PyExc_TypeError, "handle type must subclass HandleBase");
    if (!PyType_IsSubtype((PyTypeObject *)btype, &BatchType))
        return PyErr_Format(PyExc_TypeError, "batch type must subclass BatchBase");
    static const char *const fnames[] = {"shm_send",    "shm_recv",    "shm_release",
                                         "shm_release_many", "shm_unmoved", "shm_rx_spin",
                                         "shm_send_many", "shm_handle_view",
                                         "shm_handle_send_many", "shm_handle_adopt_many",
                                         "shm_timers_wait", "shm_unmoved_many",
                                         "shm_release_msgs"};
    void *fp[13];
    for (int i = 0; i < 13; i++) {
        PyObject *v = PyDict_GetItemString(addrs, fnames[i]);
        if (v == NULL) return PyErr_Format(PyExc_KeyError, "no address for %s", fnames[i]);
        fp[i] = PyLong_AsVoidPtr(v);
        if (fp[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s is NULL", fnames[i]);
            return NULL;
        }
    }
    hot_core.send = (send_fn)fp[0];
    hot_core.recv = (recv_fn)fp[1];
    hot_core.release = (release_fn)fp[2];
    hot_core.release_many = (release_many_fn)fp[3];
    hot_core.unmoved = (unmoved_fn)fp[4];
    hot_core.rx_spin = (rx_spin_fn)fp[5];
    hot_core.send_many = (send_many_fn)fp[6];
    hot_core.handle_view = (view_fn)fp[7];
    hot_core.handle_send_many = (send_many_handles_fn)fp[8];
    hot_core.handle_adopt_many = (adopt_many_fn)fp[9];
    hot_core.timers_wait = (timers_wait_fn)fp[10];
    hot_core.unmoved_many = (unmoved_many_fn)fp[11];
    hot_core.release_msgs = (release_msgs_fn)fp[12];
    if (hot_handle_type != NULL) hot_handles_flush(); /* the kept memory is the old type's */
    Py_XSETREF(hot_handle_type, (PyTypeObject *)Py_NewRef(htype));
    Py_INCREF(btype); /* held for good: the module's types outlive every batch */
    hot_batch_type = (PyTypeObject *)btype;
    Py_XSETREF(hot_encode_payload_fn, Py_NewRef(encp));
    Py_XSETREF(hot_encode_keys_fn, Py_NewRef(enck));
    if (einv) Py_XSETREF(hot_exc_invalid, Py_NewRef(einv)); /* kept when a re-bind omits them */
    if (etype) Py_XSETREF(hot_exc_type, Py_NewRef(etype));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(addresses, handle_type, encode_payload, encode_keys[, batch_type,\n"
     "invalid_argument, unsupported_type]): wire up the hot path"},
    {"handles_from", hot_handles_from, METH_VARARGS,
     "handles_from(seg, address, n): Handles for n shm_msg structs at address"},
    {"batch_from_handles", hot_batch_from_handles, METH_VARARGS,
     "batch_from_handles(seg, handles): a Batch taking over held Handles' messages"},
    {"hand_over", hot_hand_over, METH_VARARGS,
     "hand_over(seg, handles) -> (pairs, worst): mark a batch of handles in transit"},
    {"frame_keys", hot_frame_keys, METH_O,
     "frame_keys(keys) -> bytes: the key blob of a list of exact str, bytes and int keys"},
    {"decode_keys", hot_decode_keys, METH_VARARGS,
     "decode_keys(blob, n) -> tuple | None: a key blob's keys; None if malformed"},
    {"adopt_many", hot_adopt_many, METH_VARARGS,
     "adopt_many(seg, pairs, token) -> (handles, worst): adopt a batch handed over"},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_shmchan_hot",
    "shmchan's per-message calls (csrc/hot/); private to shmchan.channel.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__shmchan_hot(void) {
    PyTypeObject *types[] = {&SegmentType, &HandleType, &ReceiverType, &SenderType, &BatchType};
    const char *tnames[] = {"SegmentBase", "HandleBase", "ReceiverBase", "SenderBase",
                            "BatchBase"};
    struct {
        PyObject **slot;
        const char *s;
    } strs[] = {
        {&hot_s_maintain, "maintain"},
        {&hot_s_send_slow, "_send_slow"},
        {&hot_s_recv_slow, "_recv_slow"},
        {&hot_s_recv_many_slow, "_recv_many_slow"},
        {&hot_s_release_many_slow, "_release_many_slow"},
        {&hot_s_released, "_released"},
        {&hot_s_payload_slow, "_payload_slow"},
        {&hot_s_data_slow, "_data_slow"},
        {&hot_s_keys_slow, "_keys_slow"},
        {&hot_s_live, "_live"},
    };
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
        *strs[i].slot = PyUnicode_InternFromString(strs[i].s);
        if (*strs[i].slot == NULL) return NULL;
    }
    for (int i = 0; i < 5; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    if (PyModule_AddFunctions(m, wake_module_methods) < 0 || hot_publish_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    for (int i = 0; i < 5; i++) {
        if (PyModule_AddObjectRef(m, tnames[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
