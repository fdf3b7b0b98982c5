/* allocator._speedups: the per-block hot paths of BlockAllocator, in C, and the
 * host backend's two per-page libc calls (mprotect, fallocate) without ctypes.
 *
 * BlockCore is the C base of allocator.BlockAllocator. It stores the fields the
 * hot paths read (as members with the same names the Python code uses, so the
 * rest of BlockAllocator, written in Python, reads and writes them unchanged)
 * and implements alloc(), free(), mark_evictable() and unmark_evictable(). The
 * pure-Python reference of these four methods is allocator._blocks._PyHotPaths;
 * tests run the same random operations through both and compare every field.
 *
 * Rules kept here exactly as in the Python reference:
 *   - the ThreadGuard is consulted first (guard.enabled, then guard.check());
 *   - a bad argument raises AllocatorContractError and changes nothing, except
 *     mark/unmark, which keep the blocks before the bad one (their counts agree);
 *   - what is not hot (free of several blocks, untracking several blocks, page
 *     bucket moves on retirement) is left to the Python methods, called from here.
 *
 * Only CPython's public API; no state outside the object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>

typedef struct {
    PyObject_HEAD
    PyObject *guard;      /* ThreadGuard */
    PyObject *pages;      /* PageAllocator */
    PyObject *allocated;  /* bytearray: 0 free, 1 allocated, 2 allocated and marked */
    PyObject *occupancy;  /* list[int] per page */
    PyObject *ev_on;      /* list[int] per page (when tracking) */
    PyObject *slots;      /* list[list[int]] free slots per in-use page */
    PyObject *retired;    /* bytearray per page */
    PyObject *buckets;    /* list[list[int]] partly used, non-retired pages by occupancy */
    PyObject *rbuckets;   /* list[list[int]] retired pages by occupancy */
    PyObject *pos;        /* list[int] per page: index in its bucket */
    /* ints and bools as Python objects (members of type object): Python code reads and
     * writes them at the speed of a slot (its LOAD_ATTR specialises only object members) */
    PyObject *blocks_per_page;
    PyObject *num_blocks;
    PyObject *num_allocated_blocks;
    PyObject *num_retired_blocks;
    PyObject *partial_free;
    PyObject *top;
    PyObject *rtop;
    PyObject *changes;
    PyObject *num_evictable_blocks;
    PyObject *num_reclaimable_pages;
    PyObject *tracks_evictable;
    PyObject *refused_by_device;
} BlockCore;

#define N(field) PyLong_AsSsize_t(self->field)
#define FLAG_ON(field) (self->field == Py_True)

/* Store an int in an int field; on a failed allocation the old value stays and
 * MemoryError is pending (the public methods check PyErr_Occurred before returning). */
static inline void
store_n(PyObject **slot, Py_ssize_t value)
{
    PyObject *o = PyLong_FromSsize_t(value);
    if (o != NULL)
        Py_XSETREF(*slot, o);
}
#define SET_N(field, value) store_n(&self->field, (value))
#define ADD_N(field, delta) store_n(&self->field, N(field) + (delta))
#define SET_FLAG(field, on) Py_XSETREF(self->field, Py_NewRef((on) ? Py_True : Py_False))

static PyObject *ContractError = NULL; /* allocator.AllocatorContractError (configure()) */
static PyObject *BaseError = NULL;     /* allocator.AllocatorError */
static PyObject *s_enabled, *s_check, *s_acquire, *s_release, *s_refused_by_device,
    *s_free_checked, *s_untrack_freed, *s_num_free_blocks, *s_roll_back;

/* ------------------------------------------------------------------ helpers */
static int
not_configured(void)
{
    if (ContractError == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "allocator._speedups: configure() was not called (import allocator)");
        return 1;
    }
    return 0;
}

