/* The recording wrapper of one torch.distributed op, compiled: instrument()'s generated wrapper
 * (ncclguard/recording/instrument.py, _BODY) step for step, as a C callable.
 *
 * Why: a Python wrapper pays its own frame and a few hundred bytecodes on every collective, and
 * around a real call, right after the thread slept in the backend, that Python runs two to three
 * times slower than in a warm loop (benchmarks/recording_breakdown.py --gloo). This one forwards
 * the caller's arguments untouched (vectorcall: no tuple, no dict) and writes the same record: the
 * same list, the same slots (record.py), the same counters (flight.py: a list of three ints), the
 * same per-thread open records (recorder.opened), the same slow paths, which it calls in Python
 * (instrument._counter_of, sites.user_frame, recorder.finish/attach, phase.current_phase).
 * tests/test_flight.py runs every recording test through both wrappers and compares their records.
 *
 * Threads: it runs with the GIL held throughout, like the Python wrapper; each step is one C-API
 * operation on a list, dict or deque, and the record is complete before it is appended to the
 * ring (see the module doc of flight.py for why a reader never sees half a record).
 *
 * Built by setup.py as an optional extension: where it cannot be built (no compiler, a Python
 * before 3.11, which lacks PyFrame_GetLasti), instrument() uses the Python wrapper. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#if PY_VERSION_HEX < 0x030B0000
#error "ncclguard's compiled recorder needs Python 3.11 (PyFrame_GetLasti); the Python one is used"
#endif

/* On 3.11, the walk to the user's frame reads the interpreter's frames directly, so that it makes
 * no frame object for the frames it passes (under DeepSpeed 14 to 39 of them per collective: each
 * made and freed costs more than all the rest of a record). The layout is 3.11's
 * (internal/pycore_frame.h); other versions take the public API (PyFrame_GetBack, which makes
 * them). tests/test_flight_records.py checks both walks' sites against f_lineno's. */
#if PY_VERSION_HEX < 0x030C0000
#define NCCLGUARD_INTERPRETER_FRAMES 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif

/* Record slots: keep in step with ncclguard/recording/record.py. */
enum { R_SEQ, R_OP, R_REDOP, R_GROUP, R_NUMEL, R_DTYPE, R_START, R_END, R_PHASE, R_WHERE, R_LASTI,
       R_THREAD, R_ASYNC, R_PEER, R_ERROR, R_PROGRESS, R_WORK, R_PREV, R_SLOTS };
/* Counter slots: flight.py's C_SEQ, C_DONE. */
enum { C_SEQ = 0, C_DONE = 1 };

static PyObject *s_numel, *s_dtype, *s_default_pg, *s__default_pg, *s_ring, *s_append, *s_ident, *s_path;

/* An argument of the op: its position and name (-1/NULL: the op has no such parameter). */
typedef struct {
    Py_ssize_t pos;
    PyObject *name;
    PyObject *dflt; /* its default when not passed */
} Param;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *weakrefs;
    PyObject *original;
    PyObject *kind;
    Param data, group, op, async_op, peer;
    PyObject *names_all;     /* every parameter's name (interned), in order */
    PyObject *required;      /* the indices of the parameters without a default */
    Py_ssize_t n_positional; /* parameters that may be passed by position */
    int always_async;
    int p2p;
    /* Shared with the Python wrappers (instrument._wrap's namespace). */
    PyObject *recorder, *opened, *counts, *names, *world, *world_attrs, *user_files, *is_framework;
    PyObject *counter_of, *user_frame, *describe, *finish, *attach, *main, *current_phase;
    PyObject *tensor_type;
} Wrapper;

static PyObject *
arg_of(const Param *p, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    /* Borrowed: the argument as passed, else the parameter's default (NULL: no such parameter). */
    if (p->pos < 0)
        return NULL;
    if (p->pos < nargs)
        return args[p->pos];
    if (kwnames != NULL) {
        Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nkw; i++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, i);
            if (key == p->name)
                return args[nargs + i];
        }
        for (Py_ssize_t i = 0; i < nkw; i++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, i);
            int eq = PyUnicode_Compare(key, p->name);
            if (eq == 0)
                return args[nargs + i];
            if (eq == -1 && PyErr_Occurred())
                PyErr_Clear();
        }
    }
    return p->dflt;
}

