/* The expert pager: the interior pages of every routed-expert tensor in llama.cpp's own
   mapping become anonymous memory moepack owns (MAP_FIXED at the same addresses), registered
   with userfaultfd in missing-page mode. Nothing there is ever read as zeros: a touched page
   that is not resident waits in the kernel until this thread has read its expert slice
   (O_DIRECT, into aligned buffers, by `qd` reader threads) and placed it: with UFFDIO_MOVE
   where the kernel has it (6.8+), the read's pages themselves moved into place and evicted
   pages moved back out into a small spare pool that the next reads fill, so in the steady
   state no page is allocated, zeroed or copied (bench_pager.py mech: 3.4x less CPU per GB
   than UFFDIO_COPY); UFFDIO_COPY otherwise.
   Demand and speculation arrive from the read-ahead hook (moepack_pager_push, the fetcher's
   queue semantics); a fault is served first, whole slice. Resident pages (in flight and the
   spare pool included) never exceed the budget: demand and faults evict the least recently
   used slices (into the spare pool, which the next reads take their pages from, or with
   MADV_DONTNEED), speculation only uses what is free.
   It never waits forever. llama.cpp's MUL_MAT_ID has each compute thread on one expert's
   slice at a time (no barrier between experts), so each thread's last faulted slice is
   guarded from eviction until that thread faults elsewhere (UFFD_FEATURE_THREAD_ID; without
   it, the last `guards` faulted slices): with a budget of `guards` largest slices every
   fault finds room once the reads in flight land. A fault that still finds none ends the
   process with one line; an interrupt (the worker's signal wakeup pipe) with faults waiting
   and no read placed for STOP_GRACE_NS ends it at once, as a second interrupt does.
   MOEPACK_PAGER_HOLD_READS=1 (for tests) holds every read, as a device that stopped
   answering. Built by cbuild, driven by pager.py. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif
#ifndef UFFD_FEATURE_MOVE /* Linux 6.8's uapi, for older headers */
#define UFFD_FEATURE_MOVE (1 << 16)
struct uffdio_move { uint64_t dst, src, len, mode; int64_t move; };
#define UFFDIO_MOVE _IOWR(UFFDIO, 0x05, struct uffdio_move)
#endif

#define MAX_SHARDS 256
#define MAX_QD 64
#define MAX_TRIES 3
#define MAX_GUARDS 4096
#define STOP_GRACE_NS 3000000000LL /* after an interrupt: how long faults may wait for no read placed */

enum { MISSING = 0, INFLIGHT = 1, PRESENT = 2 };

struct region { /* one expert tensor: its whole pages inside the tensor */
    int64_t shard, layer, n_expert, slice, tensor_off, lo, hi, base, page0, unit0;
};

struct unit { /* one expert's slice of one tensor: global pages [p0, p1) */
    int64_t p0, p1;
    int32_t prev, next, region, expert;
    uint8_t in_lru, queued, asked;
};

struct io {
    int64_t unit, g0, n, off, shard, result;
    int tries;
    char * buf;
    struct io * next;
};

struct batch {
    struct batch * next;
    int32_t layer, kind; /* 0 demand, 1 speculation, 2 evict */
    int64_t n, done;
    int64_t * rows; /* n x 4: shard, expert, offset, length */
};

struct guard { /* a thread's last faulted slice, kept resident until it faults elsewhere */
    int64_t key, unit, stamp; /* key: the thread id (or a count, without thread ids) */
};

struct pstats { /* pager.py's PagerStats, in order */
    int64_t demand_experts, demand_hits, demand_pieces, demand_bytes, demand_missing;
    int64_t spec_pieces, spec_bytes, spec_missing, spec_dropped, spec_refused;
    int64_t evicted_pieces, evicted_bytes, forced_evictions, forced_bytes;
    int64_t faults, fault_waits, faults_unasked, faults_stale, faults_dropped;
    int64_t reads, read_bytes, ns_reading, copies, ns_copying, errors;
    int64_t resident_pages, peak_pages, budget_pages, total_pages;
    int64_t moved_pages, recycled_pages, spare_pages; /* UFFDIO_MOVE: placed, evicted to spare */
    int64_t guard_releases; /* guards let go to serve a fault that found no room otherwise */
    int64_t demand_dropped; /* demand pieces not read: no room, none in flight (all guarded) */
};

struct pager {
    int uffd, efd_work, efd_done, qd;
    int fds[MAX_SHARDS], n_fds, direct;
    int64_t page, chunk_pages;
    struct region * regions; int n_regions;
    struct unit * units; int64_t n_units;
    uint8_t * state; int64_t n_pages;
    int32_t lru_head, lru_tail;
    /* coordinator FIFOs of units (ring buffers of n_units) */
    int64_t * fq; int64_t fq_h, fq_n;
    int64_t * dq; int64_t dq_h, dq_n;
    int64_t spec_unit;
    int32_t * by_addr; /* region indices in address order */
    pthread_t coord, readers[MAX_QD];
    /* shared with the pushing threads and the readers */
    pthread_mutex_t mu;
    pthread_cond_t io_cv, idle_cv;
    struct batch * in_head, * in_tail, * sq_head, * sq_tail;
    int last_demand, closing, idle, drop_req, drop_gen;
    struct io * io_free, * io_sub, * io_sub_tail, * io_done;
    int inflight, started;
    struct io ios[MAX_QD];
    struct pstats st;
    int64_t * log; int64_t log_n, log_cap; /* speculative reads: layer, expert, bytes */
    /* UFFDIO_MOVE: read buffers and a spare pool registered like the regions (a move's
       destination must be), pages only the coordinator moves; `spare_n` pages at the front */
    int move;
    char * bufs, * spare, * zeros;
    int64_t spare_cap, spare_n;
    /* guards (coordinator only); interrupts through the signal wakeup pipe */
    struct guard * guards; int guard_n; int64_t guard_clock;
    int stop_fd, stops_seen, hold;
    int64_t stop_ns, progress_ns;
};

/* interrupts any pager of this process read off the wakeup pipe (each byte goes to one) */
static int stop_count, stop_signo;

