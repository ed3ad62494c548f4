#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_SHARDS 256
#define SYS_CACHESTAT 451

/* one piece: shard, expert, offset, length (int64 each, as numpy hands them over) */
struct batch {
    struct batch * next;
    int32_t layer, spec;
    int64_t n, done;
    int64_t * rows; /* n x 4 */
};

struct stats {
    int64_t demand_experts, demand_hits, demand_pieces, demand_bytes, demand_missing;
    int64_t spec_pieces, spec_bytes, spec_missing, spec_dropped;
    int64_t willneed_calls, ns_submitting, errors;
    int64_t evicted_pieces, evicted_bytes;
};

struct fetcher {
    int64_t map_base[MAX_SHARDS], map_len[MAX_SHARDS]; /* llama.cpp's mapping of each shard */
    pthread_mutex_t mu;
    pthread_cond_t work, idle_cv;
    pthread_t thread;
    int fds[MAX_SHARDS];
    int n_fds, use_cachestat, closing, idle, last_demand;
    int64_t window, page;
    struct batch * dq_head, * dq_tail, * sq_head, * sq_tail;
    struct stats st;
    int64_t * log; /* spec reads: layer, expert, bytes */
    int64_t log_n, log_cap;
    /* the expert pager (pager.c), when it holds the experts: the work goes there instead */
    int (*pg_push)(void *, int32_t, int32_t, const int64_t *, int64_t);
    int64_t (*pg_drain)(void *, int64_t *, int64_t);
    void (*pg_idle)(void *);
    void * pg;
};

struct cs_range { uint64_t off, len; };
struct cs { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };

