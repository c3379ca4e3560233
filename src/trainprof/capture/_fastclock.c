/* The step clock's hot path in C: trainprof's optional fast path.
 *
 * What it does is what the pure-Python path in trainprof/capture/clock.py
 * (_PyCore) and trainprof/capture/hooks.py (the wrappers) does, with the same
 * attributes and the same results; it is only cheaper. A wrapped call costs a
 * Python frame, argument re-packing (*args, **kwargs) and a dozen attribute
 * reads and writes in Python - about 1-2 us per call on a 2-core cloud VM,
 * several times per training step - where the vectorcall below passes the
 * caller's arguments through untouched and keeps the clock's state in C fields.
 *
 * ClockCore  the base class of StepClock: the hot state as C fields, exposed
 *            to Python as ordinary attributes (current, mark, ...; acc as a
 *            writable int64 memoryview), enter()/exit(), and the buffer of
 *            finished step records (drain_records()).
 * Timed      a callable that times one call of `orig` as a phase of the clock
 *            (kinds below); a method descriptor, so it can replace a method or
 *            a slot such as __call__ or __next__ on a class.
 *
 * Built as an optional setuptools extension (setup.py): without a compiler
 * the pure-Python path is used. TRAINPROF_PURE_PYTHON=1 forces it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "structmember.h"
#include "pythread.h"
#include <errno.h>
#include <limits.h>
#include <unistd.h>
#if defined(__linux__)
#include <pthread.h>
#include <signal.h>
#include <time.h>
#endif

/* The hooks run once or twice per call of what they wrap, between milliseconds of
   torch code that evict them from the caches: each cache line of code they run is a
   miss (callgrind --cache-sim counts ~8 first-level misses per wrapped call). Error
   and first-call paths are marked cold, so the compiler moves them out of the lines
   the steady state runs (not call_noargs_method: backward-delimited runs call it
   every step). */
#if defined(__GNUC__)
#define COLD __attribute__((cold, noinline))
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define COLD
#define UNLIKELY(x) (x)
#endif

/* What trainprof.capture.clock expects (_FAST_VERSION): bumped when the interface
   between this file and the Python code changes, so that a stale build is not used. */
#define FASTCLOCK_VERSION 7

/* Indices into clock.acc, given by trainprof.schema through configure(). */
static Py_ssize_t I_OTHER = -1, I_SAMPLES = -1, I_HOST_READS = -1, I_SYNC_N = -1,
                  I_SYNC_NS = -1, N_ACC = -1;
/* The data-wait phase (configure()'s ``data``; -1: none): see K_READ. */
static int P_DATA = -1;

/* A step record: (step, t_start_ns, dur_ns, *acc, flags), int64 each (trainprof.schema). */
#define MAX_RECORD 64

static PyObject *s_begin, *s_top_level_event, *s_mark, *s_optimizer_stepped, *s_shape,
    *s_is_cpu, *s_step_closed, *s_watch, *s_adopt_thread, *s_training;

enum {
    K_NEXT = 1,     /* DataLoader iterator __next__: phase, batch size -> acc[SAMPLES] */
    K_CALL = 2,     /* a root module's __call__: timed only at top level (phase OTHER) */
    K_BACKWARD = 3, /* torch.autograd.backward/grad: backward-delimited steps */
    K_PHASE = 4,    /* zero_grad: a plain phase */
    K_READ = 5,     /* Tensor.item/...: host reads, syncs when not on the CPU; the reads of
                       CPU tensors inside `phase` (the optimizer's) are not counted */
    K_SYNC = 6,     /* torch.cuda.synchronize */
    K_OPT_PRE = 7,  /* global optimizer step pre-hook; extra(args, kwargs) times a closure */
    K_OPT_POST = 8, /* global optimizer step post-hook: closes the step */
};

static inline long long
now_ns(void)
{
#if defined(__linux__) && defined(CLOCK_MONOTONIC)
    /* what time.perf_counter_ns() reads on Linux (CPython's pytime.c: CLOCK_MONOTONIC),
       without pytime's conversions and overflow checks: fewer lines of code per read */
    struct timespec ts;
    (void)clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + (long long)ts.tv_nsec;
#elif PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    (void)PyTime_PerfCounterRaw(&t);
    return (long long)t;
#else
    return (long long)_PyTime_GetPerfCounter(); /* what time.perf_counter_ns() reads */
#endif
}

/* threading.get_ident() of the calling thread: on Linux CPython's is pthread_self() */
static inline unsigned long
thread_ident(void)
{
#if defined(__linux__)
    return (unsigned long)pthread_self();
#else
    return PyThread_get_thread_ident();
#endif
}

/* ---------------------------------------------------------------- ClockCore */

/* The accumulators live in the object itself and finished steps in one growing C
 * buffer: a step touches a few cache lines of this struct and appends one memcpy,
 * where a list of Python ints (one allocation per phase transition) and an
 * array.frombytes() method call per step touched a dozen objects. The hooks run
 * once per step between milliseconds of torch code, with cold caches: what they
 * cost is mostly the memory they touch, not their instructions. */
#define MAX_ACC (MAX_RECORD - 4)

typedef struct {
    PyObject_HEAD
    /* what every wrapped call reads or writes first, then acc: a phase transition
       touches the first lines of the object only (acc[MAX_ACC] came first, and these
       fields ~500 bytes after it) */
    long long mark;         /* perf_counter_ns of the last phase transition */
    unsigned long owner;    /* threading.get_ident() of the training thread */
    int current;            /* the current phase */
    int opt_prev;           /* phase to restore after the optimizer step */
    char started;
    char bwd_pending;
    char bwd_track;
    char in_sync;           /* the training thread is inside a timed sync (stack samples) */
    char in_read;           /* ... inside a host read or sync (see K_READ: one count each),
                               or where reads are torch's own (DataLoader.__iter__, hooks.py) */
    PyObject *device;       /* None, or a DeviceTimer (CUDA events at phase boundaries) */
    long long acc[MAX_ACC]; /* per-phase ns and counters of the open step (N_ACC used) */
    /* once a step or less */
    PyObject *opt_args;     /* the open optimizer step's arguments (see K_OPT_PRE), or NULL */
    char *rbuf;             /* finished steps: native int64 records, drained by the Recorder */
    Py_ssize_t rlen, rcap;  /* bytes used / allocated in rbuf */
    long long n_steps, step_start, origin_ns, extra_flags, next_watch;
    unsigned long long fast_opt; /* id() of the optimizer whose post-hook closes steps */
    int opt_depth;               /* optimizer steps open inside the open one (see K_OPT_PRE) */
    int gc_prev;                 /* phase to restore after a collection */
    /* model calls in eval mode (module.training False), with autograd on [0] and off [1]:
       count and ns (trainprof.capture.eval_autograd); grad_enabled: torch.is_grad_enabled,
       or NULL: not looked at */
    PyObject *grad_enabled;
    long long eval_n[2], eval_ns[2];
    /* trainprof tune's eval_no_grad knob: such calls run with autograd off, through
       set_grad_enabled (torch._C._set_grad_enabled) */
    PyObject *set_grad_enabled;
    char eval_no_grad;
} ClockCore;