static int64_t now_ns(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void kick(int fd) { uint64_t one = 1; ssize_t w = write(fd, &one, sizeof one); (void) w; }
static void drain_fd(int fd) { uint64_t v; ssize_t r = read(fd, &v, sizeof v); (void) r; }

/* ---- userfaultfd ------------------------------------------------------------------------ */

static int raw_uffd(int * how) {
    int fd = (int) syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    int err = errno;
    *how = 1;
    if (fd < 0) { fd = (int) syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK); *how = 2; }
    if (fd < 0) {
        int dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
        if (dev >= 0) {
            fd = ioctl(dev, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
            close(dev);
            *how = 3;
        }
    }
    return fd < 0 ? -(err ? err : ENOSYS) : fd;
}

/* the handshake with the faulting threads' ids (Linux 4.14), else with no feature */
static int uffd_plain(int * how) {
    for (int bare = 0; bare < 2; bare++) {
        int fd = raw_uffd(how);
        if (fd < 0) return fd;
        struct uffdio_api api = { .api = UFFD_API, .features = bare ? 0 : UFFD_FEATURE_THREAD_ID };
        if (ioctl(fd, UFFDIO_API, &api) != 0) { /* once per descriptor: a new one without it */
            int e = errno;
            close(fd);
            if (bare) return -e;
            continue;
        }
        if (!(api.ioctls & (1ULL << _UFFDIO_REGISTER))) { close(fd); return -ENOTSUP; }
        return fd;
    }
    return -ENOTSUP;
}

/* a userfaultfd with the API handshake done, or -errno: the syscall (user-mode faults only,
   as unprivileged use allows, then without that), else /dev/userfaultfd */
int moepack_pager_uffd_open(int * how) {
    int fd = raw_uffd(how);
    if (fd < 0) return fd;
#ifdef UFFD_FEATURE_EXACT_ADDRESS
    /* the faulting byte, not its page: a page two slices share is served as the one read;
       the faulting thread (its guard); and moves where the kernel has them */
    const uint64_t want = UFFD_FEATURE_EXACT_ADDRESS | UFFD_FEATURE_THREAD_ID;
    struct uffdio_api api = { .api = UFFD_API, .features = want | UFFD_FEATURE_MOVE };
    if (ioctl(fd, UFFDIO_API, &api) != 0) {
        close(fd); /* the handshake is once per descriptor: a new one without the features */
        fd = raw_uffd(how);
        if (fd < 0) return fd;
        api = (struct uffdio_api) { .api = UFFD_API, .features = want };
        if (ioctl(fd, UFFDIO_API, &api) != 0) { close(fd); return uffd_plain(how); }
    }
    if (!(api.ioctls & (1ULL << _UFFDIO_REGISTER))) { close(fd); return -ENOTSUP; }
    return fd;
#else
    close(fd);
    return uffd_plain(how);
#endif
}

/* ---- pages, units, the LRU ---------------------------------------------------------------- */

static struct region * unit_region(struct pager * p, struct unit * u) { return &p->regions[u->region]; }

static int64_t page_addr(struct pager * p, struct region * r, int64_t g) {
    return r->base + r->lo + (g - r->page0) * p->page;
}

static int64_t page_off(struct pager * p, struct region * r, int64_t g) {
    return r->lo + (g - r->page0) * p->page;
}

static void lru_unlink(struct pager * p, int32_t i) {
    struct unit * u = &p->units[i];
    if (!u->in_lru) return;
    if (u->prev >= 0) p->units[u->prev].next = u->next; else p->lru_head = u->next;
    if (u->next >= 0) p->units[u->next].prev = u->prev; else p->lru_tail = u->prev;
    u->prev = u->next = -1; u->in_lru = 0;
}

static void lru_front(struct pager * p, int32_t i) {
    struct unit * u = &p->units[i];
    lru_unlink(p, i);
    u->prev = -1; u->next = p->lru_head;
    if (p->lru_head >= 0) p->units[p->lru_head].prev = i;
    p->lru_head = i;
    if (p->lru_tail < 0) p->lru_tail = i;
    u->in_lru = 1;
}

static void count_resident(struct pager * p, int64_t delta) {
    pthread_mutex_lock(&p->mu);
    p->st.resident_pages += delta;
    if (p->st.resident_pages > p->st.peak_pages) p->st.peak_pages = p->st.resident_pages;
    pthread_mutex_unlock(&p->mu);
}

/* ---- moves --------------------------------------------------------------------------------- */

/* move n pages src -> dst (dst registered and missing); returns the bytes moved. Busy pages
   (a folio the kernel holds for a moment) are tried again for up to a millisecond. */
static int64_t move_range(struct pager * p, char * dst, char * src, int64_t n) {
    int64_t len = n * p->page, done = 0;
    int busy = 0;
    while (done < len) {
        struct uffdio_move m = { .dst = (uint64_t) (dst + done), .src = (uint64_t) (src + done),
                                 .len = (uint64_t) (len - done), .mode = 0, .move = 0 };
        if (ioctl(p->uffd, UFFDIO_MOVE, &m) == 0) return len;
        if (m.move > 0) { done += m.move; continue; }
        if (errno == EAGAIN) { sched_yield(); continue; }
        if (errno == EBUSY && ++busy < 100) { /* an O_DIRECT completion lets go of its pages
                                                  just after it wakes the reader */
            struct timespec t = { 0, 10000 };
            nanosleep(&t, 0);
            continue;
        }
        break;
    }
    return done;
}

/* evicted pages kept for the next reads (resident still, counted so): how many of n */
static int64_t to_spare(struct pager * p, char * from, int64_t n) {
    if (!p->move) return 0;
    int64_t k = p->spare_cap - p->spare_n < n ? p->spare_cap - p->spare_n : n;
    if (k <= 0) return 0;
    int64_t got = move_range(p, p->spare + p->spare_n * p->page, from, k) / p->page;
    p->spare_n += got;
    pthread_mutex_lock(&p->mu); p->st.recycled_pages += got; pthread_mutex_unlock(&p->mu);
    return got;
}

/* a read buffer's first n pages there before the read (the reader must never fault on its
   own buffer: nobody would serve it): the spare pool's pages first (counted already, as the
   read's now), new pages for the rest (counted here). A spare page that would not move is
   freed before any new page is counted, so the count never passes what `reserve` allowed. */
static void fill_buffer(struct pager * p, char * buf, int64_t n) {
    int64_t k = p->spare_n < n ? p->spare_n : n, got = 0;
    if (k > 0) {
        char * from = p->spare + (p->spare_n - k) * p->page;
        got = move_range(p, buf, from, k) / p->page;
        if (got < k) {
            madvise(from + got * p->page, (size_t) ((k - got) * p->page), MADV_DONTNEED);
            count_resident(p, -(k - got));
        }
        p->spare_n -= k;
    }
    if (got < n) count_resident(p, n - got);
    for (int64_t done = got * p->page, len = n * p->page; done < len;) {
        int64_t step = len - done < p->chunk_pages * p->page ? len - done : p->chunk_pages * p->page;
        struct uffdio_copy c = { .dst = (uint64_t) (buf + done), .src = (uint64_t) p->zeros,
                                 .len = (uint64_t) step, .mode = 0, .copy = 0 };
        if (ioctl(p->uffd, UFFDIO_COPY, &c) == 0) { done += step; continue; }
        if (c.copy > 0) { done += c.copy; continue; }
        if (errno == EAGAIN) continue;
        /* a page is there already: seen under memory pressure with compaction running (1 run
           of 2 at 12 GiB left on a 17 GB model). The read overwrites it; it was counted when
           it came, so counting it again here only errs towards less than the budget. */
        if (errno == EEXIST) { done += p->page; continue; }
        fprintf(stderr, "moepack: error: the expert pager could not allocate its read buffer "
                "(%s)\n", strerror(errno));
        abort(); /* a reader would wait on its own buffer forever */
    }
}

/* ---- guards: the slice each computing thread is in ------------------------------------------- */

static int guarded(struct pager * p, int64_t i) {
    for (int k = 0; k < p->guard_n; k++) if (p->guards[k].unit == i) return 1;
    return 0;
}

/* thread `tid` (0: not known) faulted in unit i: it stays resident until that thread faults
   elsewhere (the least recently faulting thread's guard goes when there are more threads) */
static void guard(struct pager * p, uint32_t tid, int64_t i) {
    int64_t key = tid ? (int64_t) tid : -(p->guard_clock + 1); /* no ids: each fault its own */
    int slot = 0;
    for (int k = 0; k < p->guard_n; k++) {
        if (p->guards[k].key == key) { slot = k; break; }
        if (p->guards[k].stamp < p->guards[slot].stamp) slot = k;
    }
    p->guards[slot] = (struct guard) { key, i, ++p->guard_clock };
}

/* let the oldest guard not on unit `keep` go; 0 when there is none */
static int release_guard(struct pager * p, int64_t keep) {
    int slot = -1;
    for (int k = 0; k < p->guard_n; k++)
        if (p->guards[k].unit >= 0 && p->guards[k].unit != keep
            && (slot < 0 || p->guards[k].stamp < p->guards[slot].stamp)) slot = k;
    if (slot < 0) return 0;
    p->guards[slot] = (struct guard) { 0, -1, 0 };
    pthread_mutex_lock(&p->mu); p->st.guard_releases++; pthread_mutex_unlock(&p->mu);
    return 1;
}

static int64_t present_pages(struct pager * p, int64_t g0, int64_t g1) {
    int64_t n = 0;
    for (int64_t g = g0; g < g1; g++) n += p->state[g] == PRESENT;
    return n;
}

/* drop the unit's resident pages (never those in flight, nor a page it shares with a guarded
   slice); it leaves the LRU once none is left. Returns the pages taken out of place. */
static int64_t drop_unit(struct pager * p, int64_t i) {
    struct unit * u = &p->units[i];
    struct region * r = unit_region(p, u);
    int64_t lo = u->p0, hi = u->p1;
    for (int k = 0; k < p->guard_n && lo < hi; k++) {
        int64_t w = p->guards[k].unit;
        if (w < 0 || w == i) continue;
        struct unit * o = &p->units[w];
        if (o->p1 <= lo || o->p0 >= hi) continue;
        if (o->p0 <= lo) lo = o->p1 < hi ? o->p1 : hi; /* shared at the start */
        else if (o->p1 >= hi) hi = o->p0;              /* at the end */
        else lo = hi;                                  /* inside (slices under a page) */
    }
    int64_t taken = 0, freed = 0;
    for (int64_t g = lo; g < hi;) {
        if (p->state[g] != PRESENT) { g++; continue; }
        int64_t h = g;
        while (h < hi && p->state[h] == PRESENT) h++;
        int64_t kept = to_spare(p, (char *) page_addr(p, r, g), h - g);
        if (kept < h - g)
            madvise((void *) page_addr(p, r, g + kept), (size_t) ((h - g - kept) * p->page), MADV_DONTNEED);
        memset(p->state + g, MISSING, (size_t) (h - g));
        taken += h - g; freed += h - g - kept;
        g = h;
    }
    if (!present_pages(p, u->p0, u->p1)) lru_unlink(p, (int32_t) i);
    if (freed) count_resident(p, -freed);
    return taken;
}

static int64_t missing_pages(struct pager * p, struct unit * u) {
    int64_t n = 0;
    for (int64_t g = u->p0; g < u->p1; g++) n += p->state[g] == MISSING;
    return n;
}

/* room for a read of n more pages (what the spare pool holds is the read's own: its pages
   go into the read's buffer), evicting least recently used units (not `keep`, not a guarded
   one) when `evict`; 0 when the rest is in flight or guarded */
static int reserve(struct pager * p, int64_t n, int evict, int64_t keep) {
    int32_t v = p->lru_tail;
    for (;;) {
        int64_t reused = p->move ? (p->spare_n < n ? p->spare_n : n) : 0;
        pthread_mutex_lock(&p->mu);
        int fits = p->st.resident_pages + n - reused <= p->st.budget_pages;
        pthread_mutex_unlock(&p->mu);
        if (fits) return 1;
        if (!evict) return 0;
        while (v >= 0 && (v == keep || guarded(p, v))) v = p->units[v].prev;
        if (v < 0) return 0; /* everything else is in flight or guarded: wait for the reads */
        int32_t next = p->units[v].prev;
        int64_t d = drop_unit(p, v);
        if (d) {
            pthread_mutex_lock(&p->mu);
            p->st.forced_evictions++; p->st.forced_bytes += d * p->page;
            pthread_mutex_unlock(&p->mu);
        }
        v = next;
    }
}

/* ---- reads -------------------------------------------------------------------------------- */

static void * reader(void * arg) {
    struct pager * p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->closing && !p->io_sub) pthread_cond_wait(&p->io_cv, &p->mu);
        if (p->closing) break;
        struct io * io = p->io_sub;
        p->io_sub = io->next; if (!p->io_sub) p->io_sub_tail = 0;
        if (p->hold) { /* tests: a device that stopped answering */
            while (!p->closing) pthread_cond_wait(&p->io_cv, &p->mu);
            break;
        }
        pthread_mutex_unlock(&p->mu);
        int64_t want = io->n * p->page, got = 0, t0 = now_ns();
        int fd = p->fds[io->shard];
        while (got < want) {
            ssize_t k = pread(fd, io->buf + got, (size_t) (want - got), io->off + got);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) break;
            got += k;
        }
        if (!p->direct && got > 0) posix_fadvise(fd, io->off, got, POSIX_FADV_DONTNEED);
        int64_t dt = now_ns() - t0;
        pthread_mutex_lock(&p->mu);
        io->result = got;
        p->st.reads++; p->st.read_bytes += got; p->st.ns_reading += dt;
        io->next = p->io_done; p->io_done = io;
        kick(p->efd_done);
    }
    pthread_mutex_unlock(&p->mu);
    return 0;
}