static int64_t now_ns(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t missing_bytes(struct fetcher * f, int fd, int64_t off, int64_t len) {
    if (!f->use_cachestat) return len;
    struct cs_range r = { (uint64_t) off, (uint64_t) len };
    struct cs c;
    if (syscall(SYS_CACHESTAT, fd, &r, &c, 0) != 0) return len;
    int64_t first = off / f->page, last = (off + len - 1) / f->page;
    int64_t pages = last - first + 1, gap = pages - (int64_t) c.nr_cache;
    if (gap <= 0) return 0;
    return gap * f->page < len ? gap * f->page : len;
}

static void submit(struct fetcher * f, int fd, int64_t off, int64_t len) {
    int64_t t0 = now_ns(), calls = 0, errors = 0;
    for (int64_t o = off; o < off + len; o += f->window) {
        int64_t n = off + len - o < f->window ? off + len - o : f->window;
        if (posix_fadvise(fd, o, n, POSIX_FADV_WILLNEED) != 0) errors++;
        calls++;
    }
    int64_t dt = now_ns() - t0;
    pthread_mutex_lock(&f->mu);
    f->st.willneed_calls += calls; f->st.ns_submitting += dt; f->st.errors += errors;
    pthread_mutex_unlock(&f->mu);
}

static void free_batch(struct batch * b) { free(b->rows); free(b); }

/* drop the whole pages inside each piece: from llama.cpp's mapping (a mapped page cannot leave
   the page cache), then from the page cache */
static void do_evict(struct fetcher * f, struct batch * b) {
    int64_t bytes = 0;
    for (int64_t i = 0; i < b->n; i++) {
        int64_t * r = b->rows + 4 * i;
        int64_t lo = (r[2] + f->page - 1) / f->page * f->page, hi = (r[2] + r[3]) / f->page * f->page;
        if (hi <= lo) continue;
        int sh = (int) r[0];
        if (f->map_base[sh] && hi <= f->map_len[sh])
            madvise((void *) (f->map_base[sh] + lo), (size_t) (hi - lo), MADV_DONTNEED);
        posix_fadvise(f->fds[sh], lo, hi - lo, POSIX_FADV_DONTNEED);
        bytes += hi - lo;
    }
    pthread_mutex_lock(&f->mu);
    f->st.evicted_pieces += b->n; f->st.evicted_bytes += bytes;
    pthread_mutex_unlock(&f->mu);
}

void moepack_fetcher_map(struct fetcher * f, int shard, int64_t base, int64_t len) {
    if (shard >= 0 && shard < f->n_fds) { f->map_base[shard] = base; f->map_len[shard] = len; }
}

static void do_demand(struct fetcher * f, struct batch * b) {
    if (b->spec == 2) { do_evict(f, b); return; }
    int64_t * gap = calloc((size_t) (b->n ? b->n : 1), sizeof(int64_t));
    int64_t max_e = 0, bytes = 0, miss = 0;
    for (int64_t i = 0; i < b->n; i++) {
        int64_t * r = b->rows + 4 * i;
        gap[i] = missing_bytes(f, f->fds[r[0]], r[2], r[3]);
        if (r[1] > max_e) max_e = r[1];
        bytes += r[3]; miss += gap[i];
    }
    char * state = calloc((size_t) max_e + 1, 1); /* 0 unseen, 1 all cached, 2 something missing */
    int64_t experts = 0, hits = 0;
    for (int64_t i = 0; i < b->n; i++) {
        int64_t e = b->rows[4 * i + 1];
        if (state[e] == 0) { state[e] = 1; experts++; }
        if (gap[i]) state[e] = 2;
    }
    for (int64_t e = 0; e <= max_e; e++) hits += state[e] == 1;
    pthread_mutex_lock(&f->mu);
    f->st.demand_pieces += b->n; f->st.demand_bytes += bytes; f->st.demand_missing += miss;
    f->st.demand_experts += experts; f->st.demand_hits += hits;
    pthread_mutex_unlock(&f->mu);
    /* missing pieces that touch (neighbouring experts of one matrix) go as one request */
    for (int64_t i = 0; i < b->n;) {
        if (!gap[i]) { i++; continue; }
        int64_t sh = b->rows[4 * i], lo = b->rows[4 * i + 2], hi = lo + b->rows[4 * i + 3];
        int64_t j = i + 1;
        while (j < b->n && gap[j] && b->rows[4 * j] == sh && b->rows[4 * j + 2] == hi) {
            hi += b->rows[4 * j + 3];
            j++;
        }
        submit(f, f->fds[sh], lo, hi - lo);
        i = j;
    }
    free(state); free(gap);
}

static void log_read(struct fetcher * f, int32_t layer, int64_t expert, int64_t bytes) {
    if (f->log_n == f->log_cap) {
        int64_t cap = f->log_cap ? 2 * f->log_cap : 1024;
        int64_t * grown = realloc(f->log, (size_t) cap * 3 * sizeof(int64_t));
        if (!grown) return;
        f->log = grown; f->log_cap = cap;
    }
    f->log[3 * f->log_n] = layer; f->log[3 * f->log_n + 1] = expert; f->log[3 * f->log_n + 2] = bytes;
    f->log_n++;
}

/* returns 1 when the batch is finished, 0 when demand arrived and it must wait */
static int do_spec(struct fetcher * f, struct batch * b) {
    while (b->done < b->n) {
        pthread_mutex_lock(&f->mu);
        int waiting = f->dq_head != 0;
        pthread_mutex_unlock(&f->mu);
        if (waiting) return 0;
        int64_t * r = b->rows + 4 * b->done;
        int64_t gap = missing_bytes(f, f->fds[r[0]], r[2], r[3]);
        pthread_mutex_lock(&f->mu);
        f->st.spec_pieces++; f->st.spec_bytes += r[3]; f->st.spec_missing += gap;
        log_read(f, b->layer, r[1], gap);
        pthread_mutex_unlock(&f->mu);
        if (gap) submit(f, f->fds[r[0]], r[2], r[3]);
        b->done++;
    }
    return 1;
}

static void * loop(void * arg) {
    struct fetcher * f = arg;
    pthread_mutex_lock(&f->mu);
    for (;;) {
        while (!f->closing && !f->dq_head && !f->sq_head) {
            f->idle = 1;
            pthread_cond_broadcast(&f->idle_cv);
            pthread_cond_wait(&f->work, &f->mu);
        }
        if (f->closing) break;
        if (f->dq_head) {
            struct batch * b = f->dq_head;
            f->dq_head = b->next; if (!f->dq_head) f->dq_tail = 0;
            pthread_mutex_unlock(&f->mu);
            do_demand(f, b);
            free_batch(b);
            pthread_mutex_lock(&f->mu);
        } else {
            struct batch * b = f->sq_head;
            f->sq_head = b->next; if (!f->sq_head) f->sq_tail = 0;
            pthread_mutex_unlock(&f->mu);
            int finished = do_spec(f, b);
            pthread_mutex_lock(&f->mu);
            if (finished || b->layer <= f->last_demand) {
                if (!finished) f->st.spec_dropped += b->n - b->done;
                free_batch(b);
            } else { /* back to the head: its turn comes after the demand */
                b->next = f->sq_head; f->sq_head = b; if (!f->sq_tail) f->sq_tail = b;
            }
        }
    }
    f->idle = 1;
    pthread_cond_broadcast(&f->idle_cv);
    pthread_mutex_unlock(&f->mu);
    return 0;
}

struct fetcher * moepack_fetcher_new(const int * fds, int n_fds, int64_t window, int use_cachestat) {
    if (n_fds < 1 || n_fds > MAX_SHARDS) return 0;
    struct fetcher * f = calloc(1, sizeof *f);
    if (!f) return 0;
    memcpy(f->fds, fds, sizeof(int) * (size_t) n_fds);
    f->n_fds = n_fds; f->window = window; f->use_cachestat = use_cachestat;
    f->page = sysconf(_SC_PAGESIZE); f->idle = 1; f->last_demand = -1;
    pthread_mutex_init(&f->mu, 0); pthread_cond_init(&f->work, 0); pthread_cond_init(&f->idle_cv, 0);
    if (pthread_create(&f->thread, 0, loop, f) != 0) { free(f); return 0; }
    return f;
}

void moepack_fetcher_wait_idle(struct fetcher * f);

/* from now on the pager takes every push (its functions, with its handle) */
void moepack_fetcher_pager(struct fetcher * f, void * push, void * drain, void * idle, void * pg) {
    moepack_fetcher_wait_idle(f);
    pthread_mutex_lock(&f->mu);
    *(void **) &f->pg_push = push; *(void **) &f->pg_drain = drain; *(void **) &f->pg_idle = idle;
    f->pg = pg;
    pthread_mutex_unlock(&f->mu);
}

/* rows: n x 4 int64 (shard, expert, offset, length), copied */
int moepack_fetcher_push(struct fetcher * f, int32_t layer, int32_t spec, const int64_t * rows, int64_t n) {
    if (f->pg) return f->pg_push(f->pg, layer, spec, rows, n);
    struct batch * b = 0;
    if (n > 0) {
        b = calloc(1, sizeof *b);
        if (!b) return -1;
        b->rows = malloc((size_t) n * 4 * sizeof(int64_t));
        if (!b->rows) { free(b); return -1; }
        memcpy(b->rows, rows, (size_t) n * 4 * sizeof(int64_t));
        b->n = n; b->layer = layer; b->spec = spec;
    }
    pthread_mutex_lock(&f->mu);
    if (spec == 0) {
        /* a layer's real choice: speculation for it and earlier layers (or, at a new pass,
           any left from the last one) is dropped unsent */
        int new_pass = layer <= f->last_demand;
        struct batch ** p = &f->sq_head; f->sq_tail = 0;
        while (*p) {
            struct batch * s = *p;
            if (new_pass || s->layer <= layer) {
                f->st.spec_dropped += s->n - s->done; *p = s->next; free_batch(s);
            } else { f->sq_tail = s; p = &s->next; }
        }
        if (layer >= 0) f->last_demand = layer;
    }
    if (b) {
        struct batch ** head = spec == 1 ? &f->sq_head : &f->dq_head; /* 2 (evict): demand queue */
        struct batch ** tail = spec == 1 ? &f->sq_tail : &f->dq_tail;
        if (*tail) (*tail)->next = b; else *head = b;
        *tail = b;
        f->idle = 0;
        pthread_cond_signal(&f->work);
    }
    pthread_mutex_unlock(&f->mu);
    return 0;
}

void moepack_fetcher_wait_idle(struct fetcher * f) {
    if (f->pg) { f->pg_idle(f->pg); return; }
    pthread_mutex_lock(&f->mu);
    while (!f->idle || f->dq_head || f->sq_head) pthread_cond_wait(&f->idle_cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

int moepack_fetcher_stats(struct fetcher * f, struct stats * out, int64_t size) {
    if (size != (int64_t) sizeof *out) return -1; /* the caller's struct is not this one */
    pthread_mutex_lock(&f->mu); *out = f->st; pthread_mutex_unlock(&f->mu);
    return 0;
}

/* moves up to max spec-read records (3 int64 each) into out; returns how many */
int64_t moepack_fetcher_drain(struct fetcher * f, int64_t * out, int64_t max) {
    if (f->pg) return f->pg_drain(f->pg, out, max);
    pthread_mutex_lock(&f->mu);
    int64_t n = f->log_n < max ? f->log_n : max;
    memcpy(out, f->log, (size_t) n * 3 * sizeof(int64_t));
    memmove(f->log, f->log + 3 * n, (size_t) (f->log_n - n) * 3 * sizeof(int64_t));
    f->log_n -= n;
    pthread_mutex_unlock(&f->mu);
    return n;
}

void moepack_fetcher_free(struct fetcher * f) {
    pthread_mutex_lock(&f->mu); f->closing = 1; pthread_cond_broadcast(&f->work); pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, 0);
    for (struct batch * b = f->dq_head; b;) { struct batch * n = b->next; free_batch(b); b = n; }
    for (struct batch * b = f->sq_head; b;) { struct batch * n = b->next; free_batch(b); b = n; }
    free(f->log);
    pthread_mutex_destroy(&f->mu); pthread_cond_destroy(&f->work); pthread_cond_destroy(&f->idle_cv);
    free(f);
}

/* ---- the demand hook: a MoE layer's top-k, read by the eval gate, becomes reads -------- */

#define MAX_TENSORS 8

struct sblock {
    int32_t index, n_expert, n_tensors, next; /* next: position of the next MoE block, -1 */
    int64_t shard[MAX_TENSORS], base[MAX_TENSORS], size[MAX_TENSORS];
    const float * w;    /* router [n_expert, dim] or 0 */
    const float * norm; /* [dim] or 0 */
    float * inv_norm;   /* 1 / norm */
    const float * bias; /* [n_expert] or 0 */
    uint8_t * pending;  /* experts speculated for this block, not yet judged */
    int has_pending;
    int64_t predicted, hits, chosen, bytes_read, bytes_wasted, spec_bytes_pending;
    int64_t * read_by_expert;
    double ewma;
    /* the live cache: an LRU of capacity experts (0: the kernel decides), as replay's */
    int32_t capacity, held, head, tail;
    int32_t * prev, * nxt;
    uint8_t * in_cache;
    int64_t accesses, cache_hits, evictions;
    /* a pass's distinct chosen experts and its rows x top-k (a verification batch reads the
       union once: what it saves against one token at a time) */
    int64_t union_experts, routed;
};

struct stream {
    struct fetcher * f;
    int n_blocks, max_layer, dim, budget, depth, router_slot;
    struct sblock * blocks;
    int32_t * at; /* layer -> block position, -1 */
    int name_off, ne_off, nb_off, data_off, type_off, src_off, buffer_off;
    int (*is_host)(void *);
    int64_t calls, passes, ns, failures;
    int64_t * rows; uint8_t * chosen; float * scores; float * xs; int32_t * victims;
    uint8_t * scratch_set;
    int64_t victims_cap;
};

#define ALL_ROWS 64 /* a pass of more tokens speculates every expert of the next layer */
#define LOW 0.2
#define HIGH 0.5
#define PROBE_EVERY 16
#define EWMA 0.2

struct stream * moepack_stream_new(struct fetcher * f, int n_blocks, int max_layer, int dim,
                                   int budget, int depth, int router_slot, const int * offsets,
                                   int (*is_host)(void *)) {
    struct stream * s = calloc(1, sizeof *s);
    if (!s) return 0;
    s->f = f; s->n_blocks = n_blocks; s->max_layer = max_layer; s->dim = dim;
    s->budget = budget; s->depth = depth; s->router_slot = router_slot;
    s->name_off = offsets[0]; s->ne_off = offsets[1]; s->nb_off = offsets[2];
    s->data_off = offsets[3]; s->type_off = offsets[4]; s->src_off = offsets[5];
    s->buffer_off = offsets[6];
    s->is_host = is_host;
    s->blocks = calloc((size_t) n_blocks, sizeof *s->blocks);
    s->at = malloc(sizeof(int32_t) * (size_t) (max_layer + 1));
    if (!s->blocks || !s->at) {
        free(s->blocks); free(s->at); free(s);
        return 0;
    }
    for (int i = 0; i <= max_layer; i++) s->at[i] = -1;
    return s;
}

int moepack_stream_block(struct stream * s, int pos, int index, int n_expert, int n_tensors,
                         const int64_t * table, const float * w, const float * norm,
                         const float * bias) {
    if (pos < 0 || pos >= s->n_blocks || index < 0 || index > s->max_layer) return -1;
    if (n_tensors > MAX_TENSORS) return -1;
    struct sblock * b = &s->blocks[pos];
    b->index = index; b->n_expert = n_expert; b->n_tensors = n_tensors;
    b->next = pos + 1 < s->n_blocks ? pos + 1 : -1;
    for (int t = 0; t < n_tensors; t++) {
        b->shard[t] = table[3 * t]; b->base[t] = table[3 * t + 1]; b->size[t] = table[3 * t + 2];
    }
    b->w = w; b->norm = norm; b->bias = bias; b->ewma = HIGH;
    if (norm && s->dim > 0) {
        b->inv_norm = malloc(sizeof(float) * (size_t) s->dim);
        if (!b->inv_norm) return -1;
        for (int i = 0; i < s->dim; i++) b->inv_norm[i] = 1.0f / norm[i];
    }
    b->pending = calloc((size_t) n_expert, 1);
    b->read_by_expert = calloc((size_t) n_expert, sizeof(int64_t));
    s->at[index] = pos;
    return b->pending && b->read_by_expert ? 0 : -1;
}

static void lru_unlink(struct sblock * b, int32_t e) {
    if (b->prev[e] >= 0) b->nxt[b->prev[e]] = b->nxt[e]; else b->head = b->nxt[e];
    if (b->nxt[e] >= 0) b->prev[b->nxt[e]] = b->prev[e]; else b->tail = b->prev[e];
    b->prev[e] = b->nxt[e] = -1;
}

static void lru_front(struct sblock * b, int32_t e) {
    b->prev[e] = -1; b->nxt[e] = b->head;
    if (b->head >= 0) b->prev[b->head] = e;
    b->head = e;
    if (b->tail < 0) b->tail = e;
}

/* one access, in router order; returns the evicted expert or -1 */
static int32_t lru_access(struct sblock * b, int32_t e) {
    b->accesses++;
    if (b->in_cache[e]) { b->cache_hits++; lru_unlink(b, e); lru_front(b, e); return -1; }
    b->in_cache[e] = 1; lru_front(b, e); b->held++;
    if (b->held <= b->capacity) return -1;
    int32_t v = b->tail;
    lru_unlink(b, v); b->in_cache[v] = 0; b->held--; b->evictions++;
    return v;
}

int moepack_stream_cache(struct stream * s, int pos, int capacity) {
    struct sblock * b = &s->blocks[pos];
    b->capacity = capacity; b->held = 0; b->head = b->tail = -1;
    free(b->prev); free(b->nxt); free(b->in_cache);
    b->prev = malloc(sizeof(int32_t) * (size_t) b->n_expert);
    b->nxt = malloc(sizeof(int32_t) * (size_t) b->n_expert);
    b->in_cache = calloc((size_t) b->n_expert, 1);
    if (!b->prev || !b->nxt || !b->in_cache) return -1;
    for (int e = 0; e < b->n_expert; e++) b->prev[e] = b->nxt[e] = -1;
    return 0;
}

static int64_t rows_for(struct stream * s, struct sblock * b, const uint8_t * set) {
    int64_t n = 0;
    for (int t = 0; t < b->n_tensors; t++)
        for (int e = 0; e < b->n_expert; e++)
            if (set[e]) {
                int64_t * r = s->rows + 4 * n++;
                r[0] = b->shard[t]; r[1] = e; r[2] = b->base[t] + e * b->size[t]; r[3] = b->size[t];
            }
    return n;
}

static int fetch_count(struct stream * s, struct sblock * b) {
    if (b->ewma >= HIGH) return s->budget;
    if (b->ewma < LOW) return s->passes % PROBE_EVERY == 0 ? 1 : 0;
    int n = (int) (s->budget * (b->ewma - LOW) / (HIGH - LOW) + 0.5);
    return n < 1 ? 1 : n;
}

static void charge_reads(struct stream * s) {
    int64_t buf[3 * 256];
    int64_t n;
    while ((n = moepack_fetcher_drain(s->f, buf, 256)) > 0)
        for (int64_t i = 0; i < n; i++) {
            int32_t layer = (int32_t) buf[3 * i];
            if (layer < 0 || layer > s->max_layer || s->at[layer] < 0) continue;
            struct sblock * b = &s->blocks[s->at[layer]];
            if (buf[3 * i + 1] >= 0 && buf[3 * i + 1] < b->n_expert)
                b->read_by_expert[buf[3 * i + 1]] += buf[3 * i + 2];
        }
}

/* score what was speculated for b against its real choice; experts speculated in vain that
   the live cache does not hold are marked in `waste` (to be dropped: the page cache then holds
   what the cache model says) */
static void judge(struct sblock * b, const uint8_t * chosen, uint8_t * waste) {
    int64_t n_chosen = 0, hit = 0, pred = 0;
    memset(waste, 0, (size_t) b->n_expert);
    for (int e = 0; e < b->n_expert; e++) {
        n_chosen += chosen[e];
        if (b->read_by_expert[e]) {
            b->bytes_read += b->read_by_expert[e];
            if (!chosen[e]) b->bytes_wasted += b->read_by_expert[e];
            b->read_by_expert[e] = 0;
        }
        if (b->has_pending && b->pending[e]) {
            pred++; hit += chosen[e];
            if (!chosen[e] && b->capacity > 0 && !b->in_cache[e]) waste[e] = 1;
        }
    }
    if (b->has_pending) {
        b->predicted += pred; b->hits += hit; b->chosen += n_chosen;
        if (pred) b->ewma += EWMA * ((double) hit / (double) pred - b->ewma);
        memset(b->pending, 0, (size_t) b->n_expert);
        b->has_pending = 0;
    }
}

/* eight running sums: no chain of dependent adds, and the compiler can vectorise them (a
   ranking needs no particular summation order) */
static float dot(const float * a, const float * b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += acc[j];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* the row's best `count` experts (bit 4 while choosing) added to `set` (bit 2) */
static void top_into(const float * sc, int n_expert, int count, uint8_t * set) {
    for (int c = 0; c < count; c++) {
        int best = -1;
        for (int e = 0; e < n_expert; e++)
            if (!(set[e] & 4) && (best < 0 || sc[e] > sc[best])) best = e;
        if (best < 0) break;
        set[best] |= 4;
    }
    for (int e = 0; e < n_expert; e++)
        if (set[e] & 4) set[e] = (uint8_t) ((set[e] & ~4) | 2);
}

static void speculate(struct stream * s, struct sblock * src, const char * x_t, int64_t rows) {
    /* x_t: the router input tensor (F32 [dim, rows], contiguous rows) or 0 */
    const float * x = 0;
    if (x_t) {
        const int64_t * ne = (const int64_t *) (x_t + s->ne_off);
        const size_t * nb = (const size_t *) (x_t + s->nb_off);
        void * buffer = *(void * const *) (x_t + s->buffer_off);
        int type = *(const int *) (x_t + s->type_off);
        if (type == 0 && ne[0] == s->dim && ne[1] == rows && nb[0] == 4 && buffer && s->is_host(buffer))
            x = *(const float * const *) (x_t + s->data_off);
    }
    struct sblock * t = src;
    for (int d = 0; d < s->depth; d++) {
        if (t->next < 0) break;
        t = &s->blocks[t->next];
        int count = fetch_count(s, t);
        if (count <= 0) continue;
        uint8_t * set = t->pending; /* bit 2 while choosing, then 1 */
        memset(set, 0, (size_t) t->n_expert);
        if (rows > ALL_ROWS || (int64_t) count >= t->n_expert) {
            memset(set, 2, (size_t) t->n_expert); /* a long pass touches them all */
        } else if (x && t->w) {
            const int64_t stride = *((const size_t *) (x_t + s->nb_off) + 1) / 4;
            for (int64_t r = 0; r < rows; r++) {
                const float * xr = x + r * stride;
                if (src->norm && t->norm) { /* from the source layer's FFN norm to the target's */
                    for (int i = 0; i < s->dim; i++) s->xs[i] = xr[i] * t->norm[i] * src->inv_norm[i];
                    xr = s->xs;
                }
                for (int e = 0; e < t->n_expert; e++)
                    s->scores[e] = dot(t->w + (int64_t) e * s->dim, xr, s->dim)
                                   + (t->bias ? t->bias[e] : 0.0f);
                top_into(s->scores, t->n_expert, count, set); /* the union over tokens */
            }
        } else {
            continue;
        }
        for (int e = 0; e < t->n_expert; e++) set[e] = set[e] ? 1 : 0;
        t->has_pending = 1;
        int64_t n = rows_for(s, t, set);
        if (n) moepack_fetcher_push(s->f, t->index, 1, s->rows, n);
    }
}

void moepack_stream_on_topk(void * ctx, void * tensor, void * const * queued) {
    struct stream * s = ctx;
    int64_t t0 = now_ns();
    const char * t = tensor;
    const char * name = t + s->name_off;
    const char * dash = strrchr(name, '-');
    int layer = dash ? atoi(dash + 1) : -1;
    if (layer < 0 || layer > s->max_layer || s->at[layer] < 0 || *(const int *) (t + s->type_off) != 26) {
        s->failures++;
        return;
    }
    void * buffer = *(void * const *) (t + s->buffer_off);
    if (!buffer || !s->is_host(buffer)) { s->failures++; return; }
    struct sblock * b = &s->blocks[s->at[layer]];
    const int64_t * ne = (const int64_t *) (t + s->ne_off);
    const size_t * nb = (const size_t *) (t + s->nb_off);
    const char * data = *(const char * const *) (t + s->data_off);
    if (b->index == s->blocks[0].index) s->passes++;
    memset(s->chosen, 0, (size_t) b->n_expert);
    for (int64_t r = 0; r < ne[1]; r++)
        for (int64_t k = 0; k < ne[0]; k++) {
            int32_t e = *(const int32_t *) (data + r * nb[1] + k * nb[0]);
            if (e >= 0 && e < b->n_expert) {
                b->union_experts += !s->chosen[e];
                b->routed++;
                s->chosen[e] = 1;
            }
        }
    if (b->capacity > 0 && ne[0] * ne[1] > s->victims_cap) {
        int32_t * grown = realloc(s->victims, sizeof(int32_t) * (size_t) (ne[0] * ne[1]));
        if (grown) { s->victims = grown; s->victims_cap = ne[0] * ne[1]; }
    }
    if (b->capacity > 0 && ne[0] * ne[1] <= s->victims_cap) {
        int64_t nv = 0;
        for (int64_t r = 0; r < ne[1]; r++)
            for (int64_t k = 0; k < ne[0]; k++) {
                int32_t e = *(const int32_t *) (data + r * nb[1] + k * nb[0]);
                if (e < 0 || e >= b->n_expert) continue;
                int32_t v = lru_access(b, e);
                if (v >= 0) s->victims[nv++] = v;
            }
        /* what leaves the cache is dropped, but never what this pass still reads */
        memset(s->scratch_set, 0, (size_t) b->n_expert);
        for (int64_t i = 0; i < nv; i++)
            if (!s->chosen[s->victims[i]] && !b->in_cache[s->victims[i]]) s->scratch_set[s->victims[i]] = 1;
        int64_t nev = rows_for(s, b, s->scratch_set);
        if (nev) moepack_fetcher_push(s->f, b->index, 2, s->rows, nev);
    }
    int64_t n = rows_for(s, b, s->chosen);
    moepack_fetcher_push(s->f, b->index, 0, s->rows, n);
    s->calls++;
    if (s->depth > 0) {
        charge_reads(s);
        judge(b, s->chosen, s->scratch_set);
        int64_t nw = b->capacity > 0 ? rows_for(s, b, s->scratch_set) : 0;
        if (nw) moepack_fetcher_push(s->f, b->index, 2, s->rows, nw);
        const char * x_t = 0;
        if (s->router_slot >= 0 && queued[s->router_slot])
            x_t = *(const char * const *) ((const char *) queued[s->router_slot] + s->src_off + sizeof(void *));
        speculate(s, b, x_t, ne[1]);
    }
    s->ns += now_ns() - t0;
}

/* per block: predicted, hits, chosen, bytes_read, bytes_wasted, accesses, cache_hits,
   evictions, union_experts, routed; then calls, passes, ns, failures */
#define BLOCK_STATS 10
int moepack_stream_stats(struct stream * s, int64_t * out, int64_t n) {
    if (n != BLOCK_STATS * (int64_t) s->n_blocks + 4) return -1; /* a caller that counts differently */
    charge_reads(s);
    for (int i = 0; i < s->n_blocks; i++) {
        struct sblock * b = &s->blocks[i];
        int64_t * o = out + BLOCK_STATS * i;
        o[0] = b->predicted; o[1] = b->hits; o[2] = b->chosen; o[3] = b->bytes_read; o[4] = b->bytes_wasted;
        o[5] = b->accesses; o[6] = b->cache_hits; o[7] = b->evictions;
        o[8] = b->union_experts; o[9] = b->routed;
    }
    int64_t * tail = out + BLOCK_STATS * s->n_blocks;
    tail[0] = s->calls; tail[1] = s->passes; tail[2] = s->ns; tail[3] = s->failures;
    return 0;
}

int moepack_stream_scratch(struct stream * s, int max_rows) {
    int max_e = 1;
    for (int i = 0; i < s->n_blocks; i++) if (s->blocks[i].n_expert > max_e) max_e = s->blocks[i].n_expert;
    s->rows = malloc(sizeof(int64_t) * 4 * (size_t) max_e * MAX_TENSORS);
    s->chosen = malloc((size_t) max_e);
    s->scores = malloc(sizeof(float) * (size_t) max_e);
    s->xs = malloc(sizeof(float) * (size_t) (s->dim > 0 ? s->dim : 1));
    s->scratch_set = malloc((size_t) max_e);
    (void) max_rows;
    return s->rows && s->chosen && s->scores && s->xs && s->scratch_set ? 0 : -1;
}

void moepack_stream_free(struct stream * s) {
    if (!s) return;
    for (int i = 0; i < s->n_blocks; i++) {
        struct sblock * b = &s->blocks[i];
        free(b->pending); free(b->read_by_expert); free(b->prev); free(b->nxt); free(b->in_cache);
        free(b->inv_norm);
    }
    free(s->blocks); free(s->at); free(s->rows); free(s->chosen); free(s->scores); free(s->xs); free(s->victims); free(s->scratch_set); free(s);
}