static double
now_s(void)
{
    /* time.time()'s clock (CLOCK_REALTIME), in seconds. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* 1 when the arguments bind to the op's parameters as Python would bind them to the generated
 * wrapper's; 0 when they do not (then the original is called unrecorded, to raise its TypeError,
 * as the Python wrapper raises one before recording). */
static int
binds(Wrapper *self, Py_ssize_t nargs, PyObject *kwnames)
{
    Py_ssize_t n = PyTuple_GET_SIZE(self->names_all);
    if (nargs > self->n_positional)
        return 0;
    unsigned char given[64];
    if (n > 64)
        return 0;
    memset(given, 0, sizeof(given));
    for (Py_ssize_t i = 0; i < nargs; i++)
        given[i] = 1;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t at = -1;
        for (Py_ssize_t i = 0; i < n && at < 0; i++)
            if (PyTuple_GET_ITEM(self->names_all, i) == key)
                at = i;
        for (Py_ssize_t i = 0; i < n && at < 0; i++) {
            int eq = PyUnicode_Compare(key, PyTuple_GET_ITEM(self->names_all, i));
            if (eq == -1 && PyErr_Occurred())
                PyErr_Clear();
            else if (eq == 0)
                at = i;
        }
        if (at < 0 || given[at])
            return 0;
        given[at] = 1;
    }
    Py_ssize_t nreq = PyTuple_GET_SIZE(self->required);
    for (Py_ssize_t r = 0; r < nreq; r++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(self->required, r));
        if (i < 0 || i >= n || !given[i]) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

/* Closes `rec` as the Python wrapper's tail does; returns 0, or -1 with an exception set. */
static int
close_sync(PyObject *opened, PyObject *finish, PyObject *rec, PyObject *tid, PyObject *count, long long seq)
{
    PyObject *top = PyDict_GetItemWithError(opened, tid);
    if (top == rec) {
        if (PyDict_DelItem(opened, tid) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError))
                return -1;
            PyErr_Clear();
        }
    }
    else if (top != NULL) { /* a record start()ed inside this call and left open */
        PyObject *res = PyObject_CallOneArg(finish, rec);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
        return 0;
    }
    else if (PyErr_Occurred()) {
        return -1;
    } /* else: cleared meanwhile (a world change) */
    PyObject *end = PyFloat_FromDouble(now_s());
    if (end == NULL)
        return -1;
    if (PyList_SetItem(rec, R_END, end) < 0)
        return -1;
    PyObject *done = PyList_GET_ITEM(count, C_DONE);
    long long d = PyLong_AsLongLong(done);
    if (d == -1 && PyErr_Occurred())
        return -1;
    if (seq > d) {
        PyObject *v = PyLong_FromLongLong(seq);
        if (v == NULL || PyList_SetItem(count, C_DONE, v) < 0)
            return -1;
    }
    return 0;
}

/* The user's site of `frame`: its code and offset when its file is a user file, else those of the
 * first user frame above it, else None and -1. New references. The walk over frames whose files
 * sites.py already knows for library files (_is_framework[file] is True, the frames of torch and
 * DeepSpeed between their collective and the user) is done here; at a file it does not know yet it
 * hands over to sites.user_frame, which classifies it. */