static PyObject *
core_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (N_ACC < 0) {
        PyErr_SetString(PyExc_RuntimeError, "trainprof._fastclock: configure() first");
        return NULL;
    }
    ClockCore *self = (ClockCore *)type->tp_alloc(type, 0); /* zeroed: acc, rbuf, ... */
    if (self == NULL)
        return NULL;
    self->device = Py_NewRef(Py_None);
    self->bwd_track = 1;
    return (PyObject *)self;
}

static int
core_traverse(ClockCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->device);
    Py_VISIT(self->opt_args);
    Py_VISIT(self->grad_enabled);
    Py_VISIT(self->set_grad_enabled);
    return 0;
}

static int
core_clear(ClockCore *self)
{
    Py_CLEAR(self->device);
    Py_CLEAR(self->opt_args);
    Py_CLEAR(self->grad_enabled);
    Py_CLEAR(self->set_grad_enabled);
    return 0;
}

/* A static type: the heap subclass's subtype_dealloc releases the subclass itself. */
static void
core_dealloc(ClockCore *self)
{
    PyObject_GC_UnTrack(self);
    core_clear(self);
    PyMem_Free(self->rbuf);
    self->rbuf = NULL;
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* acc[i] += d (i comes from configure(), checked there) */
static inline void
acc_add(ClockCore *c, Py_ssize_t i, long long d)
{
    c->acc[i] += d;
}

/* StepClock.begin(now): once, at the run's first timed event */
static COLD int
core_begin(ClockCore *c, long long now)
{
    PyObject *t = PyLong_FromLongLong(now);
    if (t == NULL)
        return -1;
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)c, s_begin, t);
    Py_DECREF(t);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static COLD int
bad_phase(void)
{
    PyErr_SetString(PyExc_ValueError, "trainprof: clock.current is not a phase");
    return -1;
}

/* StepClock.enter: make `phase` current; the previous one goes to *prev. */
static int
core_enter(ClockCore *c, int phase, int *prev)
{
    long long now = now_ns();
    if (UNLIKELY(!c->started) && core_begin(c, now) < 0)
        return -1;
    if (UNLIKELY(c->current < 0 || c->current >= N_ACC))
        return bad_phase();
    acc_add(c, c->current, now - c->mark);
    *prev = c->current;
    c->current = phase;
    c->mark = now;
    return 0;
}

/* StepClock.exit: leave the current phase for `prev`. */
static int
core_exit(ClockCore *c, int prev, long long *when)
{
    long long now = now_ns();
    if (UNLIKELY(c->current < 0 || c->current >= N_ACC))
        return bad_phase();
    acc_add(c, c->current, now - c->mark);
    c->current = prev;
    c->mark = now;
    if (when != NULL)
        *when = now;
    return 0;
}

/* A model call in eval mode? -1: in training mode (or unknown); 0: eval with autograd
   on; 1: eval with autograd off. `training` is an instance attribute of nn.Module (a
   dict hit); torch.is_grad_enabled is called only for a module in eval mode. Errors are
   cleared: the check must never change what the call does. */
static int
eval_mode(ClockCore *c, PyObject *module)
{
    PyObject *training = PyObject_GetAttr(module, s_training);
    if (training == NULL) {
        PyErr_Clear();
        return -1;
    }
    int eval = training == Py_False;
    Py_DECREF(training);
    if (!eval)
        return -1;
    PyObject *on = PyObject_CallNoArgs(c->grad_enabled);
    if (on == NULL) {
        PyErr_Clear();
        return -1;
    }
    int grad = on == Py_True;
    Py_DECREF(on);
    return grad ? 0 : 1;
}

/* c->set_grad_enabled(on): 0, or -1 (not set: the error cleared, or kept and restored
   when an exception is already propagating). */
static int
set_grad(ClockCore *c, PyObject *on)
{
    if (c->set_grad_enabled == NULL || c->set_grad_enabled == Py_None)
        return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallOneArg(c->set_grad_enabled, on);
    int ok = r != NULL;
    if (ok)
        Py_DECREF(r);
    else
        PyErr_Clear();
    PyErr_Restore(type, value, tb);
    return ok ? 0 : -1;
}

