/* Native CPU kernels of hf_sparsity (see hf_sparsity/backends/_native.py). C11 + pthreads, no torch headers. */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
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
     vbf16: values are bfloat16 bit patterns (uint16) instead of float32 */
  void (*fn)(const job_t*, int64_t, int64_t);
  int64_t in;
  int vbf16;
};

/* ---- Bitmask, 2:4 and dense GEMV kernels (x: [B, in] row-major, y: [B, rows]) -----------
   Bitmask: per row ceil(in/8) mask bytes (bit i of byte g = column 8g+i kept) and the row's
   kept values packed in column order from rowptr[r] (values array padded by 16 at the end).
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
#define VALB(v, bf, k) ((bf) ? bf16f(((const uint16_t*)(v))[k]) : ((const float*)(v))[k])
#define VAL(j, k) ((j)->vbf16 ? bf16f(((const uint16_t*)(j)->v)[k]) : ((const float*)(j)->v)[k])

#if HFS_SIMD
static inline __attribute__((always_inline)) __m256 loadv8_(const void* v, int bf, int64_t k) {
  if (bf)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)v + k))), 16));
  return _mm256_loadu_ps((const float*)v + k);
}
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 loadv16_(const void* v, int bf, int64_t k) {
  if (bf)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)v + k))), 16));
  return _mm512_loadu_ps((const float*)v + k);
}
#endif
static inline __m256 loadv8(const job_t* j, int64_t k) {
  if (j->vbf16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)j->v + k))), 16));
  return _mm256_loadu_ps((const float*)j->v + k);
}
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
  const void* const V = j->v;
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
            PREFETCH((const char*)V + (o << (BF ? 1 : 2)));
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
          PREFETCH((const char*)V + (o << (BF ? 1 : 2)));
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
      for (int64_t k = 0; k < nb; k++)
        j->y[(b0 + k) * rows + r] = j->bias ? s[k] + j->bias[r] : s[k];
    }
  }
}
static void bm_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16)
    bm_rows_(j, r0, r1, 1);
  else
    bm_rows_(j, r0, r1, 0);
}

static inline __attribute__((always_inline)) void nm24_rows_(const job_t* j, int64_t r0, int64_t r1, const int BF) {
  const void* const V = j->v;
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
          PREFETCH((const char*)V + ((vo + c / 2) << (BF ? 1 : 2)));
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
      for (int64_t k = 0; k < nb; k++) j->y[(b0 + k) * rows + r] = j->bias ? s[k] + j->bias[r] : s[k];
    }
  }
}
static void nm24_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16)
    nm24_rows_(j, r0, r1, 1);
  else
    nm24_rows_(j, r0, r1, 0);
}

/* Dense y = x W^T: W [rows, in] float32 (or bf16 bits). For the LM head: torch's fp32 GEMV may run on
   one thread; this one splits rows over the pool. */
static inline __attribute__((always_inline)) void gemv_rows_(const job_t* j, int64_t r0, int64_t r1, const int BF) {
  const void* const V = j->v;
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
      j->y[b * rows + r] = j->bias ? s + j->bias[r] : s;
    }
  }
}
static void gemv_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16)
    gemv_rows_(j, r0, r1, 1);
  else
    gemv_rows_(j, r0, r1, 0);
}

/* Bitmask -> dense float32 rows (restore_dense, prefill through a dense GEMM). Per eight columns
   (sixteen with AVX-512) the packed values are expanded into the lanes of the set bits, as in the
   batch-1 kernel, and stored; the row's scalar tail after. */
static inline __attribute__((always_inline)) void bm_unpack_rows_(const job_t* j, int64_t r0, int64_t r1,
                                                                  const int BF) {
  const void* const V = j->v;
  const int64_t in = j->in, mb = (in + 7) >> 3;
  const uint8_t* M = (const uint8_t*)j->idx;
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * mb;
    float* out = j->y + r * in;
    int64_t o = j->rowptr[r], c = 0;
#if HFS_SIMD
#if defined(__AVX512F__)
    for (; c + 16 <= in; c += 16) {
      uint16_t k;
      memcpy(&k, m + (c >> 3), 2);
      _mm512_storeu_ps(out + c, _mm512_maskz_expand_ps(k, loadv16_(V, BF, o)));
      o += __builtin_popcount(k);
    }
#endif
    for (; c + 8 <= in; c += 8) {
      const uint32_t b = m[c >> 3];
      _mm256_storeu_ps(out + c, bm_expand(b, loadv8_(V, BF, o)));
      o += __builtin_popcount(b);
    }
#endif
    for (; c < in; c++) {
      if (m[c >> 3] >> (c & 7) & 1) {
        out[c] = VALB(V, BF, o);
        o++;
      } else {
        out[c] = 0.f;
      }
    }
  }
}
static void bm_unpack_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16)
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
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * ((in + 7) >> 3);
    float* out = j->y + r * in;
    const int64_t vo = r * half;
    int64_t c = 0;
