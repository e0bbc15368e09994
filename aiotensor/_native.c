/* aiotensor._native: the per-tensor loops that cost microseconds in Python, for files and states of
 * tens of thousands of tensors. Optional: where it is not built, aiotensor does the same in Python
 * (aiotensor/formats/safetensors.py says what each function stands in for, and the tests compare
 * the two on the same inputs). Each call does a bounded slice of work (its caller asks again), so
 * the GIL changes hands between calls, as between aiotensor's other C loops (_runtime/gil.py).
 *
 * rows(cls, iterators, most): up to `most` instances of the named tuple `cls`, one per row of the
 *     iterators (one per field, zip's rows), as tuple.__new__(cls, row) makes them.
 *
 * header_entries(keys, dtypes, shapes, begins, ends, lo, hi) -> bytes or None: entries [lo, hi) of
 *     a safetensors header as json.dumps(ensure_ascii=False, compact) writes them, joined by ",":
 *     '"key":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}' (None: a key that is not valid
 *     Unicode, a lone surrogate: the Python code names it).
 *
 * scan_header(doc, pos, most, data_start, file_size, itemsizes, max_dims, spec) -> None or
 *     (specs, next, meta_start, meta_end): up to `most` tensor entries of a safetensors header
 *     written as every writer writes it (no white space but the trailing pad; each entry exactly
 *     {"dtype":"..","shape":[..],"data_offsets":[b,e]}; keys without escapes), each validated and
 *     made a `spec(key, dtype, shape, data_start + b, nbytes)`. `next`: where to go on (0: the
 *     document ended, well formed); the "__metadata__" member met in this slice, if one was, is
 *     doc[meta_start:meta_end] (its text, left to the JSON decoder; else -1, -1). None: the text is
 *     not that (the Python parser then takes it and names what is wrong).
 *
 * table_rows(out, keys, texts, pos, row, most, files, sizes, itemsizes, max_dims, spec, entry) ->
 *     None or the positions to go on from: rows [row, row + most) of a manifest's tensor table
 *     (aiotensor/formats/manifest.py, version 3), made `entry(files[shard], spec(key, dtype,
 *     shape, offset, nbytes), crc32c)` and put in the dict `out` under their keys. `texts`: the
 *     columns shard, dtype, ndim, dims, offset and crc32c as the writer writes them (ASCII, one
 *     space between values; numbers in plain decimal below 10**18), `pos` where each stands. None:
 *     anything else (a value out of range, a packed or unknown dtype, a key twice, bytes past
 *     their shard's end): the Python code then reads the table and names what is wrong.
 *
 * copy_spans(base, starts, sources, sizes, compare) -> bool: for each i, sizes[i] bytes from the
 *     address sources[i] to base + starts[i] (lists of ints, of one length), the GIL let go while
 *     the bytes move. With `compare`, a span whose destination holds those bytes already (memcmp)
 *     is not copied, and the result says whether any span was (without: True). The addresses are
 *     the caller's to keep valid: this is a memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* a named tuple class of `width` fields: a direct subclass of tuple whose instances are laid out
 * as tuples (no __dict__, no slots), with `_fields` of that length (a struct sequence, such as
 * os.stat_result, is a tuple subclass of that size too, but frees hidden fields: refused) */
static int
plain_tuple_type(PyObject *cls, Py_ssize_t width)
{
    if (PyType_Check(cls) && ((PyTypeObject *)cls)->tp_base == &PyTuple_Type &&
        ((PyTypeObject *)cls)->tp_basicsize == PyTuple_Type.tp_basicsize &&
        ((PyTypeObject *)cls)->tp_itemsize == PyTuple_Type.tp_itemsize) {
        PyObject *fields = PyObject_GetAttrString(cls, "_fields");
        int ok = fields != NULL && PyTuple_Check(fields) && PyTuple_GET_SIZE(fields) == width;
        Py_XDECREF(fields);
        if (ok)
            return 1;
        PyErr_Clear();
    }
    PyErr_Format(PyExc_TypeError, "a named tuple class of %zd fields is needed", width);
    return 0;
}

