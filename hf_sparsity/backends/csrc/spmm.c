/* Batched products (prefill): the blocked sparse x dense kernel of the CSR, bitmask and 2:4 formats. */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */

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
#define SMAXV 8             /* vectors per row of accumulators, at most */
#define SBMAX (SMAXV * VW)  /* rows of x per full block */
#define STILE 8192          /* floats per x tile (32 KB) */
#define SCBMAX 512          /* columns per tile, at most */
#define SRB 32              /* output rows per block */
#define SPMM_MIN_B 17

#if HFS_SIMD

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

/* row r's nonzeros in columns [c0, c1), from its p-th on: their columns - c0 into off; returns how many */
static inline __attribute__((always_inline)) int64_t spmm_offsets_(const job_t* j, int64_t r, int64_t p, int64_t c0,
                                                                   int64_t c1, int32_t* off, const int F) {
  const int64_t mb = (j->in + 7) >> 3;
  const uint8_t* M = (const uint8_t*)j->idx;
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
  return n;
}

/* Rows [rb, re) of y for one x block (b0: its first row, xt: its copy) of NV vectors per row.
   F: 0 CSR with 16-bit indices, 1 CSR with 32-bit, 2 bitmask, 3 2:4 (values [rows, in/2]). */
static inline __attribute__((always_inline)) void spmm_block_(const job_t* j, int64_t rb, int64_t re, int64_t b0,
                                                              const float* xt, float* acc, int32_t* off,
                                                              int64_t* pos, const int NV, const int F,
                                                              const int BF) {
  const int64_t in = j->in, B = j->B, rows = j->rows, wp = NV * VW;
  const int64_t CB = STILE / wp / 16 * 16 < SCBMAX ? STILE / wp / 16 * 16 : SCBMAX;
  const void* const V = vbase(j->v, BF, rows);
  for (int64_t r = rb; r < re; r++) {
    pos[r - rb] = F == 3 ? r * (in >> 1) : j->rowptr[r];
    memset(acc + (r - rb) * wp, 0, wp * sizeof(float));
  }
  for (int64_t c0 = 0; c0 < in; c0 += CB) {
    const int64_t c1 = c0 + CB < in ? c0 + CB : in;
    const float* xc = xt + c0 * wp;
    for (int64_t r = rb; r < re; r++) {
      const int64_t p = pos[r - rb];
      const int64_t n = spmm_offsets_(j, r, p, c0, c1, off, F);
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
