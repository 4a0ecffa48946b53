/* Native CPU kernels of hf_sparsity (see hf_sparsity/backends/_native.py). C11 + pthreads, no torch headers. */
#define _GNU_SOURCE
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* Software prefetch of the packed value stream, PF_BYTES ahead. The rows of a packed weight are short
   (a 576-column row at 50% is 1.2 KB of values) and threads take chunks of rows, so the hardware
   prefetcher ramps up and stops too often: measured on a 2-core Xeon VM, 1536x576 at 50% out of cache,
   the bitmask kernel went from 1.1x to 1.7x dense with one prefetch per 64 bytes of values 4 KB ahead
   (2 KB and 1 KB ahead: 1.6x, 1.45x; prefetching dense rows gained nothing). */
#define PF_BYTES 4096
#define PREFETCH(p) __builtin_prefetch((const char*)(p) + PF_BYTES, 0, 3)

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
      PREFETCH(v + j);                                                                     \
      PREFETCH(idx + j);                                                                   \
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
#if defined(__AVX512F__)
/* AVX-512: sixteen nonzeros per FMA, their x values fetched with the hardware gather (vgatherdps);
   measured on a 2-core Xeon (Sapphire Rapids) VM at 90%, out of cache: 1.2-1.45x faster than the
   eight-lane insert path above (3072x768: 66 -> 46 us). */
#define IDX16(p) _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p)))
#define IDX32(p) _mm512_loadu_si512((const void*)(p))
#define SPMV512_ROWS(NAME, ITYPE, LOADIDX)                                                 \
static void NAME(int64_t r0, int64_t r1, const int64_t* rowptr, const ITYPE* idx,          \
                 const float* v, const float* x, float* y, const float* bias) {            \
  for (int64_t r = r0; r < r1; r++) {                                                      \
    int64_t j = rowptr[r], e = rowptr[r + 1];                                              \
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                             \
    for (; j + 32 <= e; j += 32) {                                                         \
      PREFETCH(v + j);                                                                     \
      PREFETCH(v + j + 16);                                                                \
      PREFETCH(idx + j);                                                                   \
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(v + j), _mm512_i32gather_ps(LOADIDX(idx + j), x, 4), a0);  \
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(v + j + 16), _mm512_i32gather_ps(LOADIDX(idx + j + 16), x, 4), \
                           a1);                                                            \
    }                                                                                      \
    if (j + 16 <= e) {                                                                     \
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(v + j), _mm512_i32gather_ps(LOADIDX(idx + j), x, 4), a0);  \
      j += 16;                                                                             \
    }                                                                                      \
    float t = 0.f;                                                                         \
    for (; j < e; j++) t += v[j] * x[idx[j]];                                              \
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + t;                             \
    y[r] = bias ? s + bias[r] : s;                                                         \
  }                                                                                        \
}
SPMV512_ROWS(spmv_u16, uint16_t, IDX16)
SPMV512_ROWS(spmv_i32, int32_t, IDX32)
#else
SPMV_ROWS(spmv_u16, uint16_t, gather8_u16)
SPMV_ROWS(spmv_i32, int32_t, gather8_i32)
#endif
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
typedef struct job job_t;
struct job {
  int kind, active;
  int64_t rows, chunk, nchunks, B;
  const int64_t* rowptr; const void* idx; const float* v; const float* x; float* y;
  const float* bias;
  /* formats other than CSR: fn(job, r0, r1) computes rows [r0, r1); `in` = input features;
     vbf16: the value type, 0 float32, 1 bfloat16 bit patterns (uint16), 2 int8 with per-row scales
     (see VSCALE_BYTES) */
  void (*fn)(const job_t*, int64_t, int64_t);
  int64_t in;
  int vbf16;
  float* work; /* the blocked products' per-chunk scratch (accumulators, column offsets, positions) */
};

/* ---- Bitmask, 2:4 and dense GEMV kernels (x: [B, in] row-major, y: [B, rows]) -----------
   Bitmask: per row ceil(in/8) mask bytes (bit i of byte g = column 8g+i kept) and the row's
   kept values packed in column order from rowptr[r] (values array padded by 16 values at the end; int8
   codes by 64 bytes, which the int8 product loads whole).
   For eight columns: load eight packed values, move value k to the lane of the k-th set bit
   (vpermps; lane indices from a 256-entry table), zero the other lanes (vblendvps), one
   FMA against eight contiguous x. ~2.125 bytes per weight at 50% (fp32), 1.125 (bf16).
   2:4: per group of four columns exactly two values (a group keeping fewer pads with a 0)
   and their two 2-bit positions; one meta byte per eight columns (p0 | p1<<2 | p2<<4 | p3<<6).
   For sixteen columns: eight values, two meta bytes -> lane indices, x gathered with two
   in-register permutes and a blend, one FMA. Values [rows, in/2]. */
static uint32_t g_nm_lane[256];   /* bytes: p0, p1, 4+p2, 4+p3 */
__attribute__((constructor)) static void init_tables(void) {
  for (int b = 0; b < 256; b++) {
    g_nm_lane[b] = (uint32_t)(b & 3) | (uint32_t)((b >> 2) & 3) << 8 | (uint32_t)(4 + ((b >> 4) & 3)) << 16 |
                   (uint32_t)(4 + ((b >> 6) & 3)) << 24;
  }
}

static inline float bf16f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
#define VALB(v, bf, k)                                                                                  \
  ((bf) == 2 ? (float)((const int8_t*)(v))[k] : (bf) ? bf16f(((const uint16_t*)(v))[k]) : ((const float*)(v))[k])

/* int8 values (value type 2): symmetric per output row, w = scale[r] * q. The values buffer starts with
   the rows' float32 scales, padded to 64 bytes (VSCALE_BYTES), then the int8 values in the format's
   order. Products accumulate q * x in float32 and multiply by the row's scale once, at the store. */
#define VSCALE_BYTES(rows) ((((int64_t)(rows)) * 4 + 63) & ~(int64_t)63)
static inline __attribute__((always_inline)) const void* vbase(const void* v, const int vt, int64_t rows) {
  return vt == 2 ? (const void*)((const char*)v + VSCALE_BYTES(rows)) : v;
}
static inline __attribute__((always_inline)) float vscale(const void* v, const int vt, int64_t r) {
  return vt == 2 ? ((const float*)v)[r] : 1.f;
}

#if HFS_SIMD
static inline __attribute__((always_inline)) __m256 loadv8_(const void* v, int bf, int64_t k) {
  if (bf == 2)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((const int8_t*)v + k))));
  if (bf)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)v + k))), 16));
  return _mm256_loadu_ps((const float*)v + k);
}
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 loadv16_(const void* v, int bf, int64_t k) {
  if (bf == 2)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)v + k))));
  if (bf)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)v + k))), 16));
  return _mm512_loadu_ps((const float*)v + k);
}
#endif
/* lane i of entry b: the rank of bit i among b's set bits, or -1 (sign bit: lane zeroed) when bit i
   is clear. 8 KB, built at load. */
static int32_t g_bm_lanes[256][8] __attribute__((aligned(32)));
/* lane i of the result: vals[lanes[i]], or 0 where lanes[i] is -1 (the bitmask and 2:4 expansions) */
static inline __m256 expand_lanes(const int32_t* lanes, __m256 vals) {
  __m256i t = _mm256_load_si256((const __m256i*)lanes);
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(vals, t), _mm256_setzero_ps(), _mm256_castsi256_ps(t));
}
static inline __m256 bm_expand(uint32_t b, __m256 vals) { return expand_lanes(g_bm_lanes[b], vals); }
__attribute__((constructor)) static void init_lanes(void) {
  for (int b = 0; b < 256; b++)
    for (int i = 0, k = 0; i < 8; i++) g_bm_lanes[b][i] = (b >> i & 1) ? k++ : -1;
}
#endif

static inline __attribute__((always_inline)) void bm_rows_(const job_t* j, int64_t r0, int64_t r1, const int BF) {
  const void* const V = vbase(j->v, BF, j->rows);
  const int64_t in = j->in, mb = (in + 7) >> 3, B = j->B, rows = j->rows;
  const uint8_t* M = (const uint8_t*)j->idx;
  const float* x = j->x;
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * mb;
    for (int64_t b0 = 0; b0 < B; b0 += 4) {
      const int64_t nb = B - b0 < 4 ? B - b0 : 4;
      int64_t o = j->rowptr[r], g = 0;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#if HFS_SIMD
      const int64_t ng = in >> 3;
      if (nb == 1) {
        const float* xb = x + b0 * in;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        float z = 0.f;
#if defined(__AVX512F__)
        /* AVX-512: sixteen columns per step; vexpandps (register form) puts the packed values in
           the lanes of the set bits, zeroing the rest. */
        {
          __m512 z0 = _mm512_setzero_ps(), z1 = _mm512_setzero_ps();
          for (; g + 4 <= ng; g += 4) {
            uint16_t k0, k1;
            memcpy(&k0, m + g, 2);
            memcpy(&k1, m + g + 2, 2);
            PREFETCH((const char*)V + ((o) << (BF == 2 ? 0 : BF ? 1 : 2)));
            z0 = _mm512_fmadd_ps(_mm512_maskz_expand_ps(k0, loadv16_(V, BF, o)), _mm512_loadu_ps(xb + 8 * g), z0);
            o += __builtin_popcount(k0);
            z1 = _mm512_fmadd_ps(_mm512_maskz_expand_ps(k1, loadv16_(V, BF, o)), _mm512_loadu_ps(xb + 8 * g + 16), z1);
            o += __builtin_popcount(k1);
          }
          z = _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
        }
#endif
        for (; g + 2 <= ng; g += 2) {
          uint32_t m0 = m[g], m1 = m[g + 1];
          PREFETCH((const char*)V + ((o) << (BF == 2 ? 0 : BF ? 1 : 2)));
          __m256 w0 = bm_expand(m0, loadv8_(V, BF, o));
          o += __builtin_popcount(m0);
          __m256 w1 = bm_expand(m1, loadv8_(V, BF, o));
          o += __builtin_popcount(m1);
          a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb + 8 * g), a0);
          a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8 * g + 8), a1);
        }
        for (; g < ng; g++) {
          uint32_t m0 = m[g];
          a0 = _mm256_fmadd_ps(bm_expand(m0, loadv8_(V, BF, o)), _mm256_loadu_ps(xb + 8 * g), a0);
          o += __builtin_popcount(m0);
        }
        s[0] = hsum8(_mm256_add_ps(a0, a1)) + z;
      } else {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (; g < ng; g++) {
          uint32_t m0 = m[g];
          __m256 w = bm_expand(m0, loadv8_(V, BF, o));
          o += __builtin_popcount(m0);
          if (nb == 4) {
            a[0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (b0 + 0) * in + 8 * g), a[0]);
            a[1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (b0 + 1) * in + 8 * g), a[1]);
            a[2] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (b0 + 2) * in + 8 * g), a[2]);
            a[3] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (b0 + 3) * in + 8 * g), a[3]);
          } else {
            for (int64_t k = 0; k < nb; k++)
              a[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (b0 + k) * in + 8 * g), a[k]);
          }
        }
        for (int64_t k = 0; k < nb; k++) s[k] = hsum8(a[k]);
      }
      g *= 8;
