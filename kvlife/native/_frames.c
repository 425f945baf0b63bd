/* kvlife._frames: read and verify a run of disk-tier frames outside the interpreter lock.
 *
 * One call reads every frame of a run (header and payload in one preadv each, on
 * `depth` POSIX threads that take the frames in order) while the calling thread, the
 * interpreter lock released, verifies each frame as soon as it has landed (a reader
 * with nothing left to read checks frames that landed beside it): its header
 * against the bytes the catalog row says it was written with, its payload's xxh3-128
 * against the row's checksum. So the checksum of frame i overlaps the reads of the
 * frames after it, and the only Python per frame is the caller's on_frame, called in
 * order as each is verified (issue 28).
 *
 * start_direct does the same in two steps for a served client's direct reads
 * (kvlife.client.direct): it opens the segment files and starts the reads at once, and
 * the DirectRun it returns verifies them when the caller asks (finish()), so that the
 * reads run while the caller sends its request and reads the reply. disjoint() is the
 * one-call fast path of a load's output-buffer check (kvlife.store.args.check_outs).
 * stream_copy() is a served put's copy into the arena by non-temporal stores (the
 * source may be strided: a chunk cut from one KV tensor).
 *
 * The hash is xxhash's own XXH3_128bits (or its run-time dispatching entry), a function
 * the `xxhash` Python package's extension exports (the same code that computed every
 * stored checksum): its address is handed in by kvlife.native.frames, which checks it
 * against xxhash's digest once.
 * Nothing is decided here: each frame gets a status and the Python side turns it into
 * the typed miss or the array it hands out.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_t;

typedef xxh128_t (*xxh3_128_fn)(const void *, size_t);

enum { OK = 0, HEADER_DIFFERS = 1, CHECKSUM_MISMATCH = 2, TRUNCATED = 3, READ_ERROR = 4 };

typedef struct {
    int fd;
    int64_t off;
    Py_buffer hdr;   /* writable: the frame's header lands here */
    Py_buffer body;  /* writable: the payload (padded to the alignment) lands here */
    Py_buffer want;  /* the header bytes the row's frame was written with */
    Py_buffer sum;   /* the row's xxh3-128, canonical (big-endian) 16 bytes */
    Py_ssize_t nbytes;
    int status;
    int err;
    Py_ssize_t got;
    int stage; /* READING, LANDED, CHECKING or CHECKED (under the run's lock) */
    int split;           /* read in pieces, each announced as it lands (see read_split) */
    int streamed;        /* being verified piece by piece as it lands (under the lock) */
    Py_ssize_t landed;   /* bytes of the body landed so far, of a split frame (under lock) */
    /* the streaming hash of a streamed frame, kept between the caller's calls (only the
     * caller that streams it touches these) */
    void *st;
    Py_ssize_t hashed; /* payload bytes hashed so far */
    int header;        /* -1 not landed yet, 0 differs from the row's, 1 the same */
} frame_t;

enum { READING = 0, LANDED = 1, CHECKING = 2, CHECKED = 3 };

/* xxhash's streaming xxh3-128 (the same extension's XXH3_createState, XXH3_freeState,
 * XXH3_128bits_reset, XXH3_128bits_update and XXH3_128bits_digest), set by
 * kvlife.native.frames after it checked them against xxhash's digest (set_stream);
 * without them every frame is verified whole once it landed. */
typedef void *(*xxh_create_fn)(void);
typedef int (*xxh_free_fn)(void *);
typedef int (*xxh_reset_fn)(void *);
typedef int (*xxh_update_fn)(void *, const void *, size_t);
typedef xxh128_t (*xxh_digest_fn)(const void *);

typedef struct {
    xxh_create_fn create;
    xxh_free_fn free;
    xxh_reset_fn reset;
    xxh_update_fn update;
    xxh_digest_fn digest;
} stream_t;

typedef struct {
    frame_t *frames;
    Py_ssize_t n;
    Py_ssize_t next; /* the next frame a reader takes (under lock) */
    Py_ssize_t unclaimed; /* frames before it are all claimed for checking (under lock) */
    xxh3_128_fn hash;
    stream_t stream; /* the streaming hash of its split frame (copied as the run starts) */
    Py_ssize_t piece; /* its split frame's smallest piece (piece_bytes as the run starts) */
    pthread_mutex_t lock;
    pthread_cond_t cond;
} run_t;

static uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}

static stream_t stream_fns; /* as set_stream set them (a run copies them as it starts) */

/* Whether all five streaming functions are set (a run without them verifies whole). */
static int stream_complete(const stream_t *fn) {
    return fn->create && fn->free && fn->reset && fn->update && fn->digest;
}

static Py_ssize_t frames_streamed; /* frames verified piece by piece (streamed()) */

/* A run's last frame is read in pieces, each verified as it lands, so that only the
 * hash of its last piece follows its last byte instead of the whole frame's (issue 28:
 * 1.3 ms of a 16 MiB frame; the frames before it are hashed while the next one is
 * read). The pieces halve what is left, down to the piece size: each read costs the
 * device a fixed time (60-85 us here at one in flight, 2026-12-07: 8 MiB in 256 KiB
 * reads took 1.7x as long as in 2 MiB ones), more than the hash a halving saves below
 * a few MiB (xxh3-128 runs at about 19 GB/s: 1 MiB in 55 us). Frames of at most twice
 * the piece size are read whole. The size is set by kvlife.native.frames (set_piece,
 * DEFAULT_PIECE there); a run copies it as it starts. */
#define MIN_PIECE ((Py_ssize_t)64 << 10)
static Py_ssize_t piece_bytes = (Py_ssize_t)2 << 20;

/* Bytes of the next piece of a split frame's body, of `rest` still to read (whole pages
 * but for the last piece, which takes the rest), in pieces of at least `piece`. */
static Py_ssize_t piece_len(Py_ssize_t rest, Py_ssize_t piece) {
    if (rest <= piece) return rest;
    Py_ssize_t half = (rest / 2) & ~(Py_ssize_t)4095;
    return half < piece ? piece : half;
}

static ssize_t preadv_retrying(int fd, struct iovec *iov, int iovcnt, off_t at) {
    ssize_t n;
    do {
        n = preadv(fd, iov, iovcnt, at);
    } while (n < 0 && errno == EINTR);
    return n;
}

/* Read a split frame: the header with the first piece, then each piece, publishing how
 * much of the body landed after each (r's lock, its condition broadcast) for the
 * verifier hashing it meanwhile. A short piece (end of file) ends the reads; the status
 * is set as read_frame sets it, from every byte read. */