static int
check_fields(BlockCore *self)
{
    PyObject *ints[] = {self->blocks_per_page,    self->num_blocks,   self->num_allocated_blocks,
                        self->num_retired_blocks, self->partial_free, self->top,
                        self->rtop,               self->changes,      self->num_evictable_blocks,
                        self->num_reclaimable_pages};
    for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++) {
        if (ints[i] == NULL || !PyLong_CheckExact(ints[i])) {
            PyErr_SetString(PyExc_RuntimeError,
                            "BlockAllocator: a count is missing or not an int (call __init__)");
            return -1;
        }
    }
    if (!self->tracks_evictable || !PyBool_Check(self->tracks_evictable) ||
        !self->refused_by_device || !PyBool_Check(self->refused_by_device)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "BlockAllocator: tracks_evictable/refused_by_device must be bools");
        return -1;
    }
    if (!self->allocated || !PyByteArray_CheckExact(self->allocated) || !self->occupancy ||
        !PyList_CheckExact(self->occupancy) || !self->slots || !PyList_CheckExact(self->slots) ||
        !self->retired || !PyByteArray_CheckExact(self->retired) || !self->buckets ||
        !PyList_CheckExact(self->buckets) || !self->rbuckets ||
        !PyList_CheckExact(self->rbuckets) || !self->pos || !PyList_CheckExact(self->pos) ||
        !self->pages || !self->guard || N(blocks_per_page) <= 0 ||
        PyByteArray_GET_SIZE(self->allocated) != N(num_blocks) ||
        PyList_GET_SIZE(self->occupancy) * N(blocks_per_page) != N(num_blocks) ||
        PyList_GET_SIZE(self->buckets) != N(blocks_per_page) ||
        PyList_GET_SIZE(self->rbuckets) != N(blocks_per_page) + 1) {
        PyErr_SetString(PyExc_RuntimeError,
                        "BlockAllocator: its fields are not initialised (call __init__)");
        return -1;
    }
    if (FLAG_ON(tracks_evictable) &&
        (!self->ev_on || !PyList_CheckExact(self->ev_on) ||
         PyList_GET_SIZE(self->ev_on) != PyList_GET_SIZE(self->occupancy))) {
        PyErr_SetString(PyExc_RuntimeError, "BlockAllocator: _ev_on does not match the pages");
        return -1;
    }
    return 0;
}