/* core_exit while an exception is propagating: the exception wins. */
static COLD void
core_exit_on_error(ClockCore *c, int prev)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (core_exit(c, prev, NULL) < 0)
        PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* Append n bytes of whole records to the buffer (grown by doubling, never shrunk:
   the Recorder drains it once a second, so it settles at a second's worth). */
static int
records_append(ClockCore *c, const char *data, Py_ssize_t n)
{
    if (c->rlen + n > c->rcap) {
        Py_ssize_t cap = c->rcap ? c->rcap : 64 * (Py_ssize_t)sizeof(long long) * MAX_RECORD;
        while (cap < c->rlen + n) {
            if (cap > PY_SSIZE_T_MAX / 2) {
                PyErr_NoMemory();
                return -1;
            }
            cap *= 2;
        }
        char *nb = PyMem_Realloc(c->rbuf, (size_t)cap);
        if (nb == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->rbuf = nb;
        c->rcap = cap;
    }
    memcpy(c->rbuf + c->rlen, data, (size_t)n);
    c->rlen += n;
    return 0;
}

/* StepClock._close: end the current step at `now`: append its record, zero acc,
   then the rare work in Python (CUDA events of the step, windows, --max-steps). */
static int
core_close(ClockCore *c, long long flags, long long now)
{
    long long rec[MAX_RECORD];
    rec[0] = c->n_steps;
    rec[1] = c->step_start - c->origin_ns;
    rec[2] = now - c->step_start;
    memcpy(rec + 3, c->acc, sizeof(long long) * (size_t)N_ACC);
    rec[3 + N_ACC] = flags | c->extra_flags;
    if (records_append(c, (const char *)rec, (Py_ssize_t)sizeof(long long) * (N_ACC + 4)) < 0)
        return -1;
    memset(c->acc, 0, sizeof(long long) * (size_t)N_ACC);
    c->n_steps += 1;
    c->step_start = now;
    PyObject *r;
    if (c->device != Py_None) {
        PyObject *device = Py_NewRef(c->device);
        PyObject *step = PyLong_FromLongLong(c->n_steps - 1);
        r = step == NULL ? NULL : PyObject_CallMethodOneArg(device, s_step_closed, step);
        Py_XDECREF(step);
        Py_DECREF(device);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    if (c->n_steps >= c->next_watch) {
        r = PyObject_CallMethodNoArgs((PyObject *)c, s_watch);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

static PyObject *
core_py_close(ClockCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long flags, now;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "_close(flags, now=None)");
        return NULL;
    }
    flags = PyLong_AsLongLong(args[0]);
    if (flags == -1 && PyErr_Occurred())
        return NULL;
    if (nargs == 2 && args[1] != Py_None) {
        now = PyLong_AsLongLong(args[1]);
        if (now == -1 && PyErr_Occurred())
            return NULL;
    }
    else if (core_exit(self, self->current, &now) < 0) /* charge the time to the current phase */
        return NULL;
    if (core_close(self, flags, now) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
core_py_enter(ClockCore *self, PyObject *arg)
{
    long phase = PyLong_AsLong(arg);
    int prev;
    if (phase == -1 && PyErr_Occurred())
        return NULL;
    if (phase < 0 || phase >= N_ACC) {
        PyErr_SetString(PyExc_ValueError, "enter(): not a phase");
        return NULL;
    }
    if (core_enter(self, (int)phase, &prev) < 0)
        return NULL;
    return PyLong_FromLong(prev);
}

static PyObject *
core_py_exit(ClockCore *self, PyObject *arg)
{
    long prev = PyLong_AsLong(arg);
    long long now;
    if (prev == -1 && PyErr_Occurred())
        return NULL;
    if (prev < 0 || prev >= N_ACC) {
        PyErr_SetString(PyExc_ValueError, "exit(): not a phase");
        return NULL;
    }
    if (core_exit(self, (int)prev, &now) < 0)
        return NULL;
    return PyLong_FromLongLong(now);
}

/* _append_record(data): whole records (bytes, native int64) from the Python side. */
static PyObject *
core_py_append_record(ClockCore *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t width = (Py_ssize_t)sizeof(long long) * (N_ACC + 4);
    int r = -1;
    if (view.len % width != 0)
        PyErr_SetString(PyExc_ValueError, "_append_record: not whole records");
    else
        r = records_append(self, (const char *)view.buf, view.len);
    PyBuffer_Release(&view);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
core_py_init_core(ClockCore *self, PyObject *unused)
{
    Py_RETURN_NONE; /* the struct is the state (the pure-Python core makes a list here) */
}

/* drain_records() -> bytes: the finished steps since the last drain (native int64). */
static PyObject *
core_py_drain_records(ClockCore *self, PyObject *unused)
{
    PyObject *data = PyBytes_FromStringAndSize(self->rbuf ? self->rbuf : "", self->rlen);
    if (data != NULL)
        self->rlen = 0;
    return data;
}

/* peek_records() -> bytes: the same, left in place. */
static PyObject *
core_py_peek_records(ClockCore *self, PyObject *unused)
{
    return PyBytes_FromStringAndSize(self->rbuf ? self->rbuf : "", self->rlen);
}

/* acc as a buffer: memoryview(clock) is a writable int64 view of the accumulators. */
static Py_ssize_t acc_itemsize = sizeof(long long);

static int
core_getbuffer(ClockCore *self, Py_buffer *view, int flags)
{
    static Py_ssize_t shape;
    shape = N_ACC;
    view->obj = Py_NewRef(self);
    view->buf = self->acc;
    view->len = (Py_ssize_t)sizeof(long long) * N_ACC;
    view->readonly = 0;
    view->itemsize = acc_itemsize;
    view->format = (flags & PyBUF_FORMAT) ? "q" : NULL;
    view->ndim = 1;
    view->shape = (flags & PyBUF_ND) ? &shape : NULL;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &acc_itemsize : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 0;
}

static PyBufferProcs core_as_buffer = {
    .bf_getbuffer = (getbufferproc)core_getbuffer,
};

/* clock.acc: a writable int64 view of the accumulators (reads and `acc[i] += d` work
   as on the pure-Python core's list; compare with list(acc)). */
static PyObject *
core_get_acc(ClockCore *self, void *closure)
{
    return PyMemoryView_FromObject((PyObject *)self);
}

static PyObject *
core_get_device(ClockCore *self, void *closure)
{
    return Py_NewRef(self->device);
}

static int
core_set_device(ClockCore *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete device");
        return -1;
    }
    Py_SETREF(self->device, Py_NewRef(value));
    return 0;
}

static PyMethodDef core_methods[] = {
    {"enter", (PyCFunction)core_py_enter, METH_O,
     "Make `phase` current; returns the phase to give back to exit()."},
    {"exit", (PyCFunction)core_py_exit, METH_O,
     "Leave the current phase for `prev`; returns the time of the transition."},
    {"_close", (PyCFunction)(void (*)(void))core_py_close, METH_FASTCALL,
     "End the current step at `now` (default: this instant)."},
    {"_init_core", (PyCFunction)core_py_init_core, METH_NOARGS,
     "Nothing to set up: the accumulators and the record buffer are in the struct."},
    {"_append_record", (PyCFunction)core_py_append_record, METH_O,
     "Append whole step records (bytes of native int64s)."},
    {"drain_records", (PyCFunction)core_py_drain_records, METH_NOARGS,
     "The finished step records since the last drain, as bytes (native int64s)."},
    {"peek_records", (PyCFunction)core_py_peek_records, METH_NOARGS,
     "The undrained step records, as bytes (native int64s), left in place."},
    {NULL}};

static PyGetSetDef core_getset[] = {
    {"acc", (getter)core_get_acc, NULL, "the open step's accumulators (int64 view)", NULL},
    {"device", (getter)core_get_device, (setter)core_set_device,
     "None, or the DeviceTimer of a CUDA run", NULL},
    {NULL}};

static PyMemberDef core_members[] = {
    {"mark", T_LONGLONG, offsetof(ClockCore, mark), 0, NULL},
    {"n_steps", T_LONGLONG, offsetof(ClockCore, n_steps), 0, NULL},
    {"step_start", T_LONGLONG, offsetof(ClockCore, step_start), 0, NULL},
    {"origin_ns", T_LONGLONG, offsetof(ClockCore, origin_ns), 0, NULL},
    {"extra_flags", T_LONGLONG, offsetof(ClockCore, extra_flags), 0, NULL},
    {"next_watch", T_LONGLONG, offsetof(ClockCore, next_watch), 0, NULL},
    {"fast_opt", T_ULONGLONG, offsetof(ClockCore, fast_opt), 0, NULL},
    {"owner", T_ULONG, offsetof(ClockCore, owner), 0, NULL},
    {"current", T_INT, offsetof(ClockCore, current), 0, NULL},
    {"opt_prev", T_INT, offsetof(ClockCore, opt_prev), 0, NULL},
    {"opt_depth", T_INT, offsetof(ClockCore, opt_depth), 0, NULL},
    {"opt_args", T_OBJECT, offsetof(ClockCore, opt_args), 0, NULL},
    {"gc_prev", T_INT, offsetof(ClockCore, gc_prev), 0, NULL},
    {"started", T_BOOL, offsetof(ClockCore, started), 0, NULL},
    {"bwd_pending", T_BOOL, offsetof(ClockCore, bwd_pending), 0, NULL},
    {"bwd_track", T_BOOL, offsetof(ClockCore, bwd_track), 0, NULL},
    {"in_read", T_BOOL, offsetof(ClockCore, in_read), 0, NULL},
    {"grad_enabled", T_OBJECT, offsetof(ClockCore, grad_enabled), 0, NULL},
    {"eval_grad_n", T_LONGLONG, offsetof(ClockCore, eval_n[0]), 0, NULL},
    {"eval_nograd_n", T_LONGLONG, offsetof(ClockCore, eval_n[1]), 0, NULL},
    {"eval_grad_ns", T_LONGLONG, offsetof(ClockCore, eval_ns[0]), 0, NULL},
    {"eval_nograd_ns", T_LONGLONG, offsetof(ClockCore, eval_ns[1]), 0, NULL},
    {"set_grad_enabled", T_OBJECT, offsetof(ClockCore, set_grad_enabled), 0, NULL},
    {"eval_no_grad", T_BOOL, offsetof(ClockCore, eval_no_grad), 0, NULL},
    {NULL}};

static PyTypeObject ClockCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trainprof.capture._fastclock.ClockCore",
    .tp_doc = "The step clock's hot state and phase transitions (base class of StepClock).",
    .tp_basicsize = sizeof(ClockCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = core_new,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_members = core_members,
    .tp_getset = core_getset,
    .tp_as_buffer = &core_as_buffer,
};

/* -------------------------------------------------------------------- Timed */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall; /* what every call reads, first (see ClockCore) */
    ClockCore *clock;
    PyObject *orig;        /* the wrapped callable (NULL for the optimizer hooks) */
    int kind;
    int phase;
    PyObject *dev_end;     /* DeviceTimer.mark() arguments, or NULL */
    PyObject *dev_begin;
    PyObject *extra;       /* K_NEXT: batch_size_of(batch), for batches off the fast path;
                              K_OPT_PRE: with_timed_closure(args, kwargs) */
    PyObject *tensor_type; /* K_NEXT: torch.Tensor */
} Timed;

/* device.mark(which); device may be NULL or None (no CUDA in use). The sampler
   thread may set clock.device meanwhile: hold a reference for the call. */
static int
device_mark(PyObject *device, PyObject *which)
{
    if (device == NULL || device == Py_None || which == NULL)
        return 0;
    Py_INCREF(device);
    PyObject *r = PyObject_CallMethodOneArg(device, s_mark, which);
    Py_DECREF(device);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static COLD void
device_mark_on_error(PyObject *device, PyObject *which)
{
    if (device == NULL || device == Py_None || which == NULL)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (device_mark(device, which) < 0)
        PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

static int
call_noargs_method(ClockCore *c, PyObject *name)
{
    PyObject *r = PyObject_CallMethodNoArgs((PyObject *)c, name);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Leading dimension of the usual (tensor, ...) batch; else batch_size_of(batch). */
static int
add_batch_size(Timed *self, PyObject *batch)
{
    PyTypeObject *tp = Py_TYPE(batch);
    long long n;
    if ((tp == &PyTuple_Type || tp == &PyList_Type) && Py_SIZE(batch) > 0
        && (PyObject *)Py_TYPE(tp == &PyTuple_Type ? PyTuple_GET_ITEM(batch, 0)
                                                   : PyList_GET_ITEM(batch, 0))
               == self->tensor_type) {
        PyObject *first = tp == &PyTuple_Type ? PyTuple_GET_ITEM(batch, 0)
                                              : PyList_GET_ITEM(batch, 0);
        PyObject *shape = PyObject_GetAttr(first, s_shape);
        if (shape == NULL)
            return -1;
        if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0)
            n = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0));
        else
            n = 1;
        Py_DECREF(shape);
    }
    else {
        PyObject *r = PyObject_CallOneArg(self->extra, batch);
        if (r == NULL)
            return -1;
        n = PyLong_AsLongLong(r);
        Py_DECREF(r);
    }
    if (n == -1 && PyErr_Occurred())
        return -1;
    acc_add(self->clock, I_SAMPLES, n);
    return 0;
}

static PyObject *
timed_vectorcall(Timed *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ClockCore *c = self->clock;
    PyObject *out;
    int prev;
    long long t0, now;

    switch (self->kind) {
    case K_NEXT:
        if (thread_ident() != c->owner)
            return PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
        if (c->bwd_pending && call_noargs_method(c, s_top_level_event) < 0)
            return NULL;
        if (core_enter(c, self->phase, &prev) < 0)
            return NULL;
        out = PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
        if (out == NULL) {
            core_exit_on_error(c, prev);
            return NULL;
        }
        if (core_exit(c, prev, NULL) < 0 || add_batch_size(self, out) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        return out;

    case K_CALL:
    case K_BACKWARD:
    case K_PHASE:
        if (thread_ident() != c->owner
            || (self->kind == K_CALL && c->current != I_OTHER))
            return PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
        if (c->bwd_pending && (self->kind == K_CALL || c->current == I_OTHER)
            && self->kind != K_PHASE && call_noargs_method(c, s_top_level_event) < 0)
            return NULL;
        /* a model called in eval mode: with autograd on or off (an evaluation that
           records graphs it never uses); one attribute read per model call otherwise */
        int eval = -1;
        if (self->kind == K_CALL && c->grad_enabled != NULL && c->grad_enabled != Py_None
            && PyVectorcall_NARGS(nargsf) > 0)
            eval = eval_mode(c, args[0]);
        int no_grad = eval == 0 && c->eval_no_grad && set_grad(c, Py_False) == 0;
        if (core_enter(c, self->phase, &prev) < 0) {
            if (no_grad)
                set_grad(c, Py_True);
            return NULL;
        }
        long long t_enter = c->mark;
        /* CUDA events round the call, the one device seen at its start (the backward's:
           round the outermost backward only) */
        PyObject *dev = NULL;
        if (self->dev_end != NULL && c->device != Py_None
            && (self->kind != K_BACKWARD || prev == I_OTHER)) {
            dev = Py_NewRef(c->device);
            if (device_mark(dev, self->dev_begin) < 0) {
                Py_DECREF(dev);
                core_exit_on_error(c, prev);
                return NULL;
            }
        }
        out = PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
        if (no_grad)
            set_grad(c, Py_True);
        if (out == NULL) {
            device_mark_on_error(dev, self->dev_end);
            Py_XDECREF(dev);
            core_exit_on_error(c, prev);
            if (self->kind == K_BACKWARD && c->bwd_track)
                c->bwd_pending = 1;
            return NULL;
        }
        if (dev != NULL) {
            int r = device_mark(dev, self->dev_end);
            Py_DECREF(dev);
            if (r < 0) {
                Py_DECREF(out);
                core_exit_on_error(c, prev);
                return NULL;
            }
        }
        long long t_exit = 0;
        if (core_exit(c, prev, &t_exit) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        if (eval >= 0) {
            c->eval_n[eval] += 1;
            c->eval_ns[eval] += t_exit - t_enter;
        }
        if (self->kind == K_BACKWARD && c->bwd_track)
            c->bwd_pending = 1;
        return out;

    case K_READ:
    case K_SYNC: {
        /* a read inside a read is the same read: a TorchFunctionMode (trainprof's own
           op count, or the script's) hands Tensor.item back to torch.Tensor.item, this
           wrapper, from inside the first call; counted there, it was two reads (and
           two syncs' time) a call */
        int owner = thread_ident() == c->owner;
        if (owner && c->in_read)
            return PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
        int sync = 1;
        if (self->kind == K_READ) {
            sync = 0;
            if (PyVectorcall_NARGS(nargsf) > 0) {
                /* not a tensor (the call is about to fail): not a sync; the call itself
                   raises what Python would */
                PyObject *is_cpu = PyObject_GetAttr(args[0], s_is_cpu);
                if (is_cpu == NULL)
                    PyErr_Clear();
                else {
                    sync = is_cpu == Py_False;
                    Py_DECREF(is_cpu);
                }
            }
        }
        /* the stack samples taken meanwhile are the sync's time, which the sync finding
           claims, not the loop's own code (in_sync is read by the timer's signal handler) */
        int mine = sync && owner;
        if (mine)
            c->in_sync++;
        if (owner)
            c->in_read = 1;
        t0 = now_ns();
        out = PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
        if (owner)
            c->in_read = 0;
        if (mine)
            c->in_sync--;
        if (out == NULL)
            return NULL;
        /* a CPU tensor read inside the optimizer step is torch's own bookkeeping (Adam
           reads each parameter's step counter), and one inside the DataLoader's next()
           its sampler's (a seed and a permutation each epoch) or the dataset's: not reads
           the script's loop makes; nor are other threads' */
        if (self->kind == K_READ
            && (sync || (owner && c->current != self->phase && c->current != P_DATA)))
            acc_add(c, I_HOST_READS, 1);
        if (sync) {
            acc_add(c, I_SYNC_N, 1);
            acc_add(c, I_SYNC_NS, now_ns() - t0);
        }
        return out;
    }

    case K_OPT_PRE:
    case K_OPT_POST: {
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
        if (nargs < 1) {
            PyErr_SetString(PyExc_TypeError, "optimizer hook called without the optimizer");
            return NULL;
        }
        unsigned long ident = thread_ident();
        if (ident != c->owner) {
            /* before any step: the first optimizer step in another thread moves the
               clock there (StepClock.adopt_thread) */
            if (self->kind == K_OPT_POST && c->n_steps == 0) {
                PyObject *tid = PyLong_FromUnsignedLong(ident);
                if (tid == NULL)
                    return NULL;
                PyObject *r = PyObject_CallMethodOneArg((PyObject *)c, s_adopt_thread, tid);
                Py_DECREF(tid);
                if (r == NULL)
                    return NULL;
                Py_DECREF(r);
            }
            Py_RETURN_NONE;
        }
        if (self->kind == K_OPT_PRE) {
            int outermost = 1;
            if (c->current == self->phase) {
                if (c->opt_args != NULL && Py_REFCNT(c->opt_args) > 1) {
                    /* a step inside the open one (a subclass's step calling super().step(),
                       both hooked; a wrapper optimizer stepping the one it wraps): one
                       optimizer phase, closed by the outermost step's post-hook. The open
                       step is still running: torch's step wrapper holds its arguments */
                    c->opt_depth++;
                    outermost = 0;
                }
                else {
                    /* nobody but us holds the open step's arguments: it ended by an
                       exception (no post-hook), which the script caught; close it */
                    c->opt_depth = 0;
                    if (core_exit(c, c->opt_prev, NULL) < 0)
                        return NULL;
                }
            }
            if (outermost) {
                if (core_enter(c, self->phase, &prev) < 0)
                    return NULL;
                c->opt_prev = prev;
                Py_XSETREF(c->opt_args, nargs >= 2 ? Py_NewRef(args[1]) : NULL);
                if (device_mark(c->device, self->dev_begin) < 0)
                    return NULL;
            }
            /* step(closure) or other arguments: extra(args, kwargs) returns them with the
               closure timed (hooks.with_timed_closure), or None; a plain step() has
               args == (optimizer,) and no kwargs, and returns None here */
            if (self->extra != NULL && nargs >= 3
                && ((PyTuple_Check(args[1]) && PyTuple_GET_SIZE(args[1]) > 1)
                    || (PyDict_Check(args[2]) && PyDict_GET_SIZE(args[2]) > 0))) {
                PyObject *r = PyObject_Vectorcall(self->extra, args + 1, 2, NULL);
                if (outermost && r != NULL && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2)
                    /* the step now runs with these: they are what torch holds */
                    Py_XSETREF(c->opt_args, Py_NewRef(PyTuple_GET_ITEM(r, 0)));
                return r;
            }
            Py_RETURN_NONE;
        }
        if (c->opt_depth > 0) { /* the end of a nested step (see above) */
            c->opt_depth--;
            Py_RETURN_NONE;
        }
        Py_CLEAR(c->opt_args);
        if (device_mark(c->device, self->dev_end) < 0)
            return NULL;
        if (core_exit(c, c->opt_prev, &now) < 0)
            return NULL;
        if ((unsigned long long)(uintptr_t)args[0] == c->fast_opt) {
            /* the primary optimizer in steady state (see StepClock.optimizer_stepped) */
            if (core_close(c, 0, now) < 0)
                return NULL;
            Py_RETURN_NONE;
        }
        PyObject *when = PyLong_FromLongLong(now);
        if (when == NULL)
            return NULL;
        /* slot 0 is free for the callee (PY_VECTORCALL_ARGUMENTS_OFFSET) */
        PyObject *cargs[4] = {NULL, (PyObject *)c, args[0], when};
        PyObject *r = PyObject_VectorcallMethod(s_optimizer_stepped, cargs + 1,
                                                3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(when);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    }
    PyErr_SetString(PyExc_SystemError, "trainprof: bad Timed kind");
    return NULL;
}

static PyObject *
timed_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"kind", "clock", "orig", "phase", "extra", "tensor_type",
                             "dev_begin", "dev_end", NULL};
    int kind, phase;
    PyObject *clock, *orig, *extra = NULL, *tensor_type = NULL, *dev_begin = NULL,
                            *dev_end = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iO!Oi|OOOO:Timed", kwlist, &kind,
                                     &ClockCoreType, &clock, &orig, &phase, &extra,
                                     &tensor_type, &dev_begin, &dev_end))
        return NULL;
    if (N_ACC < 0) {
        PyErr_SetString(PyExc_RuntimeError, "trainprof._fastclock: configure() first");
        return NULL;
    }
    if (phase < 0 || phase >= N_ACC) {
        PyErr_SetString(PyExc_ValueError, "phase out of range");
        return NULL;
    }
    if (kind < K_NEXT || kind > K_OPT_POST) {
        PyErr_SetString(PyExc_ValueError, "unknown kind");
        return NULL;
    }
    if (kind < K_OPT_PRE && !PyCallable_Check(orig)) {
        PyErr_SetString(PyExc_TypeError, "orig must be callable");
        return NULL;
    }
    if (kind == K_OPT_PRE && extra != NULL && extra != Py_None && !PyCallable_Check(extra)) {
        PyErr_SetString(PyExc_TypeError, "K_OPT_PRE: extra must be callable");
        return NULL;
    }
    if (kind == K_NEXT && (extra == NULL || tensor_type == NULL || !PyCallable_Check(extra))) {
        PyErr_SetString(PyExc_TypeError, "K_NEXT needs extra=batch_size_of and tensor_type");
        return NULL;
    }
    Timed *self = (Timed *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->kind = kind;
    self->phase = phase;
    self->clock = (ClockCore *)Py_NewRef(clock);
    self->orig = orig == Py_None ? NULL : Py_NewRef(orig);
    self->extra = Py_XNewRef(extra == Py_None ? NULL : extra);
    self->tensor_type = Py_XNewRef(tensor_type == Py_None ? NULL : tensor_type);
    self->dev_begin = Py_XNewRef(dev_begin == Py_None ? NULL : dev_begin);
    self->dev_end = Py_XNewRef(dev_end == Py_None ? NULL : dev_end);
    self->vectorcall = (vectorcallfunc)timed_vectorcall;
    return (PyObject *)self;
}

static int
timed_traverse(Timed *self, visitproc visit, void *arg)
{
    Py_VISIT(self->clock);
    Py_VISIT(self->orig);
    Py_VISIT(self->extra);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->dev_begin);
    Py_VISIT(self->dev_end);
    return 0;
}

static int
timed_clear(Timed *self)
{
    Py_CLEAR(self->clock);
    Py_CLEAR(self->orig);
    Py_CLEAR(self->extra);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->dev_begin);
    Py_CLEAR(self->dev_end);
    return 0;
}

static void
timed_dealloc(Timed *self)
{
    PyObject_GC_UnTrack(self);
    timed_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A method descriptor: on a class, instance.attr binds like a function does. */
static PyObject *
timed_descr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
timed_get_wrapped(Timed *self, void *closure)
{
    if (self->orig == NULL)
        Py_RETURN_NONE;
    return Py_NewRef(self->orig);
}

static PyObject *
timed_get_orig_attr(Timed *self, void *closure)
{
    if (self->orig == NULL) {
        if (strcmp((const char *)closure, "__doc__") == 0)
            Py_RETURN_NONE;
        return PyUnicode_FromString(self->kind == K_OPT_PRE ? "optimizer_pre_hook"
                                                            : "optimizer_post_hook");
    }
    return PyObject_GetAttrString(self->orig, (const char *)closure);
}

static PyObject *
timed_repr(Timed *self)
{
    if (self->orig == NULL)
        return PyUnicode_FromFormat("<trainprof timed hook, kind %d>", self->kind);
    return PyUnicode_FromFormat("<trainprof timed %R>", self->orig);
}

static PyGetSetDef timed_getset[] = {
    {"__wrapped__", (getter)timed_get_wrapped, NULL, "the wrapped callable", NULL},
    {"__name__", (getter)timed_get_orig_attr, NULL, NULL, "__name__"},
    {"__qualname__", (getter)timed_get_orig_attr, NULL, NULL, "__qualname__"},
    {"__doc__", (getter)timed_get_orig_attr, NULL, NULL, "__doc__"},
    {NULL}};

static PyMemberDef timed_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Timed, vectorcall), READONLY},
    {"kind", T_INT, offsetof(Timed, kind), READONLY},
    {"phase", T_INT, offsetof(Timed, phase), READONLY},
    {NULL}};

static PyTypeObject TimedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trainprof.capture._fastclock.Timed",
    .tp_doc = "Timed(kind, clock, orig, phase, extra=None, tensor_type=None, dev_begin=None, "
              "dev_end=None): calls orig, timing the call as `phase` of the clock.",
    .tp_basicsize = sizeof(Timed),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
                | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = timed_new,
    .tp_traverse = (traverseproc)timed_traverse,
    .tp_clear = (inquiry)timed_clear,
    .tp_dealloc = (destructor)timed_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Timed, vectorcall),
    .tp_descr_get = timed_descr_get,
    .tp_repr = (reprfunc)timed_repr,
    .tp_getset = timed_getset,
    .tp_members = timed_members,
};