static void read_split(frame_t *f, run_t *r) {
    Py_ssize_t done = 0, got = 0;
    while (done < f->body.len) {
        Py_ssize_t len = piece_len(f->body.len - done, r->piece);
        struct iovec iov[2];
        int cnt = 0;
        off_t at = (off_t)f->off + (off_t)f->hdr.len + (off_t)done;
        if (done == 0) {
            iov[cnt].iov_base = f->hdr.buf;
            iov[cnt].iov_len = (size_t)f->hdr.len;
            cnt++;
            at = (off_t)f->off;
        }
        iov[cnt].iov_base = (char *)f->body.buf + done;
        iov[cnt].iov_len = (size_t)len;
        cnt++;
        ssize_t n = preadv_retrying(f->fd, iov, cnt, at);
        if (n < 0) {
            f->status = READ_ERROR;
            f->err = errno;
            f->got = 0;
            return;
        }
        got += (Py_ssize_t)n;
        Py_ssize_t body = done == 0 ? (n > f->hdr.len ? (Py_ssize_t)n - f->hdr.len : 0) : n;
        done += body;
        pthread_mutex_lock(&r->lock);
        f->landed = done;
        pthread_cond_broadcast(&r->cond);
        pthread_mutex_unlock(&r->lock);
        if (body < len) break; /* the file ends here */
    }
    f->got = got;
    f->status = got < f->hdr.len + f->nbytes ? TRUNCATED : OK;
}

static void read_whole(frame_t *f) {
    struct iovec iov[2];
    int iovcnt = 1;
    iov[0].iov_base = f->hdr.buf;
    iov[0].iov_len = (size_t)f->hdr.len;
    if (f->body.len > 0) {
        iov[1].iov_base = f->body.buf;
        iov[1].iov_len = (size_t)f->body.len;
        iovcnt = 2;
    }
    ssize_t n = preadv_retrying(f->fd, iov, iovcnt, (off_t)f->off);
    if (n < 0) {
        f->status = READ_ERROR;
        f->err = errno;
        f->got = 0;
        return;
    }
    f->got = (Py_ssize_t)n;
    f->status = n < f->hdr.len + f->nbytes ? TRUNCATED : OK;
}

/* Read frame f of run r (the lock released): in pieces if it is split. */
static void read_frame(frame_t *f, run_t *r) {
    if (f->split)
        read_split(f, r);
    else
        read_whole(f);
}

static int header_same(const frame_t *f) {
    return f->want.len <= f->hdr.len && memcmp(f->hdr.buf, f->want.buf, (size_t)f->want.len) == 0;
}

static int sum_same(const frame_t *f, xxh128_t h) {
    const unsigned char *s = (const unsigned char *)f->sum.buf;
    return h.high64 == be64(s) && h.low64 == be64(s + 8);
}

static void verify_frame(frame_t *f, xxh3_128_fn hash) {
    if (f->status != OK) return;
    if (!header_same(f)) {
        f->status = HEADER_DIFFERS;
        return;
    }
    if (!sum_same(f, hash(f->body.buf, (size_t)f->nbytes))) f->status = CHECKSUM_MISMATCH;
}

/* Hash split frame f as its pieces land, claimed by the caller (streamed), the run's
 * lock held on entry and on return (released while hashing): its header once the first
 * piece landed, its payload piece by piece into one xxh3-128 state kept with the frame.
 * Returns once at least `until` payload bytes are hashed while the frame is still being
 * read (its header the row's; 0: never), or the read ended: then the frame is verified
 * (CHECKED, with the status verify_frame would give it). Where no state could be made,
 * the frame is left unchecked and not streamed (the caller verifies it whole). */
static void stream_check(run_t *r, frame_t *f, Py_ssize_t until) {
    const stream_t *fn = &r->stream;
    if (f->st == NULL) {
        void *st = fn->create();
        if (st == NULL || fn->reset(st) != 0) {
            if (st != NULL) fn->free(st);
            f->streamed = 0;
            return;
        }
        f->st = st;
        f->hashed = 0;
        f->header = -1;
    }
    for (;;) {
        Py_ssize_t upto, landed;
        for (;;) {
            landed = f->landed;
            upto = landed < f->nbytes ? landed : f->nbytes;
            if (f->stage != READING) break;
            if (until > 0 && (f->header == 0 || f->hashed >= until)) return;
            if (f->header < 0 && landed > 0) break;
            if (f->header == 1 && upto > f->hashed) break;
            pthread_cond_wait(&r->cond, &r->lock);
        }
        int finished = f->stage != READING;
        pthread_mutex_unlock(&r->lock);
        if (f->header < 0 && landed > 0) f->header = header_same(f);
        if (f->header == 1 && upto > f->hashed) {
            fn->update(f->st, (const char *)f->body.buf + f->hashed, (size_t)(upto - f->hashed));
            f->hashed = upto;
        }
        pthread_mutex_lock(&r->lock);
        if (finished) break;
    }
    if (f->status == OK) {
        if (f->header != 1)
            f->status = HEADER_DIFFERS;
        else if (f->hashed < f->nbytes || !sum_same(f, fn->digest(f->st)))
            f->status = CHECKSUM_MISMATCH;
    }
    fn->free(f->st);
    f->st = NULL;
    __atomic_fetch_add(&frames_streamed, 1, __ATOMIC_RELAXED);
    f->stage = CHECKED;
    pthread_cond_broadcast(&r->cond);
}

/* Free the streaming states a run's frames still hold (a run stopped between a
 * progress() and the step() that would have finished the frame's hash). */
static void free_streams(run_t *r) {
    for (Py_ssize_t k = 0; k < r->n; k++) {
        if (r->frames[k].st != NULL) {
            r->stream.free(r->frames[k].st);
            r->frames[k].st = NULL;
        }
    }
}

/* Mark the run's last frame split when it is larger than two pieces and the run has the
 * streaming hash, before any reader starts: the frames before it are hashed while the
 * next is read, its own hash is what is left after the last read. */
static void split_last(run_t *r) {
    r->piece = __atomic_load_n(&piece_bytes, __ATOMIC_RELAXED);
    if (r->n < 1 || !stream_complete(&r->stream)) return;
    frame_t *f = &r->frames[r->n - 1];
    if (f->body.len > 2 * r->piece && f->nbytes > 0) f->split = 1;
}

/* Check frame i, claimed (stage CHECKING) under the lock by the caller; the lock is
 * released meanwhile and held again on return. */
static void check_claimed(run_t *r, Py_ssize_t i) {
    pthread_mutex_unlock(&r->lock);
    verify_frame(&r->frames[i], r->hash);
    pthread_mutex_lock(&r->lock);
    r->frames[i].stage = CHECKED;
    pthread_cond_broadcast(&r->cond);
}

