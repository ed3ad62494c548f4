/* What placing read bytes into userfaultfd-registered memory costs, two ways (bench_pager.py):

   mode 0, UFFDIO_COPY: anonymous memory in missing-page mode; each chunk read with O_DIRECT
           into an aligned buffer, then copied into place by the kernel (a page allocated and
           filled per 4 KiB, its PTE installed);
   mode 1, memfd + UFFDIO_CONTINUE: a memfd mapped twice, the llama.cpp-side mapping
           registered in minor mode; each chunk read with O_DIRECT straight into the memfd
           through the second mapping (the DMA fills the shmem pages: no copy, but each page
           is allocated and zeroed first), then its PTEs installed with UFFDIO_CONTINUE.

   mode 2, the read alone: each chunk read with O_DIRECT into the same aligned buffer, nothing
           placed (what the disk's reads cost this thread by themselves);
   mode 3, UFFDIO_MOVE with recycled pages (Linux 6.8+): a pool of staging chunks, registered
           too and faulted in once; each chunk read with O_DIRECT into a staging chunk whose
           pages are already there, moved into place (PTEs moved: no page allocated, zeroed or
           copied), and, as the pager's eviction would, the chunk placed half the run before
           moved back out into the emptied staging chunk (place includes that eviction).

   They then read one byte of every resident page from the registered mapping (what llama.cpp's
   matmul would touch). Reported: wall and this thread's CPU nanoseconds (kernel time
   included) for the placing, the same for the touching, and a checksum of the bytes. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef UFFD_FEATURE_MOVE
#define UFFD_FEATURE_MOVE (1 << 16)
struct uffdio_move { uint64_t dst, src, len, mode; int64_t move; };
#define UFFDIO_MOVE _IOWR(UFFDIO, 0x05, struct uffdio_move)
#endif

static int move_pages(int uffd, char * dst, char * src, int64_t len) {
    int64_t done = 0;
    int busy = 0;
    while (done < len) {
        struct uffdio_move m = { .dst = (uint64_t) (dst + done), .src = (uint64_t) (src + done),
                                 .len = (uint64_t) (len - done), .mode = 0, .move = 0 };
        if (ioctl(uffd, UFFDIO_MOVE, &m) == 0) return 0;
        if (m.move > 0) { done += m.move; continue; }
        if (errno == EBUSY && ++busy < 5000) { /* a page the O_DIRECT completion has not let go */
            struct timespec t = { 0, 20000 };
            nanosleep(&t, 0);
            continue;
        }
        if (errno != EAGAIN) return -errno;
    }
    return 0;
}