static int
guard_check(BlockCore *self)
{
    PyObject *enabled = PyObject_GetAttr(self->guard, s_enabled);
    if (enabled == NULL)
        return -1;
    int on = PyObject_IsTrue(enabled);
    Py_DECREF(enabled);
    if (on <= 0)
        return on;
    PyObject *r = PyObject_CallMethodNoArgs(self->guard, s_check);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* An int element of a list of ints (our own lists: always exact ints). */
static inline Py_ssize_t
item(PyObject *list, Py_ssize_t i)
{
    return PyLong_AsSsize_t(PyList_GET_ITEM(list, i));
}

static inline int
set_item(PyObject *list, Py_ssize_t i, Py_ssize_t v)
{
    PyObject *o = PyLong_FromSsize_t(v);
    if (o == NULL)
        return -1;
    return PyList_SetItem(list, i, o); /* steals o */
}

static inline PyObject *
bucket_of(PyObject *buckets, Py_ssize_t occ)
{
    return PyList_GET_ITEM(buckets, occ);
}

/* bucket.pop() then move the last page into the removed page's place. */
static int
bucket_remove(BlockCore *self, PyObject *buckets, Py_ssize_t page, Py_ssize_t occ)
{
    PyObject *bucket = bucket_of(buckets, occ);
    Py_ssize_t n = PyList_GET_SIZE(bucket);
    if (n == 0) {
        PyErr_Format(PyExc_RuntimeError, "BlockAllocator: page %zd missing from bucket %zd",
                     page, occ);
        return -1;
    }
    PyObject *last = PyList_GET_ITEM(bucket, n - 1);
    Py_INCREF(last);
    if (PyList_SetSlice(bucket, n - 1, n, NULL) < 0) {
        Py_DECREF(last);
        return -1;
    }
    Py_ssize_t last_page = PyLong_AsSsize_t(last);
    if (last_page != page) {
        Py_ssize_t index = item(self->pos, page);
        if (index < 0 || index >= n - 1) {
            Py_DECREF(last);
            PyErr_Format(PyExc_RuntimeError, "BlockAllocator: bad bucket index of page %zd",
                         page);
            return -1;
        }
        if (PyList_SetItem(bucket, index, last) < 0) /* steals last */
            return -1;
        return set_item(self->pos, last_page, index);
    }
    Py_DECREF(last);
    return 0;
}

static int
bucket_add(BlockCore *self, PyObject *buckets, Py_ssize_t page, Py_ssize_t occ)
{
    PyObject *bucket = bucket_of(buckets, occ);
    if (set_item(self->pos, page, PyList_GET_SIZE(bucket)) < 0)
        return -1;
    PyObject *o = PyLong_FromSsize_t(page);
    if (o == NULL)
        return -1;
    int rc = PyList_Append(bucket, o);
    Py_DECREF(o);
    return rc;
}

static int
out_append(PyObject *out, Py_ssize_t block)
{
    PyObject *o = PyLong_FromSsize_t(block);
    if (o == NULL)
        return -1;
    int rc = PyList_Append(out, o);
    Py_DECREF(o);
    return rc;
}

/* _take: up to `need` blocks from `page` (in use, not retired) into `out`; -1 on error.
 * The ids come out in the Python reference's order: a fresh page's slots are
 * bpp-1..0, so its blocks are one ascending run; on a partly used page they are
 * slots[-count:] in list order (for one block that is slots.pop()). */
static Py_ssize_t
take(BlockCore *self, Py_ssize_t page, Py_ssize_t need, PyObject *out)
{
    Py_ssize_t bpp = N(blocks_per_page);
    Py_ssize_t old = item(self->occupancy, page);
    Py_ssize_t count = need < bpp - old ? need : bpp - old;
    PyObject *slots = PyList_GET_ITEM(self->slots, page);
    if (!PyList_CheckExact(slots) || PyList_GET_SIZE(slots) < count || count <= 0) {
        PyErr_Format(PyExc_RuntimeError, "BlockAllocator: page %zd has no free slots listed",
                     page);
        return -1;
    }
    Py_ssize_t first = page * bpp;
    char *flags = PyByteArray_AS_STRING(self->allocated);
    Py_ssize_t n = PyList_GET_SIZE(slots);
    for (Py_ssize_t i = n - count; i < n; i++) {
        Py_ssize_t block = old ? first + PyLong_AsSsize_t(PyList_GET_ITEM(slots, i))
                               : first + (i - (n - count));
        flags[block] = 1;
        if (out_append(out, block) < 0)
            return -1;
    }
    if (PyList_SetSlice(slots, n - count, n, NULL) < 0)
        return -1;
    Py_ssize_t new = old + count;
    if (set_item(self->occupancy, page, new) < 0)
        return -1;
    ADD_N(partial_free, -(count));
    if (old && FLAG_ON(tracks_evictable) && item(self->ev_on, page) == old)
        ADD_N(num_reclaimable_pages, -(1)); /* a fresh block on it is not evictable */
    if (old && bucket_remove(self, self->buckets, page, old) < 0)
        return -1;
    if (new < bpp) {
        if (bucket_add(self, self->buckets, page, new) < 0)
            return -1;
        if (new > N(top))
            SET_N(top, new);
    }
    return count;
}

static int
call_free_checked(BlockCore *self, PyObject *batch)
{
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, s_free_checked, batch);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Undo a partial alloc (the Python _roll_back): the blocks taken go back, with the
 * evictable accounting take() changed (a page that was all evictable is so again). */
static int
call_roll_back(BlockCore *self, PyObject *out)
{
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, s_roll_back, out);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *
new_slots(Py_ssize_t bpp)
{
    PyObject *slots = PyList_New(bpp);
    if (slots == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < bpp; i++) {
        PyObject *o = PyLong_FromSsize_t(bpp - 1 - i);
        if (o == NULL) {
            Py_DECREF(slots);
            return NULL;
        }
        PyList_SET_ITEM(slots, i, o);
    }
    return slots;
}

/* ------------------------------------------------------------------ alloc */
static PyObject *
BlockCore_alloc(BlockCore *self, PyObject *arg)
{
    if (not_configured() || check_fields(self) < 0 || guard_check(self) < 0)
        return NULL;
    SET_FLAG(refused_by_device, 0);
    if (!PyLong_CheckExact(arg)) {
        PyErr_Format(ContractError, "alloc(n) needs an int >= 0; got %R", arg);
        return NULL;
    }
    int overflow = 0;
    long long wide = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (wide == -1 && PyErr_Occurred())
        return NULL;
    if (overflow > 0 || (overflow == 0 && wide > PY_SSIZE_T_MAX))
        Py_RETURN_NONE; /* more than any pool holds: None, as the Python reference */
    if (overflow < 0 || wide < 0) { /* as the Python reference: a contract error */
        PyErr_Format(ContractError, "alloc(n) needs an int >= 0; got %R", arg);
        return NULL;
    }
    Py_ssize_t n = (Py_ssize_t)wide;
    if (n > N(partial_free)) {
        PyObject *free_obj = PyObject_GetAttr((PyObject *)self, s_num_free_blocks);
        if (free_obj == NULL)
            return NULL;
        Py_ssize_t free = PyLong_AsSsize_t(free_obj);
        Py_DECREF(free_obj);
        if (free == -1 && PyErr_Occurred())
            return NULL;
        if (n > free)
            Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    Py_ssize_t need = n;
    Py_ssize_t bpp = N(blocks_per_page);
    while (need && N(partial_free)) {
        Py_ssize_t top = N(top);
        while (top > 0 && PyList_GET_SIZE(bucket_of(self->buckets, top)) == 0)
            top--;
        SET_N(top, top);
        PyObject *bucket = bucket_of(self->buckets, top);
        if (top == 0 || PyList_GET_SIZE(bucket) == 0) {
            PyErr_SetString(PyExc_RuntimeError,
                            "BlockAllocator: free slots counted but no partly used page");
            goto error;
        }
        Py_ssize_t page = PyLong_AsSsize_t(PyList_GET_ITEM(bucket, PyList_GET_SIZE(bucket) - 1));
        Py_ssize_t got = take(self, page, need, out);
        if (got < 0)
            goto error;
        need -= got;
    }
    while (need) {
        PyObject *fresh = PyObject_CallMethodNoArgs(self->pages, s_acquire);
        if (fresh == NULL)
            goto error;
        if (fresh == Py_None) {
            Py_DECREF(fresh);
            PyObject *refused = PyObject_GetAttr(self->pages, s_refused_by_device);
            if (refused == NULL)
                goto error;
            int is = PyObject_IsTrue(refused);
            Py_DECREF(refused);
            if (is < 0)
                goto error;
            if (is) { /* no device memory: all or nothing */
                SET_FLAG(refused_by_device, 1);
                if (call_roll_back(self, out) < 0) {
                    Py_DECREF(out);
                    return NULL;
                }
                Py_DECREF(out);
                Py_RETURN_NONE;
            }
            PyErr_SetString(ContractError, "PageAllocator refused a page within headroom");
            goto error;
        }
        Py_ssize_t page = PyLong_AsSsize_t(fresh);
        Py_DECREF(fresh);
        if (page == -1 && PyErr_Occurred())
            goto error;
        PyObject *slots = new_slots(bpp);
        if (slots == NULL)
            goto error;
        if (PyList_SetItem(self->slots, page, slots) < 0) /* steals slots */
            goto error;
        ADD_N(partial_free, bpp);
        Py_ssize_t got = take(self, page, need, out);
        if (got < 0)
            goto error;
        need -= got;
    }
    ADD_N(num_allocated_blocks, n);
    ADD_N(changes, 1);
    if (PyErr_Occurred()) { /* a count could not be stored (out of memory) */
        Py_DECREF(out);
        return NULL;
    }
    return out;

error:
    /* an AllocatorError leaves nothing taken (as the Python reference); others propagate */
    if (PyErr_ExceptionMatches(BaseError)) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (call_roll_back(self, out) < 0) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            Py_DECREF(out);
            return NULL;
        }
        PyErr_Restore(type, value, tb);
    }
    Py_DECREF(out);
    return NULL;
}