static int
site_of(PyFrameObject *frame, PyObject *user_files, PyObject *is_framework, PyObject *user_frame, PyObject **code,
        PyObject **lasti)
{
    *code = NULL;
    *lasti = NULL;
    PyFrameObject *f = (PyFrameObject *)Py_XNewRef(frame);
    for (int depth = 0; f != NULL && depth < 1024; depth++) {
        PyCodeObject *c = PyFrame_GetCode(f);
        int mine = PySet_Contains(user_files, c->co_filename);
        if (mine < 0) {
            Py_DECREF(c);
            Py_DECREF(f);
            return -1;
        }
        if (mine) {
            *code = (PyObject *)c;
            *lasti = PyLong_FromLong(PyFrame_GetLasti(f));
            Py_DECREF(f);
            return *lasti == NULL ? -1 : 0;
        }
        PyObject *known = PyDict_GetItemWithError(is_framework, c->co_filename); /* borrowed */
        Py_DECREF(c);
        if (known == NULL && PyErr_Occurred()) {
            Py_DECREF(f);
            return -1;
        }
        if (known != Py_True) { /* a file not seen yet: sites.py decides, and walks on from here */
            PyObject *user = PyObject_CallOneArg(user_frame, (PyObject *)f);
            Py_DECREF(f);
            if (user == NULL)
                return -1;
            if (user != Py_None) {
                *code = (PyObject *)PyFrame_GetCode((PyFrameObject *)user);
                *lasti = PyLong_FromLong(PyFrame_GetLasti((PyFrameObject *)user));
            }
            Py_DECREF(user);
            f = NULL;
            break;
        }
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    if (*code == NULL) {
        *code = Py_NewRef(Py_None);
        *lasti = PyLong_FromLong(-1);
    }
    return *lasti == NULL ? -1 : 0;
}

#ifdef NCCLGUARD_INTERPRETER_FRAMES
/* site_of without frame objects, from the calling thread's current frame (`skip` complete frames
 * skipped first): 1 with `code` and `lasti` set (None and -1 when no user frame is above), 0 when
 * it met a file sites.py has not classified yet (the caller then takes site_of's way), -1 on error. */
static int
site_from_here(int skip, PyObject *is_framework, PyObject **code, PyObject **lasti)
{
    _PyInterpreterFrame *f = PyThreadState_Get()->cframe->current_frame;
    int passed = 0;
    for (int depth = 0; f != NULL && depth < 4096; depth++, f = f->previous) {
        if (_PyFrame_IsIncomplete(f) || passed++ < skip)
            continue;
        /* sites._is_framework: True for a library file, False for a user's (one lookup for both) */
        PyObject *known = PyDict_GetItemWithError(is_framework, f->f_code->co_filename); /* borrowed */
        if (known == NULL && PyErr_Occurred())
            return -1;
        if (known == Py_False) {
            int at = _PyInterpreterFrame_LASTI(f); /* in code units; frame.f_lasti is in bytes */
            *code = Py_NewRef((PyObject *)f->f_code);
            *lasti = PyLong_FromLong(at < 0 ? -1 : at * (long)sizeof(_Py_CODEUNIT));
            return *lasti == NULL ? -1 : 1;
        }
        if (known != Py_True)
            return 0;
    }
    *code = Py_NewRef(Py_None);
    *lasti = PyLong_FromLong(-1);
    return *lasti == NULL ? -1 : 1;
}
#endif

/* The calling thread's phase path: the main thread's track, read directly, or current_phase(). */
static PyObject *
phase_of(PyObject *main, PyObject *current_phase, PyObject *tid)
{
    PyObject *main_ident = PyObject_GetAttr(main, s_ident);
    if (main_ident == NULL)
        return NULL;
    int is_main = PyObject_RichCompareBool(main_ident, tid, Py_EQ);
    Py_DECREF(main_ident);
    if (is_main < 0)
        return NULL;
    return is_main ? PyObject_GetAttr(main, s_path) : PyObject_CallNoArgs(current_phase);
}

/* Appends `rec` to recorder.ring (read each time: resize() replaces it) and makes it the thread's open record. */
static int
publish(PyObject *recorder, PyObject *opened, PyObject *tid, PyObject *rec)
{
    PyObject *ring = PyObject_GetAttr(recorder, s_ring);
    if (ring == NULL)
        return -1;
    PyObject *appended = PyObject_CallMethodOneArg(ring, s_append, rec);
    Py_DECREF(ring);
    if (appended == NULL)
        return -1;
    Py_DECREF(appended);
    return PyDict_SetItem(opened, tid, rec);
}

static PyObject *
wrapper_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Wrapper *self = (Wrapper *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *tid = NULL, *numel = NULL, *dtype = NULL, *pg = NULL, *name = NULL, *count = NULL;
    PyObject *code = NULL, *lasti = NULL, *start = NULL, *phase = NULL, *rec = NULL, *out = NULL;
    PyObject *seqobj = NULL, *peer = NULL;
    long long seq;

    if (!binds(self, nargs, kwnames))
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    tid = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (tid == NULL)
        return NULL;
    int nested = PyDict_Contains(self->opened, tid);
    if (nested != 0) { /* inside a recorded call of this thread (safe_all_reduce's chunks), or an error */
        Py_DECREF(tid);
        if (nested < 0)
            return NULL;
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    }

    /* describe */
    PyObject *data = arg_of(&self->data, args, nargs, kwnames);
    if (data == NULL || data == Py_None) {
        if (self->data.pos < 0) {
            numel = PyLong_FromLong(0);
            dtype = PyUnicode_FromString("");
        }
        else {
            PyObject *pair = PyObject_CallOneArg(self->describe, data == NULL ? Py_None : data);
            if (pair == NULL)
                goto fail;
            numel = PySequence_GetItem(pair, 0);
            dtype = PySequence_GetItem(pair, 1);
            Py_DECREF(pair);
        }
    }
    else if (Py_IS_TYPE(data, (PyTypeObject *)self->tensor_type)) {
        numel = PyObject_CallMethodNoArgs(data, s_numel);
        dtype = numel == NULL ? NULL : PyObject_GetAttr(data, s_dtype);
    }
    else {
        PyObject *pair = PyObject_CallOneArg(self->describe, data);
        if (pair == NULL)
            goto fail;
        numel = PySequence_GetItem(pair, 0);
        dtype = PySequence_GetItem(pair, 1);
        Py_DECREF(pair);
    }
    if (numel == NULL || dtype == NULL)
        goto fail;

    /* counter: the group's name through torch's pg_names, then its counter */
    PyObject *group = arg_of(&self->group, args, nargs, kwnames);
    if (group == NULL || group == Py_None) {
        /* torch's default group: _World's attribute (compat.world_attributes), else its property */
        pg = PyDict_GetItemWithError(self->world_attrs, s__default_pg);
        if (pg != NULL)
            Py_INCREF(pg);
        else if (!PyErr_Occurred())
            pg = PyObject_GetAttr(self->world, s_default_pg);
    }
    else
        pg = Py_NewRef(group);
    if (pg == NULL)
        goto fail;
    PyObject *pg_names = PyList_GET_ITEM(self->names, 0);
    name = PyDict_GetItemWithError(pg_names, pg); /* borrowed */
    if (name != NULL)
        count = PyDict_GetItemWithError(self->counts, name); /* borrowed */
    if (name == NULL || count == NULL) {
        PyErr_Clear(); /* a KeyError-free miss, or a TypeError (an unhashable group) */
        PyObject *pair = PyObject_CallFunctionObjArgs(self->counter_of, pg, self->counts, NULL);
        if (pair == NULL)
            goto fail;
        name = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
        count = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(pair);
    }
    else {
        Py_INCREF(name);
        Py_INCREF(count);
    }
    if (!PyList_CheckExact(count) || PyList_GET_SIZE(count) < 3) {
        PyErr_SetString(PyExc_TypeError, "ncclguard: a counter is a list of three ints");
        goto fail;
    }
    seq = PyLong_AsLongLong(PyList_GET_ITEM(count, C_SEQ));
    if (seq == -1 && PyErr_Occurred())
        goto fail;
    seq += 1;
    seqobj = PyLong_FromLongLong(seq);
    if (seqobj == NULL)
        goto fail;
    if (PyList_SetItem(count, C_SEQ, Py_NewRef(seqobj)) < 0)
        goto fail;

    /* site: the caller's frame, or the first user frame above it */
    int found = 0;
#ifdef NCCLGUARD_INTERPRETER_FRAMES
    found = site_from_here(0, self->is_framework, &code, &lasti);
    if (found < 0)
        goto fail;
#endif
    if (!found &&
        site_of(PyEval_GetFrame(), self->user_files, self->is_framework, self->user_frame, &code, &lasti) < 0)
        goto fail;

    /* time, phase */
    start = PyFloat_FromDouble(now_s());
    if (start == NULL)
        goto fail;
    phase = phase_of(self->main, self->current_phase, tid);
    if (phase == NULL)
        goto fail;

    /* the record: the slots of record.py, in one list */
    PyObject *redop = arg_of(&self->op, args, nargs, kwnames);
    PyObject *async_val;
    if (self->always_async)
        async_val = Py_True;
    else {
        async_val = arg_of(&self->async_op, args, nargs, kwnames);
        if (async_val == NULL)
            async_val = Py_False;
    }
    if (self->p2p) {
        PyObject *p = arg_of(&self->peer, args, nargs, kwnames);
        peer = (p == NULL || p == Py_None) ? PyLong_FromLong(-1) : Py_NewRef(p);
        if (peer == NULL)
            goto fail;
    }
    else
        peer = Py_NewRef(Py_None);
    rec = PyList_New(R_SLOTS);
    if (rec == NULL)
        goto fail;
    PyList_SET_ITEM(rec, R_SEQ, Py_NewRef(seqobj));
    PyList_SET_ITEM(rec, R_OP, Py_NewRef(self->kind));
    PyList_SET_ITEM(rec, R_REDOP, Py_NewRef(redop == NULL ? Py_None : redop));
    PyList_SET_ITEM(rec, R_GROUP, Py_NewRef(name));
    PyList_SET_ITEM(rec, R_NUMEL, Py_NewRef(numel));
    PyList_SET_ITEM(rec, R_DTYPE, Py_NewRef(dtype));
    PyList_SET_ITEM(rec, R_START, Py_NewRef(start));
    PyList_SET_ITEM(rec, R_END, Py_NewRef(Py_None));
    PyList_SET_ITEM(rec, R_PHASE, Py_NewRef(phase));
    PyList_SET_ITEM(rec, R_WHERE, Py_NewRef(code));
    PyList_SET_ITEM(rec, R_LASTI, Py_NewRef(lasti));
    PyList_SET_ITEM(rec, R_THREAD, Py_NewRef(tid));
    PyList_SET_ITEM(rec, R_ASYNC, Py_NewRef(async_val));
    PyList_SET_ITEM(rec, R_PEER, Py_NewRef(peer));
    for (int i = R_ERROR; i < R_SLOTS; i++)
        PyList_SET_ITEM(rec, i, Py_NewRef(Py_None));

    /* the ring, then this thread's open record */
    if (publish(self->recorder, self->opened, tid, rec) < 0)
        goto fail;

    /* the call itself, arguments as they came */
    out = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (out == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL && value != NULL)
            PyException_SetTraceback(value, tb);
        PyObject *res = PyObject_CallFunctionObjArgs(self->finish, rec, value == NULL ? Py_None : value, NULL);
        if (res == NULL)
            PyErr_Clear(); /* the op's own error is the one to raise */
        Py_XDECREF(res);
        PyErr_Restore(type, value, tb);
        goto fail;
    }
    int is_async = 0;
    if (out != Py_None) {
        is_async = PyObject_IsTrue(async_val);
        if (is_async < 0)
            goto fail_out;
    }
    if (is_async) { /* stays in flight until its Work completes (the watchdog's sweep) */
        PyObject *res = PyObject_CallFunctionObjArgs(self->attach, rec, out, NULL);
        if (res == NULL)
            goto fail_out;
        Py_DECREF(res);
    }
    else {
        if (close_sync(self->opened, self->finish, rec, tid, count, seq) < 0)
            goto fail_out;
    }
    Py_DECREF(tid);
    Py_DECREF(numel);
    Py_DECREF(dtype);
    Py_DECREF(pg);
    Py_DECREF(name);
    Py_DECREF(count);
    Py_DECREF(seqobj);
    Py_DECREF(code);
    Py_DECREF(lasti);
    Py_DECREF(start);
    Py_DECREF(phase);
    Py_DECREF(peer);
    Py_DECREF(rec);
    return out;

fail_out:
    Py_CLEAR(out);
fail:
    Py_XDECREF(tid);
    Py_XDECREF(numel);
    Py_XDECREF(dtype);
    Py_XDECREF(pg);
    Py_XDECREF(name);
    Py_XDECREF(count);
    Py_XDECREF(seqobj);
    Py_XDECREF(code);
    Py_XDECREF(lasti);
    Py_XDECREF(start);
    Py_XDECREF(phase);
    Py_XDECREF(peer);
    Py_XDECREF(rec);
    return NULL;
}

