/* engine_ext.vllm._block_speedups: ElasticBlockPool's per-block loops, in C.
 *
 * vLLM's KVCacheBlock is a dataclass with __slots__; BlockFields(cls) finds the
 * slot offsets of the seven fields the loops read (block_id, ref_cnt, pool,
 * _block_hash, is_null, prev_free_block, next_free_block), as CPython's own
 * LOAD_ATTR specialisation does, and refuses a class whose fields are not plain
 * object slots. Its methods do what the pure-Python loops of
 * engine_ext/vllm/_block_pool.py (and vLLM's FreeKVCacheBlockQueue) do, for
 * blocks of exactly that class:
 *
 *   take(all_blocks, ids)      the fresh blocks of get_new_blocks: all_blocks[i]
 *                              for i in ids, each checked free (ref_cnt 0, no
 *                              hash) and given ref_cnt 1; on a failed check
 *                              (AssertionError) nothing is changed;
 *   split_freed(blocks, pool)  free_blocks' partition: per block, skip the null
 *                              block, set aside blocks of another pool, take one
 *                              reference off, and sort the blocks that reach 0
 *                              into (ids to free, blocks to cache, their ids).
 *   append_n(queue, blocks)    FreeKVCacheBlockQueue.append_n: link the blocks in
 *                              at the tail; False (nothing changed) if a block is
 *                              of another class;
 *   popleft_n(queue, n, hold)  FreeKVCacheBlockQueue.popleft_n, and the blocks' ids:
 *                              (blocks, ids); with hold, each block is checked free
 *                              (ref_cnt 0) and given ref_cnt 1, as get_new_blocks does;
 *   touch(queue, blocks)       BlockPool.touch without a metrics collector: a
 *                              reference more on each block, a block held by the
 *                              cache alone (ref_cnt 0) unlinked from the queue;
 *                              returns the unlinked blocks' ids, or None (nothing
 *                              changed) if a block is of another class.
 *
 * The queue's own fields (num_free_blocks, fake_free_list_head/_tail) are read and
 * written as attributes; its links are the blocks' slots, as vLLM's Python does.
 * A block of another class makes split_freed change nothing and return the
 * blocks as a list (the caller runs its Python loop over it); take raises.
 * The pool's tests run the same random traffic through both and compare.
 *
 * RunningAllocate(original, pool_class, running, otherwise, refusal, ...) is the
 * replacement of KVCacheManager.allocate_slots (engine_ext/vllm/_runtime.py,
 * allocate_slots_patch): a method whose common call, a RUNNING request extending
 * while the pool's overdraft flag is up, goes straight to vLLM's original with
 * the caller's arguments as they are, a refusal (DeviceFullError) becoming None;
 * every other call goes to ``otherwise`` (the Python replacement) unchanged. It
 * binds as a function does (a method descriptor), so vLLM's
 * ``self.kv_cache_manager.allocate_slots(...)`` costs no Python frame of ours.
 *
 * StepHook(original, globals, kind) replaces Scheduler.schedule ("schedule") and
 * Scheduler.update_from_output ("update_from_output") (schedule_patch and
 * update_from_output_patch in engine_ext/vllm/_runtime.py): vLLM's method between the
 * runtime's two hooks (begin_schedule/end_schedule, begin_update/end_update), the
 * runtime read from ``globals["_runtime"]`` at each call, as the Python replacements
 * do. When a hook has nothing to do but set a flag (its gate holds), the flag is set
 * here and the Python method is not called; otherwise it is, with the same arguments.
 * The gate's fields are slots of StepState, VllmRuntime's base class, so reading them
 * costs no attribute lookup. The end hook runs as a ``finally`` block does.
 *
 * HitWindow(size) is engine_ext._hit_window.PrefixHitWindow with its ring in C: the
 * runtime's prefix-hit window, which the plain admission records into without a
 * Python frame. RunningAllocate's last argument, (Request, name), lets the admission
 * read request.num_tokens as len(request.<name>) where the caller checked that the
 * property is exactly that (engine_ext/vllm/_runtime.py, num_tokens_list).
 *
 * Only CPython's public API (3.11: the member descriptor's offset).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    PyTypeObject *cls;
    Py_ssize_t off_block_id, off_ref_cnt, off_pool, off_block_hash, off_is_null, off_prev,
        off_next;
} BlockFields;

#define NUM_FIELDS 7
static PyObject *s_fields[NUM_FIELDS]; /* the field names, interned */
static PyObject *s_num_free, *s_head, *s_tail; /* FreeKVCacheBlockQueue's attributes */
static PyObject *one, *zero; /* the ints 1 and 0 */
static const char *const field_names[NUM_FIELDS] = {
    "block_id", "ref_cnt", "pool", "_block_hash", "is_null", "prev_free_block",
    "next_free_block"};

static Py_ssize_t
slot_offset(PyTypeObject *cls, PyObject *name)
{
    PyObject *descr = PyObject_GetAttr((PyObject *)cls, name); /* a slot: its descriptor */
    if (descr == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s has no slot %R: vLLM's KVCacheBlock changed",
                     cls->tp_name, name);
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
        ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX)
        offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    else
        PyErr_Format(PyExc_TypeError, "%s.%U is not a plain slot: vLLM's KVCacheBlock changed",
                     cls->tp_name, name);
    Py_DECREF(descr);
    return offset;
}

static PyObject *
BlockFields_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *cls;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "BlockFields(cls) takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!:BlockFields", &PyType_Type, &cls))
        return NULL;
    Py_ssize_t offs[NUM_FIELDS];
    for (int i = 0; i < NUM_FIELDS; i++) {
        offs[i] = slot_offset((PyTypeObject *)cls, s_fields[i]);
        if (offs[i] < 0)
            return NULL;
    }
    BlockFields *self = (BlockFields *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->cls = (PyTypeObject *)Py_NewRef(cls);
    self->off_block_id = offs[0];
    self->off_ref_cnt = offs[1];
    self->off_pool = offs[2];
    self->off_block_hash = offs[3];
    self->off_is_null = offs[4];
    self->off_prev = offs[5];
    self->off_next = offs[6];
    return (PyObject *)self;
}

static int
BlockFields_traverse(BlockFields *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cls);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
BlockFields_clear(BlockFields *self)
{
    Py_CLEAR(self->cls);
    return 0;
}

/* The dealloc of every type here (heap types with GC): untrack, clear the references
 * with the type's own clear, free, and drop the instance's reference to its type. */
static void
gc_dealloc(PyObject *self, inquiry clear)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* __name__ of a replacement: its original's. */
static PyObject *
name_of(PyObject *original)
{
    return PyObject_GetAttrString(original, "__name__");
}

static void
BlockFields_dealloc(BlockFields *self)
{
    gc_dealloc((PyObject *)self, (inquiry)BlockFields_clear);
}

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* The slot's value (borrowed), or NULL with AttributeError as Python would raise. */
static inline PyObject *
read_slot(PyObject *o, Py_ssize_t off, int field)
{
    PyObject *v = SLOT(o, off);
    if (v == NULL)
        PyErr_Format(PyExc_AttributeError, "'%s' object has no attribute '%U'",
                     Py_TYPE(o)->tp_name, s_fields[field]);
    return v;
}

static PyObject *
BlockFields_take(BlockFields *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "take(all_blocks: list, ids: list[int])");
        return NULL;
    }
    PyObject *all = args[0], *ids = args[1];
    Py_ssize_t n = PyList_GET_SIZE(ids), size = PyList_GET_SIZE(all);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    /* check and take each block; a failed check puts the ones taken back (ref_cnt 0,
     * as checked): nothing changed. A repeated id fails its second check. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyList_GET_ITEM(ids, i);
        Py_ssize_t k = PyLong_CheckExact(id) ? PyLong_AsSsize_t(id) : -1;
        if (k < 0 || k >= size) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_IndexError, "take(): %R is not a block id in 0..%zd", id,
                             size - 1);
            }
            goto undo;
        }
        PyObject *block = PyList_GET_ITEM(all, k);
        if (!Py_IS_TYPE(block, self->cls)) {
            PyErr_Format(PyExc_TypeError, "take(): block %zd is a %s, not a %s", k,
                         Py_TYPE(block)->tp_name, self->cls->tp_name);
            goto undo;
        }
        PyObject *ref = read_slot(block, self->off_ref_cnt, 1);
        if (ref == NULL)
            goto undo;
        PyObject *hash = read_slot(block, self->off_block_hash, 3);
        if (hash == NULL)
            goto undo;
        if (!PyLong_CheckExact(ref) || PyLong_AsSsize_t(ref) != 0 || hash != Py_None) {
            PyErr_Clear();
            PyErr_Format(PyExc_AssertionError,
                         "block %zd handed out while in use or cached (ref_cnt %R, hash %R)",
                         k, ref, hash);
            goto undo;
        }
        Py_XSETREF(SLOT(block, self->off_ref_cnt), Py_NewRef(one));
        PyList_SET_ITEM(out, i, Py_NewRef(block));
    }
    return out;
undo:
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *block = PyList_GET_ITEM(out, j);
        if (block == NULL)
            break;
        Py_XSETREF(SLOT(block, self->off_ref_cnt), Py_NewRef(zero));
    }
    Py_DECREF(out); /* the NULL items left by PyList_New are skipped by its dealloc */
    return NULL;
}

