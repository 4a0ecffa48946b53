/* Products with int8 activations (value type 3) on 256-bit vectors: the bitmask / 2:4 / dense GEMV row kernels
   of an AVX2 CPU without AVX-512 VNNI (and the bitmask / 2:4 ones of an AVX-512 VNNI CPU without VBMI2; marked unused
   for the builds whose 512-bit kernels take every format). */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */

/* The activations are quantized as for the 512-bit kernels (quantize_row: the same groups, the same buffer).
   Lane l of a 256-bit int32 accumulator sums columns 4l..4l+3 of its 32, so with four accumulators (a0, a1 for
   the first and last 32 columns of an even 64-column block, a2, a3 for an odd one) lane l of accumulator i sums
   exactly group 8i + l: the scales still apply once per row. The byte products:
   - vpdpbusd (HFS_DPBUSD256: AVX-VNNI): unsigned by signed bytes into int32 lanes. The weight codes are made
     unsigned by flipping their sign bit (w + 128) and the accumulators start at -128 times each group's code
     sum (quantize_row's correction), as in the 512-bit kernels.
   - else vpmaddubsw + vpmaddwd (as llama.cpp's AVX2 Q8_0 dot product): vpmaddubsw multiplies unsigned by signed
     bytes and SATURATES each pair sum to int16, so it is given |w| and q carrying w's sign (vpsignb): every
     product is w * q, at most 127 * 127 in size (codes are in [-127, 127]), a pair at most 32258 < 32767: the
     int32 sums are exact. */
#if HFS_Q8V
#if HFS_DPBUSD256
#define Q8V_CORR 1
static inline __attribute__((always_inline)) __m256i q8v_dot(__m256i acc, __m256i w, const int8_t* q) {
  return DPBUSD256(acc, _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)), _mm256_load_si256((const __m256i*)q));
}
#else
#define Q8V_CORR 0
static inline __attribute__((always_inline)) __m256i q8v_dot(__m256i acc, __m256i w, const int8_t* q) {
  const __m256i p =
      _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_load_si256((const __m256i*)q), w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

/* 16 columns of mask bits k (two bytes): the k-th set bit's byte gets v[k], the others 0: one vpshufb, its
   control the byte sum of two 16-byte table rows (g_bm_c0 / g_bm_c1, tables.h: two loads and an add). Measured
   on an AVX2 build (times over this one's): one 8-byte row per byte, the second indexed by the first byte's
   popcount (the index arithmetic: 1.09-1.16x); a 1 MiB table of all 65536 two-byte controls (L2 misses:
   1.13-1.5x at 50%); the two 16-column halves as one 256-bit vpshufb (1.01-1.03x). */
static inline __attribute__((always_inline)) __m128i expand16(uint32_t k, const int8_t* v) {
  const __m128i c = _mm_add_epi8(_mm_load_si128((const __m128i*)g_bm_c0[k & 255]),
                                 _mm_load_si128((const __m128i*)g_bm_c1[(k >> 8) & 255]));
  return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)v), c);
}
/* 32 columns: two 16-column expansions, the second from the values after the first's */
static inline __attribute__((always_inline)) __m256i expand32(uint32_t k, const int8_t* v) {
  const __m128i lo = expand16(k, v), hi = expand16(k >> 16, v + __builtin_popcount(k & 0xffff));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* quantize_row without the dequantized copy, eight columns per instruction (the same codes: IEEE division and
   round half to even, as nearbyintf). Float lane j of the i-th eight columns of a block is group 2 * i + j / 4
   of the block's sixteen. */
__attribute__((unused)) static void quantize_row_avx2(const float* x, int64_t in, float* buf) {
  const int64_t nb = (in + QB - 1) / QB;
  int32_t* corr = (int32_t*)(buf + QG);
  int8_t* q = (int8_t*)(buf + 2 * QG);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx[QA][8];
  for (int a = 0; a < QA; a++)
    for (int i = 0; i < 8; i++) mx[a][i] = _mm256_setzero_ps();
#define QV_LOAD(b, i)                                                                                             \
  (in - (b) * QB - 8 * (i) >= 8  ? _mm256_loadu_ps(x + (b) * QB + 8 * (i))                                       \
   : in - (b) * QB - 8 * (i) > 0 ? _mm256_maskload_ps(x + (b) * QB + 8 * (i),                                    \
                                                      _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(in - (b) * QB - 8 * (i))), \
                                                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))) \
                                 : _mm256_setzero_ps())
  for (int64_t b = 0; b < nb; b++)
    for (int i = 0; i < 8; i++) mx[b % QA][i] = _mm256_max_ps(mx[b % QA][i], _mm256_andnot_ps(sign, QV_LOAD(b, i)));
  __m256 div[QA][8]; /* per float lane: its group's scale, 1 where the scale is 0 (then x is 0 there) */
  for (int a = 0; a < QA; a++)
    for (int i = 0; i < 8; i++) {
      float t[8];
      _mm256_storeu_ps(t, mx[a][i]);
      for (int h = 0; h < 2; h++) {
        const float g = fmaxf(fmaxf(t[4 * h], t[4 * h + 1]), fmaxf(t[4 * h + 2], t[4 * h + 3]));
        buf[a * 16 + 2 * i + h] = g / 127.f;
      }
      const float s0 = buf[a * 16 + 2 * i] > 0.f ? buf[a * 16 + 2 * i] : 1.f;
      const float s1 = buf[a * 16 + 2 * i + 1] > 0.f ? buf[a * 16 + 2 * i + 1] : 1.f;
      div[a][i] = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
    }
  __m256i sums[2 * QA]; /* per accumulator of the 256-bit kernels: each group's code sum */
  for (int a = 0; a < 2 * QA; a++) sums[a] = _mm256_setzero_si256();
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; b++)
    for (int h = 0; h < 2; h++) { /* 32 columns: four vectors of eight codes -> 32 bytes in column order */
      __m256i c[4];
      for (int i = 0; i < 4; i++) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_div_ps(QV_LOAD(b, 4 * h + i), div[b % QA][4 * h + i]));
        c[i] = _mm256_max_epi32(_mm256_min_epi32(v, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
      }
      const __m256i codes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), order);
      _mm256_store_si256((__m256i*)(q + b * QB + 32 * h), codes);
      const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), codes), _mm256_set1_epi16(1));
      sums[(b % QA) * 2 + h] = _mm256_add_epi32(sums[(b % QA) * 2 + h], s4);
    }