/* ------------------------------------------------------------------- module */

static PyObject *
configure(PyObject *mod, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"n_acc", "other", "samples", "host_reads", "sync_n", "sync_ns",
                             "data", NULL};
    Py_ssize_t n, o, s, h, sn, sns, d = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nnnnnn|n:configure", kwlist, &n, &o, &s, &h,
                                     &sn, &sns, &d))
        return NULL;
    if (n < 1 || n + 4 > MAX_RECORD || o < 0 || o >= n || s < 0 || s >= n || h < 0 || h >= n
        || sn < 0 || sn >= n || sns < 0 || sns >= n || d < -1 || d >= n) {
        PyErr_SetString(PyExc_ValueError, "bad accumulator layout");
        return NULL;
    }
    N_ACC = n;
    I_OTHER = o;
    I_SAMPLES = s;
    I_HOST_READS = h;
    I_SYNC_N = sn;
    I_SYNC_NS = sns;
    P_DATA = (int)d;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ stack timer
 *
 * trainprof.capture.loop_stacks samples where the training thread is, a few times a
 * second. A Python thread that reads another thread's stack needs the GIL, so it only
 * ever sees the thread where it lets go of the GIL: in a sleep or a read at once, in
 * pure-Python code up to 5 ms later (a busy line of the loop got no sample and a
 * sleeping one all of them). A native timer thread sending the signal fared better
 * (65% / 35% for an even split) but still under-sampled the model's phases - it seems
 * to have woken late while torch's threads kept both cores busy. So the kernel keeps
 * the time: a
 * POSIX timer (CLOCK_MONOTONIC) sends a signal to the training thread itself
 * (SIGEV_THREAD_ID). This handler runs at once, whatever the thread is doing (C++
 * code of torch included), notes the clock's step and phase at that instant, and asks
 * the interpreter to run the Python handler (PyErr_SetInterruptEx: async-signal-safe),
 * which it does in that thread at the next bytecode boundary: at once in pure Python;
 * interrupting a sleep; after a C call returns, on the line that made it. Ticks that
 * arrive before the Python handler ran (one long C call, or a tick the kernel had to
 * merge: si_overrun) are counted, so the sample carries their number as its weight,
 * in units of the finest interval (st_weight: a sparse tick weighs more). The handler
 * is installed with SA_RESTART, so interrupted system calls resume.
 */