static PyObject *
rows(PyObject *self, PyObject *args)
{
    PyTypeObject *cls;
    PyObject *iters;
    Py_ssize_t most;
    if (!PyArg_ParseTuple(args, "O!O!n", &PyType_Type, &cls, &PyTuple_Type, &iters, &most))
        return NULL;
    Py_ssize_t width = PyTuple_GET_SIZE(iters);
    if (!plain_tuple_type((PyObject *)cls, width))
        return NULL;
    for (Py_ssize_t j = 0; j < width; j++) {
        if (!PyIter_Check(PyTuple_GET_ITEM(iters, j))) {
            PyErr_SetString(PyExc_TypeError, "rows: every field must be an iterator");
            return NULL;
        }
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < most; i++) {
        PyObject *row = cls->tp_alloc(cls, width);
        if (row == NULL)
            goto fail;
        for (Py_ssize_t j = 0; j < width; j++) {
            PyObject *v = PyIter_Next(PyTuple_GET_ITEM(iters, j));
            if (v == NULL) {
                Py_DECREF(row);
                if (PyErr_Occurred())
                    goto fail;
                return out; /* the shortest field ended */
            }
            PyTuple_SET_ITEM(row, j, v);
        }
        int bad = PyList_Append(out, row);
        Py_DECREF(row);
        if (bad)
            goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* ---- memory ----------------------------------------------------------------------------------- */

static int
address(PyObject *number, uintptr_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(number);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    if (v > UINTPTR_MAX) {
        PyErr_SetString(PyExc_OverflowError, "copy_spans: a number past the address space");
        return 0;
    }
    *out = (uintptr_t)v;
    return 1;
}

static int
addresses(PyObject *list, Py_ssize_t n, uintptr_t *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!address(PyList_GET_ITEM(list, i), &out[i]))
            return 0;
    }
    return 1;
}

static PyObject *
copy_spans(PyObject *self, PyObject *args)
{
    PyObject *where, *starts, *sources, *sizes;
    int compare;
    if (!PyArg_ParseTuple(args, "OO!O!O!p", &where, &PyList_Type, &starts, &PyList_Type, &sources, &PyList_Type,
                          &sizes, &compare))
        return NULL;
    uintptr_t base; /* checked as every address is ("K" took -1 as 2**64 - 1 without a word) */
    if (!address(where, &base))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(starts);
    if (PyList_GET_SIZE(sources) != n || PyList_GET_SIZE(sizes) != n) {
        PyErr_SetString(PyExc_ValueError, "copy_spans: starts, sources and sizes must be of one length");
        return NULL;
    }
    uintptr_t *at = PyMem_Malloc(sizeof(uintptr_t) * 3 * (size_t)(n ? n : 1));
    if (at == NULL)
        return PyErr_NoMemory();
    uintptr_t *from = at + n, *len = at + 2 * n;
    if (!addresses(starts, n, at) || !addresses(sources, n, from) || !addresses(sizes, n, len)) {
        PyMem_Free(at);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] > UINTPTR_MAX - base || len[i] > UINTPTR_MAX - (base + at[i]) || len[i] > UINTPTR_MAX - from[i]) {
            PyMem_Free(at);
            PyErr_SetString(PyExc_OverflowError, "copy_spans: a span past the address space");
            return NULL;
        }
    }
    int copied = !compare;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        void *to = (void *)(uintptr_t)(base + at[i]);
        if (compare && memcmp(to, (const void *)from[i], len[i]) == 0)
            continue;
        memcpy(to, (const void *)from[i], len[i]);
        copied = 1;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(at);
    return PyBool_FromLong(copied);
}

/* ---- safetensors headers ---------------------------------------------------------------------- */

#define MAX_DIGITS 18 /* below 2**63 */

typedef struct {
    const char *s;
    Py_ssize_t n, i;
} Doc;