static int
param_init(Param *p, PyObject *spec, const char *key)
{
    /* spec[key]: None, or (position, name, default) */
    PyObject *v = PyDict_GetItemString(spec, key);
    p->pos = -1;
    p->name = NULL;
    p->dflt = NULL;
    if (v == NULL || v == Py_None)
        return 0;
    Py_ssize_t pos;
    PyObject *name, *dflt;
    if (!PyArg_ParseTuple(v, "nUO", &pos, &name, &dflt))
        return -1;
    p->pos = pos;
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);
    p->name = name;
    p->dflt = Py_NewRef(dflt);
    return 0;
}

static PyObject *
ns_get(PyObject *ns, const char *key)
{
    PyObject *v = PyDict_GetItemString(ns, key);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "ncclguard: the wrapper's namespace lacks %s", key);
        return NULL;
    }
    return Py_NewRef(v);
}

static PyObject *
wrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    /* Wrapper(original, kind, spec, namespace): spec maps data/group/op/async_op/peer to None or
     * (position, name, default), plus always_async and p2p; namespace is instrument._wrap's. */
    PyObject *original, *kind, *spec, *ns;
    static char *kwlist[] = {"original", "kind", "spec", "namespace", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!O!", kwlist, &original, &kind, &PyDict_Type, &spec,
                                     &PyDict_Type, &ns))
        return NULL;
    Wrapper *self = (Wrapper *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = wrapper_vectorcall;
    self->original = Py_NewRef(original);
    self->kind = Py_NewRef(kind);
    if (param_init(&self->data, spec, "data") < 0 || param_init(&self->group, spec, "group") < 0 ||
        param_init(&self->op, spec, "op") < 0 || param_init(&self->async_op, spec, "async_op") < 0 ||
        param_init(&self->peer, spec, "peer") < 0)
        goto fail;
    PyObject *names_all = PyDict_GetItemString(spec, "names");
    PyObject *required = PyDict_GetItemString(spec, "required");
    PyObject *npos = PyDict_GetItemString(spec, "positional");
    if (names_all == NULL || !PyTuple_Check(names_all) || required == NULL || !PyTuple_Check(required) ||
        npos == NULL || !PyLong_Check(npos)) {
        PyErr_SetString(PyExc_TypeError, "ncclguard: spec needs names (tuple), required (tuple), positional (int)");
        goto fail;
    }
    Py_ssize_t n_all = PyTuple_GET_SIZE(names_all);
    self->names_all = PyTuple_New(n_all);
    if (self->names_all == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n_all; i++) {
        PyObject *nm = PyTuple_GET_ITEM(names_all, i);
        if (!PyUnicode_Check(nm)) {
            PyErr_SetString(PyExc_TypeError, "ncclguard: parameter names are str");
            goto fail;
        }
        Py_INCREF(nm);
        PyUnicode_InternInPlace(&nm);
        PyTuple_SET_ITEM(self->names_all, i, nm);
    }
    self->required = Py_NewRef(required);
    self->n_positional = PyLong_AsSsize_t(npos);
    PyObject *aa = PyDict_GetItemString(spec, "always_async");
    PyObject *p2p = PyDict_GetItemString(spec, "p2p");
    self->always_async = aa != NULL && PyObject_IsTrue(aa) == 1;
    self->p2p = p2p != NULL && PyObject_IsTrue(p2p) == 1;
#define NS(field, key)                                  \
    if ((self->field = ns_get(ns, key)) == NULL) \
        goto fail;
    NS(recorder, "recorder")
    NS(opened, "opened")
    NS(counts, "counts")
    NS(names, "names")
    NS(world, "world")
    NS(world_attrs, "world_attributes")
    NS(user_files, "user_files")
    NS(is_framework, "is_framework")
    NS(counter_of, "counter_of")
    NS(user_frame, "user_frame")
    NS(describe, "describe")
    NS(finish, "finish")
    NS(attach, "attach")
    NS(main, "main")
    NS(current_phase, "current_phase")
    NS(tensor_type, "tensor_type")
#undef NS
    if (!PyDict_Check(self->opened) || !PyDict_Check(self->counts) || !PyList_Check(self->names) ||
        !PyDict_Check(self->world_attrs) || !PyDict_Check(self->is_framework) ||
        PyList_GET_SIZE(self->names) != 1 || !PyAnySet_Check(self->user_files) || !PyType_Check(self->tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "ncclguard: the wrapper's namespace has the wrong types");
        goto fail;
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static int
wrapper_traverse(Wrapper *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dict);
    Py_VISIT(self->original);
    Py_VISIT(self->kind);
    Py_VISIT(self->names_all);
    Py_VISIT(self->required);
    Py_VISIT(self->data.dflt);
    Py_VISIT(self->group.dflt);
    Py_VISIT(self->op.dflt);
    Py_VISIT(self->async_op.dflt);
    Py_VISIT(self->peer.dflt);
    Py_VISIT(self->recorder);
    Py_VISIT(self->opened);
    Py_VISIT(self->counts);
    Py_VISIT(self->names);
    Py_VISIT(self->world);
    Py_VISIT(self->world_attrs);
    Py_VISIT(self->user_files);
    Py_VISIT(self->is_framework);
    Py_VISIT(self->counter_of);
    Py_VISIT(self->user_frame);
    Py_VISIT(self->describe);
    Py_VISIT(self->finish);
    Py_VISIT(self->attach);
    Py_VISIT(self->main);
    Py_VISIT(self->current_phase);
    Py_VISIT(self->tensor_type);
    return 0;
}

static int
wrapper_clear(Wrapper *self)
{
    Py_CLEAR(self->dict);
    Py_CLEAR(self->original);
    Py_CLEAR(self->kind);
    Py_CLEAR(self->names_all);
    Py_CLEAR(self->required);
    Param *ps[] = {&self->data, &self->group, &self->op, &self->async_op, &self->peer};
    for (int i = 0; i < 5; i++) {
        Py_CLEAR(ps[i]->name);
        Py_CLEAR(ps[i]->dflt);
    }
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->opened);
    Py_CLEAR(self->counts);
    Py_CLEAR(self->names);
    Py_CLEAR(self->world);
    Py_CLEAR(self->world_attrs);
    Py_CLEAR(self->user_files);
    Py_CLEAR(self->is_framework);
    Py_CLEAR(self->counter_of);
    Py_CLEAR(self->user_frame);
    Py_CLEAR(self->describe);
    Py_CLEAR(self->finish);
    Py_CLEAR(self->attach);
    Py_CLEAR(self->main);
    Py_CLEAR(self->current_phase);
    Py_CLEAR(self->tensor_type);
    return 0;
}

