/* The packed formats' layout and what their kernels share: the value types (float32, bfloat16, int8 with
   per-row scales) and their loads, the bitmask lane expansion (the tables: tables.h). */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */
#ifndef HFS_PACKED_H
#define HFS_PACKED_H

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
/* name(job, r0, r1): name_ (an always-inline kernel taking the value type as a constant) compiled once per
   value type, picked by the job's */
#define VT_DISPATCH(name)                                                                               \
  static void name(const job_t* j, int64_t r0, int64_t r1) {                                            \
    if (j->vbf16 == 2)                                                                                  \
      name##_(j, r0, r1, 2);                                                                            \
    else if (j->vbf16)                                                                                  \
      name##_(j, r0, r1, 1);                                                                            \
    else                                                                                                \
      name##_(j, r0, r1, 0);                                                                            \
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
/* lane i of the result: vals[lanes[i]], or 0 where lanes[i] is -1 (the bitmask and 2:4 expansions) */
static inline __m256 expand_lanes(const int32_t* lanes, __m256 vals) {
  __m256i t = _mm256_load_si256((const __m256i*)lanes);
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(vals, t), _mm256_setzero_ps(), _mm256_castsi256_ps(t));
}
static inline __m256 bm_expand(uint32_t b, __m256 vals) { return expand_lanes(g_bm_lanes[b], vals); }
#endif

#endif