static int
all_of_class(BlockFields *self, PyObject **items, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (!Py_IS_TYPE(items[i], self->cls))
            return 0;
    return 1;
}

/* arg as a fast sequence (a new reference in *seq): 1 if every item is a block of cls,
 * 0 if one is not (the caller's Python loop then runs), -1 with an exception set. */
static int
fast_blocks(BlockFields *self, PyObject *arg, const char *what, PyObject **seq)
{
    *seq = PySequence_Fast(arg, what);
    if (*seq == NULL)
        return -1;
    return all_of_class(self, PySequence_Fast_ITEMS(*seq), PySequence_Fast_GET_SIZE(*seq));
}

/* Whether a block is vLLM's null block: 1, 0, or -1 with an exception set. */
static int
null_block(BlockFields *self, PyObject *block)
{
    PyObject *v = read_slot(block, self->off_is_null, 4);
    if (v == NULL)
        return -1;
    return v == Py_True ? 1 : v == Py_False ? 0 : PyObject_IsTrue(v);
}

/* A new list of the n items of items[] (new references). */
static PyObject *
list_of(PyObject **items, Py_ssize_t n)
{
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(list, i, Py_NewRef(items[i]));
    return list;
}

static PyObject *
BlockFields_split_freed(BlockFields *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "split_freed(blocks, pool)");
        return NULL;
    }
    PyObject *pool = args[1], *seq;
    int ours = fast_blocks(self, args[0], "free_blocks(): blocks must be iterable", &seq);
    if (ours < 0)
        return NULL;
    if (!ours) { /* the Python loop handles it: no change */
        PyObject *list = PySequence_List(seq);
        Py_DECREF(seq);
        return list;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    /* the three partitions as borrowed pointers first (each at most n long), then lists
     * of their exact sizes: no append per block */
    PyObject **buf = PyMem_Malloc((size_t)(3 * (n ? n : 1)) * sizeof(PyObject *));
    PyObject *others = PyList_New(0), *result = NULL;
    PyObject *to_free = NULL, *to_cache = NULL, *cache_ids = NULL;
    if (buf == NULL || others == NULL) {
        if (buf == NULL)
            PyErr_NoMemory();
        goto done;
    }
    PyObject **free_ids = buf, **cached = buf + n, **cached_ids = buf + 2 * n;
    Py_ssize_t num_free = 0, num_cached = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = items[i];
        int is_null = null_block(self, block);
        if (is_null < 0)
            goto done;
        if (is_null)
            continue;
        PyObject *v = read_slot(block, self->off_pool, 2);
        if (v == NULL)
            goto done;
        if (v != Py_None && v != pool) {
            if (PyList_Append(others, block) < 0)
                goto done;
            continue;
        }
        PyObject *ref = read_slot(block, self->off_ref_cnt, 1);
        if (ref == NULL)
            goto done;
        PyObject *less;
        int held;
        if (PyLong_CheckExact(ref)) {
            Py_ssize_t count = PyLong_AsSsize_t(ref);
            less = count == -1 && PyErr_Occurred() ? NULL : PyLong_FromSsize_t(count - 1);
            held = count != 1;
        }
        else {
            less = PyNumber_Subtract(ref, one);
            held = less == NULL ? 0 : PyObject_IsTrue(less);
        }
        if (less == NULL)
            goto done;
        Py_XSETREF(SLOT(block, self->off_ref_cnt), less);
        if (held < 0)
            goto done;
        if (held)
            continue;
        PyObject *id = read_slot(block, self->off_block_id, 0);
        PyObject *hash = id == NULL ? NULL : read_slot(block, self->off_block_hash, 3);
        if (hash == NULL)
            goto done;
        if (hash == Py_None)
            free_ids[num_free++] = id;
        else {
            cached[num_cached] = block;
            cached_ids[num_cached++] = id;
        }
    }
    /* the borrowed pointers are still alive: the blocks are held by seq, their ids by
     * the blocks (nothing above replaced a block_id) */
    to_free = list_of(free_ids, num_free);
    to_cache = to_free == NULL ? NULL : list_of(cached, num_cached);
    cache_ids = to_cache == NULL ? NULL : list_of(cached_ids, num_cached);
    if (cache_ids != NULL)
        result = PyTuple_Pack(4, to_free, to_cache, cache_ids, others);
done:
    PyMem_Free(buf);
    Py_DECREF(seq);
    Py_XDECREF(to_free);
    Py_XDECREF(to_cache);
    Py_XDECREF(cache_ids);
    Py_XDECREF(others);
    return result;
}

/* ------------------------------------------------------------ the free block queue */
/* Store v (a new reference is taken) in a link slot. */
static inline void
set_link(PyObject *block, Py_ssize_t off, PyObject *v)
{
    Py_XSETREF(SLOT(block, off), Py_NewRef(v));
}

/* The queue's fake head or tail (a new reference), checked to be a block of cls. */
static PyObject *
queue_end(BlockFields *self, PyObject *queue, PyObject *name)
{
    PyObject *end = PyObject_GetAttr(queue, name);
    if (end != NULL && !Py_IS_TYPE(end, self->cls)) {
        PyErr_Format(PyExc_TypeError, "the queue's %U is a %s, not a %s", name,
                     Py_TYPE(end)->tp_name, self->cls->tp_name);
        Py_CLEAR(end);
    }
    return end;
}

/* The queue's num_free_blocks; -1 with an exception set on failure. */
static Py_ssize_t
queue_count(PyObject *queue)
{
    PyObject *v = PyObject_GetAttr(queue, s_num_free);
    if (v == NULL)
        return -1;
    Py_ssize_t n = PyLong_Check(v) ? PyLong_AsSsize_t(v) : -1;
    Py_DECREF(v);
    if (n < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "the queue's num_free_blocks is not an int >= 0");
    return n;
}

static int
queue_set_count(PyObject *queue, Py_ssize_t n)
{
    PyObject *v = PyLong_FromSsize_t(n);
    if (v == NULL)
        return -1;
    int rc = PyObject_SetAttr(queue, s_num_free, v);
    Py_DECREF(v);
    return rc;
}