static int
lit(Doc *d, const char *text)
{
    size_t k = strlen(text);
    if ((Py_ssize_t)k > d->n - d->i || memcmp(d->s + d->i, text, k) != 0)
        return 0;
    d->i += (Py_ssize_t)k;
    return 1;
}

/* a JSON number as writers write a count: 0, or digits without a leading zero */
static int
count(Doc *d, int64_t *out)
{
    Py_ssize_t a = d->i;
    int64_t v = 0;
    while (d->i < d->n && d->s[d->i] >= '0' && d->s[d->i] <= '9') {
        if (d->i - a >= MAX_DIGITS)
            return 0;
        v = v * 10 + (d->s[d->i] - '0');
        d->i++;
    }
    if (d->i == a || (d->s[a] == '0' && d->i - a > 1))
        return 0;
    *out = v;
    return 1;
}

/* a key: '"', bytes that need no escape (no '"', '\\' or control character), '"' */
static int
key_span(Doc *d, Py_ssize_t *a, Py_ssize_t *b)
{
    if (d->i >= d->n || d->s[d->i] != '"')
        return 0;
    *a = ++d->i;
    while (d->i < d->n) {
        unsigned char c = (unsigned char)d->s[d->i];
        if (c == '"') {
            *b = d->i++;
            return 1;
        }
        if (c == '\\' || c < 0x20)
            return 0;
        d->i++;
    }
    return 0;
}

/* a dtype's name at d->i, [A-Za-z0-9_]{1,32}: its length, 0 where there is none or a longer one */
static Py_ssize_t
dtype_chars(Doc *d)
{
    Py_ssize_t a = d->i;
    while (d->i < d->n && d->i - a <= 32 &&
           ((d->s[d->i] >= 'A' && d->s[d->i] <= 'Z') || (d->s[d->i] >= 'a' && d->s[d->i] <= 'z') ||
            (d->s[d->i] >= '0' && d->s[d->i] <= '9') || d->s[d->i] == '_'))
        d->i++;
    return d->i - a > 32 ? 0 : d->i - a;
}

/* any JSON string (escapes skipped over, not checked: the decoder checks the text later) */
static int
skip_string(Doc *d)
{
    if (d->i >= d->n || d->s[d->i] != '"')
        return 0;
    d->i++;
    while (d->i < d->n) {
        char c = d->s[d->i];
        if (c == '"') {
            d->i++;
            return 1;
        }
        d->i += c == '\\' ? 2 : 1;
    }
    return 0;
}

/* the metadata object: {} or {"k":"v",...}, compact */
static int
skip_metadata(Doc *d)
{
    if (!lit(d, "{"))
        return 0;
    if (lit(d, "}"))
        return 1;
    for (;;) {
        if (!skip_string(d) || !lit(d, ":") || !skip_string(d))
            return 0;
        if (lit(d, "}"))
            return 1;
        if (!lit(d, ","))
            return 0;
    }
}

/* ---- shared by the header and table readers --------------------------------------------------- */

/* the last dtype met, its str and item size kept while the next rows name it too */
typedef struct {
    PyObject *name;
    const char *at;
    Py_ssize_t len;
    int64_t itemsize;
} Dtype;

/* `t` made the dtype named s[0:n] (the same object as the last where it is the same name): 1; 0:
 * a packed or unknown dtype (not in `itemsizes`, or no positive size there); -1: an error set */
static int
dtype_named(Dtype *t, PyObject *itemsizes, const char *s, Py_ssize_t n)
{
    if (t->name != NULL && n == t->len && memcmp(s, t->at, n) == 0)
        return 1;
    Py_CLEAR(t->name);
    t->name = PyUnicode_FromStringAndSize(s, n);
    if (t->name == NULL)
        return -1;
    PyObject *size = PyDict_GetItemWithError(itemsizes, t->name); /* borrowed */
    if (size == NULL) {
        int error = PyErr_Occurred() != NULL;
        Py_CLEAR(t->name); /* (never compared with the last name's text) */
        return error ? -1 : 0;
    }
    t->itemsize = PyLong_AsLongLong(size);
    if (t->itemsize <= 0) {
        PyErr_Clear();
        Py_CLEAR(t->name); /* (not kept: its size is no size) */
        return 0;
    }
    t->at = s, t->len = n;
    return 1;
}