/* ------------------------------------------------------------------ free */
static int
release_page(BlockCore *self, Py_ssize_t page)
{
    PyObject *p = PyLong_FromSsize_t(page);
    if (p == NULL)
        return -1;
    PyObject *r = PyObject_CallMethodOneArg(self->pages, s_release, p);
    Py_DECREF(p);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int
clear_slots(BlockCore *self, Py_ssize_t page)
{
    PyObject *empty = PyList_New(0);
    if (empty == NULL)
        return -1;
    return PyList_SetItem(self->slots, page, empty);
}

/* _untrack_freed for one checked block, before its page's occupancy drops. */
static void
untrack_one(BlockCore *self, Py_ssize_t block)
{
    Py_ssize_t bpp = N(blocks_per_page);
    Py_ssize_t page = block / bpp;
    Py_ssize_t occ = item(self->occupancy, page);
    Py_ssize_t on = item(self->ev_on, page);
    int was = on == occ;
    if (PyByteArray_AS_STRING(self->allocated)[block] == 2) {
        on -= 1;
        set_item(self->ev_on, page, on);
        ADD_N(num_evictable_blocks, -(1));
    }
    ADD_N(num_reclaimable_pages, (occ > 1 && on == occ - 1) - was);
}

/* _free_one: one checked block back; its page goes back when it empties. */
static int
free_one(BlockCore *self, Py_ssize_t block)
{
    Py_ssize_t bpp = N(blocks_per_page);
    Py_ssize_t page = block / bpp;
    PyByteArray_AS_STRING(self->allocated)[block] = 0;
    PyObject *slot = PyLong_FromSsize_t(block - page * bpp);
    if (slot == NULL)
        return -1;
    int rc = PyList_Append(PyList_GET_ITEM(self->slots, page), slot);
    Py_DECREF(slot);
    if (rc < 0)
        return -1;
    Py_ssize_t old = item(self->occupancy, page);
    Py_ssize_t new = old - 1;
    if (set_item(self->occupancy, page, new) < 0)
        return -1;
    char *retired = PyByteArray_AS_STRING(self->retired);
    if (retired[page]) {
        ADD_N(num_retired_blocks, -(1));
        if (bucket_remove(self, self->rbuckets, page, old) < 0)
            return -1;
        if (new) {
            if (bucket_add(self, self->rbuckets, page, new) < 0)
                return -1;
            if (new > N(rtop))
                SET_N(rtop, new);
            return 0;
        }
        if (clear_slots(self, page) < 0)
            return -1;
        retired[page] = 0;
        return release_page(self, page);
    }
    ADD_N(partial_free, 1);
    if (old < bpp && bucket_remove(self, self->buckets, page, old) < 0)
        return -1;
    if (new) {
        if (bucket_add(self, self->buckets, page, new) < 0)
            return -1;
        if (new > N(top))
            SET_N(top, new);
        return 0;
    }
    ADD_N(partial_free, -(bpp));
    if (clear_slots(self, page) < 0)
        return -1;
    return release_page(self, page);
}

static PyObject *
BlockCore_free(BlockCore *self, PyObject *blocks)
{
    if (not_configured() || check_fields(self) < 0 || guard_check(self) < 0)
        return NULL;
    PyObject *batch;
    if (PyList_CheckExact(blocks)) {
        batch = blocks;
        Py_INCREF(batch);
    }
    else {
        batch = PySequence_List(blocks);
        if (batch == NULL)
            return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(batch);
    Py_ssize_t limit = N(num_blocks);
    unsigned char *flags = (unsigned char *)PyByteArray_AS_STRING(self->allocated);
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(batch, i);
        Py_ssize_t block = PyLong_CheckExact(o) ? PyLong_AsSsize_t(o) : -1;
        if (block == -1 && PyErr_Occurred())
            PyErr_Clear();
        if (!PyLong_CheckExact(o) || block < 0 || block >= limit) {
            PyErr_Format(ContractError, "free(): %R is not a block id in 0..%zd", o, limit - 1);
            goto bad;
        }
        if (!flags[block]) {
            PyErr_Format(ContractError, "free(): block %zd is not allocated (double free?)",
                         block);
            goto bad;
        }
    }
    if (n > 1) { /* the same block twice: a high bit set on first sight, cleared after */
        int twice = 0;
        for (i = 0; i < n; i++) {
            Py_ssize_t block = PyLong_AsSsize_t(PyList_GET_ITEM(batch, i));
            if (flags[block] & 0x80) {
                twice = 1;
                break;
            }
            flags[block] |= 0x80;
        }
        for (Py_ssize_t j = 0; j < i; j++)
            flags[PyLong_AsSsize_t(PyList_GET_ITEM(batch, j))] &= 0x7f;
        if (twice) {
            PyErr_SetString(ContractError, "free(): the same block appears twice in one call");
            goto bad;
        }
    }
    ADD_N(num_allocated_blocks, -(n));
    ADD_N(changes, 1);
    if (n == 1) {
        Py_ssize_t block = PyLong_AsSsize_t(PyList_GET_ITEM(batch, 0));
        if (FLAG_ON(tracks_evictable))
            untrack_one(self, block);
        if (PyErr_Occurred() || free_one(self, block) < 0)
            goto bad;
    }
    else if (n > 1) {
        if (FLAG_ON(tracks_evictable)) {
            PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, s_untrack_freed, batch);
            if (r == NULL)
                goto bad;
            Py_DECREF(r);
        }
        if (call_free_checked(self, batch) < 0)
            goto bad;
    }
    Py_DECREF(batch);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
bad:
    Py_DECREF(batch);
    return NULL;
}

