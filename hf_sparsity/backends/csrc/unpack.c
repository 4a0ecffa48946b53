/* Bitmask and 2:4 rows back to dense float32 (restore_dense, prefill through a dense GEMM). */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */

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
VT_DISPATCH(bm_unpack_rows)

/* 2:4 -> dense float32 rows: per group of four columns, zeros and the two values at their positions.
   With AVX2, eight columns per step: the meta byte indexes a table giving, per output lane, which of
   the four values lands there (or -1: zero), one vpermps + blend as in the bitmask expansion (the
   scalar loop made 2:4 prefill 0.3-0.5x dense against the bitmask's 0.8x). */
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
VT_DISPATCH(nm24_unpack_rows)