/* the bytes of `ndim` dims of item size `itemsize` in *nbytes: 0 where they, or the elements of
 * its dims that are not 0 (torch counts elements in int64, zero-size or not), overflow an int64 */
static int
bytes_of(int64_t itemsize, const int64_t *dims, Py_ssize_t ndim, int64_t *nbytes)
{
    int64_t elements = 1;
    *nbytes = itemsize;
    for (Py_ssize_t k = 0; k < ndim; k++)
        if (__builtin_mul_overflow(*nbytes, dims[k], nbytes) || (dims[k] && __builtin_mul_overflow(elements, dims[k], &elements)))
            return 0;
    return 1;
}

/* spec(key, dtype, shape, offset, nbytes), `key` stolen (released on failure too); NULL: an error set */
static PyObject *
spec_row(PyObject *spec, PyObject *key, PyObject *dtype, const int64_t *dims, Py_ssize_t ndim, int64_t offset, int64_t nbytes)
{
    PyObject *shape = PyTuple_New(ndim), *at = PyLong_FromLongLong(offset), *size = PyLong_FromLongLong(nbytes);
    PyObject *row = ((PyTypeObject *)spec)->tp_alloc((PyTypeObject *)spec, 5);
    int bad = shape == NULL || at == NULL || size == NULL || row == NULL;
    for (Py_ssize_t k = 0; !bad && k < ndim; k++) {
        PyObject *v = PyLong_FromLongLong(dims[k]);
        if (v == NULL)
            bad = 1;
        else
            PyTuple_SET_ITEM(shape, k, v);
    }
    if (bad) {
        Py_DECREF(key);
        Py_XDECREF(shape);
        Py_XDECREF(at);
        Py_XDECREF(size);
        Py_XDECREF(row);
        return NULL;
    }
    PyTuple_SET_ITEM(row, 0, key);
    PyTuple_SET_ITEM(row, 1, Py_NewRef(dtype));
    PyTuple_SET_ITEM(row, 2, shape);
    PyTuple_SET_ITEM(row, 3, at);
    PyTuple_SET_ITEM(row, 4, size);
    return row;
}