static void
wrapper_dealloc(Wrapper *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    wrapper_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
wrapper_repr(Wrapper *self)
{
    return PyUnicode_FromFormat("<ncclguard recording wrapper of %R>", self->original);
}

static PyGetSetDef wrapper_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject WrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ncclguard.recording._hotpath.Wrapper",
    .tp_basicsize = sizeof(Wrapper),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The compiled recording wrapper of one torch.distributed op (see instrument.py).",
    .tp_new = wrapper_new,
    .tp_dealloc = (destructor)wrapper_dealloc,
    .tp_traverse = (traverseproc)wrapper_traverse,
    .tp_clear = (inquiry)wrapper_clear,
    .tp_repr = (reprfunc)wrapper_repr,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Wrapper, vectorcall),
    .tp_dictoffset = offsetof(Wrapper, dict),
    .tp_weaklistoffset = offsetof(Wrapper, weakrefs),
    .tp_getset = wrapper_getset,
};

/* ---------------------------------------------------------------------------------------------
 * Opener: FlightRecorder.open_fast/close_ok for code that records its own call (safe_all_reduce),
 * the same steps as flight.py's Python methods, which stay the reference and the fallback. */

typedef struct {
    PyObject_HEAD
    PyObject *recorder, *opened, *counts, *count, *user_files, *is_framework, *user_frame, *main, *current_phase,
        *finish;
} Opener;