#endif
      for (int64_t c = g; c < in; c++) { /* scalar: the tail, or every column without AVX2 */
        if (!(m[c >> 3] >> (c & 7) & 1)) continue;
        const float w = VALB(V, BF, o);
        o++;
        for (int64_t k = 0; k < nb; k++) s[k] += w * x[(b0 + k) * in + c];
      }
      const float sc = vscale(j->v, BF, r);
      for (int64_t k = 0; k < nb; k++)
        j->y[(b0 + k) * rows + r] = j->bias ? s[k] * sc + j->bias[r] : s[k] * sc;
    }
  }
}
static void bm_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16 == 2)
    bm_rows_(j, r0, r1, 2);
  else if (j->vbf16)
    bm_rows_(j, r0, r1, 1);
  else
    bm_rows_(j, r0, r1, 0);
}

static inline __attribute__((always_inline)) void nm24_rows_(const job_t* j, int64_t r0, int64_t r1, const int BF) {
  const void* const V = vbase(j->v, BF, j->rows);
  const int64_t in = j->in, B = j->B, rows = j->rows, mb = in >> 3, half = in >> 1;
  (void)mb;
  const uint8_t* M = (const uint8_t*)j->idx;
  const float* x = j->x;
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * ((in + 7) >> 3);
    const int64_t vo = r * half;
    for (int64_t b0 = 0; b0 < B; b0 += 4) {
      const int64_t nb = B - b0 < 4 ? B - b0 : 4;
      int64_t c = 0;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#if HFS_SIMD
      __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      __m256 a1 = _mm256_setzero_ps();
      int64_t q = 0;
      if (nb == 1) {
        const float* xb = x + b0 * in;
        for (; q + 4 <= mb; q += 4, c += 32) {
          PREFETCH((const char*)V + ((vo + c / 2) << (BF == 2 ? 0 : BF ? 1 : 2)));
          uint64_t l0 = (uint64_t)g_nm_lane[m[q]] | (uint64_t)g_nm_lane[m[q + 1]] << 32;
          uint64_t l1 = (uint64_t)g_nm_lane[m[q + 2]] | (uint64_t)g_nm_lane[m[q + 3]] << 32;
          __m256i i0 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)l0));
          __m256i i1 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)l1));
          __m256 x0 = _mm256_blend_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(xb + c), i0),
                                      _mm256_permutevar8x32_ps(_mm256_loadu_ps(xb + c + 8), i0), 0xF0);
          __m256 x1 = _mm256_blend_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(xb + c + 16), i1),
                                      _mm256_permutevar8x32_ps(_mm256_loadu_ps(xb + c + 24), i1), 0xF0);
          a[0] = _mm256_fmadd_ps(loadv8_(V, BF, vo + c / 2), x0, a[0]);
          a1 = _mm256_fmadd_ps(loadv8_(V, BF, vo + c / 2 + 8), x1, a1);
        }
        a[0] = _mm256_add_ps(a[0], a1);
      }
      for (; q + 2 <= mb; q += 2, c += 16) {
        uint64_t l0 = (uint64_t)g_nm_lane[m[q]] | (uint64_t)g_nm_lane[m[q + 1]] << 32;
        __m256i i0 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)l0));
        __m256 w = loadv8_(V, BF, vo + c / 2);
        for (int64_t k = 0; k < nb; k++) {
          const float* xb = x + (b0 + k) * in + c;
          __m256 xv = _mm256_blend_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(xb), i0),
                                      _mm256_permutevar8x32_ps(_mm256_loadu_ps(xb + 8), i0), 0xF0);
          a[k] = _mm256_fmadd_ps(w, xv, a[k]);
        }
      }
      for (int64_t k = 0; k < nb; k++) s[k] = hsum8(a[k]);
#endif
      for (; c < in; c += 4) { /* scalar: per group of four, two (value, position) pairs */
        const uint32_t bits = (uint32_t)(m[c >> 3] >> ((c & 4) ? 4 : 0)) & 15u;
        const int64_t k0 = vo + c / 2;
        const float w0 = VALB(V, BF, k0), w1 = VALB(V, BF, k0 + 1);
        const int64_t c0 = c + (bits & 3), c1 = c + (bits >> 2);
        for (int64_t k = 0; k < nb; k++) s[k] += w0 * x[(b0 + k) * in + c0] + w1 * x[(b0 + k) * in + c1];
      }
      const float sc = vscale(j->v, BF, r);
      for (int64_t k = 0; k < nb; k++) j->y[(b0 + k) * rows + r] = j->bias ? s[k] * sc + j->bias[r] : s[k] * sc;
    }
  }
}
static void nm24_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16 == 2)
    nm24_rows_(j, r0, r1, 2);
  else if (j->vbf16)
    nm24_rows_(j, r0, r1, 1);
  else
    nm24_rows_(j, r0, r1, 0);
}

/* Dense y = x W^T: W [rows, in] float32 (or bf16 bits). For the LM head: torch's fp32 GEMV may run on
   one thread; this one splits rows over the pool. */
static inline __attribute__((always_inline)) void gemv_rows_(const job_t* j, int64_t r0, int64_t r1, const int BF) {
  const void* const V = vbase(j->v, BF, j->rows);
  const int64_t in = j->in, B = j->B, rows = j->rows;
  const float* x = j->x;
  for (int64_t r = r0; r < r1; r++) {
    const int64_t o = r * in;
    for (int64_t b = 0; b < B; b++) {
      const float* xb = x + b * in;
      int64_t c = 0;
      float s = 0.f;
#if HFS_SIMD
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (; c + 32 <= in; c += 32) {
        a0 = _mm256_fmadd_ps(loadv8_(V, BF, o + c), _mm256_loadu_ps(xb + c), a0);
        a1 = _mm256_fmadd_ps(loadv8_(V, BF, o + c + 8), _mm256_loadu_ps(xb + c + 8), a1);
        a2 = _mm256_fmadd_ps(loadv8_(V, BF, o + c + 16), _mm256_loadu_ps(xb + c + 16), a2);
        a3 = _mm256_fmadd_ps(loadv8_(V, BF, o + c + 24), _mm256_loadu_ps(xb + c + 24), a3);
      }
      for (; c + 8 <= in; c += 8) a0 = _mm256_fmadd_ps(loadv8_(V, BF, o + c), _mm256_loadu_ps(xb + c), a0);
      s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
      for (; c < in; c++) s += VALB(V, BF, o + c) * xb[c];
      s *= vscale(j->v, BF, r);
      j->y[b * rows + r] = j->bias ? s + j->bias[r] : s;
    }
  }
}
static void gemv_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16 == 2)
    gemv_rows_(j, r0, r1, 2);
  else if (j->vbf16)
    gemv_rows_(j, r0, r1, 1);
  else
    gemv_rows_(j, r0, r1, 0);
}

/* ---- int8 activations (value type 3) ---------------------------------------------------------------------
   Value type 3 is value type 2 (int8 codes with per-row scales) whose products also quantize their input to
   int8: symmetric codes round(x / s) (half to even) with one float32 scale s = max|x| / 127 per group of
   columns. Column c belongs to group (c / 64 % QA) * 16 + (c % 64) / 4: groups of four adjacent columns, every
   64 * QA columns, QA * 16 = 32 groups in all (quantize_activations in formats.py computes the same). That
   grouping is what makes the product cheap: lane l of a 16-lane int32 accumulator sums exactly the products of
   group l, so with AVX-512 VNNI (vpdpbusd: 64 byte products into 16 int32 lanes per instruction) a row is QA
   int32 accumulators over all its columns, and the scales apply once per row (one conversion, one multiply per
   accumulator) instead of once per block. The weight codes are made unsigned by flipping their sign bit
   (w + 128) and the accumulators start at minus 128 times each group's code sum, so the int32 sums are exactly
   sum(w * q). Every other case (more rows, no VNNI) runs the value type 2 kernels on the dequantized
   activations q * s: the same sum up to float32 rounding. */
#define QB 64
#define QA 2
#define QG (16 * QA)
/* The quantized row in the work buffer: scales float[QG], then int32[QG] (-128 times each group's code sum,
   as QA vectors of 16 lanes), then the codes int8[nb * QB], zero past `in`. */
static inline int64_t xq_floats(int64_t in) { return 2 * QG + (in + QB - 1) / QB * (QB / 4); }
static inline int64_t q_group(int64_t c) { return (c / QB % QA) * 16 + (c % QB) / 4; }
/* quantize x[0:in) into buf (xq_floats(in) floats, 64-byte aligned); deq: when not NULL, q * s per column */
static void quantize_row(const float* x, int64_t in, float* buf, float* deq) {
  const int64_t nb = (in + QB - 1) / QB;
  float* xs = buf;
  int32_t* corr = (int32_t*)(buf + QG);
  int8_t* q = (int8_t*)(buf + 2 * QG);
  float amax[QG] = {0};
  for (int64_t c = 0; c < in; c++) amax[q_group(c)] = fmaxf(amax[q_group(c)], fabsf(x[c]));
  for (int g = 0; g < QG; g++) {
    xs[g] = amax[g] / 127.f;
    corr[g] = 0;
  }
  for (int64_t c = 0; c < nb * QB; c++) {
    const int64_t g = q_group(c);
    float t = c < in && xs[g] > 0.f ? nearbyintf(x[c] / xs[g]) : 0.f;
    t = t > 127.f ? 127.f : t < -127.f ? -127.f : t;
    q[c] = (int8_t)t;
    corr[g] -= 128 * (int32_t)t;
    if (deq && c < in) deq[c] = t * xs[g];
  }
}

