/*
 * MEMO allocator core: serves planned allocations from one arena, everything else from an
 * exact-size caching free list.
 *
 * Plain C11, no CUDA or torch headers. Built by setup.py (memo_ext.allocator._core) or compiled
 * on first use by memo_ext/allocator/core.py, loaded with ctypes; on a GPU its memo_alloc /
 * memo_free pair is what torch.cuda.memory.CUDAPluggableAllocator calls, on CPU the c10 shim
 * (cpu_shim.cpp) calls them. The design is described in memo_ext/allocator/core.py.
 *
 * Process-wide state, every entry point holds `lock` for its whole body. Sizes are rounded up
 * to BLOCK_ALIGN bytes as PyTorch's caching allocator rounds its requests, so a plan made from
 * a trace of rounded sizes matches the requests seen here.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MEMO_ABI_VERSION 2
/* sha256 of this file (first 16 hex digits), set by whoever compiles it (setup.py, core.py), so
 * a library built from an older source is recognised as stale. */
#ifndef MEMO_SOURCE_DIGEST
#define MEMO_SOURCE_DIGEST "unknown"
#endif
#define BLOCK_ALIGN 512u
/* A plan's offset for a request it leaves to the fallback path (a block that outlives its
 * pass, say): its size is still checked, it is never a hit and never a miss. */
#define MEMO_UNPLANNED UINT64_MAX
#define ARENA_ALIGN 65536u
#define MAX_KINDS 8
#define MAX_PLAN_BLOCKS (1 << 24)

/* Return codes (negative: the call changed nothing; memo_last_error says why). */
#define MEMO_OK 0
#define MEMO_EINVAL (-1)   /* a bad argument */
#define MEMO_ENOMEM (-2)   /* the backend could not allocate */
#define MEMO_ENOCUDA (-3)  /* the CUDA runtime could not be found or used */
#define MEMO_ESTATE (-4)   /* not allowed now (a pass open, blocks live, not initialised) */
#define MEMO_EPLAN (-5)    /* the plan is inconsistent */

enum { MODE_OFF = 0, MODE_RECORD = 1, MODE_SERVE = 2 };
enum { BACKEND_NONE = -1, BACKEND_HOST = 0, BACKEND_CUDA = 1 };
enum { BLOCK_FALLBACK = 1, BLOCK_ARENA = 2 };
/* EVENT_FREE_OTHER: a block of the pass freed by another thread than the pass's owner (a
 * collective's worker dropping its buffer, say): a time the pass's own sequence does not set */
enum { EVENT_ALLOC = 0, EVENT_FREE = 1, EVENT_FREE_OTHER = 2 };

/* Statistics, in the order memo_stats writes them (core.py names them). */
enum {
    ST_REQUESTS,          /* allocation requests while a pass was open in serve mode */
    ST_HITS,              /* ... served at their planned offset */
    ST_HIT_BYTES,         /* rounded bytes of the hits */
    ST_MISS_SIZE,         /* rounded size differs from the plan's */
    ST_MISS_EXTRA,        /* more requests than the plan has */
    ST_MISS_OVERLAP,      /* planned range overlaps a live arena block */
    ST_MISS_THREAD,       /* request from a thread that does not own the pass */
    ST_MISS_STREAM,       /* not the pass's (or the arena's) stream / device */
    ST_MISS_NO_PLAN,      /* no plan loaded for the pass's kind */
    ST_FALLBACK_REQUESTS, /* requests served by the fallback path (all of them) */
    ST_FALLBACK_LIVE,     /* rounded bytes of live fallback blocks */
    ST_FALLBACK_PEAK,     /* peak of ST_FALLBACK_LIVE */
    ST_FALLBACK_CACHED,   /* bytes held in the fallback free lists */
    ST_ARENA_BYTES,       /* size of the arena */
    ST_ARENA_LIVE,        /* rounded bytes of live arena blocks */
    ST_ARENA_PEAK,        /* peak of ST_ARENA_LIVE */
    ST_PASSES,            /* memo_begin_pass calls that opened a pass */
    ST_BACKEND_ALLOCS,    /* fallback blocks taken from the backend (malloc / cudaMalloc) */
    ST_UNPLANNED,         /* requests the plan itself leaves to the fallback path */
    ST_UNPLANNED_BYTES,   /* rounded bytes of those */
    ST_COUNT
};

/* One live block: the pointer table's value. */
typedef struct {
    uintptr_t ptr; /* 0: empty slot */
    uint64_t size; /* rounded bytes */
    void *stream;  /* stream of the request; a cached block is reused on this stream only */
    uint64_t pass_serial; /* serial of the recorded pass that logged the block, else 0 */
    int64_t index;        /* request index within that pass */
    int32_t device;
    int32_t kind; /* BLOCK_FALLBACK or BLOCK_ARENA */
} block_t;

/* Cached fallback blocks of one (size, device, stream). */
typedef struct {
    uint64_t size; /* 0: empty slot */
    void *stream;
    int32_t device;
    int32_t count, capacity;
    void **ptrs;
} bin_t;