#undef QV_LOAD
  for (int a = 0; a < 2 * QA; a++)
    _mm256_store_si256((__m256i*)(corr + 8 * a), _mm256_mullo_epi32(sums[a], _mm256_set1_epi32(-128)));
}

#define Q8V_SETUP                                                                                  \
  const int64_t in = j->in, nb = (in + QB - 1) / QB;                                            \
  const float* xs = j->work;                                                                    \
  const int8_t* q = (const int8_t*)(j->work + 2 * QG);                                          \
  const int8_t* V = (const int8_t*)vbase(j->v, 2, j->rows)
/* the four accumulators (named registers), from quantize_row's correction or 0 */
#if Q8V_CORR
#define Q8V_START                                                                                  \
  const int32_t* corr_ = (const int32_t*)(j->work + QG);                                        \
  __m256i a0 = _mm256_load_si256((const __m256i*)corr_), a1 = _mm256_load_si256((const __m256i*)(corr_ + 8)), \
          a2 = _mm256_load_si256((const __m256i*)(corr_ + 16)), a3 = _mm256_load_si256((const __m256i*)(corr_ + 24))
#else
#define Q8V_START                                                                                  \
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0
#endif
/* block b's two 32-column weight vectors into their accumulators */
#define Q8V_ACC(b, w0, w1, qb)                                                                     \
  do {                                                                                             \
    if ((b) & 1) {                                                                                 \
      a2 = q8v_dot(a2, w0, qb);                                                                    \
      a3 = q8v_dot(a3, w1, (qb) + 32);                                                             \
    } else {                                                                                       \
      a0 = q8v_dot(a0, w0, qb);                                                                    \
      a1 = q8v_dot(a1, w1, (qb) + 32);                                                             \
    }                                                                                              \
  } while (0)
/* row r: each group's sum times its scale, times the row's scale (+ bias) */
#define Q8V_STORE(r)                                                                               \
  do {                                                                                             \
    __m256 f_ = _mm256_mul_ps(_mm256_cvtepi32_ps(a0), _mm256_load_ps(xs));                        \
    f_ = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), _mm256_load_ps(xs + 8), f_);                     \
    f_ = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a2), _mm256_load_ps(xs + 16), f_);                    \
    f_ = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a3), _mm256_load_ps(xs + 24), f_);                    \
    const float s_ = hsum8(f_) * vscale(j->v, 2, r);                                              \
    j->y[r] = j->bias ? s_ + j->bias[r] : s_;                                                     \
  } while (0)

/* dense: whole 32-byte loads up to the last block (codes past `in` meet activation codes 0; the values are
   padded by 64 bytes, see formats.NativeDenseBackend); prefetched as gemv_q8_rows */