/* A reader: reads the next frame while there is one to read, then checks frames that
 * landed and nobody checks yet, so that the checksums of frames that landed together
 * run side by side rather than one after another in the calling thread. */
static void *reader(void *arg) {
    run_t *r = (run_t *)arg;
    pthread_mutex_lock(&r->lock);
    for (;;) {
        if (r->next < r->n) {
            Py_ssize_t i = r->next++;
            pthread_mutex_unlock(&r->lock);
            read_frame(&r->frames[i], r);
            pthread_mutex_lock(&r->lock);
            r->frames[i].stage = LANDED;
            pthread_cond_broadcast(&r->cond);
            continue;
        }
        while (r->unclaimed < r->n && r->frames[r->unclaimed].stage != LANDED &&
               r->frames[r->unclaimed].stage != READING)
            r->unclaimed++;
        Py_ssize_t j = -1;
        for (Py_ssize_t k = r->unclaimed; k < r->n; k++)
            if (r->frames[k].stage == LANDED && !r->frames[k].streamed) {
                j = k;
                break;
            }
        if (j < 0) break;
        r->frames[j].stage = CHECKING;
        check_claimed(r, j);
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

/* In the calling thread: frame i checked, by this thread if nobody claimed it. */
static void await_checked(run_t *r, Py_ssize_t i) {
    pthread_mutex_lock(&r->lock);
    frame_t *f = &r->frames[i];
    if (f->split && f->stage != CHECKED && (f->stage == READING || f->streamed)) {
        f->streamed = 1; /* verified as it lands (or on from where progress() left it) */
        stream_check(r, f, 0);
    }
    while (r->frames[i].stage == READING) pthread_cond_wait(&r->cond, &r->lock);
    if (r->frames[i].stage == LANDED) {
        r->frames[i].stage = CHECKING;
        check_claimed(r, i);
    }
    while (r->frames[i].stage != CHECKED) pthread_cond_wait(&r->cond, &r->lock);
    pthread_mutex_unlock(&r->lock);
}

static void release_frames(frame_t *frames, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer *bufs[4] = {&frames[i].hdr, &frames[i].body, &frames[i].want, &frames[i].sum};
        for (int b = 0; b < 4; b++)
            if (bufs[b]->obj != NULL) PyBuffer_Release(bufs[b]);
    }
}

/* Call on_frame(i, status, errno, bytes read) with the interpreter lock held; whether to
 * go on (False, or an exception, stops the run). */
static int deliver(PyObject *on_frame, Py_ssize_t i, frame_t *f, int *failed) {
    PyObject *r = PyObject_CallFunction(on_frame, "niin", i, f->status, f->err, f->got);
    if (r == NULL) {
        *failed = 1;
        return 0;
    }
    int go_on = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (go_on < 0) {
        *failed = 1;
        return 0;
    }
    return go_on;
}

/* The exception set while frame i was parsed, raised again with the frame named. */
static void name_frame(Py_ssize_t i) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_Format(type != NULL ? type : PyExc_TypeError, "frame %zd: %S", i,
                 value != NULL ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* Whether frame i's item is a tuple (TypeError naming it if not). */
static int is_frame_tuple(PyObject *item, Py_ssize_t i) {
    if (PyTuple_Check(item)) return 1;
    PyErr_Format(PyExc_TypeError, "frame %zd is a %.100s, not a tuple", i, Py_TYPE(item)->tp_name);
    return 0;
}

/* Whether a run's depth and hash address can be used (ValueError if not). */
static int run_settings_ok(int depth, unsigned long long hash_addr) {
    if (depth < 1 || depth > 64) {
        PyErr_Format(PyExc_ValueError, "depth %d is not in 1..64", depth);
        return 0;
    }
    if (hash_addr == 0) {
        PyErr_SetString(PyExc_ValueError, "no xxh3-128 function address");
        return 0;
    }
    return 1;
}

/* read_run(frames, depth, hash_address, on_frame) -> frames taken
 * frames: a sequence of (fd, offset, header, body, nbytes, header_want, checksum).
 * on_frame(i, status, errno, bytes_read) -> bool is called in this thread, in order, as
 * soon as frame i is verified (the reads of the frames after it go on meanwhile); a
 * false return (frame i not taken) stops the run there: no further frame is read
 * (reads in flight end), none delivered. An exception it raises stops the run the
 * same way and is raised. Returns how many frames on_frame took. */
static PyObject *read_run(PyObject *self, PyObject *args) {
    PyObject *seq, *on_frame;
    int depth;
    unsigned long long hash_addr;
    if (!PyArg_ParseTuple(args, "OiKO", &seq, &depth, &hash_addr, &on_frame)) return NULL;
    if (!run_settings_ok(depth, hash_addr)) return NULL;
    if (!PyCallable_Check(on_frame)) {
        PyErr_SetString(PyExc_TypeError, "on_frame must be callable");
        return NULL;
    }
    /* a tuple of its own: a list the caller (or an item's __index__) changes while it
     * is parsed cannot pull items from under this loop */
    PyObject *fast = PySequence_Tuple(seq);
    if (fast == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fast);
    frame_t *frames = PyMem_Calloc((size_t)(n ? n : 1), sizeof(frame_t));
    if (frames == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    Py_ssize_t parsed = 0;
    for (; parsed < n; parsed++) {
        frame_t *f = &frames[parsed];
        long long off;
        PyObject *item = PyTuple_GET_ITEM(fast, parsed);
        if (!is_frame_tuple(item, parsed)) break;
        if (!PyArg_ParseTuple(item, "iLw*w*ny*y*", &f->fd, &off, &f->hdr, &f->body, &f->nbytes,
                              &f->want, &f->sum)) {
            name_frame(parsed);
            break;
        }
        f->off = off;
        const char *bad = NULL;
        if (off < 0)
            bad = "a negative offset";
        else if (f->nbytes < 0)
            bad = "a negative payload length";
        else if (f->nbytes > f->body.len)
            bad = "a payload longer than its buffer";
        else if (f->sum.len != 16)
            bad = "a checksum that is not 16 bytes";
        if (bad != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "frame %zd has %s (offset %lld, payload of %zd bytes in a buffer of "
                         "%zd, checksum of %zd bytes)",
                         parsed, bad, off, f->nbytes, f->body.len, f->sum.len);
            parsed++;
            break;
        }
    }
    if (parsed < n || PyErr_Occurred()) {
        release_frames(frames, parsed);
        PyMem_Free(frames);
        Py_DECREF(fast);
        return NULL;
    }
    xxh3_128_fn hash = (xxh3_128_fn)(uintptr_t)hash_addr;
    run_t run = {.frames = frames, .n = n, .next = 0, .unclaimed = 0, .hash = hash,
                 .stream = stream_fns};
    if (n > 1) split_last(&run); /* one frame is read and verified in this thread */
    pthread_mutex_init(&run.lock, NULL);
    pthread_cond_init(&run.cond, NULL);
    pthread_t threads[64];
    int started = 0;
    int failed = 0;
    Py_ssize_t delivered = 0;

    Py_BEGIN_ALLOW_THREADS
    if (n > 1) {
        int want = depth < n ? depth : (int)n;
        for (; started < want; started++)
            if (pthread_create(&threads[started], NULL, reader, &run) != 0) break;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (started == 0) { /* one frame, or no thread could start: all here */
            read_frame(&frames[i], &run);
            verify_frame(&frames[i], hash);
        } else {
            await_checked(&run, i);
        }
        int go_on;
        Py_BLOCK_THREADS
        go_on = deliver(on_frame, i, &frames[i], &failed);
        Py_UNBLOCK_THREADS
        if (failed || !go_on) break;
        delivered++;
    }
    pthread_mutex_lock(&run.lock);
    run.next = n; /* the readers take no further frame, and check none landed so far */
    for (Py_ssize_t k = 0; k < n; k++)
        if (frames[k].stage == LANDED) frames[k].stage = CHECKED;
    pthread_mutex_unlock(&run.lock);
    for (int t = 0; t < started; t++) pthread_join(threads[t], NULL);
    Py_END_ALLOW_THREADS

    free_streams(&run);
    pthread_cond_destroy(&run.cond);
    pthread_mutex_destroy(&run.lock);
    release_frames(frames, n);
    PyMem_Free(frames);
    Py_DECREF(fast);
    if (failed) return NULL;
    return PyLong_FromSsize_t(delivered);
}

typedef struct {
    uintptr_t low, high;
} range_t;

static int range_cmp(const void *a, const void *b) {
    uintptr_t x = ((const range_t *)a)->low, y = ((const range_t *)b)->low;
    return x < y ? -1 : x > y;
}

/* Whether the sorted ranges r[0..n) share a byte: the index of the later of a pair that
 * does (in sorted order), or -1. */
static Py_ssize_t overlapping(range_t *r, Py_ssize_t n) {
    if (n < 2) return -1;
    qsort(r, (size_t)n, sizeof(range_t), range_cmp);
    for (Py_ssize_t i = 1; i < n; i++)
        if (r[i].low < r[i - 1].high) return i;
    return -1;
}

/* ---------------------------------------------------------------------------------
 * A direct run (kvlife.client.direct): the frames a served lookup named, read by the
 * client itself. start_direct opens the segment files and starts the reads at once,
 * so that they run while the caller sends its request and reads the reply; finish()
 * verifies them in order, as read_run does, and returns how many from the first
 * verified. The run owns everything its reads write into until it is finished,
 * closed or collected: the callers' buffers stay exported (numpy refuses to resize
 * them), the headers land in memory of its own, and the files stay open. */

typedef struct {
    PyObject_HEAD
    frame_t *frames;
    Py_ssize_t n;       /* frames parsed (their buffers held) */
    Py_ssize_t opened;  /* frames whose file opened: the run reads these */
    int *fds;
    int nfds;
    unsigned char *headers;
    run_t run;
    pthread_t threads[64];
    int started;
    int sync_ready;     /* run.lock and run.cond initialised */
    int busy;           /* a step() or finish() is under way in some thread (under the GIL) */
    int done;           /* stopped and released */
    Py_ssize_t good;    /* frames from the first verified by step() so far */
    int failed;         /* a frame step() checked did not verify: no step goes further */
} DirectRun;

/* Stop the readers (no further frame read), wait for the reads in flight, close the
 * files and free the headers; with the interpreter lock released by the caller. */
static void direct_stop(DirectRun *d) {
    if (d->sync_ready) {
        pthread_mutex_lock(&d->run.lock);
        d->run.next = d->run.n;
        for (Py_ssize_t k = 0; k < d->run.n; k++)
            if (d->frames[k].stage == LANDED) d->frames[k].stage = CHECKED;
        pthread_mutex_unlock(&d->run.lock);
    }
    for (int t = 0; t < d->started; t++) pthread_join(d->threads[t], NULL);
    d->started = 0;
    for (int k = 0; k < d->nfds; k++) close(d->fds[k]);
    d->nfds = 0;
}

/* With the interpreter lock held, after direct_stop. */
static void direct_release(DirectRun *d) {
    if (d->sync_ready) {
        free_streams(&d->run);
        pthread_cond_destroy(&d->run.cond);
        pthread_mutex_destroy(&d->run.lock);
        d->sync_ready = 0;
    }
    if (d->frames != NULL) {
        release_frames(d->frames, d->n);
        PyMem_Free(d->frames);
        d->frames = NULL;
    }
    PyMem_Free(d->fds);
    d->fds = NULL;
    free(d->headers);
    d->headers = NULL;
    d->done = 1;
}

/* The objects whose buffers the run holds (the callers' arrays, the headers and
 * checksums it verifies against): a buffer that refers back to its run makes a cycle
 * the collector must see. */
static int direct_traverse(DirectRun *d, visitproc visit, void *arg) {
    if (d->done || d->frames == NULL) return 0;
    for (Py_ssize_t i = 0; i < d->n; i++) {
        Py_VISIT(d->frames[i].body.obj);
        Py_VISIT(d->frames[i].want.obj);
        Py_VISIT(d->frames[i].sum.obj);
    }
    return 0;
}

/* Stop a run no finish() is under way on and let go of everything it holds (the
 * interpreter lock released while its reads end); nothing if it is spent. */
static void direct_end(DirectRun *d) {
    if (d->done || d->busy) return;
    d->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    direct_stop(d);
    Py_END_ALLOW_THREADS
    direct_release(d);
    d->busy = 0;
}

/* The collector breaks a cycle through the run: its reads end, its files close and its
 * buffers go, as when it is closed. */
static int direct_clear(DirectRun *d) {
    direct_end(d);
    return 0;
}

static void direct_dealloc(DirectRun *d) {
    PyObject_GC_UnTrack(d);
    direct_end(d);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

/* Frame i of an unspent run checked, in the calling thread with the interpreter lock
 * released: read and verified here when the run started no thread, else awaited (and
 * verified here if no reader claimed it). Whether it verified. */
static int direct_check(DirectRun *d, Py_ssize_t i) {
    if (d->started == 0) {
        read_frame(&d->frames[i], &d->run);
        verify_frame(&d->frames[i], d->run.hash);
    } else {
        await_checked(&d->run, i);
    }
    return d->frames[i].status == OK;
}

/* step() -> whether the next frame in order read whole and verified (False once one
 * did not, or every opened frame was stepped); the reads after it go on. */
static PyObject *direct_step(DirectRun *d, PyObject *Py_UNUSED(ignored)) {
    if (d->done || d->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this direct run is finished or being finished");
        return NULL;
    }
    if (d->failed || d->good >= d->opened) Py_RETURN_FALSE;
    d->busy = 1;
    int ok;
    Py_ssize_t i = d->good;
    Py_BEGIN_ALLOW_THREADS
    ok = direct_check(d, i);
    Py_END_ALLOW_THREADS
    d->busy = 0;
    if (!ok) {
        d->failed = 1;
        Py_RETURN_FALSE;
    }
    d->good = i + 1;
    Py_RETURN_TRUE;
}

/* progress(at_least) -> bytes of the next frame to step that landed, not verified until
 * step() says so. A split frame: those hashed so far, once at least `at_least` were or
 * its read ended (then it is verified: its whole payload if it verified, 0 if not),
 * hashing what lands meanwhile, so a later step() only finishes the hash. A frame read
 * whole: its whole payload once it landed whole (at_least aside). 0 where its header
 * differs or its read failed, where a split frame was not being read when first asked
 * (it is verified whole), or where no frame is left to step. The interpreter lock is
 * released while it waits. */
static PyObject *direct_progress(DirectRun *d, PyObject *arg) {
    Py_ssize_t at_least = PyLong_AsSsize_t(arg);
    if (at_least == -1 && PyErr_Occurred()) return NULL;
    if (d->done || d->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this direct run is finished or being finished");
        return NULL;
    }
    if (at_least < 1) {
        PyErr_Format(PyExc_ValueError, "progress(%zd): at least one byte", at_least);
        return NULL;
    }
    if (d->failed || d->good >= d->opened || d->started == 0) return PyLong_FromLong(0);
    frame_t *f = &d->frames[d->good];
    Py_ssize_t got = 0;
    d->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&d->run.lock);
    if (!f->split) { /* read whole: its payload once it landed, read whole, its header the row's */
        while (f->stage == READING || f->stage == CHECKING)
            pthread_cond_wait(&d->run.cond, &d->run.lock);
        if (f->status == OK && (f->stage == CHECKED || header_same(f))) got = f->nbytes;
    } else if (f->stage != CHECKED && (f->stage == READING || f->streamed)) {
        f->streamed = 1;
        stream_check(&d->run, f, at_least);
        if (f->stage == CHECKED)
            got = f->status == OK ? f->nbytes : 0;
        else if (f->streamed && f->header == 1)
            got = f->hashed;
    }
    pthread_mutex_unlock(&d->run.lock);
    Py_END_ALLOW_THREADS
    d->busy = 0;
    return PyLong_FromSsize_t(got);
}

/* finish() -> how many frames, from the first, read whole and verified (the first that
 * did not ends the count, and the reads after it are not started); the run is spent.
 * Frames step() verified are counted without a second check. */
static PyObject *direct_finish(DirectRun *d, PyObject *Py_UNUSED(ignored)) {
    if (d->done || d->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this direct run is finished or being finished");
        return NULL;
    }
    d->busy = 1;
    Py_ssize_t good = d->good;
    int failed = d->failed;
    Py_BEGIN_ALLOW_THREADS
    for (; !failed && good < d->opened; good++)
        if (!direct_check(d, good)) break;
    direct_stop(d);
    Py_END_ALLOW_THREADS
    direct_release(d);
    d->busy = 0;
    return PyLong_FromSsize_t(good);
}

/* close(): stop without verifying (the reads in flight end first); idempotent. */
static PyObject *direct_close(DirectRun *d, PyObject *Py_UNUSED(ignored)) {
    if (d->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this direct run is being finished");
        return NULL;
    }
    direct_end(d);
    Py_RETURN_NONE;
}

static PyObject *direct_reading(DirectRun *d, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(d->done ? 0 : d->opened);
}

static PyMethodDef direct_methods[] = {
    {"step", (PyCFunction)direct_step, METH_NOARGS,
     "step() -> whether the next frame in order verified (False from the first that did not)."},
    {"finish", (PyCFunction)direct_finish, METH_NOARGS,
     "finish() -> frames verified from the first; the run is spent."},
    {"close", (PyCFunction)direct_close, METH_NOARGS, "close(): stop without verifying."},
    {"progress", (PyCFunction)direct_progress, METH_O,
     "progress(at_least): bytes of the next frame landed and hashed, not yet verified."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef direct_getset[] = {
    {"reading", (getter)direct_reading, NULL, "frames being read (0 once spent)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DirectRunType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvlife.native._frames.DirectRun",
    .tp_basicsize = sizeof(DirectRun),
    .tp_dealloc = (destructor)direct_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)direct_traverse,
    .tp_clear = (inquiry)direct_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "A run of direct frame reads under way (start_direct).",
    .tp_methods = direct_methods,
    .tp_getset = direct_getset,
};

/* Open path (a str) for reading: O_DIRECT where its filesystem takes it, never following
 * a link, without blocking (a FIFO would wait for a writer); -1 unless it is a regular
 * file. */
static int open_segment(PyObject *path) {
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(path, &encoded)) {
        PyErr_Clear();
        return -1;
    }
    const char *p = PyBytes_AS_STRING(encoded);
    int fd = -1;
    if ((Py_ssize_t)strlen(p) == PyBytes_GET_SIZE(encoded)) {
        int flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK;
        fd = open(p, flags | O_DIRECT);
        if (fd < 0 && errno == EINVAL) fd = open(p, flags);
        struct stat st;
        if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
            close(fd);
            fd = -1;
        }
    }
    Py_DECREF(encoded);
    return fd;
}

/* start_direct(frames, depth, hash_address) -> DirectRun
 * frames: a sequence of (path, offset, body, nbytes, header_want, checksum), path a
 * str naming the segment file, body writable C-contiguous memory of whole aligned pages
 * (else ValueError, nothing read). Each distinct path is opened once (see open_segment);
 * the first frame whose file cannot be opened, and every frame after it, is not read
 * (finish() counts no further). The reads start before this returns, on up to `depth`
 * threads (at least one, so that even one frame is read while the caller goes on). */
static PyObject *start_direct(PyObject *self, PyObject *args) {
    PyObject *seq;
    int depth;
    unsigned long long hash_addr;
    if (!PyArg_ParseTuple(args, "OiK", &seq, &depth, &hash_addr)) return NULL;
    if (!run_settings_ok(depth, hash_addr)) return NULL;
    PyObject *fast = PySequence_Tuple(seq);
    if (fast == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fast);
    DirectRun *d = PyObject_GC_New(DirectRun, &DirectRunType);
    if (d == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    d->frames = PyMem_Calloc((size_t)(n ? n : 1), sizeof(frame_t));
    d->fds = PyMem_Calloc((size_t)(n ? n : 1), sizeof(int));
    d->n = d->opened = 0;
    d->nfds = d->started = d->sync_ready = d->busy = d->done = d->failed = 0;
    d->good = 0;
    d->headers = NULL;
    PyObject **paths = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *));
    if (d->frames == NULL || d->fds == NULL || paths == NULL ||
        posix_memalign((void **)&d->headers, 4096, (size_t)(n ? n : 1) * 4096) != 0) {
        d->headers = NULL;
        PyMem_Free(paths);
        Py_DECREF(fast);
        Py_DECREF(d);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        frame_t *f = &d->frames[i];
        long long off;
        PyObject *item = PyTuple_GET_ITEM(fast, i);
        if (!is_frame_tuple(item, i)) break;
        PyObject *body;
        if (!PyArg_ParseTuple(item, "ULOny*y*", &paths[i], &off, &body, &f->nbytes, &f->want,
                              &f->sum)) {
            name_frame(i);
            break;
        }
        if (PyObject_GetBuffer(body, &f->body, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
            PyErr_Clear();
            PyBuffer_Release(&f->want);
            PyBuffer_Release(&f->sum);
            PyErr_Format(PyExc_ValueError, "frame %zd's buffer is not writable C-contiguous memory",
                         i);
            break;
        }
        d->n = i + 1;
        f->off = off;
        const char *bad = NULL;
        if (off < 0 || off % 4096)
            bad = "an offset that is negative or not a multiple of 4096";
        else if (f->nbytes < 0 || f->nbytes > f->body.len)
            bad = "a payload length that is negative or longer than its buffer";
        else if (f->body.len % 4096 || ((uintptr_t)f->body.buf) % 4096)
            bad = "a buffer that is not whole aligned pages";
        else if (f->sum.len != 16)
            bad = "a checksum that is not 16 bytes";
        else if (f->want.len > 4096)
            bad = "a header longer than 4096 bytes";
        if (bad != NULL) {
            PyErr_Format(PyExc_ValueError, "frame %zd has %s", i, bad);
            break;
        }
        f->hdr.buf = d->headers + i * 4096;
        f->hdr.len = 4096;
        f->hdr.obj = NULL; /* not a Python buffer: release_frames skips it */
    }
    if (!PyErr_Occurred() && n > 1) { /* two frames into one byte: one would be counted twice */
        range_t *r = PyMem_Malloc((size_t)n * sizeof(range_t));
        if (r == NULL) {
            PyErr_NoMemory();
        } else {
            for (Py_ssize_t i = 0; i < n; i++)
                r[i] = (range_t){(uintptr_t)d->frames[i].body.buf,
                                 (uintptr_t)d->frames[i].body.buf + (uintptr_t)d->frames[i].body.len};
            if (overlapping(r, n) >= 0)
                PyErr_SetString(PyExc_ValueError, "two frames' buffers share memory");
            PyMem_Free(r);
        }
    }
    if (PyErr_Occurred()) {
        PyMem_Free(paths);
        Py_DECREF(fast);
        Py_DECREF(d); /* nothing started: dealloc releases what was parsed */
        return NULL;
    }
    /* open each file once; frames from the first that cannot be opened are not read */
    for (Py_ssize_t i = 0; i < n; i++) {
        int fd = -1;
        for (Py_ssize_t j = 0; j < i; j++) {
            if (PyUnicode_Compare(paths[j], paths[i]) == 0) {
                fd = d->frames[j].fd;
                break;
            }
        }
        if (fd < 0) {
            fd = open_segment(paths[i]);
            if (fd < 0) break;
            d->fds[d->nfds++] = fd;
        }
        d->frames[i].fd = fd;
        d->opened = i + 1;
    }
    PyMem_Free(paths);
    Py_DECREF(fast);
    d->run = (run_t){.frames = d->frames, .n = d->opened, .next = 0, .unclaimed = 0,
                     .hash = (xxh3_128_fn)(uintptr_t)hash_addr, .stream = stream_fns};
    split_last(&d->run);
    pthread_mutex_init(&d->run.lock, NULL);
    pthread_cond_init(&d->run.cond, NULL);
    d->sync_ready = 1;
    if (d->opened > 0) {
        int want = depth < d->opened ? depth : (int)d->opened;
        for (; d->started < want; d->started++)
            if (pthread_create(&d->threads[d->started], NULL, reader, &d->run) != 0) break;
    }
    PyObject_GC_Track(d);
    return (PyObject *)d;
}

/* An xxh3-128 digest as xxhash's canonical (big-endian) 16 bytes. */
static PyObject *canonical(xxh128_t h) {
    unsigned char b[16];
    for (int i = 0; i < 8; i++) {
        b[i] = (unsigned char)(h.high64 >> (56 - 8 * i));
        b[8 + i] = (unsigned char)(h.low64 >> (56 - 8 * i));
    }
    return PyBytes_FromStringAndSize((const char *)b, 16);
}

/* xxh3_128(buffer, hash_address) -> canonical 16 bytes: the self-check of the address. */
static PyObject *xxh3_128(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned long long hash_addr;
    if (!PyArg_ParseTuple(args, "y*K", &data, &hash_addr)) return NULL;
    if (hash_addr == 0) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "no xxh3-128 function address");
        return NULL;
    }
    xxh128_t h = ((xxh3_128_fn)(uintptr_t)hash_addr)(data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    return canonical(h);
}

/* set_stream(create, free, reset, update, digest): the addresses of xxhash's streaming
 * xxh3-128 (all 0: none; runs started from here on verify every frame whole). Runs
 * under way keep the functions they started with. */
static PyObject *set_stream(PyObject *self, PyObject *args) {
    unsigned long long a[5];
    if (!PyArg_ParseTuple(args, "KKKKK", &a[0], &a[1], &a[2], &a[3], &a[4])) return NULL;
    int none = !a[0] && !a[1] && !a[2] && !a[3] && !a[4];
    if (!none && !(a[0] && a[1] && a[2] && a[3] && a[4])) {
        PyErr_SetString(PyExc_ValueError, "set_stream takes five function addresses, or five 0");
        return NULL;
    }
    stream_fns = (stream_t){(xxh_create_fn)(uintptr_t)a[0], (xxh_free_fn)(uintptr_t)a[1],
                            (xxh_reset_fn)(uintptr_t)a[2], (xxh_update_fn)(uintptr_t)a[3],
                            (xxh_digest_fn)(uintptr_t)a[4]};
    Py_RETURN_NONE;
}

/* xxh3_128_stream(buffer, piece) -> canonical 16 bytes: the buffer hashed `piece` bytes
 * at a time by the streaming functions set_stream set (the self-check of those). */
static PyObject *xxh3_128_stream(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t piece;
    if (!PyArg_ParseTuple(args, "y*n", &data, &piece)) return NULL;
    if (!stream_complete(&stream_fns) || piece < 1) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "no streaming xxh3-128 set, or a piece < 1 byte");
        return NULL;
    }
    void *st = stream_fns.create();
    if (st == NULL || stream_fns.reset(st) != 0) {
        if (st != NULL) stream_fns.free(st);
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t at = 0; at < data.len; at += piece) {
        Py_ssize_t len = data.len - at < piece ? data.len - at : piece;
        stream_fns.update(st, (const char *)data.buf + at, (size_t)len);
    }
    xxh128_t h = stream_fns.digest(st);
    stream_fns.free(st);
    PyBuffer_Release(&data);
    return canonical(h);
}

