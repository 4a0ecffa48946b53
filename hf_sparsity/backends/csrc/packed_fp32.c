/* Bitmask, 2:4 and dense GEMV row kernels on float32 activations (fp32, bf16 or int8 values). */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */

#if HFS_SIMD
/* batch 1: the dot product of one bitmask row with x over its first ng groups of eight columns (g: the group
   to start from, then the one after the last done; o: the row's value offset, advanced likewise).
   AVX-512: vexpandps (register form) puts sixteen packed values in the lanes of the set bits, zeroing the
   rest; 64 columns per step: one 8-byte mask load, four independent sums, a prefetch per 32 columns (enough for
   every line up to 50% density; the denser rows' other lines come from the hardware prefetcher). The values
   are kept in a register (HFS_REG): gcc folded their load into vexpandps, whose memory form measured slower
   (in cache, 16 columns per step: 0.92-0.97x the time with the register form). Measured (AMD EPYC
   Zen 5 VM, 1 thread, benchmarks/isa_layers.py --threads 1 --values fp32: the time over that of 16 columns per
   step with vexpandps from memory, both with a prefetch per 32 columns 4 KB ahead), out of cache at 70% sparse
   0.77-0.81x, 50% 0.89-0.95x; in cache (--copy-mb 1) 0.73-0.77x at any density. */
static inline __attribute__((always_inline)) float bm_dot1_(const void* V, const uint8_t* m, const float* xb,
                                                            const int64_t ng, int64_t* g_, int64_t* o_,
                                                            const int BF) {
  int64_t g = *g_, o = *o_;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  float z = 0.f;
#if defined(__AVX512F__)
  {
    __m512 z0 = _mm512_setzero_ps(), z1 = _mm512_setzero_ps(), z2 = _mm512_setzero_ps(), z3 = _mm512_setzero_ps();
    for (; g + 8 <= ng; g += 8) {
      uint64_t k;
      memcpy(&k, m + g, 8);
#define BM16(acc, i)                                                                                    \
  do {                                                                                                  \
    const __mmask16 k_ = (__mmask16)(k >> (16 * (i)));                                                   \
    if ((i) % 2 == 0) PREFETCH_FAR((const char*)V + ((o) << (BF == 2 ? 0 : BF ? 1 : 2)));                 \
    __m512 v_ = loadv16_(V, BF, o);                                                                     \
    HFS_REG(v_);                                                                                        \
    acc = _mm512_fmadd_ps(_mm512_maskz_expand_ps(k_, v_), _mm512_loadu_ps(xb + 8 * g + 16 * (i)), acc); \
    o += __builtin_popcount(k_);                                                                        \
  } while (0)
      BM16(z0, 0);
      BM16(z1, 1);
      BM16(z2, 2);
      BM16(z3, 3);
    }
    z0 = _mm512_add_ps(z0, z2);
    z1 = _mm512_add_ps(z1, z3);
    if (g + 4 <= ng) { /* 32 columns */
      uint64_t k = 0;
      memcpy(&k, m + g, 4);
      BM16(z0, 0);
      BM16(z1, 1);
      g += 4;
    }
#undef BM16
    z = _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
  }
#endif
  /* AVX2: 64 columns per step, the mask bytes from one 8-byte load (a load per byte: 1.05-1.07x the time),
     a prefetch per 16 columns as below */
  for (; g + 8 <= ng; g += 8) {
    uint64_t k;
    memcpy(&k, m + g, 8);
    for (int i = 0; i < 8; i += 2) {
      PREFETCH_FAR((const char*)V + ((o) << (BF == 2 ? 0 : BF ? 1 : 2)));
      const uint32_t m0 = (uint32_t)(k >> (8 * i)) & 255, m1 = (uint32_t)(k >> (8 * i + 8)) & 255;
      __m256 w0 = bm_expand(m0, loadv8_(V, BF, o));
      o += __builtin_popcount(m0);
      __m256 w1 = bm_expand(m1, loadv8_(V, BF, o));
      o += __builtin_popcount(m1);
      a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb + 8 * (g + i)), a0);
      a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8 * (g + i) + 8), a1);
    }
  }
  for (; g + 2 <= ng; g += 2) {
    uint32_t m0 = m[g], m1 = m[g + 1];
    PREFETCH_FAR((const char*)V + ((o) << (BF == 2 ? 0 : BF ? 1 : 2)));
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
  *g_ = g;
  *o_ = o;
  return hsum8(_mm256_add_ps(a0, a1)) + z;
}
#endif