static PyObject *
opener_open(Opener *self, PyObject *const *args, Py_ssize_t nargs)
{
    /* open(op, group, numel, dtype): the raw record, or None inside a recorded call of this thread. */
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "open(op, group, numel, dtype)");
        return NULL;
    }
    PyObject *op = args[0], *group = args[1], *numel = args[2], *dtype = args[3];
    PyObject *tid = NULL, *count = NULL, *seqobj = NULL, *code = NULL, *lasti = NULL, *start = NULL;
    PyObject *phase = NULL, *rec = NULL, *back = NULL;
    tid = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (tid == NULL)
        return NULL;
    int nested = PyDict_Contains(self->opened, tid);
    if (nested != 0) {
        Py_DECREF(tid);
        return nested < 0 ? NULL : Py_NewRef(Py_None);
    }
    count = PyDict_GetItemWithError(self->counts, group);
    if (count != NULL)
        Py_INCREF(count);
    else if (PyErr_Occurred() || (count = PyObject_CallOneArg(self->count, group)) == NULL)
        goto fail;
    if (!PyList_CheckExact(count) || PyList_GET_SIZE(count) < 3) {
        PyErr_SetString(PyExc_TypeError, "ncclguard: a counter is a list of three ints");
        goto fail;
    }
    long long seq = PyLong_AsLongLong(PyList_GET_ITEM(count, C_SEQ));
    if (seq == -1 && PyErr_Occurred())
        goto fail;
    seqobj = PyLong_FromLongLong(seq + 1);
    if (seqobj == NULL || PyList_SetItem(count, C_SEQ, Py_NewRef(seqobj)) < 0)
        goto fail;
    /* the caller is a library frame (safe_all_reduce): the site is its caller's, or above */
    int found = 0;