static PyObject *
BlockFields_append_n(BlockFields *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "append_n(queue, blocks: list)");
        return NULL;
    }
    PyObject *queue = args[0], *blocks = args[1];
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    if (n == 0)
        Py_RETURN_TRUE;
    if (!all_of_class(self, PySequence_Fast_ITEMS(blocks), n))
        Py_RETURN_FALSE; /* the caller runs vLLM's Python */
    Py_ssize_t count = queue_count(queue);
    if (count < 0)
        return NULL;
    PyObject *tail = queue_end(self, queue, s_tail);
    if (tail == NULL)
        return NULL;
    PyObject *last = SLOT(tail, self->off_prev); /* borrowed: linked until replaced below */
    if (last == NULL || last == Py_None || !Py_IS_TYPE(last, self->cls)) {
        Py_DECREF(tail);
        PyErr_SetString(PyExc_AssertionError,
                        "prev_free_block of fake_free_list_tail should always exist");
        return NULL;
    }
    Py_INCREF(last);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = PyList_GET_ITEM(blocks, i);
        set_link(block, self->off_prev, last);
        set_link(last, self->off_next, block);
        Py_SETREF(last, Py_NewRef(block));
    }
    set_link(last, self->off_next, tail);
    set_link(tail, self->off_prev, last);
    Py_DECREF(last);
    Py_DECREF(tail);
    if (queue_set_count(queue, count + n) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *
BlockFields_popleft_n(BlockFields *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3 || !PyLong_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "popleft_n(queue, n: int, hold: bool = False)");
        return NULL;
    }
    PyObject *queue = args[0];
    int hold = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (hold < 0)
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t count = queue_count(queue);
    if (count < 0)
        return NULL;
    if (n < 0 || n > count) {
        PyErr_Format(PyExc_AssertionError, "popleft_n(%zd) from a queue of %zd blocks", n,
                     count);
        return NULL;
    }
    PyObject *head = queue_end(self, queue, s_head);
    if (head == NULL)
        return NULL;
    PyObject *out = PyList_New(n), *ids = PyList_New(n), *result = NULL;
    if (out == NULL || ids == NULL)
        goto done;
    /* check the n blocks first (each linked, of cls, with an id; free with hold): nothing
     * changes on a broken queue */
    PyObject *curr = SLOT(head, self->off_next);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (curr == NULL || !Py_IS_TYPE(curr, self->cls) || SLOT(curr, self->off_next) == NULL ||
            SLOT(curr, self->off_next) == Py_None || SLOT(curr, self->off_block_id) == NULL) {
            PyErr_Format(PyExc_AssertionError,
                         "popleft_n(%zd): the free block queue breaks after %zd blocks", n, i);
            goto done;
        }
        if (hold) {
            PyObject *ref = SLOT(curr, self->off_ref_cnt);
            if (ref == NULL || !PyLong_CheckExact(ref) || PyLong_AsSsize_t(ref) != 0) {
                PyErr_Clear();
                PyErr_Format(PyExc_AssertionError,
                             "popleft_n(%zd): a queued block is in use (ref_cnt %R)", n, ref);
                goto done;
            }
        }
        curr = SLOT(curr, self->off_next);
    }
    curr = Py_NewRef(SLOT(head, self->off_next));
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *next = Py_NewRef(SLOT(curr, self->off_next));
        PyList_SET_ITEM(ids, i, Py_NewRef(SLOT(curr, self->off_block_id)));
        set_link(curr, self->off_prev, Py_None);
        set_link(curr, self->off_next, Py_None);
        if (hold)
            Py_XSETREF(SLOT(curr, self->off_ref_cnt), Py_NewRef(one));
        PyList_SET_ITEM(out, i, curr); /* takes our reference */
        curr = next;
    }
    set_link(head, self->off_next, curr);
    set_link(curr, self->off_prev, head);
    Py_DECREF(curr);
    if (queue_set_count(queue, count - n) < 0)
        goto done;
    result = PyTuple_Pack(2, out, ids);
done:
    Py_DECREF(head);
    Py_XDECREF(out);
    Py_XDECREF(ids);
    return result;
}

static PyObject *
BlockFields_touch(BlockFields *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "touch(queue, blocks)");
        return NULL;
    }
    PyObject *queue = args[0], *seq;
    int ours = fast_blocks(self, args[1], "touch(): blocks must be iterable", &seq);
    if (ours < 0)
        return NULL;
    if (!ours) {
        Py_DECREF(seq);
        Py_RETURN_NONE; /* the caller runs the Python loop */
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *hit = PyList_New(0), *result = NULL;
    Py_ssize_t removed = 0;
    if (hit == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = items[i];
        int is_null = null_block(self, block);
        if (is_null < 0)
            goto done;
        if (is_null)
            continue;
        PyObject *ref = read_slot(block, self->off_ref_cnt, 1);
        if (ref == NULL)
            goto done;
        Py_ssize_t count = PyLong_CheckExact(ref) ? PyLong_AsSsize_t(ref) : -1;
        if (count < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "touch(): block ref_cnt %R", ref);
            goto done;
        }
        if (count == 0) { /* held by the cache alone: out of the queue (vLLM's remove) */
            PyObject *prev = SLOT(block, self->off_prev), *next = SLOT(block, self->off_next);
            if (prev == NULL || prev == Py_None || next == NULL || next == Py_None ||
                !Py_IS_TYPE(prev, self->cls) || !Py_IS_TYPE(next, self->cls)) {
                PyErr_Format(PyExc_RuntimeError, "remove() called on an invalid block: %R",
                             block);
                goto done;
            }
            Py_INCREF(prev);
            Py_INCREF(next);
            set_link(prev, self->off_next, next);
            set_link(next, self->off_prev, prev);
            Py_DECREF(prev);
            Py_DECREF(next);
            set_link(block, self->off_prev, Py_None);
            set_link(block, self->off_next, Py_None);
            removed += 1;
            PyObject *id = read_slot(block, self->off_block_id, 0);
            if (id == NULL || PyList_Append(hit, id) < 0) {
                Py_XSETREF(SLOT(block, self->off_ref_cnt), Py_NewRef(one));
                goto done;
            }
        }
        PyObject *more = PyLong_FromSsize_t(count + 1);
        if (more == NULL)
            goto done;
        Py_XSETREF(SLOT(block, self->off_ref_cnt), more);
    }
    result = Py_NewRef(hit);
done:
    if (removed) { /* the count follows the links, also when a later block failed */
        /* a failed block's error waits aside while the count is read and written (the
         * attribute calls must not run with an exception set, nor swallow it) */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        Py_ssize_t count = queue_count(queue);
        if (count < 0 || queue_set_count(queue, count - removed) < 0) {
            Py_CLEAR(result);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
        }
        else
            PyErr_Restore(type, value, traceback);
    }
    Py_DECREF(seq);
    Py_XDECREF(hit);
    return result;
}