typedef struct {
    uint64_t start, end; /* [start, end) offsets in the arena */
    int64_t index;       /* the planned request this block serves, in its pass */
    uint64_t serial;     /* that pass's serial */
    int32_t kind;        /* that pass's kind */
} interval_t;

/* A planned block still live when a later request's planned bytes overlapped it: freed later
 * than in the recording (by a thread of its own timing, say). `outlived`: past its pass's end. */
typedef struct {
    int32_t kind;
    int32_t outlived;
    int64_t index;
} late_t;

#define MAX_LATE 4096

typedef struct {
    int32_t type;
    int64_t index;
    uint64_t size;
} event_t;

typedef struct {
    event_t *events;
    int count, capacity;
} event_log_t;

typedef struct {
    int loaded;
    int n;
    uint64_t *sizes, *offsets;
    uint64_t arena_bytes;
} plan_t;

typedef struct {
    int open;
    int kind;
    int mode; /* the mode when the pass began */
    pthread_t owner;
    int stream_known; /* the owner's first request fixed stream / device */
    void *stream;
    int device;
    int64_t next_index; /* requests of the owner so far */
    uint64_t serial;
} pass_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* fork() copies only the forking thread: were another thread inside the core at that moment, the
 * child (a data-loader worker, say) would find the lock held forever. Take it around fork, as
 * malloc implementations do. */
static void fork_prepare(void) { pthread_mutex_lock(&lock); }
static void fork_parent(void) { pthread_mutex_unlock(&lock); }
static void fork_child(void) { pthread_mutex_unlock(&lock); }
__attribute__((constructor)) static void register_fork_handlers(void) {
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}
/* Per thread, so a failing call reads its own sentence. */
static _Thread_local char last_error[512] = "no error";
static int backend = BACKEND_NONE;
static int mode = MODE_OFF;
static uint64_t stats[ST_COUNT];

/* CUDA runtime entry points, resolved at run time (never linked). */
static int (*cuda_malloc)(void **, size_t);
static int (*cuda_free)(void *);
static int (*cuda_get_device)(int *);
static int (*cuda_get_last_error)(void); /* optional: clears a failed cudaMalloc's error */

/* ptr -> block_t, open addressing with linear probing; capacity a power of two. */
static block_t *blocks;
static size_t blocks_capacity, blocks_count;

static bin_t *bins;
static size_t bins_capacity, bins_count;

static struct {
    char *base;
    uint64_t bytes;
    int device;
    int stream_known; /* fixed by the first hit; a later pass on another stream misses */
    void *stream;
    interval_t *live; /* live blocks sorted by start; they never overlap */
    size_t live_count, live_capacity;
} arena;

static plan_t plans[MAX_KINDS];
static pass_t pass;
static uint64_t pass_serial_counter;
static event_log_t log_now, log_done;
static int log_done_kind = -1;
static late_t late[MAX_LATE];
static int late_count;

static void set_error(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, args);
    va_end(args);
}