#if HFS_SIMD
    for (; c + 8 <= in; c += 8) {
      const __m256 vals = loadv8_(j->v, BF, vo + c / 2); /* lanes 0-3 used; the values array is padded */
      _mm256_storeu_ps(out + c, expand_lanes(g_nm_inv[m[c >> 3]], vals));
    }
#endif
    for (; c < in; c += 4) {
      const uint32_t bits = (uint32_t)(m[c >> 3] >> ((c & 4) ? 4 : 0)) & 15u;
      float g[4] = {0.f, 0.f, 0.f, 0.f};
      g[bits & 3] = VALB(j->v, BF, vo + c / 2);
      g[bits >> 2] = VALB(j->v, BF, vo + c / 2 + 1); /* the two positions differ (padding included) */
      memcpy(out + c, g, sizeof g);
    }
  }
}
static void nm24_unpack_rows(const job_t* j, int64_t r0, int64_t r1) {
  if (j->vbf16)
    nm24_unpack_rows_(j, r0, r1, 1);
  else
    nm24_unpack_rows_(j, r0, r1, 0);
}

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
    job_t j = g_job; /* consistent whenever a claim for `tag` succeeds (see above) */
    if (id < j.active) work(tag, &j);
  }
  return NULL;
}

#if defined(_OPENMP)
/* Built with -fopenmp: the chunks run on OpenMP's team. Loaded after torch, this library resolves
   libgomp.so.1 to the copy torch already loaded, so the team is torch's own intra-op pool: the
   threads that just ran a torch op (and still spin, libgomp's default) pick up the sparse layer,
   instead of a second pool fighting them for the same cores. Chunks are claimed dynamically. */
static int g_use_omp = 1;
static void run_omp(job_t* j, int nthreads) {
  _Atomic int64_t next = 0;
  const job_t* jj = j;
#pragma omp parallel num_threads(nthreads)
  {
    int64_t c;
    while ((c = atomic_fetch_add(&next, 1)) < jj->nchunks) run_chunk(jj, c);
  }
}
#else
static int g_use_omp = 0;
static void run_omp(job_t* j, int nthreads) { (void)j; (void)nthreads; }
#endif

static void run(job_t* j, int nthreads) {
  if (j->rows <= 0) return;
  j->nchunks = (j->rows + j->chunk - 1) / j->chunk;
  if (g_use_omp && nthreads > 1 && j->nchunks > 1) {
    run_omp(j, nthreads);
    return;
  }
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
  job_t j = {kind, 0, rows, chunk, 0, B, rowptr, idx, v, x, y, bias, NULL, 0, 0};
  run(&j, nthreads);
}

/* op: 0 bitmask, 1 2:4, 2 dense GEMV, 3 bitmask unpack, 4 2:4 unpack (y: [rows, in]).
   x: [B, in]; y: [B, rows]. */
void hfs_run(int op, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
             const void* meta, const void* v, int vbf16, const float* x, float* y, int64_t B,
             const float* bias) {
  static void (*const fns[5])(const job_t*, int64_t, int64_t) = {bm_rows, nm24_rows, gemv_rows, bm_unpack_rows,
                                                                 nm24_unpack_rows};
  if (op < 0 || op > 4) return;
  job_t j = {0, 0, rows, chunk, 0, B, rowptr, meta, (const float*)v, x, y, bias, fns[op], in, vbf16};
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
    hfs_matmul((int)p->op - 16, p->rows, p->chunk, (int)p->nthreads, p->rowptr, p->meta, (const float*)p->v, x, y,
               1, bias);
    return;
  }
  hfs_run((int)p->op, p->rows, p->in, p->chunk, (int)p->nthreads, p->rowptr, p->meta, p->v, (int)p->vbf16, x, y,
          1, bias);
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
int hfs_version(void) { return 6; }
int hfs_simd(void) { return HFS_SIMD; }
/* 0 scalar, 1 AVX2 + FMA, 2 AVX-512 (the bitmask expand and CSR gather paths) */
int hfs_isa(void) {
#if HFS_SIMD && defined(__AVX512F__)
  return 2;
#else
  return HFS_SIMD;
#endif
}
