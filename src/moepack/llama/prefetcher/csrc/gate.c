#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The limits are evalgate.py's (MAX_BASES, MAX_SLOTS, MAX_BASE_CHARS), passed as -D flags. */
#if !defined(MAX_BASES) || !defined(MAX_SLOTS) || !defined(MAX_BASE_CHARS)
#error "built through moepack.llama.prefetcher.cbuild: the limits come from evalgate.py"
#endif

typedef bool (*forward_fn)(void * t, bool ask, void * ud);
typedef void (*hook_fn)(void * ctx, void * t, void * const * queued);
typedef bool (*is_host_fn)(void * buffer);

struct rec { int32_t base, layer, type, ne0; int64_t rows, offset; };

struct gate {
    int name_offset;
    int op_offset;
    int flush_op;
    int n_bases;
    int slot[MAX_BASES];
    char base[MAX_BASES][MAX_BASE_CHARS];
    void * queued[MAX_SLOTS];
    int queued_base[MAX_SLOTS];
    int n_queued;
    forward_fn forward;
    long long asked;
    /* record mode: deferred tensors are copied here at the flush, not forwarded */
    int record;
    int ne_offset, nb_offset, data_offset, buffer_offset;
    is_host_fn is_host;
    char * buf;
    int64_t cap, used;
    struct rec * recs;
    int n_rec, max_rec;
    int failed; /* 1: out of room, 2: a type it cannot copy, 3: not in host memory */
    /* 0: every ask is answered "no" here (no split, no Python), as if no callback were set */
    volatile int enabled;
    /* a C function told of every read of base hook_base (with the deferred nodes queued so
       far) before Python is; hook_forward 0: Python is not told at all */
    hook_fn hook;
    void * hook_ctx;
    int hook_base;
    int hook_forward;
};

static int matches(const char * name, const char * base) {
    size_t n = strlen(base);
    if (strncmp(name, base, n) != 0 || name[n] != '-' || name[n + 1] == 0) return 0;
    for (name += n + 1; *name; name++) if (*name < '0' || *name > '9') return 0;
    return 1;
}

static int elsize(int type) {
    switch (type) {
        case 0: case 26: return 4;  /* F32, I32 */
        case 1: case 25: return 2;  /* F16, I16 */
        case 24: return 1;          /* I8 */
        case 27: case 28: return 8; /* I64, F64 */
        default: return 0;
    }
}

static void copy_tensor(struct gate * g, int base, const char * t) {
    int type = *(const int *) t;
    const int64_t * ne = (const int64_t *) (t + g->ne_offset);
    const size_t * nb = (const size_t *) (t + g->nb_offset);
    const char * data = *(const char * const *) (t + g->data_offset);
    void * buffer = *(void * const *) (t + g->buffer_offset);
    int es = elsize(type);
    if (es == 0) { g->failed = 2; return; }
    if (buffer == 0 || !g->is_host(buffer)) { g->failed = 3; return; }
    int64_t rows = ne[1] * ne[2] * ne[3];
    int64_t bytes = rows * ne[0] * es;
    if (g->n_rec >= g->max_rec || g->used + bytes > g->cap) { g->failed = 1; return; }
    const char * name = t + g->name_offset;
    const char * dash = strrchr(name, '-');
    struct rec * r = &g->recs[g->n_rec++];
    r->base = base; r->layer = dash ? atoi(dash + 1) : -1; r->type = type;
    r->ne0 = (int32_t) ne[0]; r->rows = rows; r->offset = g->used;
    char * out = g->buf + g->used;
    for (int64_t i3 = 0; i3 < ne[3]; i3++)
    for (int64_t i2 = 0; i2 < ne[2]; i2++)
    for (int64_t i1 = 0; i1 < ne[1]; i1++) {
        const char * row = data + i1 * nb[1] + i2 * nb[2] + i3 * nb[3];
        if (nb[0] == (size_t) es) {
            memcpy(out, row, (size_t) (ne[0] * es));
            out += ne[0] * es;
        } else {
            for (int64_t i0 = 0; i0 < ne[0]; i0++, out += es) memcpy(out, row + i0 * nb[0], es);
        }
    }
    g->used += bytes;
}

bool moepack_eval_gate(void * t, bool ask, void * ud) {
    struct gate * g = (struct gate *) ud;
    const char * name = (const char *) t + g->name_offset;
    int flush = g->n_queued > 0 && *(const int *) ((const char *) t + g->op_offset) == g->flush_op;
    if (ask && !g->enabled) return false;
    if (!ask) {
        if (g->hook && matches(name, g->base[g->hook_base])) {
            g->hook(g->hook_ctx, t, g->queued);
            if (!g->hook_forward) {
                for (int s = 0; s < MAX_SLOTS; s++) g->queued[s] = 0;
                g->n_queued = 0;
                return true;
            }
        }
        if (!g->record) return g->forward(t, ask, ud);
        if (flush) {
            for (int s = 0; s < MAX_SLOTS; s++) {
                if (g->queued[s]) copy_tensor(g, g->queued_base[s], (const char *) g->queued[s]);
                g->queued[s] = 0;
            }
            g->n_queued = 0;
        }
        for (int i = 0; i < g->n_bases; i++)
            if (g->slot[i] < 0 && matches(name, g->base[i])) return g->forward(t, ask, ud);
        return g->failed == 0;
    }
    g->asked++;
    for (int i = 0; i < g->n_bases; i++) {
        if (matches(name, g->base[i])) {
            if (g->slot[i] < 0) return true;
            if (g->queued[g->slot[i]] == 0) g->n_queued++;
            g->queued[g->slot[i]] = t;
            g->queued_base[g->slot[i]] = i;
            return false;
        }
    }
    return flush;
}