#ifdef NCCLGUARD_INTERPRETER_FRAMES
    found = site_from_here(1, self->is_framework, &code, &lasti);
    if (found < 0)
        goto fail;
#endif
    if (!found) {
        PyFrameObject *caller = PyEval_GetFrame();
        back = caller == NULL ? NULL : (PyObject *)PyFrame_GetBack(caller);
        if (site_of((PyFrameObject *)back, self->user_files, self->is_framework, self->user_frame, &code, &lasti) <
            0)
            goto fail;
    }
    start = PyFloat_FromDouble(now_s());
    if (start == NULL)
        goto fail;
    phase = phase_of(self->main, self->current_phase, tid);
    if (phase == NULL)
        goto fail;
    rec = PyList_New(R_SLOTS);
    if (rec == NULL)
        goto fail;
    PyObject *items[R_SLOTS] = {seqobj, op, Py_None, group, numel, dtype, start, Py_None, phase, code, lasti,
                                tid, Py_False, Py_None, Py_None, Py_None, Py_None, Py_None};
    for (int i = 0; i < R_SLOTS; i++)
        PyList_SET_ITEM(rec, i, Py_NewRef(items[i]));
    if (publish(self->recorder, self->opened, tid, rec) < 0)
        goto fail;
    Py_DECREF(tid);
    Py_DECREF(count);
    Py_DECREF(seqobj);
    Py_DECREF(code);
    Py_DECREF(lasti);
    Py_DECREF(start);
    Py_DECREF(phase);
    Py_XDECREF(back);
    return rec;
fail:
    Py_XDECREF(tid);
    Py_XDECREF(count);
    Py_XDECREF(seqobj);
    Py_XDECREF(code);
    Py_XDECREF(lasti);
    Py_XDECREF(start);
    Py_XDECREF(phase);
    Py_XDECREF(rec);
    Py_XDECREF(back);
    return NULL;
}

