/* What placing read bytes into userfaultfd-registered memory costs, two ways (bench_pager.py):

   mode 0, UFFDIO_COPY: anonymous memory in missing-page mode; each chunk read with O_DIRECT
           into an aligned buffer, then copied into place by the kernel (a page allocated and
           filled per 4 KiB, its PTE installed);
   mode 1, memfd + UFFDIO_CONTINUE: a memfd mapped twice, the llama.cpp-side mapping
           registered in minor mode; each chunk read with O_DIRECT straight into the memfd
           through the second mapping (the DMA fills the shmem pages: no copy, but each page
           is allocated and zeroed first), then its PTEs installed with UFFDIO_CONTINUE.

   Both then read one byte of every page from the registered mapping (what llama.cpp's
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
    int uffd = uffd_with(mode == 1 ? UFFD_FEATURE_MINOR_SHMEM : 0);
    if (uffd < 0) return uffd;
    char * region = 0, * alias = 0, * buf = 0;
    int memfd = -1, rc = 0;
    if (mode == 0) {
        region = mmap(0, size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (posix_memalign((void **) &buf, 4096, (size_t) chunk)) { rc = -ENOMEM; goto done; }
    } else {
        memfd = (int) syscall(SYS_memfd_create, "moepack-bench", MFD_CLOEXEC);
        if (memfd < 0 || ftruncate(memfd, (off_t) size) != 0) { rc = -errno; goto done; }
        region = mmap(0, size, PROT_READ, MAP_SHARED, memfd, 0);
        alias = mmap(0, size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
        if (alias == MAP_FAILED) { alias = 0; rc = -errno; goto done; }
    }
    if (region == MAP_FAILED) { region = 0; rc = -errno; goto done; }
    struct uffdio_register reg = { .range = { (uint64_t) region, size },
                                   .mode = mode == 0 ? UFFDIO_REGISTER_MODE_MISSING : UFFDIO_REGISTER_MODE_MINOR };
    if (ioctl(uffd, UFFDIO_REGISTER, &reg) != 0) { rc = -errno; goto done; }
    int64_t w0 = ns(CLOCK_MONOTONIC), c0 = ns(CLOCK_THREAD_CPUTIME_ID);
    for (int64_t i = 0; i < n; i++) {
        char * dst = region + i * chunk;
        if (mode == 0) {
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
    for (size_t o = 0; o < size; o += (size_t) page) sum += (unsigned char) region[o];
    int64_t w2 = ns(CLOCK_MONOTONIC), c2 = ns(CLOCK_THREAD_CPUTIME_ID);
    out[0] = w1 - w0; out[1] = c1 - c0; out[2] = w2 - w1; out[3] = c2 - c1; out[4] = (int64_t) sum;
done:
    if (region) munmap(region, size);
    if (alias) munmap(alias, size);
    if (memfd >= 0) close(memfd);
    free(buf);
    close(uffd);
    return rc;
}