enum { SENT = 1, NOTHING = 0, NO_BUFFER = -1, NO_ROOM = -2 };

/* read the next missing run of unit i (at most chunk_pages) */
static int submit_unit(struct pager * p, int64_t i, int evict) {
    struct unit * u = &p->units[i];
    int64_t g = u->p0;
    while (g < u->p1 && p->state[g] != MISSING) g++;
    if (g >= u->p1) return NOTHING;
    int64_t h = g;
    while (h < u->p1 && p->state[h] == MISSING && h - g < p->chunk_pages) h++;
    pthread_mutex_lock(&p->mu);
    struct io * io = p->io_free;
    pthread_mutex_unlock(&p->mu);
    if (!io) return NO_BUFFER;
    if (!reserve(p, h - g, evict, i)) return NO_ROOM;
    pthread_mutex_lock(&p->mu);
    p->io_free = io->next;
    p->inflight++;
    pthread_mutex_unlock(&p->mu);
    struct region * r = unit_region(p, u);
    memset(p->state + g, INFLIGHT, (size_t) (h - g));
    if (p->move) fill_buffer(p, io->buf, h - g); /* counts what it adds */
    else count_resident(p, h - g);
    io->unit = i; io->g0 = g; io->n = h - g; io->off = page_off(p, r, g); io->shard = r->shard;
    io->result = 0; io->tries = 0; io->next = 0;
    lru_front(p, (int32_t) i);
    pthread_mutex_lock(&p->mu);
    if (p->io_sub_tail) p->io_sub_tail->next = io; else p->io_sub = io;
    p->io_sub_tail = io;
    pthread_cond_signal(&p->io_cv);
    pthread_mutex_unlock(&p->mu);
    return SENT;
}

