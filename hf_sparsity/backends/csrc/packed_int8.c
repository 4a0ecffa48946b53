/* Products with int8 activations (value type 3): the activations' quantization and, with AVX-512 VNNI,
   the int8 x int8 bitmask / 2:4 / dense GEMV row kernels. */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */

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
   sum(w * q). Without AVX-512 VNNI (or VBMI2, for bitmask and 2:4) the 256-bit kernels of packed_int8_avx2.c
   take the same groups. Every other case (more rows, the scalar build) runs the value type 2 kernels on the
   dequantized activations q * s: the same sum up to float32 rounding. */
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

#if HFS_SIMD
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
#endif

#if HFS_VNNI
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

/* dense: one software prefetch per 64 codes, PF_FAR_BYTES ahead (and the chunk's first PF_FAR_BYTES). Measured
   in SmolLM2-135M's int8 decoding step on a 2-core Xeon VM (AVX-512 VNNI), against the bitmask kernel at full
   density as the yardstick (interleaved 32-token segments, medians): the GEMV went from 0.88x to 1.08x the
   bitmask's tok/s (109 -> 146 tok/s), and gemv_q8v_rows (AVX2) from 1.19x to 1.57x (95 -> 124 tok/s). */
static void gemv_q8_rows(const job_t* j, int64_t r0, int64_t r1) {
  Q8_SETUP;
  if (r0 < r1) prefetch_span(V + r0 * in, PF_FAR_BYTES);
  for (int64_t r = r0; r < r1; r++) {
    const int8_t* w = V + r * in;
    Q8_START;
    int64_t b = 0;
    for (; b + 2 <= full; b += 2) {
      PREFETCH_FAR(w + b * QB);
      PREFETCH_FAR(w + b * QB + QB);
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
  PREFETCH_FAR(v + *o);
  /* a whole 64-byte load: the expand takes the first pc bytes only (the values are padded by 64 bytes, see
     formats.BitmaskBackend); a load masked to pc bytes cost ~5% of the int8 decoding step */
  const __m512i w = expand_epi8_z(k, v + *o);
  *o += pc;
  return w;
}
#define PAIR_BLOCKS 16 /* rows of up to 1024 columns run two at a time */
static void bm_q8_rows(const job_t* j, int64_t r0, int64_t r1) {
  Q8_SETUP;
  const int64_t mb = (in + 7) >> 3;
  const uint8_t* M = (const uint8_t*)j->idx;
  int64_t r = r0;
  /* the chunk's first values and masks, which the prefetches PF_FAR_BYTES ahead do not reach (measured with a
     4 KB distance, 1 thread, out of cache: 0.95-0.97x the time at 25% sparse) */
  if (r0 < r1) {
    prefetch_span(V + j->rowptr[r0], PF_FAR_BYTES);
    prefetch_span(M + r0 * mb, 512);
  }
  /* short rows two at a time: two independent offset chains (popcount -> load -> expand) in flight, and
     one reduction for both rows' sums. Measured on a 2-vCPU EPYC (Zen 4), 2 threads, out of cache: 576
     columns (9 blocks) 24 -> 28 GB/s, 1536 x 576 29 -> 35; rows of 1536 columns gained nothing, and
     8192 x 1536 fell from 42 to 26 GB/s, so longer rows stay one at a time. */
  for (; nb <= PAIR_BLOCKS && r + 2 <= r1; r += 2) {
    const uint8_t *m = M + r * mb, *n = m + mb;
    for (int64_t i = 0; i < 2 * mb; i += 64) /* the pair's mask lines, 1 KB ahead (0.95-0.97x the time) */
      __builtin_prefetch(m + i + 1024, 0, 3);
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
#endif