/* streamed() -> frames verified piece by piece as they landed, in this process. */
static PyObject *streamed(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSsize_t(__atomic_load_n(&frames_streamed, __ATOMIC_RELAXED));
}

/* The bytes a buffer's elements lie in: [*low, *high), the lowest byte's address and
 * one past the highest (low == high when it holds no element); an exporter that gives
 * no strides is C-contiguous. What np.byte_bounds gives. */
static void byte_span(const Py_buffer *view, uintptr_t *low, uintptr_t *high) {
    *low = *high = (uintptr_t)view->buf;
    for (int d = 0; d < view->ndim; d++) {
        if (view->shape[d] == 0) return;
    }
    if (view->strides == NULL) {
        *high += (uintptr_t)view->len;
        return;
    }
    *high += (uintptr_t)view->itemsize;
    for (int d = 0; d < view->ndim; d++) {
        Py_ssize_t reach = (view->shape[d] - 1) * view->strides[d];
        if (reach < 0) *low -= (uintptr_t)(-reach);
        else *high += (uintptr_t)reach;
    }
}

/* spans(arrays) -> [(low, high, flags) or None]: each object's memory as np.byte_bounds
 * gives it (the lowest byte's address and one past the highest; low == high when it
 * holds no element), read through the buffer protocol in one call for a list of arrays
 * (numpy's byte_bounds builds its __array_interface__ dict per array). flags: bit 0
 * writable, bit 1 C-contiguous. None for an object that exports no strided buffer (the
 * caller computes that one another way). */