static PyObject *
scan_header(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t pos, most, max_dims;
    long long data_start, file_size;
    PyObject *itemsizes, *spec;
    if (!PyArg_ParseTuple(args, "y*nnLLO!nO", &buf, &pos, &most, &data_start, &file_size, &PyDict_Type, &itemsizes,
                          &max_dims, &spec))
        return NULL;
    if (!plain_tuple_type(spec, 5)) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    if (pos < 0 || pos > buf.len) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "scan_header: pos outside the document");
        return NULL;
    }
    Doc d = {(const char *)buf.buf, buf.len, pos};
    PyObject *specs = PyList_New(0), *result = NULL;
    Dtype dtype = {NULL, NULL, 0, 0};
    Py_ssize_t meta_a = -1, meta_b = -1;
    int64_t dims[64];
    if (specs == NULL)
        goto done;
    if (max_dims < 0 || max_dims > 64) {
        PyErr_SetString(PyExc_ValueError, "scan_header: max_dims must be 0 to 64");
        goto done;
    }
    if (pos == 0) { /* the document's start: '{', and '}' at once for an empty one */
        if (!lit(&d, "{"))
            goto refuse;
        if (lit(&d, "}"))
            goto end;
    }
    else if (!lit(&d, ","))
        goto refuse;
    for (Py_ssize_t done_here = 0; done_here < most; done_here++) {
        Py_ssize_t ka, kb;
        if (!key_span(&d, &ka, &kb) || !lit(&d, ":"))
            goto refuse;
        if (kb - ka == 12 && memcmp(d.s + ka, "__metadata__", 12) == 0) {
            if (meta_a >= 0) /* twice in one slice: the Python parser names it */
                goto refuse;
            meta_a = d.i;
            if (!skip_metadata(&d))
                goto refuse;
            meta_b = d.i;
        }
        else {
            if (!lit(&d, "{\"dtype\":\""))
                goto refuse;
            Py_ssize_t ta = d.i, tn = dtype_chars(&d);
            if (tn == 0 || !lit(&d, "\",\"shape\":["))
                goto refuse;
            int known = dtype_named(&dtype, itemsizes, d.s + ta, tn);
            if (known < 0)
                goto done;
            if (!known)
                goto refuse; /* a packed or unknown dtype */
            Py_ssize_t ndim = 0;
            if (!lit(&d, "]")) {
                for (;;) {
                    if (ndim == max_dims || !count(&d, &dims[ndim]))
                        goto refuse;
                    ndim++;
                    if (lit(&d, "]"))
                        break;
                    if (!lit(&d, ","))
                        goto refuse;
                }
            }
            int64_t b, e, nbytes;
            if (!lit(&d, ",\"data_offsets\":[") || !count(&d, &b) || !lit(&d, ",") || !count(&d, &e) || !lit(&d, "]}"))
                goto refuse;
            if (!bytes_of(dtype.itemsize, dims, ndim, &nbytes) || b > e || e - b != nbytes || e > file_size - data_start)
                goto refuse;
            PyObject *key = PyUnicode_DecodeUTF8(d.s + ka, kb - ka, "strict");
            if (key == NULL) {
                PyErr_Clear();
                goto refuse;
            }
            PyObject *row = spec_row(spec, key, dtype.name, dims, ndim, data_start + b, nbytes);
            if (row == NULL)
                goto done;
            int bad = PyList_Append(specs, row);
            Py_DECREF(row);
            if (bad)
                goto done;
        }
        if (lit(&d, "}"))
            goto end;
        if (d.i >= d.n || d.s[d.i] != ',')
            goto refuse;
        if (done_here + 1 < most)
            d.i++; /* the ',' before the next member (left for the next call, which begins there) */
    }
    result = Py_BuildValue("(Onnn)", specs, d.i, meta_a, meta_b);
    goto done;
end:
    while (d.i < d.n && d.s[d.i] == ' ') /* safetensors pads its header with spaces */
        d.i++;
    if (d.i != d.n)
        goto refuse;
    result = Py_BuildValue("(Onnn)", specs, (Py_ssize_t)0, meta_a, meta_b);
    goto done;
refuse:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(dtype.name);
    Py_XDECREF(specs);
    PyBuffer_Release(&buf);
    return result;
}

/* ---- safetensors headers, written ------------------------------------------------------------- */

typedef struct {
    char *s;
    Py_ssize_t n, cap;
} Out;