/* place a finished read: UFFDIO_COPY wakes whoever waits on those pages */
static void place(struct pager * p, struct io * io) {
    struct unit * u = &p->units[io->unit];
    struct region * r = unit_region(p, u);
    int64_t len = io->n * p->page;
    if (io->result != len) { /* a failed or short read: read it again, a few times */
        if (++io->tries >= MAX_TRIES) {
            fprintf(stderr, "moepack: error: the expert pager could not read %lld bytes at "
                    "offset %lld of shard %lld\n", (long long) len, (long long) io->off,
                    (long long) io->shard);
            abort(); /* a page that cannot be read must never be computed on as zeros */
        }
        pthread_mutex_lock(&p->mu);
        p->st.errors++;
        io->next = 0;
        if (p->io_sub_tail) p->io_sub_tail->next = io; else p->io_sub = io;
        p->io_sub_tail = io;
        pthread_cond_signal(&p->io_cv);
        pthread_mutex_unlock(&p->mu);
        return;
    }
    int64_t t0 = now_ns(), done = 0;
    if (p->move) { /* the read's pages themselves into place; what could not move is copied */
        done = move_range(p, (char *) page_addr(p, r, io->g0), io->buf, io->n);
        pthread_mutex_lock(&p->mu); p->st.moved_pages += done / p->page; pthread_mutex_unlock(&p->mu);
    }
    int64_t copied_from = len - done;
    while (done < len) {
        struct uffdio_copy c = { .dst = (uint64_t) page_addr(p, r, io->g0) + (uint64_t) done,
                                 .src = (uint64_t) (io->buf + done),
                                 .len = (uint64_t) (len - done), .mode = 0, .copy = 0 };
        if (ioctl(p->uffd, UFFDIO_COPY, &c) == 0) { done = len; break; }
        if (c.copy > 0) { done += c.copy; continue; }
        if (errno == EAGAIN) continue;
        if (errno == EEXIST) { done += p->page; continue; } /* that page is there already */
        pthread_mutex_lock(&p->mu); p->st.errors++; pthread_mutex_unlock(&p->mu);
        break; /* the range is gone (the model was unmapped): nothing waits on it */
    }
    /* the buffer is empty between reads: what was copied instead of moved goes */
    if (p->move && copied_from > 0) madvise(io->buf, (size_t) len, MADV_DONTNEED);
    memset(p->state + io->g0, PRESENT, (size_t) io->n);
    if (!u->in_lru) lru_front(p, (int32_t) io->unit);
    p->progress_ns = now_ns();
    pthread_mutex_lock(&p->mu);
    p->st.copies++; p->st.ns_copying += p->progress_ns - t0;
    p->inflight--;
    io->next = p->io_free; p->io_free = io;
    pthread_mutex_unlock(&p->mu);
}

/* ---- what arrives: faults and the hook's batches ------------------------------------------ */

static int64_t find_region_addr(struct pager * p, int64_t addr) {
    int lo = 0, hi = p->n_regions - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        struct region * r = &p->regions[p->by_addr[mid]];
        if (addr < r->base + r->lo) hi = mid - 1;
        else if (addr >= r->base + r->hi) lo = mid + 1;
        else return p->by_addr[mid];
    }
    return -1;
}

static struct region * sort_regions; /* qsort's comparison reads it (only while setting up) */

static int by_address(const void * a, const void * b) {
    const struct region * x = &sort_regions[*(const int32_t *) a], * y = &sort_regions[*(const int32_t *) b];
    int64_t u = x->base + x->lo, v = y->base + y->lo;
    return u < v ? -1 : u > v;
}

static int64_t find_unit_row(struct pager * p, const int64_t * row) {
    for (int lo = 0, hi = p->n_regions - 1; lo <= hi;) {
        int mid = (lo + hi) / 2;
        struct region * r = &p->regions[mid];
        int64_t end = r->tensor_off + r->n_expert * r->slice;
        if (row[0] < r->shard || (row[0] == r->shard && row[2] < r->tensor_off)) hi = mid - 1;
        else if (row[0] > r->shard || row[2] >= end) lo = mid + 1;
        else return row[1] >= 0 && row[1] < r->n_expert ? r->unit0 + row[1] : -1;
    }
    return -1;
}

static void fifo_push(struct pager * p, int64_t * q, int64_t * h, int64_t * n, int64_t i, uint8_t bit) {
    if (p->units[i].queued & bit) return;
    p->units[i].queued |= bit;
    q[(*h + *n) % p->n_units] = i;
    (*n)++;
}

static int64_t fifo_pop(struct pager * p, int64_t * q, int64_t * h, int64_t * n, uint8_t bit) {
    int64_t i = q[*h];
    *h = (*h + 1) % p->n_units; (*n)--;
    p->units[i].queued &= (uint8_t) ~bit;
    return i;
}

static void on_fault(struct pager * p, uint64_t addr, uint32_t tid) {
    int64_t exact = (int64_t) addr, a = (int64_t) (addr & ~(uint64_t) (p->page - 1));
    int64_t ri = find_region_addr(p, a);
    pthread_mutex_lock(&p->mu); p->st.faults++; pthread_mutex_unlock(&p->mu);
    if (ri < 0) return;
    struct region * r = &p->regions[ri];
    int64_t g = r->page0 + (a - r->base - r->lo) / p->page;
    int64_t e = (exact - r->base - r->tensor_off) / r->slice;
    if (e < 0) e = 0;
    if (e >= r->n_expert) e = r->n_expert - 1;
    int64_t i = r->unit0 + e;
    guard(p, tid, i); /* the thread computes on this slice now */
    if (p->state[g] == PRESENT) { /* a stale event, or a page someone else dropped */
        unsigned char vec = 0;
        if (mincore((void *) a, (size_t) p->page, &vec) == 0 && (vec & 1)) {
            struct uffdio_range w = { .start = (uint64_t) a, .len = (uint64_t) p->page };
            ioctl(p->uffd, UFFDIO_WAKE, &w);
            pthread_mutex_lock(&p->mu); p->st.faults_stale++; pthread_mutex_unlock(&p->mu);
            return;
        }
        p->state[g] = MISSING;
        count_resident(p, -1);
        pthread_mutex_lock(&p->mu); p->st.faults_dropped++; pthread_mutex_unlock(&p->mu);
    }
    if (p->state[g] == INFLIGHT) return; /* its copy wakes the fault */
    pthread_mutex_lock(&p->mu);
    p->st.fault_waits++;
    if (!p->units[i].asked) p->st.faults_unasked++;
    pthread_mutex_unlock(&p->mu);
    p->units[i].asked = 1;
    fifo_push(p, p->fq, &p->fq_h, &p->fq_n, i, 1);
}