static PyMethodDef BlockFields_methods[] = {
    {"take", (PyCFunction)(void (*)(void))BlockFields_take, METH_FASTCALL,
     "take(all_blocks, ids) -> [all_blocks[i] for i in ids], each checked free, ref_cnt 1."},
    {"split_freed", (PyCFunction)(void (*)(void))BlockFields_split_freed, METH_FASTCALL,
     "split_freed(blocks, pool) -> (ids to free, blocks to cache, their ids, other pools' "
     "blocks), one reference taken off each; or the blocks as a list (another class)."},
    {"append_n", (PyCFunction)(void (*)(void))BlockFields_append_n, METH_FASTCALL,
     "append_n(queue, blocks) -> True: FreeKVCacheBlockQueue.append_n; False (nothing "
     "changed) if a block is of another class."},
    {"popleft_n", (PyCFunction)(void (*)(void))BlockFields_popleft_n, METH_FASTCALL,
     "popleft_n(queue, n, hold=False) -> (blocks, ids): FreeKVCacheBlockQueue.popleft_n and "
     "the ids; with hold each block is checked free and given ref_cnt 1."},
    {"touch", (PyCFunction)(void (*)(void))BlockFields_touch, METH_FASTCALL,
     "touch(queue, blocks) -> ids unlinked from the queue: BlockPool.touch without "
     "metrics; None (nothing changed) if a block is of another class."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef BlockFields_members[] = {
    {"cls", T_OBJECT, offsetof(BlockFields, cls), READONLY, "the block class"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot BlockFields_slots[] = {
    {Py_tp_doc, "BlockFields(cls): the per-block loops of ElasticBlockPool for blocks of cls."},
    {Py_tp_new, BlockFields_new},
    {Py_tp_methods, BlockFields_methods},
    {Py_tp_members, BlockFields_members},
    {Py_tp_traverse, BlockFields_traverse},
    {Py_tp_clear, BlockFields_clear},
    {Py_tp_dealloc, BlockFields_dealloc},
    {0, NULL},
};

static PyType_Spec BlockFields_spec = {
    .name = "engine_ext.vllm._block_speedups.BlockFields",
    .basicsize = sizeof(BlockFields),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = BlockFields_slots,
};

/* -- Method shims: RunningAllocate and StepHook ------------------------------------ */

/* Both replace one of vLLM's methods and behave as a function would: called by
 * vectorcall, bound by the descriptor protocol, with __wrapped__, __name__ and a
 * __dict__ (the patch table's mark). Both start with these fields, in this order, so
 * the members, getters and GC helpers below serve either through a MethodShim. */
#define METHOD_SHIM_HEAD                                                                   \
    PyObject_HEAD                                                                          \
    vectorcallfunc vectorcall;                                                             \
    PyObject *original; /* vLLM's method */                                                \
    PyObject *dict;     /* attributes set on it, as on a function */

typedef struct {
    METHOD_SHIM_HEAD
} MethodShim;

#define METHOD_SHIM_FLAGS                                                                  \
    (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |                \
     Py_TPFLAGS_METHOD_DESCRIPTOR)

static int
shim_traverse(MethodShim *self, visitproc visit, void *arg)
{
    Py_VISIT(self->original);
    Py_VISIT(self->dict);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static void
shim_clear(MethodShim *self)
{
    Py_CLEAR(self->original);
    Py_CLEAR(self->dict);
}

static void
shim_dealloc(PyObject *self)
{
    gc_dealloc(self, Py_TYPE(self)->tp_clear);
}

/* A function's binding: looked up on an instance, a bound method; on the class, itself. */
static PyObject *
shim_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type))
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
shim_get_name(MethodShim *self, void *Py_UNUSED(closure))
{
    return name_of(self->original);
}

static PyMemberDef shim_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(MethodShim, vectorcall), READONLY},
    {"__dictoffset__", T_PYSSIZET, offsetof(MethodShim, dict), READONLY},
    {"__wrapped__", T_OBJECT, offsetof(MethodShim, original), READONLY, "vLLM's method"},
    {NULL, 0, 0, 0, NULL},
};

#define SHIM_GETSET                                                                        \
    {"__name__", (getter)shim_get_name, NULL, "the original's name", NULL},                 \
        {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL}

static PyGetSetDef shim_getset[] = {
    SHIM_GETSET,
    {NULL, NULL, NULL, NULL, NULL},
};

/* -- RunningAllocate: allocate_slots' running-request path ------------------------- */

typedef struct {
    METHOD_SHIM_HEAD      /* original: vLLM's KVCacheManager.allocate_slots */
    PyObject *pool_class; /* ElasticBlockPool */
    PyObject *running;    /* RequestStatus.RUNNING */
    PyObject *otherwise;  /* the Python replacement: admissions, other pools, no overdraft */
    PyObject *refusal;    /* DeviceFullError: the device had no page for a running request */
    PyObject *globals;    /* the runtime module's namespace (its "_runtime"), or NULL */
    /* vLLM's Request and the name of the list its num_tokens property is the length of
     * (checked by the caller against the property's code), or NULL: the admission reads
     * len() of that list, not the property (a Python frame entered from C) */
    PyObject *request_class, *token_list;
} RunningAllocate;

/* The plain admission in C (defined after StepState): sets *handled when it ran. */
static PyObject *admit_fast(RunningAllocate *self, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames, PyObject *status, int *handled);

static PyObject *s_status, *s_block_pool, *s_overdraft;

/* 1: a RUNNING request of an ElasticBlockPool's manager, overdraft up; 0: not; -1: error.
 * The same reads, in the same order, as the Python replacement's check. A request that
 * is not RUNNING hands its status to *other (a new reference; the admission reads it). */
static int
running_fast(RunningAllocate *self, PyObject *manager, PyObject *request, PyObject **other)
{
    PyObject *status = PyObject_GetAttr(request, s_status);
    if (status == NULL)
        return -1;
    if (status != self->running) {
        *other = status;
        return 0;
    }
    Py_DECREF(status);
    PyObject *pool = PyObject_GetAttr(manager, s_block_pool);
    if (pool == NULL)
        return -1;
    if ((PyObject *)Py_TYPE(pool) != self->pool_class) {
        Py_DECREF(pool);
        return 0;
    }
    PyObject *overdraft = PyObject_GetAttr(pool, s_overdraft);
    Py_DECREF(pool);
    if (overdraft == NULL)
        return -1;
    int fast = PyObject_IsTrue(overdraft);
    Py_DECREF(overdraft);
    return fast;
}

static PyObject *
RunningAllocate_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames)
{
    RunningAllocate *self = (RunningAllocate *)op;
    if (PyVectorcall_NARGS(nargsf) >= 2) {
        PyObject *status = NULL; /* set when not RUNNING */
        int fast = running_fast(self, args[0], args[1], &status);
        if (fast < 0)
            return NULL;
        if (fast) {
            PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
            if (result == NULL && PyErr_ExceptionMatches(self->refusal)) {
                PyErr_Clear(); /* as a full cache: vLLM preempts or waits */
                Py_RETURN_NONE;
            }
            return result;
        }
        if (status != NULL) { /* not RUNNING: an admission */
            int handled = 0;
            PyObject *result = self->globals == NULL
                                   ? NULL
                                   : admit_fast(self, args, nargsf, kwnames, status, &handled);
            Py_DECREF(status);
            if (handled)
                return result;
        }
    }
    return PyObject_Vectorcall(self->otherwise, args, nargsf, kwnames);
}

static PyObject *
RunningAllocate_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *original, *pool_class, *running, *otherwise, *refusal, *globals = NULL;
    PyObject *num_tokens_list = Py_None;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "RunningAllocate() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO!OOO|O!O:RunningAllocate", &original, &PyType_Type,
                          &pool_class, &running, &otherwise, &refusal, &PyDict_Type, &globals,
                          &num_tokens_list))
        return NULL;
    PyObject *request_class = NULL, *token_list = NULL;
    if (num_tokens_list != Py_None &&
        (!PyTuple_Check(num_tokens_list) || PyTuple_GET_SIZE(num_tokens_list) != 2 ||
         !PyType_Check(request_class = PyTuple_GET_ITEM(num_tokens_list, 0)) ||
         !PyUnicode_Check(token_list = PyTuple_GET_ITEM(num_tokens_list, 1)))) {
        PyErr_SetString(PyExc_TypeError,
                        "RunningAllocate: num_tokens_list must be None or (Request, name)");
        return NULL;
    }
    if (!PyCallable_Check(original) || !PyCallable_Check(otherwise)) {
        PyErr_SetString(PyExc_TypeError, "RunningAllocate: original and otherwise must be callable");
        return NULL;
    }
    if (!PyExceptionClass_Check(refusal)) {
        PyErr_SetString(PyExc_TypeError, "RunningAllocate: refusal must be an exception class");
        return NULL;
    }
    RunningAllocate *self = (RunningAllocate *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = RunningAllocate_vectorcall;
    self->original = Py_NewRef(original);
    self->pool_class = Py_NewRef(pool_class);
    self->running = Py_NewRef(running);
    self->otherwise = Py_NewRef(otherwise);
    self->refusal = Py_NewRef(refusal);
    self->globals = Py_XNewRef(globals);
    self->request_class = Py_XNewRef(request_class);
    self->token_list = Py_XNewRef(token_list);
    return (PyObject *)self;
}

static int
RunningAllocate_traverse(RunningAllocate *self, visitproc visit, void *arg)
{
    Py_VISIT(self->pool_class);
    Py_VISIT(self->running);
    Py_VISIT(self->otherwise);
    Py_VISIT(self->refusal);
    Py_VISIT(self->globals);
    Py_VISIT(self->request_class);
    Py_VISIT(self->token_list);
    return shim_traverse((MethodShim *)self, visit, arg);
}

static int
RunningAllocate_clear(RunningAllocate *self)
{
    shim_clear((MethodShim *)self);
    Py_CLEAR(self->pool_class);
    Py_CLEAR(self->running);
    Py_CLEAR(self->otherwise);
    Py_CLEAR(self->refusal);
    Py_CLEAR(self->globals);
    Py_CLEAR(self->request_class);
    Py_CLEAR(self->token_list);
    return 0;
}

static PyObject *
RunningAllocate_get_otherwise(RunningAllocate *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->otherwise != NULL ? self->otherwise : Py_None);
}