static int
grow(Out *o, Py_ssize_t more)
{
    if (o->n + more <= o->cap)
        return 1;
    Py_ssize_t cap = o->cap * 2 > o->n + more ? o->cap * 2 : o->n + more + 4096;
    char *s = PyMem_Realloc(o->s, cap);
    if (s == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    o->s = s;
    o->cap = cap;
    return 1;
}

static int
put(Out *o, const char *text, Py_ssize_t k)
{
    if (!grow(o, k))
        return 0;
    memcpy(o->s + o->n, text, k);
    o->n += k;
    return 1;
}

#define PUT(o, text) put((o), (text), (Py_ssize_t)sizeof(text) - 1) /* a string literal */

/* a str as json.encoder.encode_basestring writes it (ensure_ascii=False), in UTF-8; 0: not valid
 * Unicode (a lone surrogate), the error cleared */
static int
put_string(Out *o, PyObject *str)
{
    Py_ssize_t k;
    const char *u = PyUnicode_AsUTF8AndSize(str, &k);
    if (u == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (!grow(o, 6 * k + 2))
        return -1;
    char *w = o->s + o->n;
    *w++ = '"';
    for (Py_ssize_t i = 0; i < k; i++) {
        unsigned char c = (unsigned char)u[i];
        switch (c) {
        case '"': *w++ = '\\'; *w++ = '"'; break;
        case '\\': *w++ = '\\'; *w++ = '\\'; break;
        case '\n': *w++ = '\\'; *w++ = 'n'; break;
        case '\r': *w++ = '\\'; *w++ = 'r'; break;
        case '\t': *w++ = '\\'; *w++ = 't'; break;
        case '\b': *w++ = '\\'; *w++ = 'b'; break;
        case '\f': *w++ = '\\'; *w++ = 'f'; break;
        default:
            if (c < 0x20) {
                static const char hex[] = "0123456789abcdef";
                *w++ = '\\', *w++ = 'u', *w++ = '0', *w++ = '0', *w++ = hex[c >> 4], *w++ = hex[c & 15];
            }
            else
                *w++ = (char)c;
        }
    }
    *w++ = '"';
    o->n = w - o->s;
    return 1;
}

/* an int in decimal: 1; 0: an error set; -1: not a plain int (a bool, a numpy integer) or beyond
 * a long long: the Python code writes it */
static int
put_int(Out *o, PyObject *v)
{
    if (!PyLong_CheckExact(v))
        return -1;
    int over = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &over);
    if (over)
        return -1;
    if (x == -1 && PyErr_Occurred())
        return 0;
    char buf[32];
    int k = snprintf(buf, sizeof buf, "%lld", x);
    return put(o, buf, k);
}

static PyObject *
header_entries(PyObject *self, PyObject *args)
{
    PyObject *keys, *dtypes, *shapes, *begins, *ends;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!nn", &PyList_Type, &keys, &PyList_Type, &dtypes, &PyList_Type, &shapes,
                          &PyList_Type, &begins, &PyList_Type, &ends, &lo, &hi))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (lo < 0 || hi < lo || hi > n || PyList_GET_SIZE(dtypes) < hi || PyList_GET_SIZE(shapes) < hi ||
        PyList_GET_SIZE(begins) < hi || PyList_GET_SIZE(ends) < hi) {
        PyErr_SetString(PyExc_ValueError, "header_entries: [lo, hi) outside the columns");
        return NULL;
    }
    Out o = {NULL, 0, 0};
    for (Py_ssize_t i = lo; i < hi; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i), *dtype = PyList_GET_ITEM(dtypes, i);
        PyObject *shape = PyList_GET_ITEM(shapes, i);
        if (!PyUnicode_Check(key) || !PyUnicode_Check(dtype) || !PyTuple_Check(shape)) {
            PyErr_SetString(PyExc_TypeError, "header_entries: keys and dtypes must be str, shapes tuples");
            goto fail;
        }
        if (i > lo && !PUT(&o, ","))
            goto fail;
        int got = put_string(&o, key);
        if (got <= 0) {
            PyMem_Free(o.s);
            if (got < 0)
                return NULL;
            Py_RETURN_NONE; /* not valid Unicode: the Python code says where */
        }
        if (!PUT(&o, ":{\"dtype\":") || put_string(&o, dtype) <= 0 || !PUT(&o, ",\"shape\":["))
            goto fail;
        int ok = 1;
        for (Py_ssize_t k = 0; ok == 1 && k < PyTuple_GET_SIZE(shape); k++)
            ok = (k && !PUT(&o, ",")) ? 0 : put_int(&o, PyTuple_GET_ITEM(shape, k));
        if (ok == 1)
            ok = PUT(&o, "],\"data_offsets\":[") ? put_int(&o, PyList_GET_ITEM(begins, i)) : 0;
        if (ok == 1)
            ok = PUT(&o, ",") ? put_int(&o, PyList_GET_ITEM(ends, i)) : 0;
        if (ok == 1)
            ok = PUT(&o, "]}");
        if (ok < 0) { /* not a plain int, or beyond a long long: the Python code writes it */
            PyMem_Free(o.s);
            Py_RETURN_NONE;
        }
        if (!ok)
            goto fail;
    }
    PyObject *out = PyBytes_FromStringAndSize(o.s ? o.s : "", o.n);
    PyMem_Free(o.s);
    return out;