static PyObject *spans(PyObject *self, PyObject *arg) {
    PyObject *fast = PySequence_Fast(arg, "spans() takes a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PySequence_Fast_GET_ITEM(fast, i);
        Py_buffer view;
        PyObject *item;
        if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) != 0) {
            PyErr_Clear();
            Py_INCREF(Py_None);
            item = Py_None;
        } else {
            uintptr_t low, high;
            byte_span(&view, &low, &high);
            long flags = (view.readonly ? 0 : 1) | (PyBuffer_IsContiguous(&view, 'C') ? 2 : 0);
            PyBuffer_Release(&view);
            item = Py_BuildValue("(KKl)", (unsigned long long)low, (unsigned long long)high, flags);
            if (item == NULL) {
                Py_DECREF(out);
                Py_DECREF(fast);
                return NULL;
            }
        }
        PyList_SET_ITEM(out, i, item);
    }
    Py_DECREF(fast);
    return out;
}

/* disjoint(arrays) -> bool: True when every object exports a writable C-contiguous
 * buffer and no two of them share a byte (their byte ranges, sorted, do not overlap);
 * False otherwise, which decides nothing: the caller then checks them one by one
 * (kvlife.store.overlap). A load's output buffers are nearly always so, and this one
 * call costs a fraction of the Python check (issue 28). */