#if HFS_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__BMI2__)
#define HFS_VNNI 1
#if defined(__AVX512VBMI2__)
#define HFS_VNNI_EXPAND 1 /* vpexpandb: the bitmask and 2:4 codes into their columns' lanes */
#else
#define HFS_VNNI_EXPAND 0
#endif
/* quantize_row without the dequantized copy, sixteen columns per instruction (the same codes: IEEE division
   and round half to even). Float lane j of the i-th sixteen columns of a block is group 4 * i + j / 4 of the
   block's accumulator. */
static void quantize_row_vnni(const float* x, int64_t in, float* buf) {
  const int64_t nb = (in + QB - 1) / QB;
  float* xs = buf;
  int32_t* corr = (int32_t*)(buf + QG);
  int8_t* q = (int8_t*)(buf + 2 * QG);
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 mx[QA][4];
  for (int a = 0; a < QA; a++)
    for (int i = 0; i < 4; i++) mx[a][i] = _mm512_setzero_ps();
#define Q_LOAD(b, i)                                                                                             \
  _mm512_maskz_loadu_ps(in - (b) * QB - 16 * (i) >= 16 ? (__mmask16)0xffff                                      \
                        : in - (b) * QB - 16 * (i) > 0 ? (__mmask16)((1u << (in - (b) * QB - 16 * (i))) - 1)  \
                                                       : (__mmask16)0,                                           \
                        x + (b) * QB + 16 * (i))
  for (int64_t b = 0; b < nb; b++)
    for (int i = 0; i < 4; i++) mx[b % QA][i] = _mm512_max_ps(mx[b % QA][i], _mm512_andnot_ps(sign, Q_LOAD(b, i)));
  /* per accumulator: the 16 group maxima (lane 4i + j of the result: max over lanes 4j..4j+3 of mx[a][i]) */
  __m512 div[QA][4]; /* per float lane: its group's scale, 1 where the scale is 0 (then x is 0 there) */
  for (int a = 0; a < QA; a++) {
    float g[16];
    for (int i = 0; i < 4; i++) {
      float t[16];
      _mm512_storeu_ps(t, mx[a][i]);
      for (int j = 0; j < 4; j++) g[4 * i + j] = fmaxf(fmaxf(t[4 * j], t[4 * j + 1]), fmaxf(t[4 * j + 2], t[4 * j + 3]));
    }
    for (int l = 0; l < 16; l++) xs[a * 16 + l] = g[l] / 127.f;
    const __m512 sv = _mm512_loadu_ps(xs + a * 16);
    const __m512 safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(sv, _mm512_setzero_ps(), _CMP_GT_OQ),
                                             _mm512_set1_ps(1.f), sv);
    for (int i = 0; i < 4; i++) /* lane j <- group 4i + j/4 */
      div[a][i] = _mm512_permutexvar_ps(
          _mm512_add_epi32(_mm512_set1_epi32(4 * i), _mm512_srli_epi32(
              _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2)), safe);
  }
  __m512i sums[QA];
  for (int a = 0; a < QA; a++) sums[a] = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; b++) {
    __m512i codes = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
      __m512i c = _mm512_cvtps_epi32(_mm512_div_ps(Q_LOAD(b, i), div[b % QA][i])); /* MXCSR: to nearest even */
      c = _mm512_max_epi32(_mm512_min_epi32(c, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      codes = _mm512_inserti32x4(codes, _mm512_cvtepi32_epi8(c), i);
    }
    _mm512_store_si512((void*)(q + b * QB), codes);
    sums[b % QA] = _mm512_dpbusd_epi32(sums[b % QA], _mm512_set1_epi8((char)0x80), codes);
  }
#undef Q_LOAD
  for (int a = 0; a < QA; a++) _mm512_store_si512((void*)(corr + 16 * a), _mm512_sub_epi32(_mm512_setzero_si512(), sums[a]));
}

/* acc += the products of one 64-column block: w its 64 weight codes (0 where pruned), q its activation codes */
static inline __attribute__((always_inline)) __m512i q8_dot(__m512i acc, __m512i w, const int8_t* q) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), _mm512_load_si512((const void*)q));
}
#define Q8_SETUP                                                                                   \
  const int64_t in = j->in, nb = (in + QB - 1) / QB, full = in / QB;                            \
  const float* xs = j->work;                                                                    \
  const int32_t* corr = (const int32_t*)(j->work + QG);                                         \
  const int8_t* q = (const int8_t*)(j->work + 2 * QG);                                          \
  const int8_t* V = (const int8_t*)vbase(j->v, 2, j->rows);                                     \
  (void)full
/* the QA = 2 accumulators: named registers (an array indexed at run time would live in memory) */
#define Q8_START                                                                                   \
  __m512i a0 = _mm512_load_si512((const void*)corr), a1 = _mm512_load_si512((const void*)(corr + 16))
#define Q8_ACC(b, w, q) /* block b's products into its accumulator */                               \
  do {                                                                                             \
    if ((b) & 1)                                                                                   \
      a1 = q8_dot(a1, w, q);                                                                       \
    else                                                                                           \
      a0 = q8_dot(a0, w, q);                                                                       \
  } while (0)
#define Q8_STORE(r)                                                                                \
  do {                                                                                             \
    const __m512 f_ = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_loadu_ps(xs + 16),           \
                                      _mm512_mul_ps(_mm512_cvtepi32_ps(a0), _mm512_loadu_ps(xs))); \
    const float s_ = _mm512_reduce_add_ps(f_) * vscale(j->v, 2, r);                                \
    j->y[r] = j->bias ? s_ + j->bias[r] : s_;                                                      \
  } while (0)

/* rows r and r + 1 from their accumulators (a: row r, c: row r + 1): one reduction for both */
static inline __attribute__((always_inline)) void q8_store2(const job_t* j, int64_t r, const float* xs, __m512i a0,
                                                            __m512i a1, __m512i c0, __m512i c1) {
  const __m512 x0 = _mm512_loadu_ps(xs), x1 = _mm512_loadu_ps(xs + 16);
  const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), x1, _mm512_mul_ps(_mm512_cvtepi32_ps(a0), x0));
  const __m512 g = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), x1, _mm512_mul_ps(_mm512_cvtepi32_ps(c0), x0));
  /* lanes 0-7: f's halves added, 8-15: g's; then each half's eight lanes summed */
  const __m512 h = _mm512_add_ps(_mm512_shuffle_f32x4(f, g, 0x44), _mm512_shuffle_f32x4(f, g, 0xEE));
  const __m256 hf = _mm512_castps512_ps256(h), hg = _mm512_extractf32x8_ps(h, 1);
  __m256 u = _mm256_add_ps(_mm256_permute2f128_ps(hf, hg, 0x20), _mm256_permute2f128_ps(hf, hg, 0x31));
  u = _mm256_hadd_ps(u, u);
  u = _mm256_hadd_ps(u, u); /* lane 0: f's sum, lane 4: g's */
  const float s0 = _mm256_cvtss_f32(u) * vscale(j->v, 2, r);
  const float s1 = _mm_cvtss_f32(_mm256_extractf128_ps(u, 1)) * vscale(j->v, 2, r + 1);
  j->y[r] = j->bias ? s0 + j->bias[r] : s0;
  j->y[r + 1] = j->bias ? s1 + j->bias[r + 1] : s1;
}

static void gemv_q8_rows(const job_t* j, int64_t r0, int64_t r1) {
  Q8_SETUP;
  for (int64_t r = r0; r < r1; r++) {
    const int8_t* w = V + r * in;
    Q8_START;
    int64_t b = 0;
    for (; b + 2 <= full; b += 2) {
      a0 = q8_dot(a0, _mm512_loadu_si512((const void*)(w + b * QB)), q + b * QB);
      a1 = q8_dot(a1, _mm512_loadu_si512((const void*)(w + b * QB + QB)), q + b * QB + QB);
    }
    for (; b < nb; b++) {
      const __mmask64 k = b < full ? ~(__mmask64)0 : (__mmask64)_bzhi_u64(~0ULL, (unsigned)(in - b * QB));
      Q8_ACC(b, _mm512_maskz_loadu_epi8(k, w + b * QB), q + b * QB);
    }
    Q8_STORE(r);
  }
}

#if HFS_VNNI_EXPAND
/* bitmask: a block's 64 mask bits (`bytes` of them present), the next popcount codes expanded into their lanes */
static inline __attribute__((always_inline)) __m512i bm_q8_weights(const uint8_t* m, int64_t bytes,
                                                                   const int8_t* v, int64_t* o) {
  uint64_t k = 0;
  memcpy(&k, m, (size_t)bytes);
  const unsigned pc = (unsigned)__builtin_popcountll(k);
  PREFETCH(v + *o);
  /* a whole 64-byte load: the expand takes the first pc bytes only (the values are padded by 64 bytes, see
     formats.BitmaskBackend); a load masked to pc bytes cost ~5% of the int8 decoding step */
  const __m512i w = _mm512_maskz_expand_epi8(k, _mm512_loadu_si512((const void*)(v + *o)));
  *o += pc;
  return w;
}
#define PAIR_BLOCKS 16 /* rows of up to 1024 columns run two at a time */
static void bm_q8_rows(const job_t* j, int64_t r0, int64_t r1) {
  Q8_SETUP;
  const int64_t mb = (in + 7) >> 3;
  const uint8_t* M = (const uint8_t*)j->idx;
  int64_t r = r0;
  /* short rows two at a time: two independent offset chains (popcount -> load -> expand) in flight, and
     one reduction for both rows' sums. Measured on a 2-vCPU EPYC (Zen 4), 2 threads, out of cache: 576
     columns (9 blocks) 24 -> 28 GB/s, 1536 x 576 29 -> 35; rows of 1536 columns gained nothing, and
     8192 x 1536 fell from 42 to 26 GB/s, so longer rows stay one at a time. */
  for (; nb <= PAIR_BLOCKS && r + 2 <= r1; r += 2) {
    const uint8_t *m = M + r * mb, *n = m + mb;
    int64_t o = j->rowptr[r], p = j->rowptr[r + 1], b = 0;
    Q8_START;
    __m512i c0 = a0, c1 = a1;
    for (; b + 2 <= full; b += 2) {
      a0 = q8_dot(a0, bm_q8_weights(m + 8 * b, 8, V, &o), q + b * QB);
      c0 = q8_dot(c0, bm_q8_weights(n + 8 * b, 8, V, &p), q + b * QB);
      a1 = q8_dot(a1, bm_q8_weights(m + 8 * b + 8, 8, V, &o), q + b * QB + QB);
      c1 = q8_dot(c1, bm_q8_weights(n + 8 * b + 8, 8, V, &p), q + b * QB + QB);
    }
    for (; b < nb; b++) {
      const int64_t bytes = mb - 8 * b < 8 ? mb - 8 * b : 8;
      const __m512i w0 = bm_q8_weights(m + 8 * b, bytes, V, &o), w1 = bm_q8_weights(n + 8 * b, bytes, V, &p);
      if (b & 1) {
        a1 = q8_dot(a1, w0, q + b * QB);
        c1 = q8_dot(c1, w1, q + b * QB);
      } else {
        a0 = q8_dot(a0, w0, q + b * QB);
        c0 = q8_dot(c0, w1, q + b * QB);
      }
    }
    q8_store2(j, r, xs, a0, a1, c0, c1);
  }
  for (; r < r1; r++) {
    const uint8_t* m = M + r * mb;
    int64_t o = j->rowptr[r], b = 0;
    Q8_START;
    for (; b + 2 <= full; b += 2) {
      a0 = q8_dot(a0, bm_q8_weights(m + 8 * b, 8, V, &o), q + b * QB);
      a1 = q8_dot(a1, bm_q8_weights(m + 8 * b + 8, 8, V, &o), q + b * QB + QB);
    }
    for (; b < nb; b++) {
      const int64_t bytes = mb - 8 * b < 8 ? mb - 8 * b : 8; /* the tail's bits past `in` are clear */
      Q8_ACC(b, bm_q8_weights(m + 8 * b, bytes, V, &o), q + b * QB);
    }
    Q8_STORE(r);
  }
}