fail:
    PyMem_Free(o.s);
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "header_entries: a dtype that is not valid Unicode");
    return NULL;
}

/* ---- a manifest's tensor table ---------------------------------------------------------------- */

/* a column's next value begins here: at its start, or after one space */
static int
separated(Doc *c)
{
    if (c->i == 0)
        return 1;
    if (c->i >= c->n || c->s[c->i] != ' ')
        return 0;
    c->i++;
    return 1;
}

/* the next number of a column: a count as writers write one (below 10**18; a bigger one, or one
 * with a leading zero, goes to the Python reader) */
static int
next_number(Doc *c, int64_t *out)
{
    return separated(c) && count(c, out);
}

/* the next dtype name of the dtype column, from *a */
static int
next_name(Doc *c, Py_ssize_t *a)
{
    if (!separated(c))
        return 0;
    *a = c->i;
    return dtype_chars(c) > 0 && (c->i == c->n || c->s[c->i] == ' ');
}

static PyObject *
table_rows(PyObject *self, PyObject *args)
{
    PyObject *out, *keys, *texts, *pos, *files, *sizes, *itemsizes, *spec, *entry;
    Py_ssize_t row, most, max_dims;
    if (!PyArg_ParseTuple(args, "O!O!O!O!nnO!O!O!nOO", &PyDict_Type, &out, &PyList_Type, &keys, &PyTuple_Type, &texts,
                          &PyTuple_Type, &pos, &row, &most, &PyList_Type, &files, &PyList_Type, &sizes, &PyDict_Type,
                          &itemsizes, &max_dims, &spec, &entry))
        return NULL;
    if (!plain_tuple_type(spec, 5) || !plain_tuple_type(entry, 3))
        return NULL;
    Py_ssize_t nfiles = PyList_GET_SIZE(files);
    if (PyTuple_GET_SIZE(texts) != 6 || PyTuple_GET_SIZE(pos) != 6 || PyList_GET_SIZE(sizes) != nfiles || row < 0 ||
        most < 0 || max_dims < 0 || max_dims > 64) {
        PyErr_SetString(PyExc_ValueError, "table_rows: 6 texts and positions, a size per file, max_dims 0 to 64");
        return NULL;
    }
    Doc col[6];
    for (int j = 0; j < 6; j++) {
        PyObject *t = PyTuple_GET_ITEM(texts, j);
        if (!PyUnicode_Check(t)) {
            PyErr_SetString(PyExc_TypeError, "table_rows: the columns must be str");
            return NULL;
        }
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(pos, j));
        if (at == -1 && PyErr_Occurred())
            return NULL;
        if (!PyUnicode_IS_COMPACT_ASCII(t))
            Py_RETURN_NONE; /* not ASCII: not as the writer writes it */
        col[j].s = (const char *)PyUnicode_DATA(t), col[j].n = PyUnicode_GET_LENGTH(t), col[j].i = at;
        if (at < 0 || at > col[j].n) {
            PyErr_SetString(PyExc_ValueError, "table_rows: a position outside its column");
            return NULL;
        }
    }
    Py_ssize_t end = PyList_GET_SIZE(keys) - row < most ? PyList_GET_SIZE(keys) : row + most; /* (no row + most past a ssize_t) */
    Dtype dtype = {NULL, NULL, 0, 0};
    int64_t dims[64];
    PyObject *key = NULL, *file = NULL, *size = NULL; /* row r's, held: Python code a call below runs (an
                                                        * __eq__ in a dict, a __del__ the collector calls)
                                                        * may change the lists */
    for (Py_ssize_t r = row; r < end; r++) {
        int64_t shard, ndim, offset, crc, nbytes;
        Py_ssize_t ta;
        if (r >= PyList_GET_SIZE(keys) || PyList_GET_SIZE(files) != nfiles || PyList_GET_SIZE(sizes) != nfiles ||
            !next_number(&col[0], &shard) || shard >= nfiles)
            goto refuse;
        key = Py_NewRef(PyList_GET_ITEM(keys, r));
        file = Py_NewRef(PyList_GET_ITEM(files, shard));
        size = Py_NewRef(PyList_GET_ITEM(sizes, shard));
        if (!PyUnicode_CheckExact(key) || !PyLong_CheckExact(size) || !next_name(&col[1], &ta) ||
            !next_number(&col[2], &ndim) || ndim > max_dims)
            goto refuse;
        int known = dtype_named(&dtype, itemsizes, col[1].s + ta, col[1].i - ta);
        if (known < 0)
            goto fail;
        if (!known)
            goto refuse; /* a packed or unknown dtype */
        for (int64_t k = 0; k < ndim; k++)
            if (!next_number(&col[3], &dims[k]))
                goto refuse;
        if (!bytes_of(dtype.itemsize, dims, ndim, &nbytes) || !next_number(&col[4], &offset) || !next_number(&col[5], &crc) ||
            crc >= ((int64_t)1 << 32))
            goto refuse;
        int over = 0;
        long long limit = PyLong_AsLongLongAndOverflow(size, &over); /* (an int: no Python code runs) */
        if (over || offset > limit || nbytes > limit - offset) /* (a size past a long long: the Python code checks it) */
            goto refuse;
        PyObject *s = spec_row(spec, Py_NewRef(key), dtype.name, dims, ndim, offset, nbytes);
        PyObject *c = PyLong_FromLongLong(crc);
        PyObject *e = ((PyTypeObject *)entry)->tp_alloc((PyTypeObject *)entry, 3);
        if (s == NULL || c == NULL || e == NULL) {
            Py_XDECREF(s);
            Py_XDECREF(c);
            Py_XDECREF(e);
            goto fail;
        }
        PyTuple_SET_ITEM(e, 0, Py_NewRef(file));
        PyTuple_SET_ITEM(e, 1, s);
        PyTuple_SET_ITEM(e, 2, c);
        Py_ssize_t had = PyDict_GET_SIZE(out);
        int bad = PyDict_SetItem(out, key, e);
        Py_DECREF(e);
        if (bad)
            goto fail;
        if (PyDict_GET_SIZE(out) == had) /* a key twice */
            goto refuse;
        Py_CLEAR(key);
        Py_CLEAR(file);
        Py_CLEAR(size);
    }
    Py_XDECREF(dtype.name);
    return Py_BuildValue("(nnnnnn)", col[0].i, col[1].i, col[2].i, col[3].i, col[4].i, col[5].i);
refuse:
    Py_XDECREF(key);
    Py_XDECREF(file);
    Py_XDECREF(size);
    Py_XDECREF(dtype.name);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(key);
    Py_XDECREF(file);
    Py_XDECREF(size);
    Py_XDECREF(dtype.name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy_spans", copy_spans, METH_VARARGS, "copy_spans(base, starts, sources, sizes, compare) -> bool."},
    {"rows", rows, METH_VARARGS, "rows(cls, iterators, most): up to most named tuples, one per row of the iterators."},
    {"header_entries", header_entries, METH_VARARGS, "header_entries(keys, dtypes, shapes, begins, ends, lo, hi)."},
    {"scan_header", scan_header, METH_VARARGS, "scan_header(doc, pos, most, data_start, file_size, itemsizes, max_dims, spec)."},
    {"table_rows", table_rows, METH_VARARGS,
     "table_rows(out, keys, texts, pos, row, most, files, sizes, itemsizes, max_dims, spec, entry)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "aiotensor._native", NULL, -1, methods, NULL, NULL, NULL, NULL};

#ifndef SOURCE_HASH
#define SOURCE_HASH "unknown"
#endif

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE", SOURCE_HASH) < 0) { /* setup.py: the source's hash */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