static int64_t ns(clockid_t c) {
    struct timespec ts; clock_gettime(c, &ts);
    return (int64_t) ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int uffd_with(uint64_t features) {
    int fd = (int) syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return -errno;
    struct uffdio_api api = { .api = UFFD_API, .features = features };
    if (ioctl(fd, UFFDIO_API, &api) != 0) { int e = errno; close(fd); return -e; }
    return fd;
}

static int read_all(int fd, char * dst, int64_t n, int64_t off) {
    int64_t got = 0;
    while (got < n) {
        ssize_t k = pread(fd, dst + got, (size_t) (n - got), off + got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        got += k;
    }
    return 0;
}

/* out: place wall, place cpu, touch wall, touch cpu, checksum; returns 0 or -errno */
int moepack_bench_place(int mode, int fd, const int64_t * offs, int64_t n, int64_t chunk, int64_t * out) {
    size_t size = (size_t) (n * chunk);
    long page = sysconf(_SC_PAGESIZE);
    int uffd = uffd_with(mode == 1 ? UFFD_FEATURE_MINOR_SHMEM : mode == 3 ? UFFD_FEATURE_MOVE : 0);
    if (uffd < 0) return uffd;
    char * region = 0, * alias = 0, * buf = 0, * pool = 0;
    int64_t half = n / 2, slots = 4;
    size_t pool_size = (size_t) (slots * chunk);
    int memfd = -1, rc = 0;
    if (mode == 0 || mode == 2) {
        region = mmap(0, size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (posix_memalign((void **) &buf, 4096, (size_t) chunk)) { rc = -ENOMEM; goto done; }
    } else if (mode == 3) {
        region = mmap(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        pool = mmap(0, pool_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (pool == MAP_FAILED) { pool = 0; rc = -errno; goto done; }
        /* small pages: a huge one would have to be split for each 1 MiB moved */
        madvise(pool, pool_size, MADV_NOHUGEPAGE);
        madvise(region, size, MADV_NOHUGEPAGE);
        memset(pool, 1, pool_size); /* faulted in once: these pages are then only moved */
        if (posix_memalign((void **) &buf, 4096, (size_t) chunk)) { rc = -ENOMEM; goto done; }
        memset(buf, 1, (size_t) chunk);
        struct uffdio_register rp = { .range = { (uint64_t) pool, pool_size }, .mode = UFFDIO_REGISTER_MODE_MISSING };
        if (ioctl(uffd, UFFDIO_REGISTER, &rp) != 0) { rc = -errno; goto done; }
    } else {
        memfd = (int) syscall(SYS_memfd_create, "moepack-bench", MFD_CLOEXEC);
        if (memfd < 0 || ftruncate(memfd, (off_t) size) != 0) { rc = -errno; goto done; }
        region = mmap(0, size, PROT_READ, MAP_SHARED, memfd, 0);
        alias = mmap(0, size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
        if (alias == MAP_FAILED) { alias = 0; rc = -errno; goto done; }
    }
    if (region == MAP_FAILED) { region = 0; rc = -errno; goto done; }
    struct uffdio_register reg = { .range = { (uint64_t) region, size },
                                   .mode = mode == 1 ? UFFDIO_REGISTER_MODE_MINOR : UFFDIO_REGISTER_MODE_MISSING };
    if (ioctl(uffd, UFFDIO_REGISTER, &reg) != 0) { rc = -errno; goto done; }
    int64_t w0 = ns(CLOCK_MONOTONIC), c0 = ns(CLOCK_THREAD_CPUTIME_ID);
    for (int64_t i = 0; i < n; i++) {
        if (mode == 3 && i == half) { w0 = ns(CLOCK_MONOTONIC); c0 = ns(CLOCK_THREAD_CPUTIME_ID); }
        char * dst = region + i * chunk;
        if (mode == 2) {
            if (read_all(fd, buf, chunk, offs[i])) { rc = -EIO; goto done; }
        } else if (mode == 3) {
            char * slot = pool + (i % slots) * chunk;
            if (read_all(fd, slot, chunk, offs[i])) { rc = -EIO; goto done; }
            if ((rc = move_pages(uffd, dst, slot, chunk))) goto done;
            if (i >= half && (rc = move_pages(uffd, slot, region + (i - half) * chunk, chunk))) goto done;
            if (i < half) { /* nothing evicted yet: the emptied slot gets new pages (copied in,
                               as a registered range's missing pages must be) */
                struct uffdio_copy c = { .dst = (uint64_t) slot, .src = (uint64_t) buf, .len = (uint64_t) chunk };
                if (ioctl(uffd, UFFDIO_COPY, &c) != 0) { rc = -errno; goto done; }
            }
        } else if (mode == 0) {
            if (read_all(fd, buf, chunk, offs[i])) { rc = -EIO; goto done; }
            struct uffdio_copy c = { .dst = (uint64_t) dst, .src = (uint64_t) buf, .len = (uint64_t) chunk };
            if (ioctl(uffd, UFFDIO_COPY, &c) != 0) { rc = -errno; goto done; }
        } else {
            if (read_all(fd, alias + i * chunk, chunk, offs[i])) { rc = -EIO; goto done; }
            struct uffdio_continue c = { .range = { (uint64_t) dst, (uint64_t) chunk } };
            if (ioctl(uffd, UFFDIO_CONTINUE, &c) != 0) { rc = -errno; goto done; }
        }
    }
    int64_t w1 = ns(CLOCK_MONOTONIC), c1 = ns(CLOCK_THREAD_CPUTIME_ID);
    uint64_t sum = 0;
    size_t from = mode == 3 ? (size_t) ((n - half) * chunk) : 0; /* mode 3: what was not evicted */
    if (mode != 2)
        for (size_t o = from; o < size; o += (size_t) page) sum += (unsigned char) region[o];
    int64_t w2 = ns(CLOCK_MONOTONIC), c2 = ns(CLOCK_THREAD_CPUTIME_ID);
    out[0] = w1 - w0; out[1] = c1 - c0; out[2] = w2 - w1; out[3] = c2 - c1; out[4] = (int64_t) sum;
    if (mode == 3) /* the steady half and the resident half, as if over all n chunks */
        for (int k = 0; k < 4; k++) out[k] = out[k] * n / (n - half > 0 ? n - half : 1);
done:
    if (region) munmap(region, size);
    if (alias) munmap(alias, size);
    if (pool) munmap(pool, pool_size);
    if (memfd >= 0) close(memfd);
    free(buf);
    close(uffd);
    return rc;
}