/* ------------------------------------------------------------------ evictable marks */
/* mark (from 1 to 2) or unmark (from 2 to 1) every block of `blocks`; on a bad id
 * (or an iterator that raises part-way) the blocks before it stay changed, the counts
 * agree, and the error is raised -- as the Python path does. */
struct mark_run {
    const char *name;
    char *flags;
    PyObject *ev_on, *occupancy;
    Py_ssize_t bpp, limit, changed_pages, count;
    int mark;
};

/* one block: 0, or -1 with an exception set */
static int
change_one(struct mark_run *r, PyObject *o)
{
    Py_ssize_t block = PyLong_CheckExact(o) ? PyLong_AsSsize_t(o) : -1;
    if (block == -1 && PyErr_Occurred())
        PyErr_Clear();
    if (!PyLong_CheckExact(o) || block < 0 || block >= r->limit) {
        PyErr_Format(ContractError, "%s(): %R is not a block id in 0..%zd", r->name, o,
                     r->limit - 1);
        return -1;
    }
    char from = r->mark ? 1 : 2, to = r->mark ? 2 : 1;
    if (r->flags[block] != from) {
        if (r->mark)
            PyErr_Format(ContractError, "mark_evictable(): block %zd is %s", block,
                         r->flags[block] ? "already marked" : "not allocated");
        else
            PyErr_Format(ContractError, "unmark_evictable(): block %zd is not marked", block);
        return -1;
    }
    r->flags[block] = to;
    r->count += 1;
    Py_ssize_t page = block / r->bpp;
    Py_ssize_t on = item(r->ev_on, page);
    Py_ssize_t occ = item(r->occupancy, page);
    if (r->mark) {
        on += 1;
        if (on == occ)
            r->changed_pages += 1;
    }
    else {
        if (on == occ)
            r->changed_pages += 1;
        on -= 1;
    }
    return set_item(r->ev_on, page, on);
}