static void read_faults(struct pager * p) {
    struct uffd_msg msg[16];
    for (;;) {
        ssize_t k = read(p->uffd, msg, sizeof msg);
        if (k <= 0) return;
        for (ssize_t j = 0; j < k / (ssize_t) sizeof msg[0]; j++)
            if (msg[j].event == UFFD_EVENT_PAGEFAULT)
                on_fault(p, msg[j].arg.pagefault.address, msg[j].arg.pagefault.feat.ptid);
    }
}

static void log_spec(struct pager * p, int32_t layer, int64_t expert, int64_t bytes) {
    if (p->log_n == p->log_cap) {
        int64_t cap = p->log_cap ? 2 * p->log_cap : 1024;
        int64_t * grown = realloc(p->log, (size_t) cap * 3 * sizeof(int64_t));
        if (!grown) return;
        p->log = grown; p->log_cap = cap;
    }
    p->log[3 * p->log_n] = layer; p->log[3 * p->log_n + 1] = expert; p->log[3 * p->log_n + 2] = bytes;
    p->log_n++;
}

static void take_demand(struct pager * p, struct batch * b) {
    if (b->kind == 2) {
        int64_t bytes = 0;
        for (int64_t k = 0; k < b->n; k++) {
            int64_t i = find_unit_row(p, b->rows + 4 * k);
            /* a slice a thread computes on stays: the pager's LRU lets it go later */
            if (i >= 0 && !guarded(p, i)) bytes += drop_unit(p, i) * p->page;
        }
        pthread_mutex_lock(&p->mu);
        p->st.evicted_pieces += b->n; p->st.evicted_bytes += bytes;
        pthread_mutex_unlock(&p->mu);
        return;
    }
    int64_t experts = 0, hits = 0, bytes = 0, miss = 0;
    for (int64_t k = 0; k < b->n; k++) {
        const int64_t * row = b->rows + 4 * k;
        int64_t i = find_unit_row(p, row);
        int64_t m = i >= 0 ? missing_pages(p, &p->units[i]) * p->page : 0;
        bytes += row[3]; miss += m < row[3] ? m : row[3];
        if (i < 0) continue;
        p->units[i].asked = 1;
        lru_front(p, (int32_t) i);
        if (m) fifo_push(p, p->dq, &p->dq_h, &p->dq_n, i, 2);
    }
    /* an expert is a hit when none of its slices missed a page */
    int64_t max_e = 0;
    for (int64_t k = 0; k < b->n; k++) if (b->rows[4 * k + 1] > max_e) max_e = b->rows[4 * k + 1];
    uint8_t * seen = calloc((size_t) max_e + 1, 1);
    if (seen) {
        for (int64_t k = 0; k < b->n; k++) {
            int64_t e = b->rows[4 * k + 1], i = find_unit_row(p, b->rows + 4 * k);
            if (!seen[e]) { seen[e] = 1; experts++; }
            if (i >= 0 && (p->units[i].queued & 2)) seen[e] = 2;
        }
        for (int64_t e = 0; e <= max_e; e++) hits += seen[e] == 1;
        free(seen);
    }
    pthread_mutex_lock(&p->mu);
    p->st.demand_pieces += b->n; p->st.demand_bytes += bytes; p->st.demand_missing += miss;
    p->st.demand_experts += experts; p->st.demand_hits += hits;
    pthread_mutex_unlock(&p->mu);
}

/* the next speculative piece, once nothing else waits; -1 when there is none */
static int64_t take_spec(struct pager * p) {
    for (;;) {
        pthread_mutex_lock(&p->mu);
        struct batch * b = p->sq_head;
        if (!b || p->in_head) { pthread_mutex_unlock(&p->mu); return -1; }
        int64_t row[4];
        memcpy(row, b->rows + 4 * b->done, sizeof row);
        int32_t layer = b->layer;
        if (++b->done == b->n) {
            p->sq_head = b->next; if (!p->sq_head) p->sq_tail = 0;
            free(b->rows); free(b);
        }
        pthread_mutex_unlock(&p->mu);
        int64_t i = find_unit_row(p, row);
        if (i < 0) continue;
        int64_t m = missing_pages(p, &p->units[i]);
        int ok = m == 0 || reserve(p, m, 0, -1);
        pthread_mutex_lock(&p->mu);
        p->st.spec_pieces++; p->st.spec_bytes += row[3];
        if (ok) { p->st.spec_missing += m * p->page; log_spec(p, layer, row[1], m * p->page); }
        else { p->st.spec_refused++; log_spec(p, layer, row[1], 0); }
        pthread_mutex_unlock(&p->mu);
        p->units[i].asked = 1;
        if (m && ok) return i;
    }
}

/* a cold start: every resident page goes, and the demand not yet read (never a fault's) */
static void drop_everything(struct pager * p) {
    for (int k = 0; k < p->guard_n; k++) p->guards[k] = (struct guard) { 0, -1, 0 };
    for (int64_t i = 0; i < p->n_units; i++) drop_unit(p, i);
    if (p->spare_n) { /* the spare pool too: nothing of the experts stays */
        madvise(p->spare, (size_t) (p->spare_n * p->page), MADV_DONTNEED);
        count_resident(p, -p->spare_n);
        p->spare_n = 0;
    }
    p->dq_n = 0; p->spec_unit = -1;
    for (int64_t i = 0; i < p->n_units; i++) p->units[i].queued &= 1;
}

static int in_flight(struct pager * p) {
    pthread_mutex_lock(&p->mu);
    int n = p->inflight;
    pthread_mutex_unlock(&p->mu);
    return n > 0;
}

/* a fault found no room and no read in flight will make any: guards go (the oldest first),
   then pages no LRU entry holds; 0 when nothing is left to let go */
static int unstick(struct pager * p, int64_t keep) {
    if (release_guard(p, keep)) return 1;
    int64_t freed = 0;
    for (int64_t i = 0; i < p->n_units; i++) {
        struct unit * u = &p->units[i];
        if (i != keep && !u->in_lru && present_pages(p, u->p0, u->p1)) freed += drop_unit(p, i);
    }
    return freed > 0;
}

/* a fault that can never be served ends the process: waiting would be for ever */
static void cannot_serve(struct pager * p, int64_t i) {
    struct unit * u = &p->units[i];
    fprintf(stderr, "moepack: error: the expert pager cannot serve a fault: a slice of %lld "
            "pages does not fit in its budget of %lld pages (%lld resident)\n",
            (long long) (u->p1 - u->p0), (long long) p->st.budget_pages,
            (long long) p->st.resident_pages);
    _exit(1);
}

/* interrupts written to the wakeup pipe (one byte each, the signal's number) */
static void take_stops(struct pager * p) {
    unsigned char b[64];
    ssize_t k;
    while ((k = read(p->stop_fd, b, sizeof b)) > 0)
        for (ssize_t j = 0; j < k; j++)
            if (b[j] == SIGINT || b[j] == SIGTERM || b[j] == SIGHUP) {
                __atomic_store_n(&stop_signo, (int) b[j], __ATOMIC_RELAXED);
                __atomic_add_fetch(&stop_count, 1, __ATOMIC_RELAXED);
            }
}