/* 2:4: `bytes` (<= 8) meta bytes -> their columns' kept bits, eight per byte: each nibble's positions
   p0 < p1 of its group of four -> 1 << p0 | 1 << p1, one byte shuffle per nibble */
static inline __attribute__((always_inline)) uint64_t nm24_bits(const uint8_t* m, int64_t bytes) {
  uint64_t raw = 0;
  memcpy(&raw, m, (size_t)bytes);
  const __m128i lut = _mm_setr_epi8(1, 3, 5, 9, 3, 2, 6, 10, 5, 6, 4, 12, 9, 10, 12, 8);
  const __m128i b = _mm_cvtsi64_si128((long long)raw), low = _mm_set1_epi8(15);
  const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, low));
  const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), low));
  return (uint64_t)_mm_cvtsi128_si64(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)));
}
static void nm24_q8_rows(const job_t* j, int64_t r0, int64_t r1) {
  Q8_SETUP;
  const int64_t mb = (in + 7) >> 3, half = in >> 1;
  const uint8_t* M = (const uint8_t*)j->idx;
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * mb;
    const int8_t* v = V + r * half;
    Q8_START;
    for (int64_t b = 0; b < nb; b++) {
      const int64_t cols = in - b * QB < QB ? in - b * QB : QB; /* a multiple of 4 */
      uint64_t k = nm24_bits(m + 8 * b, (cols + 7) >> 3);
      if (cols < QB) k = _bzhi_u64(k, (unsigned)cols); /* a padded last nibble sets no column */
      PREFETCH(v + b * (QB / 2));
      /* a whole block's 32 codes by a plain 256-bit load (a masked load cost ~5% of the int8 decoding step) */
      const __m512i vals =
          cols == QB ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(v + b * (QB / 2))))
                     : _mm512_maskz_loadu_epi8(_bzhi_u64(~0ULL, (unsigned)(cols / 2)), v + b * (QB / 2));
      const __m512i w = _mm512_maskz_expand_epi8(k, vals);
      Q8_ACC(b, w, q + b * QB);
    }
    Q8_STORE(r);
  }
}
#endif
#else
#define HFS_VNNI 0
#define HFS_VNNI_EXPAND 0
#endif

/* Bitmask -> dense float32 rows (restore_dense, prefill through a dense GEMM). Per eight columns
   (sixteen with AVX-512) the packed values are expanded into the lanes of the set bits, as in the
   batch-1 kernel, and stored; the row's scalar tail after. */
static inline __attribute__((always_inline)) void bm_unpack_rows_(const job_t* j, int64_t r0, int64_t r1,
                                                                  const int BF) {
  const void* const V = vbase(j->v, BF, j->rows);
  const int64_t in = j->in, mb = (in + 7) >> 3;
  const uint8_t* M = (const uint8_t*)j->idx;
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * mb;
    float* out = j->y + r * in;
    int64_t o = j->rowptr[r], c = 0;
    const float sc = vscale(j->v, BF, r);
#if HFS_SIMD
#if defined(__AVX512F__)
    for (; c + 16 <= in; c += 16) {
      uint16_t k;
      memcpy(&k, m + (c >> 3), 2);
      __m512 w = _mm512_maskz_expand_ps(k, loadv16_(V, BF, o));
      _mm512_storeu_ps(out + c, BF == 2 ? _mm512_mul_ps(w, _mm512_set1_ps(sc)) : w);
      o += __builtin_popcount(k);
    }
#endif
    for (; c + 8 <= in; c += 8) {
      const uint32_t b = m[c >> 3];
      __m256 w = bm_expand(b, loadv8_(V, BF, o));
      _mm256_storeu_ps(out + c, BF == 2 ? _mm256_mul_ps(w, _mm256_set1_ps(sc)) : w);
      o += __builtin_popcount(b);
    }
#endif
    for (; c < in; c++) {
      if (m[c >> 3] >> (c & 7) & 1) {
        out[c] = VALB(V, BF, o) * sc;
        o++;
      } else {
        out[c] = 0.f;
      }
    }
  }
}
static void bm_unpack_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16 == 2)
    bm_unpack_rows_(j, r0, r1, 2);
  else if (j->vbf16)
    bm_unpack_rows_(j, r0, r1, 1);
  else
    bm_unpack_rows_(j, r0, r1, 0);
}

/* 2:4 -> dense float32 rows: per group of four columns, zeros and the two values at their positions.
   With AVX2, eight columns per step: the meta byte indexes a table giving, per output lane, which of
   the four values lands there (or -1: zero), one vpermps + blend as in the bitmask expansion (the
   scalar loop made 2:4 prefill 0.3-0.5x dense against the bitmask's 0.8x). */
#if HFS_SIMD
static int32_t g_nm_inv[256][8] __attribute__((aligned(32)));
__attribute__((constructor)) static void init_nm_inv(void) {
  for (int b = 0; b < 256; b++) {
    int lanes[4] = {b & 3, (b >> 2) & 3, 4 + ((b >> 4) & 3), 4 + ((b >> 6) & 3)};
    for (int i = 0; i < 8; i++) g_nm_inv[b][i] = -1;
    for (int k = 0; k < 4; k++) g_nm_inv[b][lanes[k]] = k;
  }
}
#endif
static inline __attribute__((always_inline)) void nm24_unpack_rows_(const job_t* j, int64_t r0, int64_t r1,
                                                                    const int BF) {
  const int64_t in = j->in, half = in >> 1;
  const uint8_t* M = (const uint8_t*)j->idx;
  const void* const V = vbase(j->v, BF, j->rows);
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * ((in + 7) >> 3);
    float* out = j->y + r * in;
    const int64_t vo = r * half;
    const float sc = vscale(j->v, BF, r);
    int64_t c = 0;
#if HFS_SIMD
    for (; c + 8 <= in; c += 8) {
      const __m256 vals = loadv8_(V, BF, vo + c / 2); /* lanes 0-3 used; the values array is padded */
      const __m256 w = expand_lanes(g_nm_inv[m[c >> 3]], vals);
      _mm256_storeu_ps(out + c, BF == 2 ? _mm256_mul_ps(w, _mm256_set1_ps(sc)) : w);
    }
#endif
    for (; c < in; c += 4) {
      const uint32_t bits = (uint32_t)(m[c >> 3] >> ((c & 4) ? 4 : 0)) & 15u;
      float g[4] = {0.f, 0.f, 0.f, 0.f};
      g[bits & 3] = VALB(V, BF, vo + c / 2) * sc;
      g[bits >> 2] = VALB(V, BF, vo + c / 2 + 1) * sc; /* the two positions differ (padding included) */
      memcpy(out + c, g, sizeof g);
    }
  }
}
static void nm24_unpack_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16 == 2)
    nm24_unpack_rows_(j, r0, r1, 2);
  else if (j->vbf16)
    nm24_unpack_rows_(j, r0, r1, 1);
  else
    nm24_unpack_rows_(j, r0, r1, 0);
}

/* ---- Batched products (prefill, more than 16 rows of x): blocked sparse x dense ----------------------
   y[b, r] = sum_c W[r, c] x[b, c] for the three formats, reading W once per block of up to SBMAX rows of x
   (128 with AVX-512). x is first copied, per block, to [in][wp] (wp: the block's rows rounded up to whole
   vectors, zero-padded; 8x8 transposes): the block's values of one input column are contiguous. Then per
   SRB output rows, per x block, per tile of CB input columns (CB x wp floats, 32 KB: stays in L1), every
   row's nonzeros in those columns are listed (column offsets: from the CSR indices, the set bits without
   a branch per bit, or the 2:4 positions), and each nonzero is one broadcast multiply-add into the row's
   wp accumulator lanes, held in registers across the tile (8 vectors in flight hide the FMA latency). The
   work is the nonzeros' (at 50% half of a dense GEMM's multiply-adds), at about one L1 load per
   multiply-add, where a dense GEMM reuses each load across a register tile: measured on a 2-core Xeon
   (AVX-512), 128 rows of x, against MKL's GEMM: 0.8-1.1x at 50% on SmolLM2-135M's shapes (the small
   192x576 ones lowest), 1.0-1.5x at 70%, 1.9-2.4x for CSR at 90% on GPT-2's. Wider x blocks won each
   step (32 rows of x: 0.7-0.9x at 50%). Summation order: per tile, a few
   interleaved partial sums; results differ from the sequential sum by rounding only. */
