/* handover.c -- hand-over of a batch of handles (shmchan.hand_over / shmchan.adopt).
 *
 * The batch twin of pickling handles one by one: one core call marks every handle in
 * transit (shm_handle_send_many) and one adopts them all on the other side
 * (shm_handle_adopt_many). What travels is (slot, gen) per handle, two uint32 each, in
 * this machine's byte order; the Python layer adds which channel they belong to. A
 * handle handed over is never released by the sender's garbage collector (pid -1); on
 * the adopting side every message the core adopted ends up in a Handle or given back.
 */
#include "hot.h"

/* hand_over(seg, handles) -> (pairs, worst): marks the handles (all of `seg`) in
 * transit; they no longer release when collected here. `worst` is the first status
 * that is neither SHM_OK nor SHM_STALE (a stale handle travels as a no-op one), or 0. */
PyObject *hot_hand_over(PyObject *mod, PyObject *args) {
    PyObject *seg, *list;
    if (!PyArg_ParseTuple(args, "O!O!", &SegmentType, &seg, &PyList_Type, &list)) return NULL;
    SegmentObject *sg = (SegmentObject *)seg;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (sg->c == NULL || seg_detached(sg))
        return PyErr_Format(EXC_INVALID, "hand_over: the channel is closed in this process");
    if (n > (Py_ssize_t)MAX_BATCH)
        return PyErr_Format(EXC_INVALID, "hand_over: at most %u handles at once", MAX_BATCH);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        if (!PyObject_TypeCheck(o, &HandleType))
            return PyErr_Format(EXC_TYPE, "hand_over: not a Handle: %s", Py_TYPE(o)->tp_name);
        if (((HandleObject *)o)->seg != sg)
            return PyErr_Format(EXC_INVALID, "hand_over: handles of more than one channel");
    }
    PyObject *pairs = PyBytes_FromStringAndSize(NULL, n * 8);
    if (pairs == NULL) return NULL;
    uint32_t *mem = PyMem_Malloc((size_t)(n ? n : 1) * 3 * sizeof(uint32_t));
    if (mem == NULL) {
        Py_DECREF(pairs);
        return PyErr_NoMemory();
    }
    uint32_t *slots = mem, *gens = mem + n;
    int32_t *status = (int32_t *)(mem + 2 * n);
    char *out = PyBytes_AS_STRING(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        HandleObject *h = (HandleObject *)PyList_GET_ITEM(list, i);
        slots[i] = h->slot;
        gens[i] = h->gen;
        memcpy(out + 8 * i, &h->slot, 4);
        memcpy(out + 8 * i + 4, &h->gen, 4);
    }
    if (n) hot_core.handle_send_many(sg->c, slots, gens, (uint32_t)n, status);
    int worst = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        HandleObject *h = (HandleObject *)PyList_GET_ITEM(list, i);
        h->pid = -1; /* handed over (or gone): never released by this process's GC */
        if (!worst && status[i] != SHM_OK && status[i] != SHM_STALE) worst = status[i];
    }
    PyMem_Free(mem);
    return Py_BuildValue("(Ni)", pairs, worst);
}

/* adopt_many(seg, pairs, token) -> (handles, worst): this process (token) adopts the
 * handles `pairs` names. A handle released, redelivered or taken back meanwhile comes
 * back as a no-op (released) Handle. `worst` is the first error status, or 0. */
PyObject *hot_adopt_many(PyObject *mod, PyObject *args) {
    PyObject *seg;
    Py_buffer buf;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "O!y*K", &SegmentType, &seg, &buf, &token)) return NULL;
    SegmentObject *sg = (SegmentObject *)seg;
    PyObject *res = NULL, *list = NULL;
    Py_ssize_t n = buf.len / 8;
    int adopted = 0; /* the core call was made: some messages may be ours now */
    uint32_t *mem = NULL;
    shm_msg *msgs = NULL;
    if (sg->c == NULL || seg_detached(sg)) {
        PyErr_Format(EXC_INVALID, "adopt: the channel is closed in this process");
        goto out;
    }
    if (buf.len % 8 || n > (Py_ssize_t)MAX_BATCH) {
        PyErr_Format(EXC_INVALID, "adopt: not a hand-over of at most %u handles", MAX_BATCH);
        goto out;
    }
    mem = PyMem_Malloc((size_t)(n ? n : 1) * 3 * sizeof(uint32_t));
    msgs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(shm_msg));
    if (mem == NULL || msgs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    uint32_t *slots = mem, *gens = mem + n;
    int32_t *status = (int32_t *)(mem + 2 * n);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(&slots[i], (const char *)buf.buf + 8 * i, 4);
        memcpy(&gens[i], (const char *)buf.buf + 8 * i + 4, 4);
    }
    if (n)
        hot_core.handle_adopt_many(sg->c, slots, gens, (uint32_t)n, (uint64_t)token, msgs,
                                   status);
    adopted = 1;
    list = PyList_New(n);
    if (list == NULL) goto out;
    int worst = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* not ours: released, redelivered or taken back meanwhile, or never valid */
        int gone = status[i] == SHM_STALE || status[i] == SHM_LOST || status[i] == SHM_E_INVALID;
        if (status[i] != SHM_OK) { /* a handle that still says which slot it was */
            memset(&msgs[i], 0, sizeof(shm_msg));
            msgs[i].slot = slots[i];
            msgs[i].gen = gens[i];
            if (!worst && status[i] != SHM_STALE && status[i] != SHM_LOST) worst = status[i];
        }
        HandleObject *h = (HandleObject *)hot_make_handle(sg, &msgs[i]);
        if (h == NULL) goto out;
        h->done = (char)gone; /* adopted but not described (an error): still ours to nack */
        PyList_SET_ITEM(list, i, (PyObject *)h);
    }
    res = Py_BuildValue("(Oi)", list, worst);
out:
    if (res == NULL && adopted) {
        /* Failed after the core adopted them (no memory for the list or a Handle): give
         * back every message this process now holds rather than drop it. A Handle
         * already made is marked done first, or collecting it would release (and so
         * lose) its message; one not made yet would stay held by this live process. */
        const uint32_t *sl = mem, *gn = mem + n;
        const int32_t *st = (const int32_t *)(mem + 2 * n);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (st[i] == SHM_STALE || st[i] == SHM_LOST || st[i] == SHM_E_INVALID)
                continue; /* not ours */
            if (list != NULL && PyList_GET_ITEM(list, i) != NULL)
                ((HandleObject *)PyList_GET_ITEM(list, i))->done = 1;
            int r = hot_core.release(sg->c, sl[i], gn[i], 1);
            if (r > 0) hot_post_wakeups(sg, r);
        }
    }
    Py_XDECREF(list);
    PyMem_Free(mem);
    PyMem_Free(msgs);
    PyBuffer_Release(&buf);
    return res;
}