static inline __attribute__((always_inline)) void bm_rows_(const job_t* j, int64_t r0, int64_t r1, const int BF) {
  const void* const V = vbase(j->v, BF, j->rows);
  const int64_t in = j->in, mb = (in + 7) >> 3, B = j->B, rows = j->rows;
  const uint8_t* M = (const uint8_t*)j->idx;
  const float* x = j->x;
  if (B == 1 && r0 < r1) { /* the chunk's first values and masks, short of the prefetches' distance */
    prefetch_span((const char*)V + (j->rowptr[r0] << (BF == 2 ? 0 : BF ? 1 : 2)), PF_FAR_BYTES);
    prefetch_span(M + r0 * mb, 512);
  }
  for (int64_t r = r0; r < r1; r++) {
    const uint8_t* m = M + r * mb;
    for (int64_t b0 = 0; b0 < B; b0 += 4) {
      const int64_t nb = B - b0 < 4 ? B - b0 : 4;
      int64_t o = j->rowptr[r], g = 0;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#if HFS_SIMD
      const int64_t ng = in >> 3;
      if (nb == 1) {
        s[0] = bm_dot1_(V, m, x + b0 * in, ng, &g, &o, BF);
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
VT_DISPATCH(bm_rows)

/* ---- The gathered bitmask (op 5): the batch-1 product of a bitmask weight by its kept values ---------------
   On AVX2 the bitmask product above costs the same per eight columns at any density (one lane expansion per
   mask byte), so from about 60% sparsity on a product of x gathered by chunks costs less: per row, its kept
   values in order cut into chunks of at most eight that lie within sixteen columns, each chunk one uint64:
   bits 0-31 the column of value i (i < 8) as a 4-bit offset from the chunk's first column (nibble i), bits
   32-55 that first column (at most in - 16: the two 8-column loads of x stay inside the row), bits 56-63 the
   number n of values (1..8). Per chunk: x[base .. base + 16) as two vectors, lane i of the product vector
   x[base + nibble i] (two vpermps and a blend on bit 3 of the nibble), the n values (lanes past n zeroed), one
   FMA: the work follows the kept values, not the columns. The chunks are made from the mask (hfs_bm_gather,
   when the weight is packed; nothing of them is saved) and `meta` holds int64 chunk offsets [rows + 1] then the
   chunks; the values and their row offsets are the bitmask's own. Measured (benchmarks/isa_layers.py --gather
   --threads 1: an AVX2 build on an AMD EPYC Zen 5 VM, random masks, out of cache; the bitmask kernel's time
   over this one's): 70% sparse 1.25x, 60% 1.07-1.1x, 50% 0.96-0.97x (so the layout is kept where its chunks
   are few: GATHER_CHUNK_GROUPS in formats/bitmask.py). */
#define BMG_BASE(c) ((int64_t)(((c) >> 32) & 0xffffff))
#define BMG_N(c) ((int64_t)((c) >> 56))
static inline __attribute__((always_inline)) void bmg_rows_(const job_t* j, int64_t r0, int64_t r1, const int BF) {
  const void* const V = vbase(j->v, BF, j->rows);
  const int64_t in = j->in, B = j->B, rows = j->rows;
  const int64_t* cp = (const int64_t*)j->idx;
  const uint64_t* ch = (const uint64_t*)(cp + rows + 1);
  if (r0 < r1) { /* the chunk's first values and chunks, short of the prefetches' distance */
    prefetch_span((const char*)V + (j->rowptr[r0] << (BF == 2 ? 0 : BF ? 1 : 2)), PF_FAR_BYTES);
    prefetch_span(ch + cp[r0], PF_FAR_BYTES);
  }
  for (int64_t r = r0; r < r1; r++) {
    for (int64_t b = 0; b < B; b++) {
      const float* xb = j->x + b * in;
      int64_t o = j->rowptr[r], k = cp[r];
      const int64_t e = cp[r + 1];
      float s = 0.f;
#if HFS_SIMD
      const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
#define BMG_CHUNK(acc, c)                                                                                       \
  do {                                                                                                          \
    const __m256i l_ = _mm256_srlv_epi32(_mm256_set1_epi32((int)(uint32_t)(c)), sh);                           \
    const float* x_ = xb + BMG_BASE(c);                                                                         \
    const __m256 g_ = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(x_), l_),                       \
                                       _mm256_permutevar8x32_ps(_mm256_loadu_ps(x_ + 8), l_),                   \
                                       _mm256_castsi256_ps(_mm256_slli_epi32(l_, 28)));                         \
    const __m256 w_ = _mm256_and_ps(loadv8_(V, BF, o), _mm256_load_ps((const float*)g_bmg_tail[BMG_N(c)]));    \
    acc = _mm256_fmadd_ps(w_, g_, acc);                                                                         \
    o += BMG_N(c);                                                                                              \
  } while (0)
      for (; k + 2 <= e; k += 2) {
        const uint64_t c0 = ch[k], c1 = ch[k + 1];
        PREFETCH_FAR((const char*)V + ((o) << (BF == 2 ? 0 : BF ? 1 : 2)));
        PREFETCH_FAR(ch + k);
        BMG_CHUNK(a0, c0);
        BMG_CHUNK(a1, c1);
      }
      if (k < e) {
        const uint64_t c0 = ch[k++];
        BMG_CHUNK(a0, c0);
      }
#undef BMG_CHUNK
      s = hsum8(_mm256_add_ps(a0, a1));
#endif
      for (; k < e; k++) { /* scalar: every chunk without AVX2 */
        const uint64_t c = ch[k];
        for (int64_t i = 0; i < BMG_N(c); i++) s += VALB(V, BF, o + i) * xb[BMG_BASE(c) + (int64_t)((c >> (4 * i)) & 15)];
        o += BMG_N(c);
      }
      const float sc = vscale(j->v, BF, r);
      j->y[b * rows + r] = j->bias ? s * sc + j->bias[r] : s * sc;
    }
  }
}
VT_DISPATCH(bmg_rows)

/* The chunks of op 5 from a bitmask [rows, ceil(in / 8)]: cp[r] the first chunk of row r (cp[rows]: the count);
   ch (NULL: count only) the chunks, each greedily the next kept column and the kept ones after it within
   sixteen columns, at most eight. Returns the number of chunks, or -1 where in < 16 or in >= 2^24. */
static int64_t bm_gather(int64_t rows, int64_t in, const uint8_t* bits, int64_t* cp, uint64_t* ch) {
  if (in < 16 || in >= (1 << 24)) return -1;
  const int64_t mb = (in + 7) >> 3;
  int64_t n = 0;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t* m = bits + r * mb;
    cp[r] = n;
    int64_t c = 0;
    for (;;) {
      while (c < in && !(m[c >> 3] >> (c & 7) & 1)) c++;
      if (c >= in) break;
      const int64_t base = c < in - 16 ? c : in - 16;
      uint64_t lanes = 0, k = 0;
      for (; c < in && c < base + 16 && k < 8; c++)
        if (m[c >> 3] >> (c & 7) & 1) lanes |= (uint64_t)(c - base) << (4 * k++);
      if (ch) ch[n] = lanes | (uint64_t)base << 32 | k << 56;
      n++;
    }
  }
  cp[rows] = n;
  return n;
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
VT_DISPATCH(nm24_rows)

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
VT_DISPATCH(gemv_rows)