static PyObject *disjoint(PyObject *self, PyObject *arg) {
    PyObject *fast = PySequence_Fast(arg, "disjoint() takes a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    range_t *r = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(range_t));
    if (r == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    Py_ssize_t used = 0;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        Py_buffer view;
        /* not asked writable: numpy then exports a broadcast array it only warns on
         * writing as read-only, without the warning (and the caller's check decides) */
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &view, PyBUF_STRIDES) != 0) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        if (view.readonly || !PyBuffer_IsContiguous(&view, 'C'))
            ok = 0;
        else if (view.len > 0)
            r[used++] = (range_t){(uintptr_t)view.buf, (uintptr_t)view.buf + (uintptr_t)view.len};
        PyBuffer_Release(&view);
    }
    Py_DECREF(fast);
    if (ok && overlapping(r, used) >= 0) ok = 0;
    PyMem_Free(r);
    return PyBool_FromLong(ok);
}

/* stream_copy(dst, src) -> bool: copy src's bytes into dst with the interpreter lock
 * released, by non-temporal stores where the build has SSE2 (every x86-64): the
 * destination's lines are written without being read first (a cached store reads each
 * line before it writes it) and without displacing the cache, so a large copy moves two
 * bytes per byte instead of three. dst is a writable C-contiguous buffer; src any
 * strided buffer of the same length whose elements, in C order, are dst's (numpy
 * exports a slice of a larger array so: a chunk cut from one KV tensor); its innermost
 * contiguous run must be at least STREAM_RUN bytes. False, and nothing copied, where it
 * is not, or where src and dst share memory: the caller copies another way. The store
 * fence makes the bytes visible to other threads and processes, as memcpy's are,
 * before the call returns. What a served put's client copies into the arena (the
 * server hashes it from memory, not from this core's cache); kvlife.native.copies
 * decides when to call it. */