static uint64_t round_up(uint64_t value, uint64_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

static void bump_peak(int live, int peak) {
    if (stats[live] > stats[peak]) stats[peak] = stats[live];
}

/* ---- backend ---------------------------------------------------------------------------- */

static void *backend_alloc(uint64_t bytes, size_t alignment) {
    if (backend == BACKEND_HOST) {
        void *ptr = NULL;
        return posix_memalign(&ptr, alignment, (size_t)bytes) == 0 ? ptr : NULL;
    }
    if (backend == BACKEND_CUDA) {
        /* cudaMalloc returns at least 256-byte aligned memory, 2 MiB for large sizes. */
        void *ptr = NULL;
        if (cuda_malloc(&ptr, (size_t)bytes) == 0) return ptr;
        /* Clear the out-of-memory error, or torch's next launch check would report it. */
        if (cuda_get_last_error) cuda_get_last_error();
        return NULL;
    }
    return NULL;
}

static void backend_free(void *ptr) {
    if (backend == BACKEND_HOST) free(ptr);
    else if (backend == BACKEND_CUDA) cuda_free(ptr);
}

static int current_cuda_device(void) {
    int device = -1;
    if (backend == BACKEND_CUDA && cuda_get_device(&device) != 0) device = -1;
    return device;
}

static void *find_cuda_symbol(void *handle, const char *name) {
    return handle ? dlsym(handle, name) : dlsym(RTLD_DEFAULT, name);
}

static int resolve_cuda(void) {
    /* torch has usually loaded libcudart already: look in the process first. */
    static const char *const libraries[] = {NULL, "libcudart.so", "libcudart.so.13",
                                            "libcudart.so.12"};
    for (size_t k = 0; k < sizeof libraries / sizeof libraries[0]; k++) {
        void *handle = NULL;
        if (libraries[k]) {
            handle = dlopen(libraries[k], RTLD_NOW | RTLD_LOCAL);
            if (!handle) continue;
        }
        /* dlsym returns data pointers; memcpy turns them into function pointers portably. */
        void *symbols[3] = {find_cuda_symbol(handle, "cudaMalloc"),
                            find_cuda_symbol(handle, "cudaFree"),
                            find_cuda_symbol(handle, "cudaGetDevice")};
        memcpy(&cuda_malloc, &symbols[0], sizeof symbols[0]);
        memcpy(&cuda_free, &symbols[1], sizeof symbols[1]);
        memcpy(&cuda_get_device, &symbols[2], sizeof symbols[2]);
        void *last_error_symbol = find_cuda_symbol(handle, "cudaGetLastError");
        memcpy(&cuda_get_last_error, &last_error_symbol, sizeof last_error_symbol);
        if (cuda_malloc && cuda_free && cuda_get_device) return MEMO_OK;
        if (handle) dlclose(handle);
    }
    cuda_malloc = NULL;
    cuda_free = NULL;
    cuda_get_device = NULL;
    set_error("the CUDA runtime was not found (cudaMalloc, cudaFree and cudaGetDevice are not "
              "in the process, libcudart.so, libcudart.so.13 or libcudart.so.12); import torch "
              "with CUDA first or put libcudart on the library path.");
    return MEMO_ENOCUDA;
}

/* ---- pointer table ---------------------------------------------------------------------- */

static size_t ptr_slot(uintptr_t ptr, size_t capacity) {
    /* Blocks are 512-byte aligned: drop the low bits, then a multiplicative hash. */
    return (size_t)(((uint64_t)(ptr >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & (capacity - 1);
}

static int table_grow(void) {
    size_t capacity = blocks_capacity ? blocks_capacity * 2 : 1024;
    block_t *grown = calloc(capacity, sizeof *grown);
    if (!grown) return MEMO_ENOMEM;
    for (size_t k = 0; k < blocks_capacity; k++) {
        if (!blocks[k].ptr) continue;
        size_t slot = ptr_slot(blocks[k].ptr, capacity);
        while (grown[slot].ptr) slot = (slot + 1) & (capacity - 1);
        grown[slot] = blocks[k];
    }
    free(blocks);
    blocks = grown;
    blocks_capacity = capacity;
    return MEMO_OK;
}

/* Needs room for one more block (reserve_tables). */
static void table_insert(const block_t *block) {
    size_t slot = ptr_slot(block->ptr, blocks_capacity);
    while (blocks[slot].ptr) slot = (slot + 1) & (blocks_capacity - 1);
    blocks[slot] = *block;
    blocks_count++;
}

static block_t *table_find(uintptr_t ptr) {
    if (!blocks_capacity) return NULL;
    size_t slot = ptr_slot(ptr, blocks_capacity);
    while (blocks[slot].ptr) {
        if (blocks[slot].ptr == ptr) return &blocks[slot];
        slot = (slot + 1) & (blocks_capacity - 1);
    }
    return NULL;
}

static void table_remove(block_t *found) {
    /* Backward-shift deletion: no tombstones, every remaining key stays reachable. */
    size_t mask = blocks_capacity - 1;
    size_t hole = (size_t)(found - blocks);
    size_t next = (hole + 1) & mask;
    while (blocks[next].ptr) {
        size_t home = ptr_slot(blocks[next].ptr, blocks_capacity);
        /* Move `next` into the hole unless its home lies cyclically in (hole, next]. */
        int stays = hole <= next ? (hole < home && home <= next) : (hole < home || home <= next);
        if (!stays) {
            blocks[hole] = blocks[next];
            hole = next;
        }
        next = (next + 1) & mask;
    }
    memset(&blocks[hole], 0, sizeof blocks[hole]);
    blocks_count--;
}

/* ---- fallback: exact-size caching free lists ---------------------------------------------- */

static size_t bin_slot(uint64_t size, int device, void *stream, size_t capacity) {
    uint64_t key = size ^ ((uint64_t)(uintptr_t)stream * 0x100000001B3ull) ^ (uint64_t)device;
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & (capacity - 1);
}

static bin_t *bin_lookup(uint64_t size, int device, void *stream, int create) {
    if (create && 2 * (bins_count + 1) > bins_capacity) {
        size_t capacity = bins_capacity ? bins_capacity * 2 : 64;
        bin_t *grown = calloc(capacity, sizeof *grown);
        if (!grown) return NULL;
        for (size_t k = 0; k < bins_capacity; k++) {
            if (!bins[k].size) continue;
            size_t slot = bin_slot(bins[k].size, bins[k].device, bins[k].stream, capacity);
            while (grown[slot].size) slot = (slot + 1) & (capacity - 1);
            grown[slot] = bins[k];
        }
        free(bins);
        bins = grown;
        bins_capacity = capacity;
    }
    if (!bins_capacity) return NULL;
    size_t slot = bin_slot(size, device, stream, bins_capacity);
    while (bins[slot].size) {
        bin_t *bin = &bins[slot];
        if (bin->size == size && bin->device == device && bin->stream == stream) return bin;
        slot = (slot + 1) & (bins_capacity - 1);
    }
    if (!create) return NULL;
    bins[slot] = (bin_t){.size = size, .device = device, .stream = stream};
    bins_count++;
    return &bins[slot];
}

static void release_cached_locked(void) {
    for (size_t k = 0; k < bins_capacity; k++) {
        for (int j = 0; j < bins[k].count; j++) backend_free(bins[k].ptrs[j]);
        free(bins[k].ptrs);
    }
    free(bins);
    bins = NULL;
    bins_capacity = bins_count = 0;
    stats[ST_FALLBACK_CACHED] = 0;
}

static void *fallback_alloc(uint64_t size, int device, void *stream) {
    bin_t *bin = bin_lookup(size, device, stream, 0);
    void *ptr = NULL;
    if (bin && bin->count > 0) {
        ptr = bin->ptrs[--bin->count];
        stats[ST_FALLBACK_CACHED] -= size;
    } else {
        ptr = backend_alloc(size, BLOCK_ALIGN);
        if (!ptr && stats[ST_FALLBACK_CACHED] > 0) {
            /* Out of memory: hand the cached blocks back and try once more. */
            release_cached_locked();
            ptr = backend_alloc(size, BLOCK_ALIGN);
        }
        if (!ptr) {
            set_error("the backend could not allocate %llu bytes.", (unsigned long long)size);
            return NULL;
        }
        stats[ST_BACKEND_ALLOCS]++;
    }
    stats[ST_FALLBACK_REQUESTS]++;
    stats[ST_FALLBACK_LIVE] += size;
    bump_peak(ST_FALLBACK_LIVE, ST_FALLBACK_PEAK);
    return ptr;
}

static void fallback_release(const block_t *block) {
    stats[ST_FALLBACK_LIVE] -= block->size;
    bin_t *bin = bin_lookup(block->size, block->device, block->stream, 1);
    if (bin && bin->count == bin->capacity) {
        int capacity = bin->capacity ? 2 * bin->capacity : 8;
        void **grown = realloc(bin->ptrs, (size_t)capacity * sizeof *grown);
        if (grown) {
            bin->ptrs = grown;
            bin->capacity = capacity;
        }
    }
    if (!bin || bin->count == bin->capacity) {
        backend_free((void *)block->ptr); /* no room to cache it */
        return;
    }
    bin->ptrs[bin->count++] = (void *)block->ptr;
    stats[ST_FALLBACK_CACHED] += block->size;
}

/* ---- arena: live intervals ---------------------------------------------------------------- */

static size_t first_starting_at_or_after(uint64_t offset) {
    size_t lo = 0, hi = arena.live_count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (arena.live[mid].start < offset) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The live block that reaches into [start, end), or NULL. Live blocks are disjoint and sorted,
 * so their ends are sorted too: only the last block starting before `end` can. */
static const interval_t *arena_overlapping_live(uint64_t start, uint64_t end) {
    size_t k = first_starting_at_or_after(end);
    return k > 0 && arena.live[k - 1].end > start ? &arena.live[k - 1] : NULL;
}

/* Needs room for one more interval (reserve_tables). */
static void arena_mark_live(uint64_t start, uint64_t end, int64_t index) {
    size_t k = first_starting_at_or_after(start);
    memmove(&arena.live[k + 1], &arena.live[k], (arena.live_count - k) * sizeof *arena.live);
    arena.live[k] = (interval_t){start, end, index, pass.serial, pass.kind};
    arena.live_count++;
    stats[ST_ARENA_LIVE] += end - start;
    bump_peak(ST_ARENA_LIVE, ST_ARENA_PEAK);
}

static void arena_mark_free(uint64_t start) {
    size_t k = first_starting_at_or_after(start);
    if (k == arena.live_count || arena.live[k].start != start) return;
    stats[ST_ARENA_LIVE] -= arena.live[k].end - arena.live[k].start;
    memmove(&arena.live[k], &arena.live[k + 1], (arena.live_count - k - 1) * sizeof *arena.live);
    arena.live_count--;
}

static void arena_release(void) {
    if (arena.base) backend_free(arena.base);
    arena.base = NULL;
    arena.bytes = 0;
    arena.stream_known = 0;
    stats[ST_ARENA_BYTES] = 0;
}

/* Room for one more block in the pointer table (load factor at most 1/2 keeps probe chains
 * short) and one more live arena interval. */
static int reserve_tables(void) {
    if (2 * (blocks_count + 1) > blocks_capacity && table_grow() != MEMO_OK) return MEMO_ENOMEM;
    if (arena.live_count == arena.live_capacity) {
        size_t capacity = arena.live_capacity ? 2 * arena.live_capacity : 256;
        interval_t *grown = realloc(arena.live, capacity * sizeof *grown);
        if (!grown) return MEMO_ENOMEM;
        arena.live = grown;
        arena.live_capacity = capacity;
    }
    return MEMO_OK;
}

/* ---- record log ---------------------------------------------------------------------------- */

static void log_event(int32_t type, int64_t index, uint64_t size) {
    if (log_now.count == log_now.capacity) {
        int capacity = log_now.capacity ? 2 * log_now.capacity : 1024;
        event_t *grown = realloc(log_now.events, (size_t)capacity * sizeof *grown);
        if (!grown) return; /* the log is short by an event; memo_recorded_count shows it */
        log_now.events = grown;
        log_now.capacity = capacity;
    }
    log_now.events[log_now.count++] = (event_t){type, index, size};
}

/* ---- serving ------------------------------------------------------------------------------- */

/* Where a request of the open pass goes: an arena offset (>= 0) or -1 for the fallback path.
 * Counts the request and its miss reason in serve mode, assigns its index in record mode. */
static int64_t route_pass_request(uint64_t size, int device, void *stream, int64_t *logged) {
    if (!pthread_equal(pthread_self(), pass.owner)) {
        if (pass.mode == MODE_SERVE) {
            stats[ST_REQUESTS]++;
            stats[ST_MISS_THREAD]++;
        }
        return -1; /* other threads never advance the pass's counter */
    }
    int64_t i = pass.next_index++;
    if (!pass.stream_known) {
        pass.stream_known = 1;
        pass.stream = stream;
        pass.device = device;
    }
    if (pass.mode == MODE_RECORD) {
        *logged = i;
        log_event(EVENT_ALLOC, i, size);
        return -1;
    }
    stats[ST_REQUESTS]++;
    const plan_t *plan = &plans[pass.kind];
    if (!plan->loaded || !arena.base || plan->arena_bytes > arena.bytes) {
        stats[ST_MISS_NO_PLAN]++;
        return -1;
    }
    if (i >= plan->n) {
        stats[ST_MISS_EXTRA]++;
        return -1;
    }
    if (size != plan->sizes[i]) {
        stats[ST_MISS_SIZE]++;
        return -1;
    }
    if (plan->offsets[i] == MEMO_UNPLANNED) {
        stats[ST_UNPLANNED]++;
        stats[ST_UNPLANNED_BYTES] += size;
        return -1;
    }
    /* A block freed on one stream may still be read by work queued there: the arena serves
     * one stream (the first hit's) on the device it lives on. */
    int other_stream = stream != pass.stream || device != pass.device || device != arena.device;
    if (arena.stream_known) other_stream |= stream != arena.stream;
    if (other_stream) {
        stats[ST_MISS_STREAM]++;
        return -1;
    }
    uint64_t start = plan->offsets[i];
    const interval_t *blocking = arena_overlapping_live(start, start + size);
    if (blocking) {
        stats[ST_MISS_OVERLAP]++;
        if (late_count < MAX_LATE)
            late[late_count++] = (late_t){blocking->kind, blocking->serial != pass.serial,
                                          blocking->index};
        return -1;
    }
    return (int64_t)start;
}

void *memo_alloc(size_t size, int device, void *stream) {
    if (size == 0) return NULL; /* no storage, never part of a trace */
    pthread_mutex_lock(&lock);
    void *result = NULL;
    if (backend == BACKEND_NONE) {
        set_error("memo_alloc was called before memo_init chose a backend.");
        goto done;
    }
    if (size > UINT64_MAX - BLOCK_ALIGN) {
        set_error("memo_alloc got an impossible size of %llu bytes.", (unsigned long long)size);
        goto done;
    }
    uint64_t rounded = round_up(size, BLOCK_ALIGN);
    if (backend == BACKEND_HOST) device = -1; /* one host "device" */
    else if (device < 0) device = current_cuda_device();
    /* Make room in the tables first, so nothing can fail once the request is routed. */
    if (reserve_tables() != MEMO_OK) {
        set_error("no host memory to track one more block.");
        goto done;
    }
    int64_t logged = -1, offset = -1;
    if (pass.open && pass.mode != MODE_OFF)
        offset = route_pass_request(rounded, device, stream, &logged);
    block_t block = {.size = rounded, .stream = stream, .device = device, .index = logged,
                     .pass_serial = logged >= 0 ? pass.serial : 0};
    if (offset >= 0) {
        arena_mark_live((uint64_t)offset, (uint64_t)offset + rounded, pass.next_index - 1);
        result = arena.base + offset;
        block.kind = BLOCK_ARENA;
        if (!arena.stream_known) {
            arena.stream_known = 1;
            arena.stream = stream;
        }
        stats[ST_HITS]++;
        stats[ST_HIT_BYTES] += rounded;
    } else {
        result = fallback_alloc(rounded, device, stream);
        block.kind = BLOCK_FALLBACK;
    }
    if (!result) goto done;
    block.ptr = (uintptr_t)result;
    table_insert(&block);
done:
    pthread_mutex_unlock(&lock);
    return result;
}

void memo_free(void *ptr, size_t size, int device, void *stream) {
    (void)size, (void)device, (void)stream; /* the table knows; the CPU shim passes 0 / -1 */
    if (!ptr) return;
    pthread_mutex_lock(&lock);
    block_t *found = table_find((uintptr_t)ptr);
    if (!found) {
        set_error("memo_free got pointer %p, which the allocator did not hand out (or already "
                  "took back).", ptr);
        goto done;
    }
    block_t block = *found;
    table_remove(found);
    if (pass.open && pass.mode == MODE_RECORD && block.pass_serial == pass.serial) {
        int own = pthread_equal(pthread_self(), pass.owner);
        log_event(own ? EVENT_FREE : EVENT_FREE_OTHER, block.index, block.size);
    }
    if (block.kind == BLOCK_ARENA) arena_mark_free((uint64_t)((char *)ptr - arena.base));
    else fallback_release(&block);
done:
    pthread_mutex_unlock(&lock);
}

/* ---- plans --------------------------------------------------------------------------------- */

static int check_block(int kind, int i, uint64_t size, uint64_t offset, int64_t alloc_at,
                       int64_t free_at, uint64_t arena_bytes) {
    if (size == 0 || size % BLOCK_ALIGN) {
        set_error("plan for pass kind %d refused: block %d has size %llu bytes, which is not a "
                  "positive multiple of %u.", kind, i, (unsigned long long)size, BLOCK_ALIGN);
        return MEMO_EPLAN;
    }
    if (alloc_at < 0 || (free_at >= 0 && alloc_at >= free_at) || free_at < -1) {
        set_error("plan for pass kind %d refused: block %d is allocated at event %lld and freed "
                  "at event %lld; a block must be freed after it is allocated (or -1: never).",
                  kind, i, (long long)alloc_at, (long long)free_at);
        return MEMO_EPLAN;
    }
    if (offset == MEMO_UNPLANNED) return MEMO_OK; /* not in the arena: nothing to place */
    if (offset % BLOCK_ALIGN) {
        set_error("plan for pass kind %d refused: block %d has offset %llu, which is not a "
                  "multiple of %u bytes.", kind, i, (unsigned long long)offset, BLOCK_ALIGN);
        return MEMO_EPLAN;
    }
    if (offset > arena_bytes || size > arena_bytes - offset) {
        set_error("plan for pass kind %d refused: block %d ends at byte %llu, past the plan's "
                  "arena of %llu bytes.", kind, i, (unsigned long long)offset + size,
                  (unsigned long long)arena_bytes);
        return MEMO_EPLAN;
    }
    return MEMO_OK;
}

static int check_plan(int kind, int n, const uint64_t *sizes, const uint64_t *offsets,
                      const int64_t *alloc_at, const int64_t *free_at, uint64_t arena_bytes) {
    for (int i = 0; i < n; i++) {
        int status = check_block(kind, i, sizes[i], offsets[i], alloc_at[i], free_at[i],
                                 arena_bytes);
        if (status != MEMO_OK) return status;
        if (i > 0 && alloc_at[i] <= alloc_at[i - 1]) {
            set_error("plan for pass kind %d refused: block %d is allocated at event %lld, not "
                      "after block %d (event %lld); blocks must be listed in request order.",
                      kind, i, (long long)alloc_at[i], i - 1, (long long)alloc_at[i - 1]);
            return MEMO_EPLAN;
        }
    }
    /* Blocks are in allocation order, so block j > i shares i's lifetime exactly when it is
     * allocated before i is freed: O(n x blocks live at once). */
    for (int i = 0; i < n; i++) {
        if (offsets[i] == MEMO_UNPLANNED) continue;
        for (int j = i + 1; j < n && (free_at[i] < 0 || alloc_at[j] < free_at[i]); j++) {
            if (offsets[j] == MEMO_UNPLANNED) continue;
            if (offsets[i] < offsets[j] + sizes[j] && offsets[j] < offsets[i] + sizes[i]) {
                set_error("plan for pass kind %d refused: blocks %d and %d are live at the same "
                          "time and overlap ([%llu, %llu) and [%llu, %llu)).", kind, i, j,
                          (unsigned long long)offsets[i],
                          (unsigned long long)(offsets[i] + sizes[i]),
                          (unsigned long long)offsets[j],
                          (unsigned long long)(offsets[j] + sizes[j]));
                return MEMO_EPLAN;
            }
        }
    }
    return MEMO_OK;
}

static void drop_plan(int kind) {
    free(plans[kind].sizes);
    free(plans[kind].offsets);
    memset(&plans[kind], 0, sizeof plans[kind]);
}

int memo_load_plan(int kind, int n, const uint64_t *sizes, const uint64_t *offsets,
                   const int64_t *alloc_at, const int64_t *free_at, uint64_t arena_bytes) {
    pthread_mutex_lock(&lock);
    int status = MEMO_OK;
    if (kind < 0 || kind >= MAX_KINDS) {
        set_error("pass kind %d is out of range; kinds are 0 to %d.", kind, MAX_KINDS - 1);
        status = MEMO_EINVAL;
    } else if (n < 0 || n > MAX_PLAN_BLOCKS || (n > 0 && (!sizes || !offsets || !alloc_at ||
                                                          !free_at))) {
        set_error("plan for pass kind %d refused: %d blocks, or a missing array.", kind, n);
        status = MEMO_EINVAL;
    } else if (pass.open && pass.kind == kind) {
        set_error("a pass of kind %d is open; end it before loading its plan.", kind);
        status = MEMO_ESTATE;
    } else if (arena_bytes > arena.bytes) {
        set_error("plan for pass kind %d needs an arena of %llu bytes but %llu are reserved; "
                  "reserve the arena (memo_reserve_arena) first.", kind,
                  (unsigned long long)arena_bytes, (unsigned long long)arena.bytes);
        status = MEMO_ESTATE;
    } else {
        status = check_plan(kind, n, sizes, offsets, alloc_at, free_at, arena_bytes);
    }
    if (status != MEMO_OK) goto done;
    size_t bytes = (size_t)(n > 0 ? n : 1) * sizeof(uint64_t);
    uint64_t *sizes_copy = malloc(bytes), *offsets_copy = malloc(bytes);
    if (!sizes_copy || !offsets_copy) {
        free(sizes_copy);
        free(offsets_copy);
        set_error("no host memory to keep a plan of %d blocks.", n);
        status = MEMO_ENOMEM;
        goto done;
    }
    if (n > 0) {
        memcpy(sizes_copy, sizes, (size_t)n * sizeof(uint64_t));
        memcpy(offsets_copy, offsets, (size_t)n * sizeof(uint64_t));
    }
    drop_plan(kind);
    plans[kind] = (plan_t){.loaded = 1, .n = n, .sizes = sizes_copy, .offsets = offsets_copy,
                           .arena_bytes = arena_bytes};
done:
    pthread_mutex_unlock(&lock);
    return status;
}

int memo_drop_plan(int kind) {
    pthread_mutex_lock(&lock);
    int status = MEMO_OK;
    if (kind < 0 || kind >= MAX_KINDS) {
        set_error("pass kind %d is out of range; kinds are 0 to %d.", kind, MAX_KINDS - 1);
        status = MEMO_EINVAL;
    } else if (pass.open && pass.kind == kind) {
        set_error("a pass of kind %d is open; end it before dropping its plan.", kind);
        status = MEMO_ESTATE;
    } else {
        drop_plan(kind);
    }
    pthread_mutex_unlock(&lock);
    return status;
}

/* ---- arena, modes, passes ----------------------------------------------------------------- */

int memo_reserve_arena(uint64_t bytes) {
    pthread_mutex_lock(&lock);
    int status = MEMO_OK;
    /* the arena is exactly what the plans need (to the block alignment); its base is aligned to
     * ARENA_ALIGN, the backend's allocation rounded up to that */
    uint64_t wanted = round_up(bytes, BLOCK_ALIGN);
    if (backend == BACKEND_NONE) {
        set_error("memo_reserve_arena was called before memo_init chose a backend.");
        status = MEMO_ESTATE;
    } else if (wanted <= arena.bytes) {
        status = MEMO_OK; /* large enough already */
    } else if (arena.live_count > 0) {
        set_error("the arena cannot grow to %llu bytes while %zu planned blocks live in it; free "
                  "them first.", (unsigned long long)wanted, arena.live_count);
        status = MEMO_ESTATE;
    } else {
        arena_release();
        uint64_t backing = round_up(wanted, ARENA_ALIGN);
        char *base = backend_alloc(backing, ARENA_ALIGN);
        if (!base && stats[ST_FALLBACK_CACHED] > 0) {
            release_cached_locked();
            base = backend_alloc(backing, ARENA_ALIGN);
        }
        if (!base) {
            set_error("the backend could not allocate an arena of %llu bytes.",
                      (unsigned long long)wanted);
            status = MEMO_ENOMEM;
        } else {
            arena.base = base;
            arena.bytes = wanted;
            arena.device = current_cuda_device();
            stats[ST_ARENA_BYTES] = wanted;
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}

uint64_t memo_arena_bytes(void) {
    pthread_mutex_lock(&lock);
    uint64_t bytes = arena.bytes;
    pthread_mutex_unlock(&lock);
    return bytes;
}

uint64_t memo_arena_base(void) {
    pthread_mutex_lock(&lock);
    uint64_t base = (uint64_t)(uintptr_t)arena.base;
    pthread_mutex_unlock(&lock);
    return base;
}

void memo_set_mode(int new_mode) {
    pthread_mutex_lock(&lock);
    if (new_mode < MODE_OFF || new_mode > MODE_SERVE)
        set_error("mode %d is unknown; modes are 0 (off), 1 (record) and 2 (serve).", new_mode);
    else
        mode = new_mode; /* takes effect at the next memo_begin_pass */
    pthread_mutex_unlock(&lock);
}

int memo_get_mode(void) {
    pthread_mutex_lock(&lock);
    int current = mode;
    pthread_mutex_unlock(&lock);
    return current;
}

int memo_begin_pass(int kind) {
    pthread_mutex_lock(&lock);
    int status = MEMO_OK;
    if (kind < 0 || kind >= MAX_KINDS) {
        set_error("pass kind %d is out of range; kinds are 0 to %d.", kind, MAX_KINDS - 1);
        status = MEMO_EINVAL;
    } else if (pass.open) {
        set_error("a pass of kind %d is still open; passes never nest, call memo_end_pass "
                  "first.", pass.kind);
        status = MEMO_ESTATE;
    } else {
        pass = (pass_t){.open = 1, .kind = kind, .mode = mode, .owner = pthread_self(),
                        .serial = ++pass_serial_counter};
        log_now.count = 0;
        stats[ST_PASSES]++;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int memo_end_pass(void) {
    pthread_mutex_lock(&lock);
    int status = MEMO_OK;
    if (!pass.open) {
        set_error("memo_end_pass was called with no pass open.");
        status = MEMO_ESTATE;
    } else {
        if (pass.mode == MODE_RECORD) {
            event_log_t done = log_done;
            log_done = log_now;
            log_now = done;
            log_now.count = 0;
            log_done_kind = pass.kind;
        }
        pass.open = 0;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int memo_recorded_kind(void) {
    pthread_mutex_lock(&lock);
    int kind = log_done_kind;
    pthread_mutex_unlock(&lock);
    return kind;
}

int memo_recorded_count(void) {
    pthread_mutex_lock(&lock);
    int count = log_done.count;
    pthread_mutex_unlock(&lock);
    return count;
}

int memo_recorded_events(int max, int32_t *types, int64_t *indices, uint64_t *sizes) {
    pthread_mutex_lock(&lock);
    int count = log_done.count < max ? log_done.count : (max > 0 ? max : 0);
    for (int k = 0; k < count; k++) {
        types[k] = log_done.events[k].type;
        indices[k] = log_done.events[k].index;
        sizes[k] = log_done.events[k].size;
    }
    pthread_mutex_unlock(&lock);
    return count;
}

/* ---- statistics, init, shutdown ----------------------------------------------------------- */

int memo_stats_count(void) { return ST_COUNT; }

int memo_abi_version(void) { return MEMO_ABI_VERSION; }

const char *memo_source_digest(void) { return "memo-core-source:" MEMO_SOURCE_DIGEST; }

void memo_stats(uint64_t *out, int n) {
    pthread_mutex_lock(&lock);
    for (int k = 0; k < n && k < ST_COUNT; k++) out[k] = stats[k];
    pthread_mutex_unlock(&lock);
}

void memo_reset_stats(void) {
    pthread_mutex_lock(&lock);
    /* States stay; counters restart; peaks restart from the current value. */
    const int keep[] = {ST_FALLBACK_LIVE, ST_FALLBACK_CACHED, ST_ARENA_BYTES, ST_ARENA_LIVE};
    uint64_t kept[4];
    for (int k = 0; k < 4; k++) kept[k] = stats[keep[k]];
    memset(stats, 0, sizeof stats);
    for (int k = 0; k < 4; k++) stats[keep[k]] = kept[k];
    stats[ST_FALLBACK_PEAK] = stats[ST_FALLBACK_LIVE];
    stats[ST_ARENA_PEAK] = stats[ST_ARENA_LIVE];
    pthread_mutex_unlock(&lock);
}

const char *memo_last_error(void) { return last_error; }

/* The planned blocks that made requests miss by overlap since the last call (up to
 * `capacity`, oldest first; the rest stay for the next call): kind, request index, and whether
 * the block had outlived its pass. Returns the count. */
int memo_take_late(int32_t *kinds, int64_t *indexes, int32_t *outlived, int capacity) {
    pthread_mutex_lock(&lock);
    int n = late_count < capacity ? late_count : capacity;
    for (int k = 0; k < n; k++) {
        kinds[k] = late[k].kind;
        indexes[k] = late[k].index;
        outlived[k] = late[k].outlived;
    }
    memmove(late, late + n, (size_t)(late_count - n) * sizeof *late);
    late_count -= n;
    pthread_mutex_unlock(&lock);
    return n;
}

int memo_live_blocks(void) {
    pthread_mutex_lock(&lock);
    int count = (int)blocks_count;
    pthread_mutex_unlock(&lock);
    return count;
}

int memo_backend(void) {
    pthread_mutex_lock(&lock);
    int current = backend;
    pthread_mutex_unlock(&lock);
    return current;
}

int memo_init(int wanted) {
    pthread_mutex_lock(&lock);
    int status = MEMO_OK;
    if (wanted != BACKEND_HOST && wanted != BACKEND_CUDA) {
        set_error("backend %d is unknown; backends are 0 (host) and 1 (cuda).", wanted);
        status = MEMO_EINVAL;
    } else if (wanted == backend) {
        status = MEMO_OK;
    } else if (blocks_count > 0) {
        set_error("the backend cannot change while %zu blocks are live; free them first.",
                  blocks_count);
        status = MEMO_ESTATE;
    } else {
        int previous = backend;
        if (wanted == BACKEND_CUDA) status = resolve_cuda();
        if (status == MEMO_OK && wanted == BACKEND_CUDA) {
            int device = -1;
            int error = cuda_get_device(&device);
            if (error != 0) {
                set_error("cudaGetDevice failed with CUDA error %d; no usable GPU.", error);
                status = MEMO_ENOCUDA;
            }
        }
        if (status == MEMO_OK) {
            /* Cached blocks and the arena belong to the old backend: hand them back. */
            release_cached_locked();
            arena_release();
            backend = wanted;
        } else {
            backend = previous;
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}

void memo_release_cached(void) {
    pthread_mutex_lock(&lock);
    release_cached_locked();
    pthread_mutex_unlock(&lock);
}

void memo_shutdown(void) {
    pthread_mutex_lock(&lock);
    release_cached_locked();
    for (int kind = 0; kind < MAX_KINDS; kind++) drop_plan(kind);
    if (arena.live_count == 0) arena_release();
    else set_error("the arena is kept: %zu planned blocks still live in it.", arena.live_count);
    pass.open = 0;
    mode = MODE_OFF;
    log_now.count = log_done.count = 0;
    log_done_kind = -1;
    late_count = 0;
    pthread_mutex_unlock(&lock);
}