static PyGetSetDef RunningAllocate_getset[] = {
    SHIM_GETSET,
    {"otherwise", (getter)RunningAllocate_get_otherwise, NULL,
     "the Python replacement every other call goes to", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot RunningAllocate_slots[] = {
    {Py_tp_doc, "RunningAllocate(original, pool_class, running, otherwise, refusal"
                "[, globals[, num_tokens_list]]): "
                "KVCacheManager.allocate_slots with its running-request path in C."},
    {Py_tp_new, RunningAllocate_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, shim_get},
    {Py_tp_members, shim_members},
    {Py_tp_getset, RunningAllocate_getset},
    {Py_tp_traverse, RunningAllocate_traverse},
    {Py_tp_clear, RunningAllocate_clear},
    {Py_tp_dealloc, shim_dealloc},
    {0, NULL},
};

static PyType_Spec RunningAllocate_spec = {
    .name = "engine_ext.vllm._block_speedups.RunningAllocate",
    .basicsize = sizeof(RunningAllocate),
    .flags = METHOD_SHIM_FLAGS,
    .slots = RunningAllocate_slots,
};

/* -- StepState and StepHook: schedule()'s and update_from_output()'s brackets ------ */

/* The runtime's fields the brackets read at every step, as object slots of a base class
 * (VllmRuntime extends it; Python reads and writes them as plain attributes). */
typedef struct {
    PyObject_HEAD
    PyObject *pool;             /* ElasticBlockPool, or None before build_backing */
    PyObject *blocks;           /* its BlockAllocator */
    PyObject *pages;            /* ... and that one's PageAllocator */
    PyObject *scheduler;        /* vLLM's Scheduler, seen at the first schedule() */
    PyObject *fence;            /* allocator.UnmapFence, None on CPU */
    PyObject *reservation;      /* OutputReservation, or None */
    PyObject *woken;            /* the safe points' gate (VllmRuntime.end_schedule) */
    PyObject *steady;
    PyObject *seen_mapped;
    PyObject *seen_device_full;
    PyObject *seen_refused;
    PyObject *seen_device_refused;
    PyObject *refresh_due;
    PyObject *demand_events;
    PyObject *refused_blocks;
    PyObject *device_refused;
    PyObject *in_update;
    PyObject *freed_in_update;
    PyObject *hits;             /* the prefix-hit window (a HitWindow where built) */
} StepState;

#define STATE_FIELD(name, field, doc) \
    {name, T_OBJECT_EX, offsetof(StepState, field), 0, doc}

static PyMemberDef StepState_members[] = {
    STATE_FIELD("pool", pool, "the ElasticBlockPool"),
    STATE_FIELD("_blocks", blocks, "the pool's BlockAllocator"),
    STATE_FIELD("_pages", pages, "the BlockAllocator's PageAllocator"),
    STATE_FIELD("_scheduler", scheduler, "vLLM's Scheduler"),
    STATE_FIELD("_fence", fence, "the unmap fence (None on CPU)"),
    STATE_FIELD("_reservation", reservation, "the output reservation, or None"),
    STATE_FIELD("_woken", woken, "wake() since the last safe point"),
    STATE_FIELD("_steady", steady, "status settled: a safe point may be skipped"),
    STATE_FIELD("_seen_mapped", seen_mapped, "num_mapped at the last safe point"),
    STATE_FIELD("_seen_device_full", seen_device_full, "device_full, the same"),
    STATE_FIELD("_seen_refused", seen_refused, "an admission was refused, the same"),
    STATE_FIELD("_seen_device_refused", seen_device_refused, "_device_refused, the same"),
    STATE_FIELD("_refresh_due", refresh_due, "monotonic time of the next forced refresh"),
    STATE_FIELD("_demand_events", demand_events, "hooked events that moved the demand"),
    STATE_FIELD("_refused_blocks", refused_blocks, "blocks the refused admissions need"),
    STATE_FIELD("_device_refused", device_refused, "refused because the device is full"),
    STATE_FIELD("_in_update", in_update, "inside update_from_output"),
    STATE_FIELD("_freed_in_update", freed_in_update, "the pool freed blocks there"),
    STATE_FIELD("_hits", hits, "the prefix-hit window the admissions feed"),
    {NULL, 0, 0, 0, NULL},
};

#define STATE_EACH(X)                                                                  \
    X(pool) X(blocks) X(pages) X(scheduler) X(fence) X(reservation) X(woken) X(steady) \
    X(seen_mapped) X(seen_device_full) X(seen_refused) X(seen_device_refused)           \
    X(refresh_due) X(demand_events) X(refused_blocks)                                   \
    X(device_refused) X(in_update) X(freed_in_update) X(hits)

static int
StepState_traverse(StepState *self, visitproc visit, void *arg)
{
#define VISIT(f) Py_VISIT(self->f);
    STATE_EACH(VISIT)
#undef VISIT
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
StepState_clear(StepState *self)
{
#define CLEAR(f) Py_CLEAR(self->f);
    STATE_EACH(CLEAR)
#undef CLEAR
    return 0;
}

static void
StepState_dealloc(StepState *self)
{
    gc_dealloc((PyObject *)self, (inquiry)StepState_clear);
}

static PyType_Slot StepState_slots[] = {
    {Py_tp_doc, "StepState: the fields StepHook reads at every scheduler step, as slots."},
    {Py_tp_members, StepState_members},
    {Py_tp_traverse, StepState_traverse},
    {Py_tp_clear, StepState_clear},
    {Py_tp_dealloc, StepState_dealloc},
    {0, NULL},
};

static PyType_Spec StepState_spec = {
    .name = "engine_ext.vllm._block_speedups.StepState",
    .basicsize = sizeof(StepState),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = StepState_slots,
};

static PyTypeObject *StepState_type;
static PyObject *s_runtime, *s_begin_schedule, *s_end_schedule, *s_begin_update, *s_end_update;
static PyObject *s_in_schedule, *s_cleanup_due, *s_num_mapped, *s_device_full_at;
static PyObject *s_reserve_pages;

enum { HOOK_SCHEDULE = 0, HOOK_UPDATE = 1 };

typedef struct {
    METHOD_SHIM_HEAD   /* original: vLLM's Scheduler.schedule or Scheduler.update_from_output */
    PyObject *globals; /* the runtime module's namespace: its "_runtime", read at each call */
    int kind;          /* HOOK_SCHEDULE or HOOK_UPDATE */
} StepHook;

/* 1: the attribute is true; 0: false; -1: error. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* 1: obj.name == value; 0: not; -1: error. */
static int
attr_equals(PyObject *obj, PyObject *name, PyObject *value)
{
    PyObject *got = PyObject_GetAttr(obj, name);
    if (got == NULL)
        return -1;
    int equal = PyObject_RichCompareBool(got, value, Py_EQ);
    Py_DECREF(got);
    return equal;
}

/* A slot is unset (NULL) only while VllmRuntime.__init__ runs: the Python path then. */
#define SET(f) (self->f != NULL)

/* begin_schedule with nothing to do but raise the pool's two flags: 1 (done), 0 (the
 * Python method must run), -1 (error). The same tests as begin_schedule's branches. */
static int
begin_schedule_fast(StepState *self, PyObject *scheduler)
{
    if (!(SET(pool) && SET(scheduler) && SET(woken) && SET(steady) && SET(refused_blocks) &&
          SET(device_refused) && SET(reservation)))
        return 0;
    if (self->pool == Py_None || self->scheduler != scheduler || self->woken != Py_False ||
        self->steady != Py_True || self->reservation != Py_None ||
        self->device_refused != Py_False)
        return 0;
    int truth = PyObject_IsTrue(self->refused_blocks);
    if (truth != 0)
        return truth < 0 ? -1 : 0;
    truth = attr_true(self->pool, s_cleanup_due);
    if (truth != 0)
        return truth < 0 ? -1 : 0;
    if (PyObject_SetAttr(self->pool, s_in_schedule, Py_True) < 0 ||
        PyObject_SetAttr(self->pool, s_overdraft, Py_True) < 0)
        return -1;
    return 1;
}

/* end_schedule when its gate holds (no figure that must be exact at every step moved,
 * the last refresh is recent): lower the pool's flags and return 1; 0: the Python
 * method must run; -1: error. */
static int
end_schedule_fast(StepState *self)
{
    if (!(SET(pool) && SET(pages) && SET(woken) && SET(steady) && SET(seen_mapped) &&
          SET(seen_device_full) && SET(refused_blocks) && SET(device_refused) &&
          SET(seen_refused) && SET(seen_device_refused) && SET(refresh_due)))
        return 0;
    if (self->pool == Py_None)
        return 0;
    if (PyObject_SetAttr(self->pool, s_in_schedule, Py_False) < 0 ||
        PyObject_SetAttr(self->pool, s_overdraft, Py_False) < 0)
        return -1;
    if (self->steady != Py_True || self->woken != Py_False ||
        self->seen_device_full != Py_False || !PyFloat_CheckExact(self->refresh_due))
        return 0;
    if (self->device_refused != self->seen_device_refused)
        return 0;
    int ok = PyObject_IsTrue(self->refused_blocks); /* a refusal began or ended */
    if (ok < 0)
        return -1;
    if (ok != (self->seen_refused == Py_True))
        return 0;
    ok = attr_true(self->pool, s_cleanup_due);
    if (ok != 0)
        return ok < 0 ? -1 : 0;
    ok = attr_equals(self->pages, s_num_mapped, self->seen_mapped);
    if (ok <= 0)
        return ok;
    /* device_full is False while no device OOM is on record; otherwise Python decides */
    PyObject *full_at = PyObject_GetAttr(self->pages, s_device_full_at);
    if (full_at == NULL)
        return -1;
    ok = full_at == Py_None;
    Py_DECREF(full_at);
    if (!ok)
        return 0;
    ok = attr_true(self->pages, s_reserve_pages); /* a reserve: the pass may refill it */
    if (ok != 0)
        return ok < 0 ? -1 : 0;
    struct timespec now; /* time.monotonic()'s clock */
    if (clock_gettime(CLOCK_MONOTONIC, &now) != 0)
        return 0;
    double t = (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
    return t < PyFloat_AS_DOUBLE(self->refresh_due);
}

#undef SET

/* The runtime's method ``name`` called as a ``finally`` block runs: with the pending
 * exception set aside, then raised again; an exception of the method's own replaces it,
 * with the first as its __context__. Returns NULL (an exception is always set). */
static PyObject *
call_finally(PyObject *runtime, PyObject *name)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *result = PyObject_CallMethodNoArgs(runtime, name);
    if (result != NULL) {
        Py_DECREF(result);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *type2, *value2, *tb2;
    PyErr_Fetch(&type2, &value2, &tb2);
    PyErr_NormalizeException(&type2, &value2, &tb2);
    if (value2 != NULL && value != NULL && value2 != value)
        PyException_SetContext(value2, value); /* steals the reference */
    else
        Py_XDECREF(value);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyErr_Restore(type2, value2, tb2);
    return NULL;
}

/* A fast check that failed (an attribute missing or of another kind) decides nothing:
 * the Python method runs and meets the same error, or not, as it reads in its own
 * order. Only an Exception is set aside (KeyboardInterrupt and the like propagate). */
static int
or_python(int fast)
{
    if (fast >= 0)
        return fast;
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyErr_Clear();
    return 0;
}

static PyObject *
call_method(PyObject *runtime, PyObject *name, PyObject *arg)
{
    return arg == NULL ? PyObject_CallMethodNoArgs(runtime, name)
                       : PyObject_CallMethodOneArg(runtime, name, arg);
}

static PyObject *
schedule_bracket(StepHook *hook, PyObject *runtime, PyObject *const *args, size_t nargsf,
                 PyObject *kwnames)
{
    StepState *state = PyObject_TypeCheck(runtime, StepState_type) ? (StepState *)runtime : NULL;
    int fast = state != NULL ? or_python(begin_schedule_fast(state, args[0])) : 0;
    if (fast < 0)
        return NULL;
    if (!fast) {
        PyObject *done = call_method(runtime, s_begin_schedule, args[0]);
        if (done == NULL)
            return NULL;
        Py_DECREF(done);
    }
    PyObject *result = PyObject_Vectorcall(hook->original, args, nargsf, kwnames);
    if (result == NULL)
        return call_finally(runtime, s_end_schedule);
    fast = state != NULL ? or_python(end_schedule_fast(state)) : 0;
    if (!fast) {
        PyObject *done = fast < 0 ? NULL : call_method(runtime, s_end_schedule, NULL);
        if (done == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(done);
    }
    return result;
}

static PyObject *
update_bracket(StepHook *hook, PyObject *runtime, PyObject *const *args, size_t nargsf,
               PyObject *kwnames)
{
    StepState *state = PyObject_TypeCheck(runtime, StepState_type) ? (StepState *)runtime : NULL;
    if (state != NULL && state->fence == Py_None && state->in_update != NULL) {
        Py_SETREF(state->in_update, Py_NewRef(Py_True)); /* begin_update without a fence */
    }
    else {
        PyObject *done = call_method(runtime, s_begin_update, NULL);
        if (done == NULL)
            return NULL;
        Py_DECREF(done);
    }
    PyObject *result = PyObject_Vectorcall(hook->original, args, nargsf, kwnames);
    if (result == NULL)
        return call_finally(runtime, s_end_update);
    if (state != NULL && state->freed_in_update == Py_False && state->in_update != NULL) {
        Py_SETREF(state->in_update, Py_NewRef(Py_False)); /* end_update: nothing freed */
        return result;
    }
    PyObject *done = call_method(runtime, s_end_update, NULL);
    if (done == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    Py_DECREF(done);
    return result;
}

/* -- HitWindow: the prefix-hit window in C ------------------------------------------ */

/* engine_ext._hit_window.PrefixHitWindow with its ring in C arrays, so the plain
 * admission below records into it without a Python frame (the Python class stays the
 * reference; tests/integration/vllm/test_demand_fields.py runs both over the same
 * random admissions). Counts are C long long: a token count past 2**63 raises
 * OverflowError, as no real one does. Invariants as in Python: the sums equal the
 * ring's sums, 0 <= hit <= looked_up per slot. Scheduler thread only (no lock). */
typedef struct {
    PyObject_HEAD
    Py_ssize_t size;
    Py_ssize_t next;         /* the slot the next admission overwrites */
    long long hit, looked_up; /* the ring's sums */
    long long changes;       /* admissions recorded so far */
    long long *hit_ring, *looked_up_ring;
} HitWindow;

static PyTypeObject *HitWindow_type;

/* One admission (PrefixHitWindow.record): hit outside 0..looked_up is clamped; nothing
 * looked up is no information. */
static void
hit_window_add(HitWindow *self, long long hit, long long looked_up)
{
    if (looked_up <= 0)
        return;
    if (hit < 0)
        hit = 0;
    else if (hit > looked_up)
        hit = looked_up;
    Py_ssize_t i = self->next;
    self->hit += hit - self->hit_ring[i];
    self->looked_up += looked_up - self->looked_up_ring[i];
    self->hit_ring[i] = hit;
    self->looked_up_ring[i] = looked_up;
    self->next = i + 1 == self->size ? 0 : i + 1;
    self->changes++;
}

static int
HitWindow_init(HitWindow *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"size", NULL};
    Py_ssize_t size = 128; /* engine_ext._hit_window.HIT_WINDOW_ADMISSIONS */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|n:HitWindow", keywords, &size))
        return -1;
    if (size < 1) {
        PyErr_Format(PyExc_ValueError,
                     "the hit-rate window needs at least one admission, got %zd", size);
        return -1;
    }
    long long *hits = PyMem_Calloc((size_t)size, sizeof(long long));
    long long *looked = PyMem_Calloc((size_t)size, sizeof(long long));
    if (hits == NULL || looked == NULL) {
        PyMem_Free(hits);
        PyMem_Free(looked);
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(self->hit_ring); /* __init__ called again: a fresh window */
    PyMem_Free(self->looked_up_ring);
    self->hit_ring = hits;
    self->looked_up_ring = looked;
    self->size = size;
    self->next = 0;
    self->hit = self->looked_up = self->changes = 0;
    return 0;
}

/* record() with its two ints as Python objects (the method and the plain admission):
 * 0, or -1 with an error and nothing recorded. */
static int
hit_window_record(HitWindow *self, PyObject *hit_tokens, PyObject *looked_up_tokens)
{
    if (self->size < 1) {
        PyErr_SetString(PyExc_RuntimeError, "HitWindow.__init__ was not called");
        return -1;
    }
    long long hit = PyLong_AsLongLong(hit_tokens);
    if (hit == -1 && PyErr_Occurred())
        return -1;
    long long looked_up = PyLong_AsLongLong(looked_up_tokens);
    if (looked_up == -1 && PyErr_Occurred())
        return -1;
    hit_window_add(self, hit, looked_up);
    return 0;
}

static PyObject *
HitWindow_record(HitWindow *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError,
                     "record() takes 2 arguments (hit_tokens, looked_up_tokens), %zd given",
                     nargs);
        return NULL;
    }
    if (hit_window_record(self, args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
HitWindow_rate(HitWindow *self, void *closure)
{
    (void)closure;
    if (self->looked_up == 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble((double)self->hit / (double)self->looked_up);
}

static Py_ssize_t
HitWindow_len(HitWindow *self)
{
    return self->changes < self->size ? (Py_ssize_t)self->changes : self->size;
}

static void
HitWindow_dealloc(HitWindow *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyMem_Free(self->hit_ring);
    PyMem_Free(self->looked_up_ring);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef HitWindow_methods[] = {
    {"record", (PyCFunction)(void (*)(void))HitWindow_record, METH_FASTCALL,
     "record(hit_tokens, looked_up_tokens): one admission (ints; a hit count outside "
     "0..looked_up_tokens is clamped, nothing looked up is ignored)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef HitWindow_getset[] = {
    {"rate", (getter)HitWindow_rate, NULL,
     "hit tokens / looked-up tokens over the window; None before any admission", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef HitWindow_members[] = {
    {"changes", T_LONGLONG, offsetof(HitWindow, changes), READONLY,
     "admissions recorded so far: a cheap 'did the rate move' key"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot HitWindow_slots[] = {
    {Py_tp_doc, "HitWindow(size=128): engine_ext._hit_window.PrefixHitWindow in C."},
    {Py_tp_init, HitWindow_init},
    {Py_tp_methods, HitWindow_methods},
    {Py_tp_getset, HitWindow_getset},
    {Py_tp_members, HitWindow_members},
    {Py_sq_length, HitWindow_len},
    {Py_tp_dealloc, HitWindow_dealloc},
    {0, NULL},
};

static PyType_Spec HitWindow_spec = {
    .name = "engine_ext.vllm._block_speedups.HitWindow",
    .basicsize = sizeof(HitWindow),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = HitWindow_slots,
};

/* -- RunningAllocate's plain admission ---------------------------------------------- */

/* VllmRuntime.allocating for an admission with no limit and no output reservation, the
 * common one: the pool's flags for an admission around vLLM's method, a device refusal
 * as None (and the prefix hits given back), then the demand event and the hit window.
 * A refusal (None) is handed to the runtime's _refused_admission, as Python does. Runs
 * only when every read below succeeds and holds; otherwise *handled stays 0 and the
 * Python replacement runs (and meets the same error, or not, in its own order). */

static PyObject *s_target_pages, *s_request_id, *s_coordinator, *s_single_type_managers;
static PyObject *s_req_to_blocks, *s_get, *s_free, *s_num_tokens, *s_hits, *s_record;
static PyObject *s_refused_admission, *s_num_new_computed_tokens;
static PyObject *dict_get; /* dict.get, the method descriptor */

/* 1: the request holds blocks in one of the manager's groups; 0: not; -1: error. */
static int
holds_blocks(PyObject *manager, PyObject *request_id)
{
    PyObject *coordinator = PyObject_GetAttr(manager, s_coordinator);
    if (coordinator == NULL)
        return -1;
    PyObject *singles = PyObject_GetAttr(coordinator, s_single_type_managers);
    Py_DECREF(coordinator);
    if (singles == NULL)
        return -1;
    PyObject *it = PyObject_GetIter(singles);
    Py_DECREF(singles);
    if (it == NULL)
        return -1;
    int held = 0;
    PyObject *single;
    while (!held && (single = PyIter_Next(it)) != NULL) {
        PyObject *table = PyObject_GetAttr(single, s_req_to_blocks);
        Py_DECREF(single);
        if (table == NULL) {
            held = -1;
            break;
        }
        PyObject *blocks;
        /* a dict whose get() is dict's own (vLLM's defaultdict): the lookup get() does */
        if (PyDict_Check(table) && _PyType_Lookup(Py_TYPE(table), s_get) == dict_get) {
            blocks = PyDict_GetItemWithError(table, request_id); /* borrowed */
            held = blocks != NULL ? PyObject_IsTrue(blocks) : PyErr_Occurred() ? -1 : 0;
            Py_DECREF(table);
            continue;
        }
        blocks = PyObject_CallMethodOneArg(table, s_get, request_id);
        Py_DECREF(table);
        if (blocks == NULL) {
            held = -1;
            break;
        }
        held = PyObject_IsTrue(blocks);
        Py_DECREF(blocks);
    }
    Py_DECREF(it);
    if (held == 0 && PyErr_Occurred())
        return -1;
    return held;
}

/* allocate_slots' num_new_computed_tokens as the caller passed it (0 when absent). */
static PyObject *
hit_tokens(PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs > 3)
        return PyNumber_Long(args[3]);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        int same = PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), s_num_new_computed_tokens);
        if (same == 0)
            return PyNumber_Long(args[nargs + i]);
        if (same == -1 && PyErr_Occurred())
            return NULL;
    }
    return Py_NewRef(zero);
}

/* The pool's two flags back as they were (an exception pending is kept); a NULL flag was
 * not changed and is not stored again. */
static int
put_flags_back(PyObject *pool, PyObject *in_schedule, PyObject *overdraft)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int failed = (overdraft != NULL && PyObject_SetAttr(pool, s_overdraft, overdraft) < 0) ||
                 (in_schedule != NULL && PyObject_SetAttr(pool, s_in_schedule, in_schedule) < 0);
    if (type != NULL) {
        if (failed)
            PyErr_Clear(); /* (plain attributes: never seen) the pending error is kept */
        PyErr_Restore(type, value, tb);
        return -1;
    }
    return failed ? -1 : 0;
}

/* The refusal handed to the runtime: (request, args after request, kwargs, device). */
static PyObject *
refused_admission(PyObject *runtime, PyObject *request, PyObject *const *args, size_t nargsf,
                  PyObject *kwnames, int device)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *rest = PyTuple_New(nargs - 2);
    if (rest == NULL)
        return NULL;
    for (Py_ssize_t i = 2; i < nargs; i++)
        PyTuple_SET_ITEM(rest, i - 2, Py_NewRef(args[i]));
    PyObject *kwargs = PyDict_New();
    if (kwargs == NULL) {
        Py_DECREF(rest);
        return NULL;
    }
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
            Py_DECREF(rest);
            Py_DECREF(kwargs);
            return NULL;
        }
    }
    PyObject *done = PyObject_CallMethodObjArgs(runtime, s_refused_admission, request, rest,
                                                kwargs, device ? Py_True : Py_False, NULL);
    Py_DECREF(rest);
    Py_DECREF(kwargs);
    if (done == NULL)
        return NULL;
    Py_DECREF(done);
    Py_RETURN_NONE;
}

/* runtime._hits.record(hit, num_tokens): in C for a HitWindow (no Python frame), the
 * method call for anything else (the Python PrefixHitWindow). 0, or -1 with an error. */
static int
record_hits(StepState *state, PyObject *hit, PyObject *num_tokens)
{
    PyObject *hits = state->hits;
    if (hits != NULL && Py_IS_TYPE(hits, HitWindow_type))
        return hit_window_record((HitWindow *)hits, hit, num_tokens);
    hits = PyObject_GetAttr((PyObject *)state, s_hits);
    if (hits == NULL)
        return -1;
    PyObject *done = PyObject_CallMethodObjArgs(hits, s_record, hit, num_tokens, NULL);
    Py_DECREF(hits);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

/* request.num_tokens: len() of the list the property reads, for exactly vLLM's Request
 * whose property was checked to be that (see RunningAllocate's num_tokens_list). */
static PyObject *
request_num_tokens(RunningAllocate *self, PyObject *request)
{
    if (self->token_list != NULL && Py_IS_TYPE(request, (PyTypeObject *)self->request_class)) {
        PyObject *tokens = PyObject_GetAttr(request, self->token_list);
        if (tokens == NULL)
            return NULL;
        if (PyList_CheckExact(tokens)) {
            Py_ssize_t n = PyList_GET_SIZE(tokens);
            Py_DECREF(tokens);
            return PyLong_FromSsize_t(n);
        }
        Py_DECREF(tokens); /* another container: the property, as it is */
    }
    return PyObject_GetAttr(request, s_num_tokens);
}

static PyObject *
admit_fast(RunningAllocate *self, PyObject *const *args, size_t nargsf, PyObject *kwnames,
           PyObject *status, int *handled)
{
    PyObject *manager = args[0], *request = args[1];
    PyObject *runtime = PyDict_GetItemWithError(self->globals, s_runtime); /* borrowed */
    if (runtime == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!PyObject_TypeCheck(runtime, StepState_type))
        return NULL;
    StepState *state = (StepState *)runtime;
    if (state->pool == NULL || state->pages == NULL || state->reservation != Py_None ||
        state->demand_events == NULL || !PyLong_CheckExact(state->demand_events) ||
        Py_TYPE(state->pool) != (PyTypeObject *)self->pool_class)
        return NULL;
    Py_INCREF(runtime); /* the global may be rebound during vLLM's call */
    PyObject *pool = Py_NewRef(state->pool);
    PyObject *result = NULL, *in_schedule = NULL, *overdraft = NULL, *request_id = NULL;
    /* the reads that decide (status: the caller's, not RUNNING): an Exception among them
     * leaves it to Python */
    PyObject *managers_pool = PyObject_GetAttr(manager, s_block_pool);
    PyObject *target = managers_pool == NULL ? NULL : PyObject_GetAttr(state->pages, s_target_pages);
    int plain = target != NULL && status != self->running && managers_pool == pool &&
                target == Py_None;
    Py_XDECREF(managers_pool);
    Py_XDECREF(target);
    if (plain) {
        in_schedule = PyObject_GetAttr(pool, s_in_schedule);
        overdraft = in_schedule == NULL ? NULL : PyObject_GetAttr(pool, s_overdraft);
        request_id = overdraft == NULL ? NULL : PyObject_GetAttr(request, s_request_id);
        plain = request_id != NULL;
    }
    int held = plain ? holds_blocks(manager, request_id) : 0;
    if (!plain || held < 0) {
        if (PyErr_Occurred() && or_python(-1) < 0)
            *handled = 1; /* KeyboardInterrupt and the like: not ours to set aside */
        goto done;
    }
    *handled = 1;
    /* an admission's flags: overdraft down, in_schedule up; a flag already so is neither
     * stored nor put back (two attribute stores fewer: outside schedule() overdraft is
     * down, inside it in_schedule is up) */
    PyObject *was_schedule = in_schedule == Py_True ? NULL : in_schedule;
    PyObject *was_overdraft = overdraft == Py_False ? NULL : overdraft;
    if ((was_overdraft != NULL && PyObject_SetAttr(pool, s_overdraft, Py_False) < 0) ||
        (was_schedule != NULL && PyObject_SetAttr(pool, s_in_schedule, Py_True) < 0)) {
        put_flags_back(pool, was_schedule, was_overdraft);
        goto done;
    }
    int device = 0;
    result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result == NULL && PyErr_ExceptionMatches(self->refusal)) {
        /* the device filled between the free count and the map: a refusal, with the
         * prefix hits this call touched given back when the request held nothing */
        PyErr_Clear();
        device = 1;
        if (!held) {
            PyObject *freed = PyObject_CallMethodOneArg(manager, s_free, request);
            if (freed == NULL) {
                put_flags_back(pool, was_schedule, was_overdraft);
                goto done;
            }
            Py_DECREF(freed);
        }
        result = Py_NewRef(Py_None);
    }
    if (put_flags_back(pool, was_schedule, was_overdraft) < 0) {
        Py_CLEAR(result);
        goto done;
    }
    if (result == NULL)
        goto done;
    if (result == Py_None) {
        Py_SETREF(result, refused_admission(runtime, request, args, nargsf, kwnames, device));
        goto done;
    }
    PyObject *events = PyNumber_Add(state->demand_events, one); /* the demand moved */
    if (events == NULL) {
        Py_CLEAR(result);
        goto done;
    }
    Py_SETREF(state->demand_events, events);
    PyObject *hit = hit_tokens(args, nargsf, kwnames);
    PyObject *num_tokens = hit == NULL ? NULL : request_num_tokens(self, request);
    int recorded = num_tokens != NULL && record_hits(state, hit, num_tokens) == 0;
    Py_XDECREF(hit);
    Py_XDECREF(num_tokens);
    if (!recorded)
        Py_CLEAR(result);
done:
    Py_XDECREF(in_schedule);
    Py_XDECREF(overdraft);
    Py_XDECREF(request_id);
    Py_DECREF(pool);
    Py_DECREF(runtime);
    return result;
}

static PyObject *
StepHook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    StepHook *self = (StepHook *)op;
    PyObject *runtime = PyDict_GetItemWithError(self->globals, s_runtime); /* borrowed */
    if (runtime == NULL && PyErr_Occurred())
        return NULL;
    if (runtime == NULL || runtime == Py_None || PyVectorcall_NARGS(nargsf) < 1)
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    Py_INCREF(runtime); /* the global may be rebound during the call */
    PyObject *result = self->kind == HOOK_SCHEDULE
                           ? schedule_bracket(self, runtime, args, nargsf, kwnames)
                           : update_bracket(self, runtime, args, nargsf, kwnames);
    Py_DECREF(runtime);
    return result;
}

static PyObject *
StepHook_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *original, *globals;
    const char *kind;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "StepHook() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO!s:StepHook", &original, &PyDict_Type, &globals, &kind))
        return NULL;
    if (!PyCallable_Check(original)) {
        PyErr_SetString(PyExc_TypeError, "StepHook: original must be callable");
        return NULL;
    }
    int which;
    if (strcmp(kind, "schedule") == 0)
        which = HOOK_SCHEDULE;
    else if (strcmp(kind, "update_from_output") == 0)
        which = HOOK_UPDATE;
    else {
        PyErr_Format(PyExc_ValueError,
                     "StepHook: kind must be 'schedule' or 'update_from_output', not %R",
                     PyTuple_GET_ITEM(args, 2));
        return NULL;
    }
    StepHook *self = (StepHook *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = StepHook_vectorcall;
    self->original = Py_NewRef(original);
    self->globals = Py_NewRef(globals);
    self->kind = which;
    return (PyObject *)self;
}

static int
StepHook_traverse(StepHook *self, visitproc visit, void *arg)
{
    Py_VISIT(self->globals);
    return shim_traverse((MethodShim *)self, visit, arg);
}

static int
StepHook_clear(StepHook *self)
{
    shim_clear((MethodShim *)self);
    Py_CLEAR(self->globals);
    return 0;
}

static PyType_Slot StepHook_slots[] = {
    {Py_tp_doc, "StepHook(original, globals, kind): Scheduler.schedule or "
                "update_from_output bracketed by the runtime's hooks, their no-op case in C."},
    {Py_tp_new, StepHook_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, shim_get},
    {Py_tp_members, shim_members},
    {Py_tp_getset, shim_getset},
    {Py_tp_traverse, StepHook_traverse},
    {Py_tp_clear, StepHook_clear},
    {Py_tp_dealloc, shim_dealloc},
    {0, NULL},
};

static PyType_Spec StepHook_spec = {
    .name = "engine_ext.vllm._block_speedups.StepHook",
    .basicsize = sizeof(StepHook),
    .flags = METHOD_SHIM_FLAGS,
    .slots = StepHook_slots,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "engine_ext.vllm._block_speedups",
    .m_doc = "ElasticBlockPool's per-block loops over vLLM's KVCacheBlock slots, the "
             "running-request path of the allocate_slots patch, and the scheduler step's "
             "brackets, in C.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__block_speedups(void)
{
    for (int i = 0; i < NUM_FIELDS; i++) {
        s_fields[i] = PyUnicode_InternFromString(field_names[i]);
        if (s_fields[i] == NULL)
            return NULL;
    }
    s_num_free = PyUnicode_InternFromString("num_free_blocks");
    s_head = PyUnicode_InternFromString("fake_free_list_head");
    s_tail = PyUnicode_InternFromString("fake_free_list_tail");
    s_status = PyUnicode_InternFromString("status");
    s_block_pool = PyUnicode_InternFromString("block_pool");
    s_overdraft = PyUnicode_InternFromString("overdraft");
    if (s_num_free == NULL || s_head == NULL || s_tail == NULL || s_status == NULL ||
        s_block_pool == NULL || s_overdraft == NULL)
        return NULL;
    PyObject **names[] = {&s_runtime,       &s_begin_schedule,
                          &s_end_schedule,   &s_begin_update,
                          &s_end_update,     &s_in_schedule,
                          &s_cleanup_due,    &s_num_mapped,
                          &s_device_full_at, &s_reserve_pages,
                          &s_target_pages,   &s_request_id,
                          &s_coordinator,    &s_single_type_managers,
                          &s_req_to_blocks,  &s_get,
                          &s_free,           &s_num_tokens,
                          &s_hits,           &s_record,
                          &s_refused_admission, &s_num_new_computed_tokens};
    const char *const texts[] = {"_runtime",       "begin_schedule",
                                 "end_schedule",   "begin_update",
                                 "end_update",     "in_schedule",
                                 "cleanup_due",    "num_mapped",
                                 "_device_full_at", "reserve_pages",
                                 "target_pages",   "request_id",
                                 "coordinator",    "single_type_managers",
                                 "req_to_blocks",  "get",
                                 "free",           "num_tokens",
                                 "_hits",          "record",
                                 "_refused_admission", "num_new_computed_tokens"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        *names[i] = PyUnicode_InternFromString(texts[i]);
        if (*names[i] == NULL)
            return NULL;
    }
    dict_get = PyObject_GetAttr((PyObject *)&PyDict_Type, s_get);
    if (dict_get == NULL)
        return NULL;
    one = PyLong_FromLong(1);
    zero = PyLong_FromLong(0);
    if (one == NULL || zero == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    PyObject *type = PyType_FromSpec(&BlockFields_spec);
    if (type == NULL || PyModule_AddObject(module, "BlockFields", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    type = PyType_FromSpec(&RunningAllocate_spec);
    if (type == NULL || PyModule_AddObject(module, "RunningAllocate", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    type = PyType_FromSpec(&StepState_spec);
    if (type == NULL || PyModule_AddObject(module, "StepState", Py_NewRef(type)) < 0) {
        Py_XDECREF(type);
        Py_XDECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    StepState_type = (PyTypeObject *)type; /* the module's reference went to the module */
    type = PyType_FromSpec(&HitWindow_spec);
    if (type == NULL || PyModule_AddObject(module, "HitWindow", Py_NewRef(type)) < 0) {
        Py_XDECREF(type);
        Py_XDECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    HitWindow_type = (PyTypeObject *)type; /* the module's reference went to the module */
    type = PyType_FromSpec(&StepHook_spec);
    if (type == NULL || PyModule_AddObject(module, "StepHook", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