#if defined(__linux__) && defined(SIGEV_THREAD_ID)
#include <sys/syscall.h>
#ifndef sigev_notify_thread_id
#define sigev_notify_thread_id _sigev_un._tid
#endif
#define HAVE_STACK_TIMER 1
static timer_t st_timer;
static int st_running, st_signum;
static ClockCore *st_core;         /* a strong reference while the timer runs */
static struct sigaction st_python; /* the action Python installed, put back at stop */
static long long st_seq, st_step;  /* written by the signal handler, read under the GIL */
static long long st_weight = 1;    /* what one tick adds to st_seq: its interval, in units */
static int st_phase, st_in_sync;

static void
stack_timer_tick(int sig, siginfo_t *info, void *context)
{
    (void)context;
    ClockCore *core = st_core;
    if (core == NULL || !__atomic_load_n(&core->started, __ATOMIC_RELAXED))
        return;
    int overrun = (info != NULL && info->si_code == SI_TIMER) ? info->si_overrun : 0;
    __atomic_store_n(&st_phase, core->current, __ATOMIC_RELAXED);
    __atomic_store_n(&st_in_sync, core->in_sync > 0, __ATOMIC_RELAXED);
    __atomic_store_n(&st_step, core->n_steps, __ATOMIC_RELAXED);
    long long ticks = 1 + (overrun > 0 ? overrun : 0);
    __atomic_add_fetch(&st_seq, __atomic_load_n(&st_weight, __ATOMIC_RELAXED) * ticks,
                       __ATOMIC_RELEASE);
    PyErr_SetInterruptEx(sig);
}

