/* The thread pool the kernels run on (or OpenMP's team), and the per-thread work memory. */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */

/* ---- A tiny thread pool that never waits for a helper that has not started. ----------
   OpenMP's end-of-region barrier waits for every thread of the team; on a busy machine a
   preempted or sleeping worker then stalls each call by a scheduler slice (ms). Here the
   caller publishes a job, runs chunks itself, and waits only for chunks a helper has
   actually claimed. Chunks are claimed by a CAS on (job tag << 32 | chunks left), so a
   late helper can never take a chunk of a newer job. Helpers spin briefly, then sleep on
   a futex. */

#define MAX_JOBS 4                       /* products run as one hand-off (the decoding step's q/k/v, gate/up) */
static job_t g_jobs[MAX_JOBS];
static int g_njobs;
static _Atomic uint64_t g_left;          /* (tag << 32) | chunks not yet claimed */
static _Atomic int64_t g_done;           /* chunks finished in the current job */
static _Atomic uint32_t g_tag;           /* futex word, bumped per job */
static _Atomic int g_sleepers;
static int g_nhelpers;
static int64_t g_spin = 4000;            /* pause iterations before a helper sleeps (~0.1 ms) */
static pthread_mutex_t g_run = PTHREAD_MUTEX_INITIALIZER;

static void run_chunk(const job_t* j, int64_t c) {
  int64_t r0 = c * j->chunk, r1 = r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows;
  if (j->fn) {
    j->fn(j, r0, r1);
    return;
  }
  switch (j->kind) {
    case 0: spmv_u16(r0, r1, j->rowptr, (const uint16_t*)j->idx, j->v, j->x, j->y, j->bias); break;
    case 1: spmv_i32(r0, r1, j->rowptr, (const int32_t*)j->idx, j->v, j->x, j->y, j->bias); break;
    case 2: spmm_u16(r0, r1, j->rowptr, (const uint16_t*)j->idx, j->v, j->x, j->y, j->rows, j->B, j->bias); break;
    default: spmm_i32(r0, r1, j->rowptr, (const int32_t*)j->idx, j->v, j->x, j->y, j->rows, j->B, j->bias);
  }
}

/* chunk c of jobs js[0..n) numbered one after the other */
static void run_chunk_of(const job_t* js, int n, int64_t c) {
  for (int k = 0; k < n; k++) {
    if (c < js[k].nchunks) {
      run_chunk(js + k, c);
      return;
    }
    c -= js[k].nchunks;
  }
}

static void work(uint32_t tag, const job_t* js, int n) {
  uint64_t cur = atomic_load(&g_left);
  for (;;) {
    if ((uint32_t)(cur >> 32) != tag || (cur & 0xffffffffu) == 0) return;
    if (!atomic_compare_exchange_weak(&g_left, &cur, cur - 1)) continue;
    run_chunk_of(js, n, (int64_t)((cur & 0xffffffffu) - 1));
    atomic_fetch_add(&g_done, 1);
    cur = atomic_load(&g_left);
  }
}