#if HFS_SIMD && defined(__AVX512F__)
#define VW 16
typedef __m512 vw_t;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_load_ps(p)
#define VSTORE(p, a) _mm512_store_ps(p, a)
#define VFMA(w, p, a) _mm512_fmadd_ps(w, _mm512_load_ps(p), a)
#define VSET1(w) _mm512_set1_ps(w)
#define VADD(a, b) _mm512_add_ps(a, b)
#elif HFS_SIMD
#define VW 8
typedef __m256 vw_t;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_load_ps(p)
#define VSTORE(p, a) _mm256_store_ps(p, a)
#define VFMA(w, p, a) _mm256_fmadd_ps(w, _mm256_load_ps(p), a)
#define VSET1(w) _mm256_set1_ps(w)
#define VADD(a, b) _mm256_add_ps(a, b)
#else
#define VW 4
#endif
#define SMAXV 8             /* vectors per row of accumulators, at most */
#define SBMAX (SMAXV * VW)  /* rows of x per full block */
#define STILE 8192          /* floats per x tile (32 KB) */
#define SCBMAX 512          /* columns per tile, at most */
#define SRB 32              /* output rows per block */
#define SPMM_MIN_B 17

#if HFS_SIMD
/* per mask byte: the positions of its set bits, in order */
static int32_t g_bm_pos[256][8] __attribute__((aligned(32)));
__attribute__((constructor)) static void init_bm_pos(void) {
  for (int b = 0; b < 256; b++)
    for (int i = 0, k = 0; i < 8; i++) {
      g_bm_pos[b][i] = 0;
      if (b >> i & 1) g_bm_pos[b][k++] = i;
    }
}

/* the 8x8 block at x (row stride ld) transposed into t (row stride ldt) */
static inline void transpose8(const float* x, int64_t ld, float* t, int64_t ldt) {
  __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + ld), r2 = _mm256_loadu_ps(x + 2 * ld);
  __m256 r3 = _mm256_loadu_ps(x + 3 * ld), r4 = _mm256_loadu_ps(x + 4 * ld), r5 = _mm256_loadu_ps(x + 5 * ld);
  __m256 r6 = _mm256_loadu_ps(x + 6 * ld), r7 = _mm256_loadu_ps(x + 7 * ld);
  __m256 u0 = _mm256_unpacklo_ps(r0, r1), u1 = _mm256_unpackhi_ps(r0, r1), u2 = _mm256_unpacklo_ps(r2, r3);
  __m256 u3 = _mm256_unpackhi_ps(r2, r3), u4 = _mm256_unpacklo_ps(r4, r5), u5 = _mm256_unpackhi_ps(r4, r5);
  __m256 u6 = _mm256_unpacklo_ps(r6, r7), u7 = _mm256_unpackhi_ps(r6, r7);
  __m256 s0 = _mm256_shuffle_ps(u0, u2, 0x44), s1 = _mm256_shuffle_ps(u0, u2, 0xEE);
  __m256 s2 = _mm256_shuffle_ps(u1, u3, 0x44), s3 = _mm256_shuffle_ps(u1, u3, 0xEE);
  __m256 s4 = _mm256_shuffle_ps(u4, u6, 0x44), s5 = _mm256_shuffle_ps(u4, u6, 0xEE);
  __m256 s6 = _mm256_shuffle_ps(u5, u7, 0x44), s7 = _mm256_shuffle_ps(u5, u7, 0xEE);
  _mm256_storeu_ps(t + 0 * ldt, _mm256_permute2f128_ps(s0, s4, 0x20));
  _mm256_storeu_ps(t + 1 * ldt, _mm256_permute2f128_ps(s1, s5, 0x20));
  _mm256_storeu_ps(t + 2 * ldt, _mm256_permute2f128_ps(s2, s6, 0x20));
  _mm256_storeu_ps(t + 3 * ldt, _mm256_permute2f128_ps(s3, s7, 0x20));
  _mm256_storeu_ps(t + 4 * ldt, _mm256_permute2f128_ps(s0, s4, 0x31));
  _mm256_storeu_ps(t + 5 * ldt, _mm256_permute2f128_ps(s1, s5, 0x31));
  _mm256_storeu_ps(t + 6 * ldt, _mm256_permute2f128_ps(s2, s6, 0x31));
  _mm256_storeu_ps(t + 7 * ldt, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#endif

/* x block bb: its first row, real rows and padded width (whole vectors); the last block holds the rest */
static inline void spmm_block_shape(int64_t B, int64_t bb, int64_t* b0, int64_t* bw, int64_t* wp) {
  *b0 = bb * SBMAX;
  *bw = B - *b0 < SBMAX ? B - *b0 : SBMAX;
  *wp = (*bw + VW - 1) / VW * VW;
}

/* job rows = input columns [c0, c1): x [B, in] -> y = the blocks [in][wp], block bb at bb * in * SBMAX */
static void spmm_pack_rows(const job_t* j, int64_t c0, int64_t c1) {
  const int64_t B = j->B, in = j->in, nb = (B + SBMAX - 1) / SBMAX;
  for (int64_t bb = 0; bb < nb; bb++) {
    int64_t b0, bw, wp;
    spmm_block_shape(B, bb, &b0, &bw, &wp);
    float* t = j->y + bb * in * SBMAX;
    const float* xb = j->x + b0 * in;
    int64_t c = c0;
#if HFS_SIMD
    for (; c + 8 <= c1; c += 8) {
      int64_t b = 0;
      for (; b + 8 <= bw; b += 8) transpose8(xb + b * in + c, in, t + c * wp + b, wp);
      for (; b < wp; b++)
        for (int64_t q = 0; q < 8; q++) t[(c + q) * wp + b] = b < bw ? xb[b * in + c + q] : 0.f;
    }
#endif
    for (; c < c1; c++)
      for (int64_t b = 0; b < wp; b++) t[c * wp + b] = b < bw ? xb[b * in + c] : 0.f;
  }
}

/* Rows [rb, re) of y for one x block (b0: its first row, xt: its copy) of NV vectors per row.
   F: 0 CSR with 16-bit indices, 1 CSR with 32-bit, 2 bitmask, 3 2:4 (values [rows, in/2]). */
static inline __attribute__((always_inline)) void spmm_block_(const job_t* j, int64_t rb, int64_t re, int64_t b0,
                                                              const float* xt, float* acc, int32_t* off,
                                                              int64_t* pos, const int NV, const int F,
                                                              const int BF) {
  const int64_t in = j->in, B = j->B, rows = j->rows, mb = (in + 7) >> 3, wp = NV * VW;
  const int64_t CB = STILE / wp / 16 * 16 < SCBMAX ? STILE / wp / 16 * 16 : SCBMAX;
  const void* const V = vbase(j->v, BF, rows);
  const uint8_t* M = (const uint8_t*)j->idx;
  for (int64_t r = rb; r < re; r++) {
    pos[r - rb] = F == 3 ? r * (in >> 1) : j->rowptr[r];
    memset(acc + (r - rb) * wp, 0, wp * sizeof(float));
  }
  for (int64_t c0 = 0; c0 < in; c0 += CB) {
    const int64_t c1 = c0 + CB < in ? c0 + CB : in;
    const float* xc = xt + c0 * wp;
    for (int64_t r = rb; r < re; r++) {
      const int64_t p = pos[r - rb];
      int64_t n = 0;
      if (F == 0 || F == 1) { /* sorted column indices */
        const int64_t pe = j->rowptr[r + 1];
        if (F == 0) {
          const uint16_t* ix = (const uint16_t*)j->idx + p;
          while (p + n < pe && ix[n] < c1) { off[n] = (int32_t)(ix[n] - c0); n++; }
        } else {
          const int32_t* ix = (const int32_t*)j->idx + p;
          while (p + n < pe && ix[n] < c1) { off[n] = (int32_t)(ix[n] - c0); n++; }
        }
      } else if (F == 2) { /* set bits; a loop per bit mispredicts about once per byte of a random mask */
        const uint8_t* m = M + r * mb;
        int64_t c = c0;
#if HFS_SIMD
#if defined(__AVX512F__)
        const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (; c + 16 <= c1; c += 16) {
          uint16_t k;
          memcpy(&k, m + (c >> 3), 2);
          _mm512_storeu_si512((void*)(off + n),
                              _mm512_maskz_compress_epi32(k, _mm512_add_epi32(iota, _mm512_set1_epi32((int)(c - c0)))));
          n += __builtin_popcount(k);
        }
#endif
        for (; c + 8 <= c1; c += 8) {
          const uint32_t k = m[c >> 3];
          _mm256_storeu_si256((__m256i*)(off + n), _mm256_add_epi32(_mm256_load_si256((const __m256i*)g_bm_pos[k]),
                                                                    _mm256_set1_epi32((int)(c - c0))));
          n += __builtin_popcount(k);
        }
#endif
        for (; c < c1; c += 8)
          for (uint32_t k = m[c >> 3]; k; k &= k - 1) off[n++] = (int32_t)(c - c0 + __builtin_ctz(k));
      } else { /* 2:4: two positions per group of four (a group keeping fewer pads with a zero value) */
        const uint8_t* m = M + r * mb;
        for (int64_t c = c0; c < c1; c += 8) {
          const uint32_t ln = g_nm_lane[m[c >> 3]];
          const int npos = c1 - c >= 8 ? 4 : 2; /* in % 8 == 4: the last byte holds one group */
          for (int q = 0; q < npos; q++) off[n++] = (int32_t)(c - c0 + (ln >> (8 * q) & 0xff));
        }
      }
      float* a = acc + (r - rb) * wp;
#if HFS_SIMD
      const int U = NV >= 8 ? 1 : 8 / NV; /* nonzeros in flight: U * NV accumulators */
      vw_t t[8][SMAXV];
      for (int u = 0; u < U; u++)
        for (int v = 0; v < NV; v++) t[u][v] = u ? VZERO() : VLOAD(a + v * VW);
      int64_t k = 0;
      for (; k + U <= n; k += U)
        for (int u = 0; u < U; u++) {
          const float* xp = xc + off[k + u] * wp;
          const vw_t w = VSET1(VALB(V, BF, p + k + u));
          for (int v = 0; v < NV; v++) t[u][v] = VFMA(w, xp + v * VW, t[u][v]);
        }
      for (; k < n; k++) {
        const float* xp = xc + off[k] * wp;
        const vw_t w = VSET1(VALB(V, BF, p + k));
        for (int v = 0; v < NV; v++) t[0][v] = VFMA(w, xp + v * VW, t[0][v]);
      }
      for (int v = 0; v < NV; v++) {
        for (int u = 1; u < U; u++) t[0][v] = VADD(t[0][v], t[u][v]);
        VSTORE(a + v * VW, t[0][v]);
      }
#else
      for (int64_t k = 0; k < n; k++) {
        const float w = VALB(V, BF, p + k);
        const float* xp = xc + off[k] * wp;
        for (int64_t b = 0; b < wp; b++) a[b] += w * xp[b];
      }
#endif
      pos[r - rb] = p + n;
    }
  }
  const int64_t bw = B - b0 < wp ? B - b0 : wp;
  for (int64_t b = 0; b < bw; b++) {
    float* yb = j->y + (b0 + b) * rows;
    for (int64_t r = rb; r < re; r++) {
      const float s = acc[(r - rb) * wp + b] * vscale(j->v, BF, r);
      yb[r] = j->bias ? s + j->bias[r] : s;
    }
  }
}

/* per chunk of rows: accumulators (SRB x SBMAX floats, 64-byte aligned), column offsets, row positions; in
   the work memory rather than on the stack (inlined for eight widths, they made a 130 KB frame) */
#define SPMM_SCRATCH (SRB * SBMAX + (SCBMAX + 16) + 2 * SRB + 16) /* floats, a multiple of 16 */

static inline __attribute__((always_inline)) void spmm_rows_(const job_t* j, int64_t r0, int64_t r1, const int F,
                                                             const int BF) {
  const int64_t B = j->B, in = j->in, nb = (B + SBMAX - 1) / SBMAX;
  float* acc = j->work + (r0 / j->chunk) * SPMM_SCRATCH;
  int32_t* off = (int32_t*)(acc + SRB * SBMAX);
  int64_t* pos = (int64_t*)(off + SCBMAX + 16);
  for (int64_t rb = r0; rb < r1; rb += SRB) {
    const int64_t re = rb + SRB < r1 ? rb + SRB : r1;
    for (int64_t bb = 0; bb < nb; bb++) {
      int64_t b0, bw, wp;
      spmm_block_shape(B, bb, &b0, &bw, &wp);
      const float* xt = j->x + bb * in * SBMAX;
      switch (wp / VW) { /* the last block's width; the others are full */
        case 1: spmm_block_(j, rb, re, b0, xt, acc, off, pos, 1, F, BF); break;
        case 2: spmm_block_(j, rb, re, b0, xt, acc, off, pos, 2, F, BF); break;
        case 3: spmm_block_(j, rb, re, b0, xt, acc, off, pos, 3, F, BF); break;
        case 4: spmm_block_(j, rb, re, b0, xt, acc, off, pos, 4, F, BF); break;
        case 5: spmm_block_(j, rb, re, b0, xt, acc, off, pos, 5, F, BF); break;
        case 6: spmm_block_(j, rb, re, b0, xt, acc, off, pos, 6, F, BF); break;
        case 7: spmm_block_(j, rb, re, b0, xt, acc, off, pos, 7, F, BF); break;
        default: spmm_block_(j, rb, re, b0, xt, acc, off, pos, SMAXV, F, BF);
      }
    }
  }
}
/* CSR values are always float32 */
static void spmm_csr16_rows(const job_t* j, int64_t r0, int64_t r1) { spmm_rows_(j, r0, r1, 0, 0); }
static void spmm_csr32_rows(const job_t* j, int64_t r0, int64_t r1) { spmm_rows_(j, r0, r1, 1, 0); }
static void spmm_bm_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16 == 2)
    spmm_rows_(j, r0, r1, 2, 2);
  else if (j->vbf16)
    spmm_rows_(j, r0, r1, 2, 1);
  else
    spmm_rows_(j, r0, r1, 2, 0);
}
static void spmm_nm24_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16 == 2)
    spmm_rows_(j, r0, r1, 3, 2);
  else if (j->vbf16)
    spmm_rows_(j, r0, r1, 3, 1);
  else
    spmm_rows_(j, r0, r1, 3, 0);
}

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

