/* subclass.c -- what a Python subclass of one of the extension's types takes from its C
 * base when the class is made (the base's __init_subclass__): descriptors of its own
 * for the base's methods and attributes, and, for a Handle, the base's plain memory.
 *
 * Descriptors of its own. CPython's quick call of a C method (the specialized call of a
 * method descriptor in Python/ceval.c) is taken only when the object's type is exactly
 * the type the descriptor names; every other object takes the generic call, and the
 * descriptor's own check of the object walks the type's MRO (PyType_IsSubtype). The
 * objects the extension hands out are all of a Python subclass (shmchan.Handle,
 * shmchan.Receiver, ...), never of the C base, so each h.release(), rx.recv() and
 * h.payload paid for both. A copy of each descriptor made for the subclass (the same C
 * function or member, the same docstring, the subclass as its type) passes the test.
 * A copy is made only for a name the subclass resolves to the base's own descriptor: a
 * name the subclass (or a class between them) defines stays as it is. Special methods
 * (__enter__, ...) are left to the base.
 *
 * Plain memory. Every class made by a class statement is collected by the cyclic
 * garbage collector (CPython makes each one so, since its instances could be part of a
 * cycle through their __dict__, their slots or the class), and its objects go through
 * subtype_dealloc. A subclass that adds nothing to the base's object -- no __dict__, no
 * slots, no weak references, no finalizer -- has nothing the collector could follow but
 * the class, so hot_subclass_plain gives it the base's allocation instead: objects
 * outside the collector, freed directly by a deallocator the base provides. Each object
 * still owns a reference to its class (PyObject_Init takes it, that deallocator drops
 * it). The one cycle the collector no longer sees is a class holding one of its own
 * instances as a class attribute: then neither is freed.
 */
#include "hot.h"

/* Is `name` resolved on sub (its MRO, as attribute lookup walks it) to base's own
 * descriptor, that is, does no class between them define it? 1, 0, or -1 on error. */
static int resolves_to_base(PyTypeObject *sub, PyTypeObject *base, PyObject *name) {
    PyObject *own = PyDict_GetItemWithError(base->tp_dict, name);
    if (own == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *mro = sub->tp_mro;
    if (mro == NULL || !PyTuple_Check(mro)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *t = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if (t == base) return 1;
        PyObject *v = t->tp_dict ? PyDict_GetItemWithError(t->tp_dict, name) : NULL;
        if (v != NULL) return v == own;
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* Put descriptor d (a new reference, or NULL on error) into sub under name. */
static int put(PyTypeObject *sub, const char *name, PyObject *d) {
    if (d == NULL) return -1;
    int r = PyObject_SetAttrString((PyObject *)sub, name, d);
    Py_DECREF(d);
    return r;
}

/* Is a copy of base's descriptor `name` wanted on sub? Not for special methods
 * (__enter__, ...): CPython finds those by their type slot or a special lookup, not by
 * the quick call, and setting one on a class rewires its slots. */
static int wanted(PyTypeObject *sub, PyTypeObject *base, const char *name) {
    if (name[0] == '_' && name[1] == '_') return 0;
    PyObject *s = PyUnicode_InternFromString(name);
    if (s == NULL) return -1;
    int r = resolves_to_base(sub, base, s);
    Py_DECREF(s);
    return r;
}

int hot_subclass_descriptors(PyTypeObject *sub, PyTypeObject *base) {
    if (sub == base || !(sub->tp_flags & Py_TPFLAGS_HEAPTYPE)) return 0;
    for (PyMethodDef *m = base->tp_methods; m && m->ml_name; m++) {
        if (m->ml_flags & (METH_CLASS | METH_STATIC)) continue; /* no type check to pass */
        int w = wanted(sub, base, m->ml_name);
        if (w < 0 || (w && put(sub, m->ml_name, PyDescr_NewMethod(sub, m)) < 0)) return -1;
    }
    for (PyGetSetDef *g = base->tp_getset; g && g->name; g++) {
        int w = wanted(sub, base, g->name);
        if (w < 0 || (w && put(sub, g->name, PyDescr_NewGetSet(sub, g)) < 0)) return -1;
    }
    for (PyMemberDef *d = base->tp_members; d && d->name; d++) {
        int w = wanted(sub, base, d->name);
        if (w < 0 || (w && put(sub, d->name, PyDescr_NewMember(sub, d)) < 0)) return -1;
    }
    return 0;
}

int hot_subclass_plain(PyTypeObject *sub, PyTypeObject *base, destructor dealloc) {
    if (sub == base || !(sub->tp_flags & Py_TPFLAGS_HEAPTYPE) || PyType_IS_GC(base) ||
        sub->tp_basicsize != base->tp_basicsize || sub->tp_itemsize != base->tp_itemsize ||
        sub->tp_dictoffset != base->tp_dictoffset ||
        sub->tp_weaklistoffset != base->tp_weaklistoffset || sub->tp_finalize != NULL ||
        sub->tp_del != NULL)
        return 0;
#ifdef Py_TPFLAGS_MANAGED_DICT
    if (sub->tp_flags & Py_TPFLAGS_MANAGED_DICT) return 0;
#endif
#ifdef Py_TPFLAGS_MANAGED_WEAKREF
    if (sub->tp_flags & Py_TPFLAGS_MANAGED_WEAKREF) return 0;
#endif
    /* No object of sub exists yet: __init_subclass__ runs before the class statement
     * binds the class to anything. */
    sub->tp_flags &= ~Py_TPFLAGS_HAVE_GC;
    sub->tp_traverse = NULL;
    sub->tp_clear = NULL;
    sub->tp_free = PyObject_Free;
    sub->tp_dealloc = dealloc;
    return 1;
}

int hot_subclass_args(PyObject *cls, PyObject *args, PyObject *kwds) {
    if ((args == NULL || PyTuple_GET_SIZE(args) == 0) && (kwds == NULL || PyDict_GET_SIZE(kwds) == 0))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s.__init_subclass__() takes no arguments",
                 ((PyTypeObject *)cls)->tp_name);
    return -1;
}

PyObject *hot_init_subclass(PyObject *cls, PyObject *args, PyObject *kwds) {
    if (hot_subclass_args(cls, args, kwds) < 0) return NULL;
    PyTypeObject *sub = (PyTypeObject *)cls, *base = sub->tp_base;
    while (base != NULL && (base->tp_flags & Py_TPFLAGS_HEAPTYPE)) base = base->tp_base;
    if (base != NULL && hot_subclass_descriptors(sub, base) < 0) return NULL;
    Py_RETURN_NONE;
}