__attribute__((unused)) static void gemv_q8v_rows(const job_t* j, int64_t r0, int64_t r1) {
  Q8V_SETUP;
  if (r0 < r1) prefetch_span(V + r0 * in, PF_FAR_BYTES);
  for (int64_t r = r0; r < r1; r++) {
    const int8_t* w = V + r * in;
    Q8V_START;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      const int8_t* wb = w + b * QB;
      PREFETCH_FAR(wb);
      PREFETCH_FAR(wb + QB);
      a0 = q8v_dot(a0, _mm256_loadu_si256((const __m256i*)wb), q + b * QB);
      a1 = q8v_dot(a1, _mm256_loadu_si256((const __m256i*)(wb + 32)), q + b * QB + 32);
      a2 = q8v_dot(a2, _mm256_loadu_si256((const __m256i*)(wb + 64)), q + b * QB + 64);
      a3 = q8v_dot(a3, _mm256_loadu_si256((const __m256i*)(wb + 96)), q + b * QB + 96);
    }
    if (b < nb)
      Q8V_ACC(b, _mm256_loadu_si256((const __m256i*)(w + b * QB)),
              _mm256_loadu_si256((const __m256i*)(w + b * QB + 32)), q + b * QB);
    Q8V_STORE(r);
  }
}

/* one 64-column block of mask bits k: its codes from V + o expanded into the accumulators of parity p */
#define BM_Q8V_BLOCK(p, b, k)                                                                      \
  do {                                                                                             \
    PREFETCH(V + o);                                                                               \
    const int8_t* v_ = V + o;                                                                      \
    const __m256i w0_ = expand32((uint32_t)(k), v_),                                               \
                  w1_ = expand32((uint32_t)((k) >> 32), v_ + __builtin_popcount((uint32_t)(k)));   \
    o += __builtin_popcountll(k);                                                                  \
    Q8V_ACC(p, w0_, w1_, q + (b) * QB);                                                            \
  } while (0)
/* bitmask: per 64-column block its eight mask bytes (fewer in the last), the codes expanded by vpshufb. The
   offset chain costs one popcount per 64 columns; the values are padded by 64 bytes (16-byte loads). Two blocks
   per step (even, odd: their accumulators fixed, no branch), the short last block after the loop. */
__attribute__((unused)) static void bm_q8v_rows(const job_t* j, int64_t r0, int64_t r1) {
  Q8V_SETUP;
  const int64_t mb = (in + 7) >> 3;
  const int64_t nf = mb / 8 < nb ? mb / 8 : nb; /* the blocks with eight mask bytes */
  const uint8_t* M = (const uint8_t*)j->idx;
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * mb;
    int64_t o = j->rowptr[r];
    Q8V_START;
    int64_t b = 0;
    for (; b + 2 <= nf; b += 2) {
      uint64_t k0, k1;
      memcpy(&k0, m + 8 * b, 8);
      memcpy(&k1, m + 8 * b + 8, 8);
      BM_Q8V_BLOCK(0, b, k0);
      BM_Q8V_BLOCK(1, b + 1, k1);
    }
    if (b < nf) { /* an odd count of whole blocks: the last whole one */
      uint64_t k;
      memcpy(&k, m + 8 * b, 8);
      BM_Q8V_BLOCK(b, b, k);
      b++;
    }
    if (b < nb) { /* the last block's mask bytes (fewer than eight): the bits past `in` are clear */
      uint64_t k = 0;
      memcpy(&k, m + 8 * b, (size_t)(mb - 8 * b));
      BM_Q8V_BLOCK(b, b, k);
    }
    Q8V_STORE(r);
  }
}

/* 2:4: a block's meta bytes -> its columns' kept bits (nm24_bits, packed_int8.c), then the bitmask expansion of
   the block's 32 codes (16 per 32 columns). The last block's codes are copied out: the values are padded by 8
   bytes only. */
__attribute__((unused)) static void nm24_q8v_rows(const job_t* j, int64_t r0, int64_t r1) {
  Q8V_SETUP;
  const int64_t mb = (in + 7) >> 3, half = in >> 1;
  const uint8_t* M = (const uint8_t*)j->idx;
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * mb;
    const int8_t* v = V + r * half;
    Q8V_START;
    for (int64_t b = 0; b < nb; b++) {
      const int64_t cols = in - b * QB < QB ? in - b * QB : QB; /* a multiple of 4 */
      uint64_t k = nm24_bits(m + 8 * b, (cols + 7) >> 3);
      const int8_t* vb = v + b * (QB / 2);
      int8_t tail[QB / 2 + 16];
      if (cols < QB) {
        k &= (1ULL << cols) - 1; /* a padded last nibble sets no column */
        memset(tail, 0, sizeof tail);
        memcpy(tail, vb, (size_t)(cols / 2));
        vb = tail;
      }
      PREFETCH(vb);
      Q8V_ACC(b, expand32((uint32_t)k, vb), expand32((uint32_t)(k >> 32), vb + QB / 4), q + b * QB);
    }
    Q8V_STORE(r);
  }
}
#endif