/* Batched product through the blocked kernel above: x [B, in] row-major, y [B, rows]; fmt as spmm_rows_'s F.
   Returns 0, or -1 when the work memory cannot be allocated or the build has no SIMD (callers then use the
   row kernels). */
int hfs_spmm(int fmt, int64_t rows, int64_t in, int nthreads, const int64_t* rowptr, const void* idx,
             const void* v, int vbf16, const float* x, float* y, int64_t B, const float* bias) {
  static void (*const fns[4])(const job_t*, int64_t, int64_t) = {spmm_csr16_rows, spmm_csr32_rows, spmm_bm_rows,
                                                                 spmm_nm24_rows};
  if (!HFS_SIMD || fmt < 0 || fmt > 3) return -1; /* the scalar build: the row kernels do better */
  if (nthreads < 1) nthreads = 1;
  const int64_t chunk = (rows + nthreads - 1) / nthreads, nchunks = rows > 0 ? (rows + chunk - 1) / chunk : 0;
  const size_t xsize = (size_t)((B + SBMAX - 1) / SBMAX) * (size_t)in * SBMAX;
  int owned;
  float* work = work_buf(xsize + (size_t)nchunks * SPMM_SCRATCH, &owned);
  if (!work) return -1;
  job_t p = {0, 0, in, (in + nthreads - 1) / nthreads, 0, B, NULL, NULL, NULL, x, work, NULL, spmm_pack_rows, in, 0,
             NULL};
  run(&p, nthreads);
  job_t j = {fmt, 0, rows, chunk, 0, B, rowptr, idx, (const float*)v, work, y, bias, fns[fmt], in, vbf16, work + xsize};
  run(&j, nthreads);
  if (owned) free(work);
  return 0;
}

/* CSR: y = x W^T (+ bias), x [B, in] row-major, y [B, rows]; kind 0/1: 16/32-bit column indices. Batches of
   SPMM_MIN_B rows or more go through the blocked kernel; smaller ones through SPMM_ROWS on x transposed
   (into the per-thread buffer), or, without that buffer, one batch-1 product per row. */
void hfs_matmul(int kind, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
                const void* idx, const float* v, const float* x, float* y, int64_t B, const float* bias) {
  if (B >= SPMM_MIN_B && hfs_spmm(kind, rows, in, nthreads, rowptr, idx, v, 0, x, y, B, bias) == 0) return;
  int owned = 0;
  float* xt = B > 1 ? work_buf((size_t)(B * in), &owned) : NULL;
  if (xt) {
    for (int64_t b = 0; b < B; b++)
      for (int64_t c = 0; c < in; c++) xt[c * B + b] = x[b * in + c];
    job_t j = {kind + 2, 0, rows, chunk, 0, B, rowptr, idx, v, xt, y, bias, NULL, 0, 0, NULL};
    run(&j, nthreads);
    if (owned) free(xt);
    return;
  }
  for (int64_t b = 0; b < B; b++) {
    job_t j = {kind, 0, rows, chunk, 0, 1, rowptr, idx, v, x + b * in, y + b * rows, bias, NULL, 0, 0, NULL};
    run(&j, nthreads);
  }
}

void hfs_run(int op, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
             const void* meta, const void* v, int vbf16, const float* x, float* y, int64_t B,
             const float* bias);
/* the row kernels by op: 0 bitmask, 1 2:4, 2 dense GEMV, 3 bitmask unpack, 4 2:4 unpack */
static void (*const ROW_FNS[5])(const job_t*, int64_t, int64_t) = {bm_rows, nm24_rows, gemv_rows, bm_unpack_rows,
                                                                   nm24_unpack_rows};
#if HFS_VNNI
/* the batch-1 int8 x int8 products by op (0 bitmask, 1 2:4, 2 dense GEMV); NULL: none on this CPU */
static void (*const Q8_FNS[3])(const job_t*, int64_t, int64_t) = {
#if HFS_VNNI_EXPAND
    bm_q8_rows, nm24_q8_rows,
#else
    NULL, NULL,
#endif
    gemv_q8_rows};
#endif
/* value type 3 (op 0-2): see quantize_row */
static void run_q8(int op, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
                   const void* meta, const void* v, const float* x, float* y, int64_t B, const float* bias) {
  const int64_t nf = xq_floats(in);
#if HFS_VNNI
  if (B == 1 && Q8_FNS[op]) {
    int owned;
    float* buf = work_buf((size_t)nf, &owned);
    if (buf) {
      quantize_row_vnni(x, in, buf);
      job_t j = {0, 0, rows, chunk, 0, 1, rowptr, meta, (const float*)v, x, y, bias, Q8_FNS[op], in, 2, buf};
      run(&j, nthreads);
      if (owned) free(buf);
      return;
    }
  }
#endif
  /* the dequantized activations, in memory of their own (the batched kernels use the work buffer) */
  float* xd = aligned_alloc(64, (((size_t)(B * in + nf) * sizeof(float)) + 63) & ~(size_t)63);
  if (!xd) return;
  for (int64_t b = 0; b < B; b++) quantize_row(x + b * in, in, xd + B * in, xd + b * in);
  hfs_run(op, rows, in, chunk, nthreads, rowptr, meta, v, 2, xd, y, B, bias);
  free(xd);
}

/* op: 0 bitmask, 1 2:4, 2 dense GEMV, 3 bitmask unpack, 4 2:4 unpack (y: [rows, in]).
   x: [B, in]; y: [B, rows]. */
void hfs_run(int op, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
             const void* meta, const void* v, int vbf16, const float* x, float* y, int64_t B,
             const float* bias) {
  if (op < 0 || op > 4) return;
  if (vbf16 == 3) { /* int8 activations: the VNNI products at batch 1, else the dequantized activations */
    if (op >= 3) {
      vbf16 = 2;
    } else {
      run_q8(op, rows, in, chunk, nthreads, rowptr, meta, v, x, y, B, bias);
      return;
    }
  }
  if (op <= 1 && B >= SPMM_MIN_B && hfs_spmm(op + 2, rows, in, nthreads, rowptr, meta, v, vbf16, x, y, B, bias) == 0)
    return;
  job_t j = {0, 0, rows, chunk, 0, B, rowptr, meta, (const float*)v, x, y, bias, ROW_FNS[op], in, vbf16, NULL};
  run(&j, nthreads);
}

/* A batch-1 call whose fixed arguments were prepared once (Python: _native.Prepared): four arguments
   cross ctypes per call instead of thirteen (~1 us instead of ~3 us; ~200 calls per decoded token). */
typedef struct {
  int64_t op, rows, in, chunk, nthreads;
  const int64_t* rowptr;
  const void* meta;
  const void* v;
  int64_t vbf16;
} prepared_t;
/* op 0-4 as hfs_run; 16 + kind: CSR (hfs_matmul's batch-1 kinds 0/1, `meta` = the column indices). */
void hfs_run_prepared(const prepared_t* p, const float* x, float* y, const float* bias) {
  if (p->op >= 16) {
    hfs_matmul((int)p->op - 16, p->rows, p->in, p->chunk, (int)p->nthreads, p->rowptr, p->meta, (const float*)p->v, x,
               y, 1, bias);
    return;
  }
  hfs_run((int)p->op, p->rows, p->in, p->chunk, (int)p->nthreads, p->rowptr, p->meta, p->v, (int)p->vbf16, x, y,
          1, bias);
}