/* llama.cpp's threads may wait in a fault where no Python handler can run: a second
   interrupt ends the process at once (as the worker's handler would), the first once faults
   or reads have waited STOP_GRACE_NS with no read placed (a stop otherwise waits for the
   pass to end, served as ever) */
static void watch_stops(struct pager * p) {
    int n = __atomic_load_n(&stop_count, __ATOMIC_RELAXED);
    if (n == 0) return;
    int sig = __atomic_load_n(&stop_signo, __ATOMIC_RELAXED);
    int64_t now = now_ns();
    if (p->stops_seen == 0) p->stop_ns = now;
    p->stops_seen = n;
    if (n >= 2) _exit(128 + sig);
    int64_t since = p->progress_ns > p->stop_ns ? p->progress_ns : p->stop_ns;
    if ((p->fq_n || in_flight(p)) && now - since >= STOP_GRACE_NS) {
        fprintf(stderr, "moepack: error: stopped (%s) while llama.cpp waited for expert reads "
                "that had not come back for %lld s\n", sig == SIGINT ? "SIGINT" : sig == SIGTERM
                ? "SIGTERM" : "SIGHUP", (long long) ((now - since) / 1000000000LL));
        _exit(128 + sig);
    }
}

static void * coordinator(void * arg) {
    struct pager * p = arg;
    struct pollfd pf[4] = { { p->uffd, POLLIN, 0 }, { p->efd_done, POLLIN, 0 },
                            { p->efd_work, POLLIN, 0 }, { p->stop_fd, POLLIN, 0 } };
    for (;;) {
        watch_stops(p);
        read_faults(p);
        /* finished reads: placed */
        pthread_mutex_lock(&p->mu);
        struct io * done = p->io_done; p->io_done = 0;
        pthread_mutex_unlock(&p->mu);
        while (done) { struct io * nx = done->next; place(p, done); done = nx; }
        read_faults(p);
        /* the hook's batches: demand and evictions in order */
        pthread_mutex_lock(&p->mu);
        if (p->closing) { pthread_mutex_unlock(&p->mu); break; }
        struct batch * in = p->in_head; p->in_head = p->in_tail = 0;
        int drop = p->drop_req;
        pthread_mutex_unlock(&p->mu);
        while (in) {
            struct batch * nx = in->next;
            take_demand(p, in);
            free(in->rows); free(in);
            in = nx;
        }
        if (drop) {
            pthread_mutex_lock(&p->mu);
            int busy = p->inflight > 0;
            pthread_mutex_unlock(&p->mu);
            if (!busy) {
                drop_everything(p);
                pthread_mutex_lock(&p->mu);
                p->drop_req = 0; p->drop_gen++;
                pthread_cond_broadcast(&p->idle_cv);
                pthread_mutex_unlock(&p->mu);
                continue;
            }
        }
        /* reads out: faults, then demand, then speculation */
        for (;;) { /* until out of buffers, of room, or of work */
            int rc = NOTHING;
            while (p->fq_n && (rc = submit_unit(p, p->fq[p->fq_h], 1)) == NOTHING)
                fifo_pop(p, p->fq, &p->fq_h, &p->fq_n, 1);
            if (rc == SENT) continue;
            if (rc == NO_ROOM && !in_flight(p)) { /* no read will land to make room */
                if (unstick(p, p->fq[p->fq_h])) continue;
                cannot_serve(p, p->fq[p->fq_h]);
            }
            if (rc != NOTHING) break;
            while (!drop && p->dq_n && (rc = submit_unit(p, p->dq[p->dq_h], 1)) == NOTHING)
                fifo_pop(p, p->dq, &p->dq_h, &p->dq_n, 2);
            if (rc == SENT) continue;
            if (rc == NO_ROOM && !in_flight(p)) { /* the rest is guarded: a fault reads it */
                fifo_pop(p, p->dq, &p->dq_h, &p->dq_n, 2);
                pthread_mutex_lock(&p->mu); p->st.demand_dropped++; pthread_mutex_unlock(&p->mu);
                continue;
            }
            if (rc != NOTHING || drop) break;
            if (p->spec_unit < 0) p->spec_unit = take_spec(p);
            if (p->spec_unit < 0) break;
            rc = submit_unit(p, p->spec_unit, 0);
            if (rc == SENT) continue;
            if (rc == NO_BUFFER) break;
            p->spec_unit = -1; /* read, or no room left for it: speculation never evicts */
        }
        pthread_mutex_lock(&p->mu);
        int idle = !p->inflight && !p->in_head && !p->sq_head && !p->fq_n && !p->dq_n
                   && p->spec_unit < 0 && !p->drop_req;
        if (idle != p->idle) { p->idle = idle; if (idle) pthread_cond_broadcast(&p->idle_cv); }
        int pending = p->in_head != 0
                      || (!drop && p->sq_head && p->spec_unit < 0 && !p->fq_n && !p->dq_n);
        pthread_mutex_unlock(&p->mu);
        if (pending) continue;
        /* after an interrupt, awake to watch the faults that wait */
        if (poll(pf, 4, p->stops_seen ? 100 : -1) <= 0) continue;
        if (pf[1].revents & POLLIN) drain_fd(p->efd_done);
        if (pf[2].revents & POLLIN) drain_fd(p->efd_work);
        if (pf[3].revents & POLLIN) take_stops(p);
    }
    return 0;
}

/* ---- the calls pager.py makes ------------------------------------------------------------ */

