/* Native CPU kernels of hf_sparsity (see hf_sparsity/backends/_native.py). C11 + pthreads, no torch headers. */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* y[r] = sum_j v[j] * x[idx[j]] for rows [r0, r1).

   With AVX2 + FMA: eight nonzeros at a time. Their x values are loaded one by one and
   inserted into a vector (vinsertps), then one FMA against eight contiguous values; two
   vector accumulators hide the FMA latency. On AMD Zen this beats both the scalar loop
   (three loads per nonzero) and the hardware gather (microcoded, ~1 element per cycle):
   measured on a 2-core EPYC VM, 48 GPT-2-small layers at 90%, 2.8 ms vs 3.5 ms scalar and
   3.8 ms vgatherdps. 16-bit indices are read four at a time (one 64-bit load). Without
   AVX2, four scalar accumulators. Summation order: lane-wise partial sums, then a fixed
   reduction; the result differs from the sequential sum by rounding only. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#define LDX(q, sh) _mm_load_ss(x + (((q) >> (sh)) & 0xffff))
static inline __m256 gather8_u16(const float* x, const uint16_t* ix) {
  uint64_t q0, q1;
  memcpy(&q0, ix, 8);
  memcpy(&q1, ix + 4, 8);
  __m128 lo = LDX(q0, 0), hi = LDX(q1, 0);
  lo = _mm_insert_ps(lo, LDX(q0, 16), 0x10); hi = _mm_insert_ps(hi, LDX(q1, 16), 0x10);
  lo = _mm_insert_ps(lo, LDX(q0, 32), 0x20); hi = _mm_insert_ps(hi, LDX(q1, 32), 0x20);
  lo = _mm_insert_ps(lo, LDX(q0, 48), 0x30); hi = _mm_insert_ps(hi, LDX(q1, 48), 0x30);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}
static inline __m256 gather8_i32(const float* x, const int32_t* ix) {
  __m128 lo = _mm_load_ss(x + ix[0]), hi = _mm_load_ss(x + ix[4]);
  lo = _mm_insert_ps(lo, _mm_load_ss(x + ix[1]), 0x10); hi = _mm_insert_ps(hi, _mm_load_ss(x + ix[5]), 0x10);
  lo = _mm_insert_ps(lo, _mm_load_ss(x + ix[2]), 0x20); hi = _mm_insert_ps(hi, _mm_load_ss(x + ix[6]), 0x20);
  lo = _mm_insert_ps(lo, _mm_load_ss(x + ix[3]), 0x30); hi = _mm_insert_ps(hi, _mm_load_ss(x + ix[7]), 0x30);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}
#define SPMV_ROWS(NAME, ITYPE, GATHER)                                                     \
static void NAME(int64_t r0, int64_t r1, const int64_t* rowptr, const ITYPE* idx,          \
                 const float* v, const float* x, float* y, const float* bias) {            \
  for (int64_t r = r0; r < r1; r++) {                                                      \
    int64_t j = rowptr[r], e = rowptr[r + 1];                                              \
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                             \
    for (; j + 16 <= e; j += 16) {                                                         \
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(v + j), GATHER(x, idx + j), a0);                \
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(v + j + 8), GATHER(x, idx + j + 8), a1);        \
    }                                                                                      \
    if (j + 8 <= e) {                                                                      \
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(v + j), GATHER(x, idx + j), a0);                \
      j += 8;                                                                              \
    }                                                                                      \
    float t = 0.f;                                                                         \
    for (; j < e; j++) t += v[j] * x[idx[j]];                                              \
    float s = hsum8(_mm256_add_ps(a0, a1)) + t;                                            \
    y[r] = bias ? s + bias[r] : s;                                                         \
  }                                                                                        \
}
SPMV_ROWS(spmv_u16, uint16_t, gather8_u16)
SPMV_ROWS(spmv_i32, int32_t, gather8_i32)
#define HFS_SIMD 1
#else
#define SPMV_ROWS(NAME, ITYPE)                                                             \
static void NAME(int64_t r0, int64_t r1, const int64_t* rowptr, const ITYPE* idx,          \
                 const float* v, const float* x, float* y, const float* bias) {            \
  for (int64_t r = r0; r < r1; r++) {                                                      \
    int64_t j = rowptr[r], e = rowptr[r + 1];                                              \
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;                                          \
    for (; j + 4 <= e; j += 4) {                                                           \
      a0 += v[j] * x[idx[j]];         a1 += v[j + 1] * x[idx[j + 1]];                      \
      a2 += v[j + 2] * x[idx[j + 2]]; a3 += v[j + 3] * x[idx[j + 3]];                      \
    }                                                                                      \
    for (; j < e; j++) a0 += v[j] * x[idx[j]];                                             \
    float s = (a0 + a1) + (a2 + a3);                                                       \
    y[r] = bias ? s + bias[r] : s;                                                         \
  }                                                                                        \
}
SPMV_ROWS(spmv_u16, uint16_t)
SPMV_ROWS(spmv_i32, int32_t)
#define HFS_SIMD 0
#endif

/* Batched: xt is X^T ([in, B] row-major), y is [B, rows]. One AXPY of length B per
   nonzero into a per-row accumulator tile of 64, contiguous in xt so it vectorizes. */