/* first tick after first_s (<= 0: after one interval), then every interval_s */
static int
stack_timer_arm(double interval_s, double first_s)
{
    long long ns = (long long)(interval_s * 1e9);
    long long first = first_s > 0 ? (long long)(first_s * 1e9) : ns;
    struct itimerspec spec;
    spec.it_interval.tv_sec = (time_t)(ns / 1000000000LL);
    spec.it_interval.tv_nsec = (long)(ns % 1000000000LL);
    spec.it_value.tv_sec = (time_t)(first / 1000000000LL);
    spec.it_value.tv_nsec = (long)(first % 1000000000LL);
    return timer_settime(st_timer, 0, &spec, NULL);
}

/* set_stack_interval(interval_s, weight, first_s=0): tick at another interval from now
   on, each tick counting `weight` units (its interval over the finest one); the first
   tick after first_s when it is positive (a first step is sampled once it has lasted
   that long: trainprof.capture.loop_stacks), else after one interval. */
static PyObject *
py_set_stack_interval(PyObject *mod, PyObject *args)
{
    double interval_s, first_s = 0.0;
    long long weight;
    if (!PyArg_ParseTuple(args, "dL|d", &interval_s, &weight, &first_s))
        return NULL;
    if (!(interval_s > 0) || weight < 1 || !(first_s >= 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "interval_s and weight must be positive, first_s not negative");
        return NULL;
    }
    if (!st_running)
        Py_RETURN_NONE;
    __atomic_store_n(&st_weight, weight, __ATOMIC_RELAXED);
    if (stack_timer_arm(interval_s, first_s) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* start_stack_timer(core, interval_s, signum, weight): called in the thread to sample,
   after signal.signal(signum, python_handler). interval_s 0: the timer is made but not
   armed (set_stack_interval arms it): a signal interrupts a blocking call that has a
   timeout whatever SA_RESTART says (connect() under torch.distributed's TCPStore
   failed with EINTR and retried 0.7 s later), so the set-up is left alone. */
static PyObject *
py_start_stack_timer(PyObject *mod, PyObject *args)
{
    PyObject *core;
    double interval_s;
    int signum;
    long long weight = 1;
    if (!PyArg_ParseTuple(args, "O!di|L", &ClockCoreType, &core, &interval_s, &signum, &weight))
        return NULL;
    if (st_running) {
        PyErr_SetString(PyExc_RuntimeError, "the stack timer is already running");
        return NULL;
    }
    if (!(interval_s >= 0) || weight < 1) {
        PyErr_SetString(PyExc_ValueError, "interval_s must be >= 0 and weight positive");
        return NULL;
    }
    st_weight = weight;
    struct sigaction act;
    memset(&act, 0, sizeof(act));
    act.sa_sigaction = stack_timer_tick;
    act.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    Py_INCREF(core);
    st_core = (ClockCore *)core;
    st_signum = signum;
    if (sigaction(signum, &act, &st_python) != 0) {
        Py_CLEAR(st_core);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    struct sigevent ev;
    memset(&ev, 0, sizeof(ev));
    ev.sigev_notify = SIGEV_THREAD_ID;
    ev.sigev_signo = signum;
    ev.sigev_notify_thread_id = (pid_t)syscall(SYS_gettid);
    if (timer_create(CLOCK_MONOTONIC, &ev, &st_timer) != 0) {
        int err = errno;
        sigaction(signum, &st_python, NULL);
        Py_CLEAR(st_core);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (interval_s > 0 && stack_timer_arm(interval_s, 0.0) != 0) {
        int err = errno;
        timer_delete(st_timer);
        sigaction(signum, &st_python, NULL);
        Py_CLEAR(st_core);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    st_running = 1;
    Py_RETURN_NONE;
}

/* stop_stack_timer(): delete the timer, put Python's action for the signal back. */
static PyObject *
py_stop_stack_timer(PyObject *mod, PyObject *unused)
{
    if (!st_running)
        Py_RETURN_NONE;
    st_running = 0;
    timer_delete(st_timer);
    /* only if the action is still ours: the script may have installed its own since */
    struct sigaction now;
    if (sigaction(st_signum, NULL, &now) == 0 && (now.sa_flags & SA_SIGINFO)
        && now.sa_sigaction == stack_timer_tick)
        sigaction(st_signum, &st_python, NULL);
    Py_CLEAR(st_core);
    Py_RETURN_NONE;
}

/* In a forked child: the timer was not inherited (POSIX timers are per process), nor is
   the parent's clock the child's. The child may record a run of its own (a forked rank). */
static void
stack_timer_after_fork_child(void)
{
    st_running = 0;
    st_core = NULL; /* the parent's reference: the child's copy of it is left as it is */
}

/* stack_stash() -> (ticks, step, phase, in_sync): the timer's ticks so far, and the step
   and phase the clock was in at the last one, and whether the training thread was inside
   a timed sync (a CUDA tensor's .item(), torch.cuda.synchronize) then. */
static PyObject *
py_stack_stash(PyObject *mod, PyObject *unused)
{
    long long seq = __atomic_load_n(&st_seq, __ATOMIC_ACQUIRE);
    return Py_BuildValue("(LLii)", seq, __atomic_load_n(&st_step, __ATOMIC_RELAXED),
                         __atomic_load_n(&st_phase, __ATOMIC_RELAXED),
                         __atomic_load_n(&st_in_sync, __ATOMIC_RELAXED));
}
#endif

static PyObject *
py_now_ns(PyObject *mod, PyObject *unused)
{
    return PyLong_FromLongLong(now_ns());
}

/* pread_held(fd, length, offset) -> bytes: os.pread without releasing the GIL.
 *
 * For the system sampler's reads of /proc files, which the kernel generates in
 * microseconds and never block on a disk. os.pread releases the GIL around the
 * system call; the training thread then takes it, and the sampler must wait for
 * it to be handed back (a forced switch after sys.getswitchinterval()): one such
 * hand-off per read, each costing the training thread a futex round trip and
 * cold caches. Holding the GIL through these reads leaves one hand-off a tick. */
static PyObject *
py_pread_held(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pread_held(fd, length, offset)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    Py_ssize_t length = PyLong_AsSsize_t(args[1]);
    long long offset = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (length < 0 || offset < 0 || fd < 0 || fd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "pread_held: negative length, offset or fd");
        return NULL;
    }
    PyObject *buf = PyBytes_FromStringAndSize(NULL, length);
    if (buf == NULL)
        return NULL;
    ssize_t got;
    do {
        got = pread((int)fd, PyBytes_AS_STRING(buf), (size_t)length, (off_t)offset);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
        Py_DECREF(buf);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (got != length && _PyBytes_Resize(&buf, got) < 0)
        return NULL;
    return buf;
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Set the accumulator layout (indices from trainprof.schema)."},
    {"now_ns", py_now_ns, METH_NOARGS, "The clock the C path reads: time.perf_counter_ns()."},
#if defined(HAVE_STACK_TIMER)
    {"start_stack_timer", py_start_stack_timer, METH_VARARGS,
     "start_stack_timer(core, interval_s, signum, weight=1): signal the calling thread at "
     "the interval (see trainprof.capture.loop_stacks)."},
    {"set_stack_interval", py_set_stack_interval, METH_VARARGS,
     "set_stack_interval(interval_s, weight, first_s=0): another interval, each tick weighing "
     "`weight`; the first tick after first_s when positive."},
    {"stop_stack_timer", py_stop_stack_timer, METH_NOARGS,
     "Stop the stack timer and put Python's handling of the signal back."},
    {"stack_stash", py_stack_stash, METH_NOARGS,
     "(ticks, step, phase, in_sync) of the stack timer's last tick."},
#endif
    {"pread_held", (PyCFunction)(void (*)(void))py_pread_held, METH_FASTCALL,
     "os.pread(fd, length, offset) without releasing the GIL (for /proc files)."},
    {NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_fastclock",
    "The step clock's hot path in C (optional; see trainprof.capture.clock).", -1,
    module_methods};

PyMODINIT_FUNC
PyInit__fastclock(void)
{
    if (PyType_Ready(&ClockCoreType) < 0 || PyType_Ready(&TimedType) < 0)
        return NULL;
#define INTERN(var, text)                                                                       \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                       \
        return NULL;
    INTERN(s_begin, "begin");
    INTERN(s_top_level_event, "top_level_event");
    INTERN(s_mark, "mark");
    INTERN(s_step_closed, "step_closed");
    INTERN(s_watch, "_watch");
    INTERN(s_optimizer_stepped, "optimizer_stepped");
    INTERN(s_shape, "shape");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_adopt_thread, "adopt_thread");
    INTERN(s_training, "training");
#undef INTERN
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
#if defined(HAVE_STACK_TIMER)
    pthread_atfork(NULL, NULL, stack_timer_after_fork_child);
#endif
    if (PyModule_AddObjectRef(m, "ClockCore", (PyObject *)&ClockCoreType) < 0
        || PyModule_AddObjectRef(m, "Timed", (PyObject *)&TimedType) < 0
        || PyModule_AddIntConstant(m, "K_NEXT", K_NEXT) < 0
        || PyModule_AddIntConstant(m, "K_CALL", K_CALL) < 0
        || PyModule_AddIntConstant(m, "K_BACKWARD", K_BACKWARD) < 0
        || PyModule_AddIntConstant(m, "K_PHASE", K_PHASE) < 0
        || PyModule_AddIntConstant(m, "K_READ", K_READ) < 0
        || PyModule_AddIntConstant(m, "K_SYNC", K_SYNC) < 0
        || PyModule_AddIntConstant(m, "K_OPT_PRE", K_OPT_PRE) < 0
        || PyModule_AddIntConstant(m, "K_OPT_POST", K_OPT_POST) < 0
        || PyModule_AddIntConstant(m, "VERSION", FASTCLOCK_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