#define STREAM_RUN 1024

static void copy_streaming(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* Blocks a sealed copy hashes and then copies (from this core's cache, just read). */
#define SEALED_BLOCK (32 << 10)

static void copy_hashing(char *dst, const char *src, size_t n, void *state, xxh_update_fn update) {
    for (size_t at = 0; at < n; at += SEALED_BLOCK) {
        size_t len = n - at < SEALED_BLOCK ? n - at : SEALED_BLOCK;
        update(state, src + at, len);
        copy_streaming(dst + at, src + at, len);
    }
}

/* The copy of stream_copy (its arguments, its checks), each run hashed into `state`
 * as it is copied when `state` is not NULL. 1: copied; 0: refused, nothing copied. */
static int stream_into(PyObject *dst_obj, PyObject *src_obj, void *state, xxh_update_fn update) {
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return -1;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES) != 0) {
        PyBuffer_Release(&dst);
        return -1;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy of %zd bytes into %zd", src.len, dst.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return -1;
    }
    uintptr_t low, high;
    byte_span(&src, &low, &high);
    /* an exporter that gives no strides (ctypes does) is C-contiguous: one run */
    int outer = src.strides != NULL ? src.ndim : 0; /* the axes above the run */
    Py_ssize_t run = outer ? src.itemsize : src.len; /* src's innermost contiguous run */
    /* trailing axes merge into the run while each one's stride is the run so far (an
     * axis of length 1 merges whatever its stride: it adds no element) */
    while (outer > 0 && (src.shape[outer - 1] == 1 || src.strides[outer - 1] == run)) {
        run *= src.shape[outer - 1];
        outer--;
    }
    uintptr_t dlow = (uintptr_t)dst.buf, dhigh = dlow + (uintptr_t)dst.len;
    int ok = src.len > 0 && low < high && outer <= 64 && run >= STREAM_RUN &&
             (dhigh <= low || high <= dlow);
    if (ok) {
        char *out = (char *)dst.buf;
        const char *base = (const char *)src.buf;
        Py_ssize_t idx[64] = {0};
        Py_ssize_t rows = 1;
        for (int d = 0; d < outer; d++) rows *= src.shape[d];
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < rows; r++) {
            Py_ssize_t at = 0;
            for (int d = 0; d < outer; d++) at += idx[d] * src.strides[d];
            if (state != NULL) copy_hashing(out + r * run, base + at, (size_t)run, state, update);
            else copy_streaming(out + r * run, base + at, (size_t)run);
            for (int d = outer - 1; d >= 0; d--) { /* the next row, in C order */
                if (++idx[d] < src.shape[d]) break;
                idx[d] = 0;
            }
        }
#if defined(__SSE2__)
        _mm_sfence();
#endif
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return ok;
}