static PyObject *
opener_close(Opener *self, PyObject *rec)
{
    /* close(rec): completed, as FlightRecorder.close_ok; None (a nested op's record): nothing. */
    if (rec == Py_None)
        Py_RETURN_NONE;
    if (!PyList_CheckExact(rec) || PyList_GET_SIZE(rec) != R_SLOTS) {
        PyErr_SetString(PyExc_TypeError, "close() takes a raw record");
        return NULL;
    }
    PyObject *tid = PyList_GET_ITEM(rec, R_THREAD);
    PyObject *top = PyDict_GetItemWithError(self->opened, tid);
    if (top == NULL && PyErr_Occurred())
        return NULL;
    if (top != rec || PyList_GET_ITEM(rec, R_PREV) != Py_None || PyList_GET_ITEM(rec, R_END) != Py_None ||
        PyList_GET_ITEM(rec, R_PEER) != Py_None)
        return PyObject_CallOneArg(self->finish, rec); /* any other case: the Python way */
    PyObject *count = PyDict_GetItemWithError(self->counts, PyList_GET_ITEM(rec, R_GROUP));
    if (count == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return PyObject_CallOneArg(self->finish, rec);
    }
    Py_INCREF(count);
    Py_INCREF(tid);
    long long seq = PyLong_AsLongLong(PyList_GET_ITEM(rec, R_SEQ));
    int rc = (seq == -1 && PyErr_Occurred()) ? -1 : close_sync(self->opened, self->finish, rec, tid, count, seq);
    Py_DECREF(count);
    Py_DECREF(tid);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
opener_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    /* Opener(namespace): recorder, opened, counts, count, user_files, is_framework, user_frame, main,
     * current_phase, finish */
    PyObject *ns;
    static char *kwlist[] = {"namespace", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!", kwlist, &PyDict_Type, &ns))
        return NULL;
    Opener *self = (Opener *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
#define NS(field, key)                               \
    if ((self->field = ns_get(ns, key)) == NULL) \
        goto fail;
    NS(recorder, "recorder")
    NS(opened, "opened")
    NS(counts, "counts")
    NS(count, "count")
    NS(user_files, "user_files")
    NS(is_framework, "is_framework")
    NS(user_frame, "user_frame")
    NS(main, "main")
    NS(current_phase, "current_phase")
    NS(finish, "finish")
#undef NS
    if (!PyDict_Check(self->opened) || !PyDict_Check(self->counts) || !PyAnySet_Check(self->user_files) ||
        !PyDict_Check(self->is_framework)) {
        PyErr_SetString(PyExc_TypeError, "ncclguard: the opener's namespace has the wrong types");
        goto fail;
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static int
opener_traverse(Opener *self, visitproc visit, void *arg)
{
    Py_VISIT(self->recorder);
    Py_VISIT(self->opened);
    Py_VISIT(self->counts);
    Py_VISIT(self->count);
    Py_VISIT(self->user_files);
    Py_VISIT(self->is_framework);
    Py_VISIT(self->user_frame);
    Py_VISIT(self->main);
    Py_VISIT(self->current_phase);
    Py_VISIT(self->finish);
    return 0;
}

static int
opener_clear(Opener *self)
{
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->opened);
    Py_CLEAR(self->counts);
    Py_CLEAR(self->count);
    Py_CLEAR(self->user_files);
    Py_CLEAR(self->is_framework);
    Py_CLEAR(self->user_frame);
    Py_CLEAR(self->main);
    Py_CLEAR(self->current_phase);
    Py_CLEAR(self->finish);
    return 0;
}

static void
opener_dealloc(Opener *self)
{
    PyObject_GC_UnTrack(self);
    opener_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef opener_methods[] = {
    {"open", (PyCFunction)(void (*)(void))opener_open, METH_FASTCALL,
     "open(op, group, numel, dtype): the raw record of the caller's collective, or None when nested."},
    {"close", (PyCFunction)opener_close, METH_O, "close(rec): closes it as completed."},
    {NULL},
};

static PyTypeObject OpenerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ncclguard.recording._hotpath.Opener",
    .tp_basicsize = sizeof(Opener),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "FlightRecorder.open_fast/close_ok compiled, for safe_all_reduce (see flight.py).",
    .tp_new = opener_new,
    .tp_dealloc = (destructor)opener_dealloc,
    .tp_traverse = (traverseproc)opener_traverse,
    .tp_clear = (inquiry)opener_clear,
    .tp_methods = opener_methods,
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ncclguard.recording._hotpath",
    .m_doc = "The compiled recording wrapper (see ncclguard/recording/_hotpath.c).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
#define INTERN(var, text)                               \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;
    INTERN(s_numel, "numel")
    INTERN(s_dtype, "dtype")
    INTERN(s_default_pg, "default_pg")
    INTERN(s__default_pg, "_default_pg")
    INTERN(s_ring, "ring")
    INTERN(s_append, "append")
    INTERN(s_ident, "ident")
    INTERN(s_path, "path")
#undef INTERN
    if (PyType_Ready(&WrapperType) < 0 || PyType_Ready(&OpenerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&hotpath_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Wrapper", (PyObject *)&WrapperType) < 0 ||
        PyModule_AddObjectRef(m, "Opener", (PyObject *)&OpenerType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