static PyObject *
change_marks(BlockCore *self, PyObject *blocks, int mark)
{
    const char *name = mark ? "mark_evictable" : "unmark_evictable";
    if (not_configured() || check_fields(self) < 0 || guard_check(self) < 0)
        return NULL;
    if (!FLAG_ON(tracks_evictable)) {
        PyErr_Format(ContractError, "%s(): call track_evictable() first", name);
        return NULL;
    }
    struct mark_run r = {name, PyByteArray_AS_STRING(self->allocated), self->ev_on,
                         self->occupancy, N(blocks_per_page), N(num_blocks), 0, 0, mark};
    int failed = 0;
    if (PyList_CheckExact(blocks) || PyTuple_CheckExact(blocks)) {
        /* the hot path: no iterator (nothing below runs Python code before a break) */
        PyObject *seq = blocks;
        Py_INCREF(seq);
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (change_one(&r, items[i]) < 0) {
                failed = 1;
                break;
            }
        }
        Py_DECREF(seq);
    }
    else {
        PyObject *it = PyObject_GetIter(blocks);
        if (it == NULL) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_SetString(PyExc_TypeError, "blocks must be iterable");
            }
            return NULL;
        }
        PyObject *o;
        while ((o = PyIter_Next(it)) != NULL) {
            int rc = change_one(&r, o);
            Py_DECREF(o);
            if (rc < 0) {
                failed = 1;
                break;
            }
        }
        Py_DECREF(it);
        if (PyErr_Occurred())
            failed = 1; /* the iterator raised part-way: what came before stays changed */
    }
    if (mark) {
        ADD_N(num_reclaimable_pages, r.changed_pages);
        ADD_N(num_evictable_blocks, r.count);
    }
    else {
        ADD_N(num_reclaimable_pages, -(r.changed_pages));
        ADD_N(num_evictable_blocks, -(r.count));
    }
    ADD_N(changes, 1);
    if (failed || PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
BlockCore_mark_evictable(BlockCore *self, PyObject *blocks)
{
    return change_marks(self, blocks, 1);
}

static PyObject *
BlockCore_unmark_evictable(BlockCore *self, PyObject *blocks)
{
    return change_marks(self, blocks, 0);
}

/* ------------------------------------------------------------------ type */
static int
BlockCore_traverse(BlockCore *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->guard);
    Py_VISIT(self->pages);
    Py_VISIT(self->allocated);
    Py_VISIT(self->occupancy);
    Py_VISIT(self->ev_on);
    Py_VISIT(self->slots);
    Py_VISIT(self->retired);
    Py_VISIT(self->buckets);
    Py_VISIT(self->rbuckets);
    Py_VISIT(self->pos);
    return 0;
}