/* whether UFFDIO_MOVE works with this userfaultfd: one page moved between two of our own */
static int probe_move(int uffd, int64_t page) {
    char * a = mmap(0, (size_t) (2 * page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a == MAP_FAILED) return 0;
    a[0] = 1;
    int ok = 0;
    struct uffdio_register reg = { .range = { (uint64_t) (a + page), (uint64_t) page },
                                   .mode = UFFDIO_REGISTER_MODE_MISSING };
    if (ioctl(uffd, UFFDIO_REGISTER, &reg) == 0) {
        struct uffdio_move m = { .dst = (uint64_t) (a + page), .src = (uint64_t) a,
                                 .len = (uint64_t) page, .mode = 0, .move = 0 };
        ok = ioctl(uffd, UFFDIO_MOVE, &m) == 0 && a[page] == 1; /* read only once moved */
        struct uffdio_range rr = { (uint64_t) (a + page), (uint64_t) page };
        ioctl(uffd, UFFDIO_UNREGISTER, &rr);
    }
    munmap(a, (size_t) (2 * page));
    return ok;
}

/* anonymous read-write memory, small pages, registered (a move's destination must be) */
static char * registered(int uffd, size_t len) {
    char * a = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (a == MAP_FAILED) return 0;
    madvise(a, len, MADV_NOHUGEPAGE);
    struct uffdio_register reg = { .range = { (uint64_t) a, (uint64_t) len }, .mode = UFFDIO_REGISTER_MODE_MISSING };
    if (ioctl(uffd, UFFDIO_REGISTER, &reg) != 0) { munmap(a, len); return 0; }
    return a;
}

static void free_buffers(struct pager * p) {
    size_t chunk = (size_t) (p->chunk_pages * p->page);
    if (p->bufs) munmap(p->bufs, chunk * MAX_QD);
    else for (int q = 0; q < MAX_QD; q++) free(p->ios[q].buf);
    if (p->spare) munmap(p->spare, (size_t) (p->spare_cap * p->page));
    free(p->zeros);
}

/* regions: n x 6 int64 (shard, layer, n_expert, slice bytes, tensor offset, mapping base),
   sorted by shard then offset; fds: O_DIRECT where `direct`; `guards`: the threads that
   compute on the experts (each keeps its slice resident); `stop_fd`: the signal wakeup
   pipe's reading end, or -1. Takes the ranges over: anonymous memory at the same addresses,
   registered with `uffd`. */
struct pager * moepack_pager_new(int uffd, const int * fds, int n_fds, int direct,
                                 const int64_t * regions, int n_regions, int64_t budget,
                                 int qd, int64_t chunk, int guards, int stop_fd) {
    if (n_fds < 1 || n_fds > MAX_SHARDS || n_regions < 1 || qd < 1 || qd > MAX_QD
        || guards < 1 || guards > MAX_GUARDS || budget < 0) return 0;
    struct pager * p = calloc(1, sizeof *p);
    if (!p) return 0;
    p->uffd = uffd; p->n_fds = n_fds; p->direct = direct; p->qd = qd;
    p->stop_fd = stop_fd; p->guard_n = guards;
    const char * hold = getenv("MOEPACK_PAGER_HOLD_READS");
    p->hold = hold && strcmp(hold, "1") == 0;
    memcpy(p->fds, fds, sizeof(int) * (size_t) n_fds);
    p->page = sysconf(_SC_PAGESIZE);
    p->chunk_pages = chunk / p->page > 0 ? chunk / p->page : 1;
    p->regions = calloc((size_t) n_regions, sizeof *p->regions);
    p->n_regions = n_regions;
    p->lru_head = p->lru_tail = -1; p->spec_unit = -1; p->last_demand = -1; p->idle = 1;
    p->efd_work = p->efd_done = -1;
    if (!p->regions) { free(p); return 0; }
    int64_t pages = 0, units = 0;
    for (int k = 0; k < n_regions; k++) {
        const int64_t * a = regions + 6 * k;
        struct region * r = &p->regions[k];
        r->shard = a[0]; r->layer = a[1]; r->n_expert = a[2]; r->slice = a[3];
        r->tensor_off = a[4]; r->base = a[5];
        r->lo = (r->tensor_off + p->page - 1) / p->page * p->page;
        r->hi = (r->tensor_off + r->n_expert * r->slice) / p->page * p->page;
        if (r->hi < r->lo) r->hi = r->lo;
        r->page0 = pages; r->unit0 = units;
        pages += (r->hi - r->lo) / p->page; units += r->n_expert;
    }
    p->n_pages = pages; p->n_units = units;
    p->by_addr = malloc(sizeof(int32_t) * (size_t) n_regions);
    if (!p->by_addr) { free(p->regions); free(p); return 0; }
    for (int k = 0; k < n_regions; k++) p->by_addr[k] = k;
    sort_regions = p->regions;
    qsort(p->by_addr, (size_t) n_regions, sizeof(int32_t), by_address);
    p->state = calloc((size_t) (pages ? pages : 1), 1);
    p->units = calloc((size_t) units, sizeof *p->units);
    p->guards = calloc((size_t) guards, sizeof *p->guards);
    p->fq = malloc(sizeof(int64_t) * (size_t) units);
    p->dq = malloc(sizeof(int64_t) * (size_t) units);
    if (!p->state || !p->units || !p->fq || !p->dq || !p->guards) goto fail;
    for (int k = 0; k < guards; k++) p->guards[k].unit = -1;
    for (int k = 0; k < n_regions; k++) {
        struct region * r = &p->regions[k];
        for (int64_t e = 0; e < r->n_expert; e++) {
            struct unit * u = &p->units[r->unit0 + e];
            int64_t s = r->tensor_off + e * r->slice, t = s + r->slice;
            int64_t lo = s / p->page * p->page, hi = (t + p->page - 1) / p->page * p->page;
            if (lo < r->lo) lo = r->lo;
            if (hi > r->hi) hi = r->hi;
            if (hi < lo) hi = lo;
            u->p0 = r->page0 + (lo - r->lo) / p->page; u->p1 = r->page0 + (hi - r->lo) / p->page;
            u->prev = u->next = -1; u->region = k; u->expert = (int32_t) e;
        }
    }
    p->st.total_pages = pages;
    size_t chunk_len = (size_t) (p->chunk_pages * p->page);
    const char * want = getenv("MOEPACK_PAGER_PLACE"); /* "copy": the other way, to measure */
    p->move = !(want && strcmp(want, "copy") == 0) && probe_move(uffd, p->page);
    if (p->move) {
        p->spare_cap = qd * p->chunk_pages;
        p->bufs = registered(uffd, chunk_len * MAX_QD);
        p->spare = registered(uffd, (size_t) (p->spare_cap * p->page));
        if (posix_memalign((void **) &p->zeros, 4096, chunk_len) == 0) memset(p->zeros, 0, chunk_len);
        if (!p->bufs || !p->spare || !p->zeros) goto fail;
        p->st.spare_pages = p->spare_cap;
    }
    /* never more than can ever be held: every expert page and a full spare pool */
    p->st.budget_pages = budget / p->page;
    if (p->st.budget_pages > pages + p->spare_cap) p->st.budget_pages = pages + p->spare_cap;
    for (int q = 0; q < qd; q++) {
        if (p->move) p->ios[q].buf = p->bufs + (size_t) q * chunk_len;
        else if (posix_memalign((void **) &p->ios[q].buf, 4096, chunk_len)) goto fail;
        p->ios[q].next = p->io_free; p->io_free = &p->ios[q];
    }
    p->efd_work = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    p->efd_done = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (p->efd_work < 0 || p->efd_done < 0) goto fail;
    pthread_mutex_init(&p->mu, 0); pthread_cond_init(&p->io_cv, 0); pthread_cond_init(&p->idle_cv, 0);
    return p;
fail:
    free_buffers(p);
    if (p->efd_work >= 0) close(p->efd_work);
    if (p->efd_done >= 0) close(p->efd_done);
    free(p->state); free(p->units); free(p->guards); free(p->fq); free(p->dq); free(p->by_addr);
    free(p->regions); free(p);
    return 0;
}

/* anonymous memory over every region's pages, registered; then the threads start.
   Returns 0, or an errno (nothing is taken over then: what was replaced is put back). */
int moepack_pager_take_over(struct pager * p, const int * buffered_fds) {
    int k = 0, err = 0;
    for (; k < p->n_regions; k++) {
        struct region * r = &p->regions[k];
        if (r->hi <= r->lo) continue;
        void * a = (void *) (r->base + r->lo);
        size_t len = (size_t) (r->hi - r->lo);
        /* writable where pages are moved in (a move needs both sides alike); llama.cpp only reads */
        int prot = p->move ? PROT_READ | PROT_WRITE : PROT_READ;
        if (mmap(a, len, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) != a) {
            err = errno; break;
        }
        if (p->move) madvise(a, len, MADV_NOHUGEPAGE); /* small pages, as moved */
        struct uffdio_register reg = { .range = { (uint64_t) a, (uint64_t) len }, .mode = UFFDIO_REGISTER_MODE_MISSING };
        if (ioctl(p->uffd, UFFDIO_REGISTER, &reg) != 0 || !(reg.ioctls & (1ULL << _UFFDIO_COPY))) {
            err = errno ? errno : ENOTSUP; k++; break;
        }
    }
    if (err) { /* the file back where it was */
        for (int j = 0; j < k; j++) {
            struct region * r = &p->regions[j];
            if (r->hi <= r->lo) continue;
            mmap((void *) (r->base + r->lo), (size_t) (r->hi - r->lo), PROT_READ,
                 MAP_SHARED | MAP_FIXED, buffered_fds[r->shard], r->lo);
        }
        return err;
    }
    for (int q = 0; q < p->qd; q++)
        if (pthread_create(&p->readers[q], 0, reader, p) != 0) { p->qd = q; break; }
    if (p->qd == 0 || pthread_create(&p->coord, 0, coordinator, p) != 0) return EAGAIN;
    p->started = 1;
    return 0;
}

/* the hook's work, as moepack_fetcher_push takes it (kind 0 demand, 1 speculation, 2 evict) */
int moepack_pager_push(struct pager * p, int32_t layer, int32_t kind, const int64_t * rows, int64_t n) {
    struct batch * b = 0;
    if (n > 0) {
        b = calloc(1, sizeof *b);
        if (!b) return -1;
        b->rows = malloc((size_t) n * 4 * sizeof(int64_t));
        if (!b->rows) { free(b); return -1; }
        memcpy(b->rows, rows, (size_t) n * 4 * sizeof(int64_t));
        b->n = n; b->layer = layer; b->kind = kind;
    }
    pthread_mutex_lock(&p->mu);
    if (kind == 0) { /* speculation for this layer and earlier ones (all, at a new pass) goes */
        int new_pass = layer <= p->last_demand;
        struct batch ** q = &p->sq_head; p->sq_tail = 0;
        while (*q) {
            struct batch * s = *q;
            if (new_pass || s->layer <= layer) {
                p->st.spec_dropped += s->n - s->done; *q = s->next; free(s->rows); free(s);
            } else { p->sq_tail = s; q = &s->next; }
        }
        if (layer >= 0) p->last_demand = layer;
    }
    if (b) {
        struct batch ** head = kind == 1 ? &p->sq_head : &p->in_head;
        struct batch ** tail = kind == 1 ? &p->sq_tail : &p->in_tail;
        if (*tail) (*tail)->next = b; else *head = b;
        *tail = b;
        p->idle = 0;
        kick(p->efd_work);
    }
    pthread_mutex_unlock(&p->mu);
    return 0;
}

void moepack_pager_wait_idle(struct pager * p) {
    pthread_mutex_lock(&p->mu);
    while (!p->idle || p->in_head || p->sq_head) {
        pthread_mutex_unlock(&p->mu);
        kick(p->efd_work);
        pthread_mutex_lock(&p->mu);
        struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20000000; if (ts.tv_nsec >= 1000000000) { ts.tv_sec++; ts.tv_nsec -= 1000000000; }
        pthread_cond_timedwait(&p->idle_cv, &p->mu, &ts);
    }
    pthread_mutex_unlock(&p->mu);
}

/* every resident page dropped (a cold start), once what is in flight has landed */
void moepack_pager_drop_all(struct pager * p) {
    pthread_mutex_lock(&p->mu);
    int gen = p->drop_gen;
    p->drop_req = 1; p->idle = 0;
    kick(p->efd_work);
    while (p->drop_gen == gen) pthread_cond_wait(&p->idle_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

int64_t moepack_pager_drain(struct pager * p, int64_t * out, int64_t max) {
    pthread_mutex_lock(&p->mu);
    int64_t n = p->log_n < max ? p->log_n : max;
    memcpy(out, p->log, (size_t) n * 3 * sizeof(int64_t));
    memmove(p->log, p->log + 3 * n, (size_t) (p->log_n - n) * 3 * sizeof(int64_t));
    p->log_n -= n;
    pthread_mutex_unlock(&p->mu);
    return n;
}

int moepack_pager_stats(struct pager * p, struct pstats * out, int64_t size) {
    if (size != (int64_t) sizeof *out) return -1;
    pthread_mutex_lock(&p->mu); *out = p->st; pthread_mutex_unlock(&p->mu);
    return 0;
}

/* the address range of region k (for /proc/self/smaps); 0 when it has no whole page */
int64_t moepack_pager_region(struct pager * p, int k, int64_t * len) {
    struct region * r = &p->regions[k];
    *len = r->hi - r->lo;
    return r->hi > r->lo ? r->base + r->lo : 0;
}

/* the read buffers (which 0) or the spare pool (1) of the move mode; 0 in copy mode */
int64_t moepack_pager_pool(struct pager * p, int which, int64_t * len) {
    char * a = which == 0 ? p->bufs : p->spare;
    *len = which == 0 ? p->chunk_pages * p->page * MAX_QD : p->spare_cap * p->page;
    return a ? (int64_t) a : 0;
}

/* stop the threads and map the file back over every region (llama.cpp's pointers keep
   reading the same bytes, now from the page cache), then let go of the userfaultfd */
void moepack_pager_free(struct pager * p, const int * buffered_fds, int restore) {
    pthread_mutex_lock(&p->mu); p->closing = 1; pthread_cond_broadcast(&p->io_cv); pthread_mutex_unlock(&p->mu);
    kick(p->efd_work);
    if (p->started) pthread_join(p->coord, 0);
    for (int q = 0; q < p->qd; q++) pthread_join(p->readers[q], 0);
    if (restore)
        for (int k = 0; k < p->n_regions; k++) {
            struct region * r = &p->regions[k];
            if (r->hi <= r->lo) continue;
            mmap((void *) (r->base + r->lo), (size_t) (r->hi - r->lo), PROT_READ,
                 MAP_SHARED | MAP_FIXED, buffered_fds[r->shard], r->lo);
        }
    for (struct batch * b = p->in_head; b;) { struct batch * n = b->next; free(b->rows); free(b); b = n; }
    for (struct batch * b = p->sq_head; b;) { struct batch * n = b->next; free(b->rows); free(b); b = n; }
    free_buffers(p);
    close(p->efd_work); close(p->efd_done);
    free(p->log); free(p->state); free(p->units); free(p->guards); free(p->fq); free(p->dq);
    free(p->by_addr); free(p->regions);
    pthread_mutex_destroy(&p->mu); pthread_cond_destroy(&p->io_cv); pthread_cond_destroy(&p->idle_cv);
    free(p);
}