/* Batch-1 products of the same input x as one hand-off to the pool (the decoding step's q / k / v, and
   gate / up): their chunks are claimed from one pool, so the threads wait once instead of once per product,
   and int8 activations are quantized once for all of them. Products a fused call cannot take (CSR, or int8
   activations without the VNNI kernel) make the whole call fall back to one call per product. */
static int prepared_job(const prepared_t* p, const float* x, float* y, const float* bias, job_t* j) {
  if (p->op < 0 || p->op > 2) return 0;
  void (*fn)(const job_t*, int64_t, int64_t) = ROW_FNS[p->op];
  if (p->vbf16 == 3) { /* the int8 x int8 kernel; its `work` (the quantized x) is set by the caller */
#if HFS_VNNI
    fn = Q8_FNS[p->op];
#else
    fn = NULL;
#endif
    if (!fn) return 0;
  }
  const job_t jj = {0, 0, p->rows, p->chunk, 0, 1, p->rowptr, p->meta, (const float*)p->v, x, y, bias, fn,
                    p->in, p->vbf16 == 3 ? 2 : (int)p->vbf16, NULL};
  *j = jj;
  return 1;
}

void hfs_run_fused(const prepared_t* const* ps, int n, const float* x, float* const* ys, const float* const* bs) {
  job_t js[MAX_JOBS];
  int ok = n > 0 && n <= MAX_JOBS, q8 = 0, nthreads = 1, owned = 0;
  for (int k = 0; ok && k < n; k++) {
    ok = ps[k]->in == ps[0]->in && prepared_job(ps[k], x, ys[k], bs[k], js + k);
    q8 |= ps[k]->vbf16 == 3;
    if (ps[k]->nthreads > nthreads) nthreads = (int)ps[k]->nthreads;
  }
  float* xq = NULL;
#if HFS_VNNI
  if (ok && q8) { /* quantized once for every int8 x int8 product */
    xq = work_buf((size_t)xq_floats(ps[0]->in), &owned);
    ok = xq != NULL;
    if (ok) quantize_row_vnni(x, ps[0]->in, xq);
    for (int k = 0; ok && k < n; k++)
      if (ps[k]->vbf16 == 3) js[k].work = xq;
  }
#endif
  if (ok)
    run_jobs(js, n, nthreads);
  else
    for (int k = 0; k < n; k++) hfs_run_prepared(ps[k], x, ys[k], bs[k]);
  if (owned) free(xq);
}

void hfs_set_spin(int64_t spin) { g_spin = spin; }
/* 1: chunks on the OpenMP team (when built with -fopenmp); 0: the pthread pool above; -1: no change.
   Returns the mode in use. */
int hfs_set_openmp(int on) {
#if defined(_OPENMP)
  if (on >= 0) g_use_omp = on != 0;
#endif
  return g_use_omp;
}
int hfs_version(void) { return 11; }
int hfs_simd(void) { return HFS_SIMD; }
/* 0 scalar, 1 AVX2 + FMA, 2 AVX-512 (the bitmask expand and CSR gather paths) */
int hfs_isa(void) {
#if HFS_SIMD && defined(__AVX512F__)
  return 2;
#else
  return HFS_SIMD;
#endif
}
/* 1: batch-1 products with int8 activations multiply int8 codes (AVX-512 VNNI); 2: the bitmask and 2:4
   ones too (VBMI2's byte expand); 0: they run on the dequantized activations */
int hfs_vnni(void) { return HFS_VNNI + HFS_VNNI_EXPAND; }

/* ---- One decoded token of a Llama-family or GPT-2 model in one call (hf_sparsity/decoding.py, NativeDecoder) --
   Each projection is a prepared batch-1 call of any native format (bitmask, 2:4, CSR, dense GEMV; fp32,
   bf16 or int8 values); everything between them runs here: RMSNorm, the rotary embedding (rotate-half
   convention, cos / sin tables computed by the model's own rotary module), the attention of one query over
   the key / value cache (grouped heads), the SiLU-gated MLP, the residuals, the final norm, the LM head and
   the argmax. One ctypes call per token replaces transformers' ~2000 small torch operations. Float32
   throughout, in transformers' order of operations up to the order of sums (the products' and the attention's
   dot products sum in vector lanes; RMSNorm's and the softmax's sums accumulate in double).
   GPT-2 (arch 1): learned positions added to the embedding, LayerNorm with a bias, one fused q / k / v
   product (`q` alone; its output is q, k, v side by side), no rotary embedding, a GELU MLP (`up` = c_fc,
   `down` = c_proj; no `gate`), biases everywhere; the last logits stay in `logits` for sampling. */
typedef struct {
  const prepared_t *q, *k, *v, *o, *gate, *up, *down;
  const float *bq, *bk, *bv, *bo, *bgate, *bup, *bdown;
  const float *norm1, *norm2;
  float *kc, *vc;               /* [kv_heads, max_len, head_dim] */
  const float *nbias1, *nbias2; /* LayerNorm biases (GPT-2) */
  const float *qnorm, *knorm;   /* per-head RMSNorm of q and k before the rotary embedding (Qwen3); NULL: none */
} hfs_layer_t;

typedef struct {
  int64_t nlayers, hidden, heads, kv_heads, head_dim, ffn, max_len, vocab, threads;
  double eps, scale;
  const hfs_layer_t* layers;
  const prepared_t* head;
  const float* head_bias;
  const float* final_norm;
  const float* embed; /* [embedding rows, hidden] */
  const float* cos;   /* [max_len, head_dim] */
  const float* sin;
  float* work;   /* hfs_decode_work_floats() floats */
  float* logits; /* [vocab] */
  int64_t arch;  /* 0: Llama family (RMSNorm, rotary, SiLU-gated MLP); 1: GPT-2 (see above) */
  int64_t act;   /* GPT-2's MLP activation: 0 GELU with the tanh approximation, 1 GELU (erf) */
  const float* pos_embed;       /* [positions, hidden] (GPT-2) */
  const float* final_norm_bias; /* (GPT-2) */
} hfs_decoder_t;

int64_t hfs_decode_work_floats(const hfs_decoder_t* d) {
  return 4 * d->hidden + 2 * d->heads * d->head_dim + 2 * d->kv_heads * d->head_dim + 2 * d->ffn +
         d->heads * d->max_len;
}

#if HFS_SIMD && defined(__AVX512F__)
/* e^x for 16 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial; ~1 ulp),
   inputs clamped to [-88.38, 88.38]. Used by the SiLU and the attention's softmax. */
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500E-4f), r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#define HFS_VEXP 1
#else
#define HFS_VEXP 0
#endif

/* g = silu(g) * u, n values */
static void silu_mul(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#if HFS_VEXP
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a));
    _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                          _mm512_loadu_ps(u + i)));
  }
#endif
  for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* One query over the cache: the attention of its heads [h0, h1) (a pool job's rows). Scores and their
   exponentials go to sc + head * max_len; dot products sum in 16 lanes, the softmax's sum in double. */
typedef struct {
  const float *q, *kc, *vc;
  float *att, *sc;
  int64_t T, hd, rep, pos;
  float scale;
} attn_t;

static void attn_rows(const job_t* j, int64_t h0, int64_t h1) {
  const attn_t* a = (const attn_t*)j->idx;
  const int64_t hd = a->hd, n = a->pos + 1;
  for (int64_t hh = h0; hh < h1; hh++) {
    const float* qh = a->q + hh * hd;
    const float* kb = a->kc + (hh / a->rep) * a->T * hd;
    const float* vb = a->vc + (hh / a->rep) * a->T * hd;
    float* sc = a->sc + hh * a->T;
    float* out = a->att + hh * hd;
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
      const float* kt = kb + t * hd;
      int64_t i = 0;
      float s = 0.0f;
#if HFS_VEXP
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= hd; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + i), _mm512_loadu_ps(kt + i), acc);
      s = _mm512_reduce_add_ps(acc);
#endif
      for (; i < hd; i++) s += qh[i] * kt[i];
      sc[t] = s * a->scale;
      if (sc[t] > mx) mx = sc[t];
    }
    double den = 0.0;
    int64_t t = 0;
#if HFS_VEXP
    for (; t + 16 <= n; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), _mm512_set1_ps(mx)));
      _mm512_storeu_ps(sc + t, e);
      den += (double)_mm512_reduce_add_ps(e);
    }
#endif
    for (; t < n; t++) {
      sc[t] = expf(sc[t] - mx);
      den += sc[t];
    }
    for (int64_t i = 0; i < hd; i++) out[i] = 0.0f;
    for (t = 0; t < n; t++) {
      const float p = (float)(sc[t] / den);
      const float* vt = vb + t * hd;
      int64_t i = 0;
#if HFS_VEXP
      const __m512 pv = _mm512_set1_ps(p);
      for (; i + 16 <= hd; i += 16)
        _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(vt + i), _mm512_loadu_ps(out + i)));
#endif
      for (; i < hd; i++) out[i] += p * vt[i];
    }
  }
}

#define ATTN_SPLIT 8192 /* multiply-adds of q.k in one layer's attention */

__attribute__((optimize("fp-contract=off"))) static void rms_norm(const float* x, const float* w, float* out,
                                                                  int64_t n, double eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
  const float var = (float)(ss / (double)n);
  const float r = 1.0f / sqrtf(var + (float)eps);
  for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* LayerNorm (GPT-2): mean and variance in double, then (x - mean) * rstd * w + b in float */
__attribute__((optimize("fp-contract=off"))) static void layer_norm(const float* x, const float* w, const float* b,
                                                                    float* out, int64_t n, double eps) {
  double s = 0.0, ss = 0.0;
  for (int64_t i = 0; i < n; i++) s += (double)x[i];
  const double mean = s / (double)n;
  for (int64_t i = 0; i < n; i++) ss += ((double)x[i] - mean) * ((double)x[i] - mean);
  const float m = (float)mean, r = (float)(1.0 / sqrt(ss / (double)n + eps));
  for (int64_t i = 0; i < n; i++) out[i] = (x[i] - m) * r * w[i] + b[i];
}

static void norm(const float* x, const float* w, const float* b, float* out, int64_t n, double eps) {
  if (b)
    layer_norm(x, w, b, out, n, eps);
  else
    rms_norm(x, w, out, n, eps);
}

/* GELU in place: act 0 the tanh approximation (transformers' gelu_new / gelu_pytorch_tanh), 1 erf */
static void gelu(float* g, int64_t n, int64_t act) {
  if (act == 1) {
    for (int64_t i = 0; i < n; i++) g[i] = 0.5f * g[i] * (1.0f + erff(g[i] * 0.70710678118654752f));
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    const float v = g[i];
    g[i] = 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
  }
}

__attribute__((optimize("fp-contract=off"))) static void rope(float* t, int64_t nheads, int64_t hd,
                                                              const float* cs, const float* sn) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < nheads; h++) {
    float* v = t + h * hd;
    for (int64_t i = 0; i < half; i++) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cs[i] + (-b) * sn[i];
      v[i + half] = b * cs[i + half] + a * sn[i + half];
    }
  }
}