#define SPMM_ROWS(NAME, ITYPE)                                                             \
static void NAME(int64_t r0, int64_t r1, const int64_t* rowptr, const ITYPE* idx,          \
                 const float* v, const float* xt, float* y, int64_t rows, int64_t B,       \
                 const float* bias) {                                                      \
  float acc[64];                                                                           \
  for (int64_t r = r0; r < r1; r++) {                                                      \
    for (int64_t b0 = 0; b0 < B; b0 += 64) {                                               \
      int64_t bw = B - b0 < 64 ? B - b0 : 64;                                              \
      memset(acc, 0, sizeof(acc));                                                         \
      for (int64_t j = rowptr[r]; j < rowptr[r + 1]; j++) {                                \
        const float w = v[j];                                                              \
        const float* restrict xr = xt + (int64_t)idx[j] * B + b0;                          \
        for (int64_t b = 0; b < bw; b++) acc[b] += w * xr[b];                              \
      }                                                                                    \
      const float br = bias ? bias[r] : 0.f;                                               \
      for (int64_t b = 0; b < bw; b++) y[(b0 + b) * rows + r] = bias ? acc[b] + br : acc[b]; \
    }                                                                                      \
  }                                                                                        \
}

SPMM_ROWS(spmm_u16, uint16_t)
SPMM_ROWS(spmm_i32, int32_t)

/* ---- A tiny thread pool that never waits for a helper that has not started. ----------
   OpenMP's end-of-region barrier waits for every thread of the team; on a busy machine a
   preempted or sleeping worker then stalls each call by a scheduler slice (ms). Here the
   caller publishes a job, runs chunks itself, and waits only for chunks a helper has
   actually claimed. Chunks are claimed by a CAS on (job tag << 32 | chunks left), so a
   late helper can never take a chunk of a newer job. Helpers spin briefly, then sleep on
   a futex. */
typedef struct {
  int kind, active;
  int64_t rows, chunk, nchunks, B;
  const int64_t* rowptr; const void* idx; const float* v; const float* x; float* y;
  const float* bias;
} job_t;

static job_t g_job;
static _Atomic uint64_t g_left;          /* (tag << 32) | chunks not yet claimed */
static _Atomic int64_t g_done;           /* chunks finished in the current job */
static _Atomic uint32_t g_tag;           /* futex word, bumped per job */
static _Atomic int g_sleepers;
static int g_nhelpers;
static int64_t g_spin = 4000;            /* pause iterations before a helper sleeps (~0.1 ms) */
static pthread_mutex_t g_run = PTHREAD_MUTEX_INITIALIZER;

static void run_chunk(const job_t* j, int64_t c) {
  int64_t r0 = c * j->chunk, r1 = r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows;
  switch (j->kind) {
    case 0: spmv_u16(r0, r1, j->rowptr, (const uint16_t*)j->idx, j->v, j->x, j->y, j->bias); break;
    case 1: spmv_i32(r0, r1, j->rowptr, (const int32_t*)j->idx, j->v, j->x, j->y, j->bias); break;
    case 2: spmm_u16(r0, r1, j->rowptr, (const uint16_t*)j->idx, j->v, j->x, j->y, j->rows, j->B, j->bias); break;
    default: spmm_i32(r0, r1, j->rowptr, (const int32_t*)j->idx, j->v, j->x, j->y, j->rows, j->B, j->bias);
  }
}

static void work(uint32_t tag, const job_t* j) {
  uint64_t cur = atomic_load(&g_left);
  for (;;) {
    if ((uint32_t)(cur >> 32) != tag || (cur & 0xffffffffu) == 0) return;
    if (!atomic_compare_exchange_weak(&g_left, &cur, cur - 1)) continue;
    run_chunk(j, (int64_t)((cur & 0xffffffffu) - 1));
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
      if (++spins < g_spin) { CPU_RELAX(); continue; }
      atomic_fetch_add(&g_sleepers, 1);
      syscall(SYS_futex, &g_tag, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
      atomic_fetch_sub(&g_sleepers, 1);
      spins = 0;
    }
    seen = tag;
    job_t j = g_job; /* consistent whenever a claim for `tag` succeeds (see above) */
    if (id < j.active) work(tag, &j);
  }
  return NULL;
}

static void run(job_t* j, int nthreads) {
  if (j->rows <= 0) return;
  j->nchunks = (j->rows + j->chunk - 1) / j->chunk;
  if (nthreads <= 1 || j->nchunks <= 1 || pthread_mutex_trylock(&g_run) != 0) {
    for (int64_t c = 0; c < j->nchunks; c++) run_chunk(j, c);
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
  j->active = nthreads - 1;
  uint32_t tag = atomic_load(&g_tag) + 1;
  g_job = *j;
  atomic_store(&g_done, 0);
  atomic_store(&g_left, ((uint64_t)tag << 32) | (uint64_t)j->nchunks);
  atomic_store(&g_tag, tag);
  if (atomic_load(&g_sleepers) > 0) syscall(SYS_futex, &g_tag, FUTEX_WAKE_PRIVATE, 64, NULL, NULL, 0);
  work(tag, j);
  while (atomic_load(&g_done) < j->nchunks) CPU_RELAX();
  pthread_mutex_unlock(&g_run);
}

/* y = x W^T (+ bias): kind 0/1 batch-1 with 16/32-bit indices, 2/3 batched (x transposed). */
void hfs_matmul(int kind, int64_t rows, int64_t chunk, int nthreads, const int64_t* rowptr,
                const void* idx, const float* v, const float* x, float* y, int64_t B,
                const float* bias) {
  job_t j = {kind, 0, rows, chunk, 0, B, rowptr, idx, v, x, y, bias};
  run(&j, nthreads);
}

void hfs_set_spin(int64_t spin) { g_spin = spin; }
int hfs_version(void) { return 4; }
int hfs_simd(void) { return HFS_SIMD; }