static void* helper(void* arg) {
  int id = (int)(intptr_t)arg;
  uint32_t seen = atomic_load(&g_tag);
  for (;;) {
    uint32_t tag;
    int64_t spins = 0;
    while ((tag = atomic_load(&g_tag)) == seen) {
      if (++spins < g_spin) {
        /* yield now and then: a thread woken on this core (torch's OpenMP worker, between two sparse
           layers) runs at once instead of waiting for this spinning helper's time slice */
        if ((spins & 63) == 0) sched_yield(); else CPU_RELAX();
        continue;
      }
      atomic_fetch_add(&g_sleepers, 1);
      syscall(SYS_futex, &g_tag, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
      atomic_fetch_sub(&g_sleepers, 1);
      spins = 0;
    }
    seen = tag;
    /* consistent whenever a claim for `tag` succeeds (see above) */
    const int n = g_njobs < MAX_JOBS ? g_njobs : MAX_JOBS;
    job_t js[MAX_JOBS];
    memcpy(js, g_jobs, sizeof(job_t) * (size_t)n);
    if (n > 0 && id < js[0].active) work(tag, js, n);
  }
  return NULL;
}

#if defined(_OPENMP)
/* Built with -fopenmp: the chunks run on OpenMP's team. Loaded after torch, this library resolves
   libgomp.so.1 to the copy torch already loaded, so the team is torch's own intra-op pool: the
   threads that just ran a torch op (and still spin, libgomp's default) pick up the sparse layer,
   instead of a second pool fighting them for the same cores. Chunks are claimed dynamically. */
static int g_use_omp = 1;
static void run_omp(const job_t* js, int n, int64_t total, int nthreads) {
  _Atomic int64_t next = 0;
#pragma omp parallel num_threads(nthreads)
  {
    int64_t c;
    while ((c = atomic_fetch_add(&next, 1)) < total) run_chunk_of(js, n, c);
  }
}
#else
static int g_use_omp = 0;
static void run_omp(const job_t* js, int n, int64_t total, int nthreads) {
  (void)js; (void)n; (void)total; (void)nthreads;
}
#endif

/* Set by the decoding step on its thread: its products run on the pool above, never OpenMP's team. Between
   two of them nothing else runs (no torch op keeps OpenMP's threads spinning), and on a busy machine the
   team's end barrier waits a scheduler slice for a preempted thread at every product, where the pool's
   caller just runs the chunks no helper took (measured: 3-9 tok/s on OpenMP, 14-25 on the pool). */
static __thread int tl_pool_only;

/* jobs js[0..n) (n <= MAX_JOBS) with nthreads: their chunks in one pool of claims, one hand-off for all */
static void run_jobs(job_t* js, int n, int nthreads) {
  int64_t total = 0;
  for (int k = 0; k < n; k++) {
    js[k].nchunks = js[k].rows > 0 ? (js[k].rows + js[k].chunk - 1) / js[k].chunk : 0;
    total += js[k].nchunks;
  }
  if (total <= 0) return;
  if (g_use_omp && !tl_pool_only && nthreads > 1 && total > 1) {
    run_omp(js, n, total, nthreads);
    return;
  }
  if (nthreads <= 1 || total <= 1 || pthread_mutex_trylock(&g_run) != 0) {
    for (int64_t c = 0; c < total; c++) run_chunk_of(js, n, c);
    return;
  }
  while (g_nhelpers < nthreads - 1 && g_nhelpers < 63) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, helper, (void*)(intptr_t)g_nhelpers);
    pthread_attr_destroy(&attr);
    if (rc != 0) break;
    g_nhelpers++;
  }
  js[0].active = nthreads - 1;
  uint32_t tag = atomic_load(&g_tag) + 1;
  memcpy(g_jobs, js, sizeof(job_t) * (size_t)n);
  g_njobs = n;
  atomic_store(&g_done, 0);
  atomic_store(&g_left, ((uint64_t)tag << 32) | (uint64_t)total);
  atomic_store(&g_tag, tag);
  if (atomic_load(&g_sleepers) > 0) syscall(SYS_futex, &g_tag, FUTEX_WAKE_PRIVATE, 64, NULL, NULL, 0);
  work(tag, js, n);
  while (atomic_load(&g_done) < total) CPU_RELAX();
  pthread_mutex_unlock(&g_run);
}

static void run(job_t* j, int nthreads) { run_jobs(j, 1, nthreads); }

/* Work memory of the batched products (x's copy, the per-chunk scratch), kept per calling thread up to
   WORK_KEEP bytes: fresh pages on every call would cost page faults. A larger need is allocated for the call
   and freed after it. A thread's kept buffer is freed when the thread exits. */
#define WORK_KEEP ((size_t)16 << 20)
static __thread float* tl_work;
static __thread size_t tl_cap; /* floats */
static pthread_key_t g_work_key;
static pthread_once_t g_work_once = PTHREAD_ONCE_INIT;
static void work_key_init(void) { pthread_key_create(&g_work_key, free); }

/* n floats, 64-byte aligned, or NULL (out of memory); *owned: the caller frees it */
static float* work_buf(size_t n, int* owned) {
  const size_t bytes = (n * sizeof(float) + 63) & ~(size_t)63;
  *owned = 0;
  if (n <= tl_cap) return tl_work;
  if (bytes > WORK_KEEP) {
    *owned = 1;
    return aligned_alloc(64, bytes);
  }
  pthread_once(&g_work_once, work_key_init);
  free(tl_work);
  tl_work = aligned_alloc(64, bytes);
  tl_cap = tl_work ? n : 0;
  pthread_setspecific(g_work_key, tl_work);
  return tl_work;
}