/* The layers for `token` at `pos`: its keys / values go into the cache, the final hidden state into x */
static void decode_layers(const hfs_decoder_t* d, int64_t token, int64_t pos) {
  const int64_t D = d->hidden, H = d->heads, G = d->kv_heads, hd = d->head_dim, F = d->ffn, T = d->max_len;
  float *x = d->work, *h = x + D, *o = h + D, *att = o + D, *q = att + H * hd, *k = q + H * hd, *v = k + G * hd;
  float *g = v + G * hd, *u = g + F, *sc = u + F;
  memcpy(x, d->embed + token * D, (size_t)D * sizeof(float));
  if (d->pos_embed)
    for (int64_t i = 0; i < D; i++) x[i] += d->pos_embed[pos * D + i];
  const float *cs = d->cos ? d->cos + pos * hd : NULL, *sn = d->sin ? d->sin + pos * hd : NULL;
  const int64_t rep = H / G;
  for (int64_t l = 0; l < d->nlayers; l++) {
    const hfs_layer_t* L = d->layers + l;
    norm(x, L->norm1, L->nbias1, h, D, d->eps);
    if (!L->k) { /* one fused product: q, k, v side by side (GPT-2's c_attn) */
      hfs_run_prepared(L->q, h, q, L->bq);
    } else {
      const prepared_t* ps[3] = {L->q, L->k, L->v};
      float* ys[3] = {q, k, v};
      const float* bs[3] = {L->bq, L->bk, L->bv};
      hfs_run_fused(ps, 3, h, ys, bs);
    }
    if (L->qnorm)
      for (int64_t j = 0; j < H; j++) rms_norm(q + j * hd, L->qnorm, q + j * hd, hd, d->eps);
    if (L->knorm)
      for (int64_t j = 0; j < G; j++) rms_norm(k + j * hd, L->knorm, k + j * hd, hd, d->eps);
    if (cs) {
      rope(q, H, hd, cs, sn);
      rope(k, G, hd, cs, sn);
    }
    for (int64_t j = 0; j < G; j++) {
      memcpy(L->kc + (j * T + pos) * hd, k + j * hd, (size_t)hd * sizeof(float));
      memcpy(L->vc + (j * T + pos) * hd, v + j * hd, (size_t)hd * sizeof(float));
    }
    {
      const attn_t a = {q, L->kc, L->vc, att, sc, T, hd, rep, pos, (float)d->scale};
      job_t j = {0, 0, H, 1, 0, 1, NULL, &a, NULL, NULL, NULL, NULL, attn_rows, hd, 0, NULL};
      /* the heads on the pool when they are worth a hand-off (~1 us) */
      run(&j, (pos + 1) * H * hd >= ATTN_SPLIT ? (int)d->threads : 1);
    }
    hfs_run_prepared(L->o, att, o, L->bo);
    for (int64_t i = 0; i < D; i++) x[i] += o[i];
    norm(x, L->norm2, L->nbias2, h, D, d->eps);
    if (!L->gate) { /* GPT-2: c_fc, GELU */
      hfs_run_prepared(L->up, h, g, L->bup);
      gelu(g, F, d->act);
    } else {
      const prepared_t* ps[2] = {L->gate, L->up};
      float* ys[2] = {g, u};
      const float* bs[2] = {L->bgate, L->bup};
      hfs_run_fused(ps, 2, h, ys, bs);
      silu_mul(g, u, F);
    }
    hfs_run_prepared(L->down, g, o, L->bdown);
    for (int64_t i = 0; i < D; i++) x[i] += o[i];
  }
}

/* The final norm, the LM head and the argmax of the hidden state decode_layers left */
static int64_t decode_head(const hfs_decoder_t* d) {
  float *x = d->work, *h = x + d->hidden;
  norm(x, d->final_norm, d->final_norm_bias, h, d->hidden, d->eps);
  hfs_run_prepared(d->head, h, d->logits, d->head_bias);
  int64_t best = 0;
  for (int64_t i = 1; i < d->vocab; i++)
    if (d->logits[i] > d->logits[best]) best = i;
  return best;
}

/* One decoded token: the next token's id (-1: pos outside the cache) */
int64_t hfs_decode_step(const hfs_decoder_t* d, int64_t token, int64_t pos) {
  if (pos < 0 || pos >= d->max_len) return -1;
  tl_pool_only = 1;
  decode_layers(d, token, pos);
  const int64_t best = decode_head(d);
  tl_pool_only = 0;
  return best;
}

/* A short prompt, one token at a time from `pos` (the cache holds the positions before it): the LM head runs
   for its last token only. Returns the first generated token's id (-1: the prompt does not fit the cache). */
int64_t hfs_decode_prompt(const hfs_decoder_t* d, const int64_t* tokens, int64_t n, int64_t pos) {
  if (n <= 0 || pos < 0 || pos + n > d->max_len) return -1;
  tl_pool_only = 1;
  for (int64_t i = 0; i < n; i++) decode_layers(d, tokens[i], pos + i);
  const int64_t best = decode_head(d);
  tl_pool_only = 0;
  return best;
}

/* ---- The layout of the structs Python mirrors with ctypes (tests/test_struct_mirrors.py compares) -----------
   prepared_t: _native.Prepared; hfs_layer_t, hfs_decoder_t: decoding.py's _Layer, _Decoder. Every field, in
   declaration order. */
typedef struct {
  const char *type, *field;
  int64_t offset, size;
} hfs_field_t;
#define HFS_FIELD(T, F) {#T, #F, (int64_t)offsetof(T, F), (int64_t)sizeof(((T*)0)->F)}
static const hfs_field_t g_fields[] = {
    HFS_FIELD(prepared_t, op), HFS_FIELD(prepared_t, rows), HFS_FIELD(prepared_t, in), HFS_FIELD(prepared_t, chunk),
    HFS_FIELD(prepared_t, nthreads), HFS_FIELD(prepared_t, rowptr), HFS_FIELD(prepared_t, meta),
    HFS_FIELD(prepared_t, v), HFS_FIELD(prepared_t, vbf16),
    HFS_FIELD(hfs_layer_t, q), HFS_FIELD(hfs_layer_t, k), HFS_FIELD(hfs_layer_t, v), HFS_FIELD(hfs_layer_t, o),
    HFS_FIELD(hfs_layer_t, gate), HFS_FIELD(hfs_layer_t, up), HFS_FIELD(hfs_layer_t, down),
    HFS_FIELD(hfs_layer_t, bq), HFS_FIELD(hfs_layer_t, bk), HFS_FIELD(hfs_layer_t, bv), HFS_FIELD(hfs_layer_t, bo),
    HFS_FIELD(hfs_layer_t, bgate), HFS_FIELD(hfs_layer_t, bup), HFS_FIELD(hfs_layer_t, bdown),
    HFS_FIELD(hfs_layer_t, norm1), HFS_FIELD(hfs_layer_t, norm2), HFS_FIELD(hfs_layer_t, kc),
    HFS_FIELD(hfs_layer_t, vc), HFS_FIELD(hfs_layer_t, nbias1), HFS_FIELD(hfs_layer_t, nbias2),
    HFS_FIELD(hfs_layer_t, qnorm), HFS_FIELD(hfs_layer_t, knorm),
    HFS_FIELD(hfs_decoder_t, nlayers), HFS_FIELD(hfs_decoder_t, hidden), HFS_FIELD(hfs_decoder_t, heads),
    HFS_FIELD(hfs_decoder_t, kv_heads), HFS_FIELD(hfs_decoder_t, head_dim), HFS_FIELD(hfs_decoder_t, ffn),
    HFS_FIELD(hfs_decoder_t, max_len), HFS_FIELD(hfs_decoder_t, vocab), HFS_FIELD(hfs_decoder_t, threads),
    HFS_FIELD(hfs_decoder_t, eps), HFS_FIELD(hfs_decoder_t, scale), HFS_FIELD(hfs_decoder_t, layers),
    HFS_FIELD(hfs_decoder_t, head), HFS_FIELD(hfs_decoder_t, head_bias), HFS_FIELD(hfs_decoder_t, final_norm),
    HFS_FIELD(hfs_decoder_t, embed), HFS_FIELD(hfs_decoder_t, cos), HFS_FIELD(hfs_decoder_t, sin),
    HFS_FIELD(hfs_decoder_t, work), HFS_FIELD(hfs_decoder_t, logits), HFS_FIELD(hfs_decoder_t, arch),
    HFS_FIELD(hfs_decoder_t, act), HFS_FIELD(hfs_decoder_t, pos_embed), HFS_FIELD(hfs_decoder_t, final_norm_bias),
};
#undef HFS_FIELD

/* sizeof the struct named `type` (-1: not a mirrored struct) */
int64_t hfs_struct_size(const char* type) {
  if (!strcmp(type, "prepared_t")) return (int64_t)sizeof(prepared_t);
  if (!strcmp(type, "hfs_layer_t")) return (int64_t)sizeof(hfs_layer_t);
  if (!strcmp(type, "hfs_decoder_t")) return (int64_t)sizeof(hfs_decoder_t);
  return -1;
}

/* field i (declaration order) of the struct named `type`: its name, offset and size; 0 past the last */
int hfs_struct_field(const char* type, int i, const char** field, int64_t* offset, int64_t* size) {
  for (size_t k = 0; k < sizeof(g_fields) / sizeof(g_fields[0]); k++) {
    if (strcmp(g_fields[k].type, type)) continue;
    if (i-- > 0) continue;
    *field = g_fields[k].field;
    *offset = g_fields[k].offset;
    *size = g_fields[k].size;
    return 1;
  }
  return 0;
}