static int
BlockCore_clear(BlockCore *self)
{
    Py_CLEAR(self->guard);
    Py_CLEAR(self->pages);
    Py_CLEAR(self->allocated);
    Py_CLEAR(self->occupancy);
    Py_CLEAR(self->ev_on);
    Py_CLEAR(self->slots);
    Py_CLEAR(self->retired);
    Py_CLEAR(self->buckets);
    Py_CLEAR(self->rbuckets);
    Py_CLEAR(self->pos);
    Py_CLEAR(self->blocks_per_page);
    Py_CLEAR(self->num_blocks);
    Py_CLEAR(self->num_allocated_blocks);
    Py_CLEAR(self->num_retired_blocks);
    Py_CLEAR(self->partial_free);
    Py_CLEAR(self->top);
    Py_CLEAR(self->rtop);
    Py_CLEAR(self->changes);
    Py_CLEAR(self->num_evictable_blocks);
    Py_CLEAR(self->num_reclaimable_pages);
    Py_CLEAR(self->tracks_evictable);
    Py_CLEAR(self->refused_by_device);
    return 0;
}

static void
BlockCore_dealloc(BlockCore *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    BlockCore_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef BlockCore_methods[] = {
    {"alloc", (PyCFunction)BlockCore_alloc, METH_O,
     "n blocks, all or nothing; None when they cannot all be had now."},
    {"free", (PyCFunction)BlockCore_free, METH_O,
     "Give blocks back; a page that empties goes back to the PageAllocator."},
    {"mark_evictable", (PyCFunction)BlockCore_mark_evictable, METH_O,
     "These allocated blocks are now held by the cache alone (O(1) each)."},
    {"unmark_evictable", (PyCFunction)BlockCore_unmark_evictable, METH_O,
     "These blocks are referenced again (or about to be reused in place)."},
    {NULL, NULL, 0, NULL},
};

#define OBJ(name, field) {name, T_OBJECT_EX, offsetof(BlockCore, field), 0, NULL}
static PyMemberDef BlockCore_members[] = {
    OBJ("guard", guard),
    OBJ("pages", pages),
    OBJ("_allocated", allocated),
    OBJ("_occupancy", occupancy),
    OBJ("_ev_on", ev_on),
    OBJ("_slots", slots),
    OBJ("_retired", retired),
    OBJ("_buckets", buckets),
    OBJ("_rbuckets", rbuckets),
    OBJ("_pos", pos),
    OBJ("blocks_per_page", blocks_per_page),
    OBJ("num_blocks", num_blocks),
    OBJ("num_allocated_blocks", num_allocated_blocks),
    OBJ("num_retired_blocks", num_retired_blocks),
    OBJ("_partial_free", partial_free),
    OBJ("_top", top),
    OBJ("_rtop", rtop),
    OBJ("changes", changes),
    OBJ("num_evictable_blocks", num_evictable_blocks),
    OBJ("num_reclaimable_pages", num_reclaimable_pages),
    OBJ("tracks_evictable", tracks_evictable),
    OBJ("refused_by_device", refused_by_device),
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot BlockCore_slots[] = {
    {Py_tp_doc, "The C hot paths of allocator.BlockAllocator (see allocator/_speedups.c)."},
    {Py_tp_methods, BlockCore_methods},
    {Py_tp_members, BlockCore_members},
    {Py_tp_traverse, BlockCore_traverse},
    {Py_tp_clear, BlockCore_clear},
    {Py_tp_dealloc, BlockCore_dealloc},
    {0, NULL},
};

static PyType_Spec BlockCore_spec = {
    .name = "allocator._speedups.BlockCore",
    .basicsize = sizeof(BlockCore),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = BlockCore_slots,
};

/* ------------------------------------------------------------------ module */
static PyObject *
configure(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *contract, *base;
    if (!PyArg_ParseTuple(args, "OO:configure", &contract, &base))
        return NULL;
    Py_INCREF(contract);
    Py_INCREF(base);
    Py_XSETREF(ContractError, contract);
    Py_XSETREF(BaseError, base);
    Py_RETURN_NONE;
}

/* The host backend's per-page calls (allocator/_libc.py): ctypes spends thousands of
 * instructions converting arguments per call, a map or unmap makes two per region. */
static PyObject *
sys_mprotect(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "mprotect(addr, length, prot) takes 3 arguments");
        return NULL;
    }
    unsigned long long addr = PyLong_AsUnsignedLongLong(args[0]);
    if (addr == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    size_t length = PyLong_AsSize_t(args[1]);
    if (length == (size_t)-1 && PyErr_Occurred())
        return NULL;
    long prot = PyLong_AsLong(args[2]);
    if (prot == -1 && PyErr_Occurred())
        return NULL;
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = mprotect((void *)(uintptr_t)addr, length, (int)prot);
    if (rc != 0)
        err = errno;
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyObject *
sys_fallocate(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "fallocate(fd, mode, offset, length) takes 4 arguments");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    long mode = PyLong_AsLong(args[1]);
    if (mode == -1 && PyErr_Occurred())
        return NULL;
    long long offset = PyLong_AsLongLong(args[2]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    long long length = PyLong_AsLongLong(args[3]);
    if (length == -1 && PyErr_Occurred())
        return NULL;
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = fallocate((int)fd, (int)mode, (off_t)offset, (off_t)length);
    if (rc != 0)
        err = errno;
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyMethodDef module_methods[] = {
    {"mprotect", (PyCFunction)(void (*)(void))sys_mprotect, METH_FASTCALL,
     "mprotect(addr, length, prot) -> 0, or the errno of the failure."},
    {"fallocate", (PyCFunction)(void (*)(void))sys_fallocate, METH_FASTCALL,
     "fallocate(fd, mode, offset, length) -> 0, or the errno of the failure."},
    {"configure", configure, METH_VARARGS,
     "configure(AllocatorContractError, AllocatorError): the errors the hot paths raise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "allocator._speedups",
    .m_doc = "The per-block hot paths of allocator.BlockAllocator, in C.",
    .m_size = -1,
    .m_methods = module_methods,
};

#define INTERN(var, text)                                                                  \
    do {                                                                                   \
        var = PyUnicode_InternFromString(text);                                            \
        if (var == NULL)                                                                   \
            return NULL;                                                                   \
    } while (0)

PyMODINIT_FUNC
PyInit__speedups(void)
{
    INTERN(s_enabled, "enabled");
    INTERN(s_check, "check");
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
    INTERN(s_refused_by_device, "refused_by_device");
    INTERN(s_free_checked, "_free_checked");
    INTERN(s_untrack_freed, "_untrack_freed");
    INTERN(s_num_free_blocks, "num_free_blocks");
    INTERN(s_roll_back, "_roll_back");
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    PyObject *type = PyType_FromSpec(&BlockCore_spec);
    if (type == NULL || PyModule_AddObject(module, "BlockCore", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