static PyObject *stream_copy(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj)) return NULL;
    int ok = stream_into(dst_obj, src_obj, NULL, NULL);
    return ok < 0 ? NULL : PyBool_FromLong(ok);
}

/* copy_sealed(dst, src) -> 16 bytes or None: stream_copy's copy, with the xxh3-128 of
 * the bytes copied (canonical, as xxhash's digest() gives it) taken as they pass: each
 * block of src hashed, then copied from this core's cache, so the seal costs no second
 * pass over memory. None, nothing copied, where stream_copy would refuse or no
 * streaming hash is set: the caller copies and hashes another way. The seal is of the
 * bytes read from src; a caller that changes src meanwhile gets a seal its copy fails
 * where seals are verified (a miss, never a wrong hit). What a served put's client
 * sends with its commit instead of the server hashing the arena (issue 28). */
static PyObject *copy_sealed(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj)) return NULL;
    stream_t fn = stream_fns;
    if (!stream_complete(&fn)) Py_RETURN_NONE;
    void *st = fn.create();
    if (st == NULL || fn.reset(st) != 0) {
        if (st != NULL) fn.free(st);
        return PyErr_NoMemory();
    }
    int ok = stream_into(dst_obj, src_obj, st, fn.update);
    if (ok <= 0) {
        fn.free(st);
        if (ok < 0) return NULL;
        Py_RETURN_NONE;
    }
    xxh128_t h = fn.digest(st);
    fn.free(st);
    return canonical(h);
}

/* set_piece(n) -> the size it replaces: the smallest piece a run's last frame is read
 * in (frames of at most twice it are read whole), for runs started after it; a multiple
 * of 4096 of at least MIN_PIECE. */
static PyObject *set_piece(PyObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < MIN_PIECE || n % 4096) {
        PyErr_Format(PyExc_ValueError, "a piece of %zd bytes: not a multiple of 4096 of at least %zd",
                     n, (Py_ssize_t)MIN_PIECE);
        return NULL;
    }
    return PyLong_FromSsize_t(__atomic_exchange_n(&piece_bytes, n, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"set_piece", set_piece, METH_O,
     "set_piece(n) -> previous: the smallest piece of a run's last frame read in pieces."},
    {"copy_sealed", copy_sealed, METH_VARARGS,
     "copy_sealed(dst, src) -> 16 bytes or None: stream_copy, hashed (xxh3-128) as it copies."},
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(dst, src) -> bool: src into C-contiguous dst by streaming stores, no GIL."},
    {"read_run", read_run, METH_VARARGS,
     "read_run(frames, depth, hash_address, on_frame): read and verify frames without the GIL."},
    {"start_direct", start_direct, METH_VARARGS,
     "start_direct(frames, depth, hash_address): a DirectRun whose reads are under way."},
    {"xxh3_128", xxh3_128, METH_VARARGS, "xxh3_128(buffer, hash_address): canonical digest."},
    {"set_stream", set_stream, METH_VARARGS,
     "set_stream(create, free, reset, update, digest): xxhash's streaming xxh3-128."},
    {"xxh3_128_stream", xxh3_128_stream, METH_VARARGS,
     "xxh3_128_stream(buffer, piece): canonical digest, hashed piece by piece."},
    {"streamed", streamed, METH_NOARGS, "streamed(): frames verified as their pieces landed."},
    {"disjoint", disjoint, METH_O,
     "disjoint(arrays): whether all are writable, C-contiguous and share no byte."},
    {"spans", spans, METH_O, "spans(arrays): [(low, high, flags) or None], as np.byte_bounds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frames", NULL, -1, methods};

PyMODINIT_FUNC PyInit__frames(void) {
    if (PyType_Ready(&DirectRunType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "OK", OK) || PyModule_AddIntConstant(m, "HEADER_DIFFERS", HEADER_DIFFERS) ||
        PyModule_AddIntConstant(m, "CHECKSUM_MISMATCH", CHECKSUM_MISMATCH) ||
        PyModule_AddIntConstant(m, "TRUNCATED", TRUNCATED) ||
        PyModule_AddIntConstant(m, "READ_ERROR", READ_ERROR) ||
        PyModule_AddIntConstant(m, "DIRECT_STEPS", 1) ||
        PyModule_AddIntConstant(m, "DIRECT_PROGRESS", 1) ||
        PyModule_AddIntConstant(m, "MIN_PIECE", (long)MIN_PIECE) ||
        PyModule_AddIntConstant(m, "STREAM_RUN", STREAM_RUN)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
