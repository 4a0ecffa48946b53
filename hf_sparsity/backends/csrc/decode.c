/* The decoding step (hf_sparsity/inference/native_step.py, NativeDecoder): one call per token, apart from the kernels. */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */

/* ---- One decoded token of a Llama-family or GPT-2 model in one call (hf_sparsity/inference/native_step.py, NativeDecoder) --
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
/* hfs_layer_t and hfs_decoder_t: api.h */

int64_t hfs_decode_work_floats(const hfs_decoder_t* d) {
  return 4 * d->hidden + 2 * d->heads * d->head_dim + 2 * d->kv_heads * d->head_dim + 2 * d->ffn +
         d->heads * d->max_len;
}

#if HFS_VEXP
/* Cephes' expf up to its last step, on W-bit vectors (W: 512 or 256; ROUND: that width's round to nearest):
   x clamped to [-88.38, 88.38] (a NaN stays NaN: the constant is min's and max's first operand), n = round(x /
   ln 2), r = x - n ln 2 (ln 2 in two parts), p = e^r by a degree-5 polynomial (~1 ulp); e^x = p * 2^n. */
#define EXP_POLY(W, ROUND, x, n, p)                                                                           \
  do {                                                                                                          \
    x = _mm##W##_max_ps(_mm##W##_set1_ps(-88.3762626647949f),                                                 \
                        _mm##W##_min_ps(_mm##W##_set1_ps(88.3762626647949f), x));                               \
    n = ROUND(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)),                                       \
              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                                   \
    __m##W r_ = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693359375f), x);                                     \
    r_ = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(-2.12194440e-4f), r_);                                        \
    p = _mm##W##_fmadd_ps(_mm##W##_set1_ps(1.9875691500E-4f), r_, _mm##W##_set1_ps(1.3981999507E-3f));       \
    p = _mm##W##_fmadd_ps(p, r_, _mm##W##_set1_ps(8.3334519073E-3f));                                         \
    p = _mm##W##_fmadd_ps(p, r_, _mm##W##_set1_ps(4.1665795894E-2f));                                         \
    p = _mm##W##_fmadd_ps(p, r_, _mm##W##_set1_ps(1.6666665459E-1f));                                         \
    p = _mm##W##_fmadd_ps(p, r_, _mm##W##_set1_ps(5.0000001201E-1f));                                         \
    p = _mm##W##_fmadd_ps(p, _mm##W##_mul_ps(r_, r_), _mm##W##_add_ps(r_, _mm##W##_set1_ps(1.0f)));           \
  } while (0)
#endif

#if HFS_VEXP == 16
/* e^x for 16 floats (EXP_POLY, then vscalefps). Used by the SiLU and the attention's softmax. */
static inline __m512 exp16(__m512 x) {
  __m512 n, p;
  EXP_POLY(512, _mm512_roundscale_ps, x, n, p);
  return _mm512_scalef_ps(p, n);
}
#elif HFS_VEXP == 8
/* e^x for 8 floats (AVX2 + FMA; EXP_POLY): 2^n (n in [-128, 128]) from the exponent bits in two halves,
   2^(n >> 1) * 2^(n - (n >> 1)), each a normal float, so that e^88.38 = p * 2^128 does not overflow and
   e^-88.38 = p * 2^-128 rounds once into the subnormals. */
static inline __m256 exp8(__m256 x) {
  __m256 n, p;
  EXP_POLY(256, _mm256_round_ps, x, n, p);
  const __m256i ni = _mm256_cvtps_epi32(n), lo = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(lo, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, lo), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
#endif

/* g = silu(g) * u, n values */
static void silu_mul(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#if HFS_VEXP == 16
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a));
    _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                          _mm512_loadu_ps(u + i)));
  }
#elif HFS_VEXP == 8
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                          _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

#if HFS_VEXP
/* the eight sums of a[0..7]'s lanes, in order */
static inline __m256 hsum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* sc[t] = (q . k_t) * scale for the n keys from kb (hd floats apart); returns the largest. Vector builds:
   eight keys at a time on 256-bit vectors, eight accumulators summed together (hsum8x8), then one key at a
   time in 16 or 8 lanes. SmolLM2-135M's 9 heads of 64 over 101 positions, one core of a 2-core AMD EPYC VM
   (2026-11-27): 4.5 us for the whole attention, where one 512-bit dot product per key took 5.9 us and the
   AVX2 build's scalar chains of FMAs 18 us. */
static float attn_scores(const float* q, const float* kb, int64_t n, int64_t hd, float scale, float* sc) {
  int64_t t = 0;
#if HFS_VEXP
  const int64_t hd8 = hd & ~(int64_t)7;
  for (; t + 8 <= n; t += 8) {
    const float* k = kb + t * hd;
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < hd8; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * hd + i), acc[j]);
    }
    _mm256_storeu_ps(sc + t, hsum8x8(acc));
    for (int j = 0; j < 8; j++) {
      float s = sc[t + j];
      for (int64_t i = hd8; i < hd; i++) s += q[i] * k[j * hd + i];
      sc[t + j] = s * scale;
    }
  }
#endif
  for (; t < n; t++) {
    const float* k = kb + t * hd;
    int64_t i = 0;
    float s = 0.0f;
#if HFS_VEXP == 16
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= hd; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
    s = _mm512_reduce_add_ps(acc);
#elif HFS_VEXP == 8
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
    s = hsum8(acc);
#endif
    for (; i < hd; i++) s += q[i] * k[i];
    sc[t] = s * scale;
  }
  float mx = -INFINITY;
  for (t = 0; t < n; t++)
    if (sc[t] > mx) mx = sc[t];
  return mx;
}

/* x[t] = e^(x[t] - shift) for t < n (the softmax's numerators); returns their sum, in double */
static double exp_shift(float* x, int64_t n, float shift) {
  double den = 0.0;
  int64_t t = 0;
#if HFS_VEXP == 16
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + t), _mm512_set1_ps(shift)));
    _mm512_storeu_ps(x + t, e);
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  den = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
#elif HFS_VEXP == 8
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), _mm256_set1_ps(shift)));
    _mm256_storeu_ps(x + t, e);
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  double part[4];
  _mm256_storeu_pd(part, _mm256_add_pd(lo, hi));
  den = (part[0] + part[1]) + (part[2] + part[3]);
#endif
  for (; t < n; t++) {
    x[t] = expf(x[t] - shift);
    den += x[t];
  }
  return den;
}

/* out = sum over t < n of p[t] * v_t (hd floats apart from vb), summed in the order of t. Vector builds: four
   keys per pass over out (one load and store of out per four products), then one key per pass. */
static void attn_values(const float* p, const float* vb, int64_t n, int64_t hd, float* out) {
  for (int64_t i = 0; i < hd; i++) out[i] = 0.0f;
  int64_t t = 0;
#if HFS_VEXP
  for (; t + 4 <= n; t += 4) {
    const float* v = vb + t * hd;
    const __m256 p0 = _mm256_set1_ps(p[t]), p1 = _mm256_set1_ps(p[t + 1]);
    const __m256 p2 = _mm256_set1_ps(p[t + 2]), p3 = _mm256_set1_ps(p[t + 3]);
    int64_t i = 0;
    for (; i + 8 <= hd; i += 8) {
      __m256 o = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i));
      o = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v + hd + i), o);
      o = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v + 2 * hd + i), o);
      _mm256_storeu_ps(out + i, _mm256_fmadd_ps(p3, _mm256_loadu_ps(v + 3 * hd + i), o));
    }
    for (; i < hd; i++)
      for (int j = 0; j < 4; j++) out[i] += p[t + j] * v[j * hd + i];
  }
#endif
  for (; t < n; t++) {
    const float* v = vb + t * hd;
    int64_t i = 0;
#if HFS_VEXP == 16
    const __m512 pv = _mm512_set1_ps(p[t]);
    for (; i + 16 <= hd; i += 16)
      _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + i), _mm512_loadu_ps(out + i)));
#endif
    for (; i < hd; i++) out[i] += p[t] * v[i];
  }
}

/* One query over the cache: the attention of its heads [h0, h1) (a pool job's rows). Scores and then the
   probabilities go to sc + head * max_len; the softmax's sum in double (exp_shift). */
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
    const int64_t off = (hh / a->rep) * a->T * hd;
    float* sc = a->sc + hh * a->T;
    const float mx = attn_scores(a->q + hh * hd, a->kc + off, n, hd, a->scale, sc);
    const double den = exp_shift(sc, n, mx);
    for (int64_t t = 0; t < n; t++) sc[t] = (float)(sc[t] / den);
    attn_values(sc, a->vc + off, n, hd, a->att + hh * hd);
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
  if (d->embed_codes) { /* a tied int8 LM head's row, dequantized as torch does: float(code) * scale */
    const int8_t* c = d->embed_codes + token * D;
    const float s = d->embed_scales[token];
    for (int64_t i = 0; i < D; i++) x[i] = (float)c[i] * s;
  } else {
    memcpy(x, d->embed + token * D, (size_t)D * sizeof(float));
  }
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

/* torch.argmax of y[0..n): the first largest value, or the first NaN where there is one. With vectors two
   passes (the largest value and whether a NaN occurs, then its first index): a few microseconds for a
   49,152-token vocabulary, where the scalar loop's dependent comparisons took tens. */
static int64_t argmax_first(const float* y, int64_t n) {
  int64_t best = 0, i = 1;
#if HFS_VEXP
  if (n >= HFS_VEXP) {
    float top;
    int nan;
#if HFS_VEXP == 16
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 un = 0;
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(y + i);
      un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, v);
    }
    top = _mm512_reduce_max_ps(mx);
    nan = un != 0;
#else
    __m256 mx = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(y + i);
      un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      mx = _mm256_max_ps(mx, v);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    nan = _mm256_movemask_ps(un) != 0;
#endif
    for (int64_t j = i; j < n; j++) {
      nan |= y[j] != y[j];
      if (y[j] > top) top = y[j];
    }
    if (nan) {
      for (int64_t j = 0; j < n; j++)
        if (y[j] != y[j]) return j;
    }
#if HFS_VEXP == 16
    for (i = 0; i + 16 <= n; i += 16) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(y + i), _mm512_set1_ps(top), _CMP_EQ_OQ);
      if (eq) return i + __builtin_ctz(eq);
    }
#else
    for (i = 0; i + 8 <= n; i += 8) {
      const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(y + i), _mm256_set1_ps(top), _CMP_EQ_OQ));
      if (eq) return i + __builtin_ctz(eq);
    }
#endif
    best = i;
    i++;
  }
#endif
  for (; i < n; i++)
    if (y[i] > y[best] || (y[i] != y[i] && y[best] == y[best])) best = i;
  return best;
}

/* The screen's first pass: the head's int8 copy `screen` gives every row's logit A_r into `logits`, within
   B_r = screen_err[r] * nx of the head's own L_r (screen_err: the rows' quantization error and both products'
   float rounding, native_step._screen), nx = ||h||_2 rounded up. Returns -1 where h is not finite (or near
   overflow), or the head is not a float one. */
static int screen_pass(const hfs_decoder_t* d, const float* h, double* nx) {
  double s2 = 0.;
  for (int64_t i = 0; i < d->hidden; i++) s2 += (double)h[i] * h[i];
  if (!(s2 < 1e60) || d->head->vbf16 > 1) return -1; /* NaN, inf or near overflow; an int8 head */
  *nx = sqrt(s2) * (1. + 1e-9);
  hfs_run_prepared(d->screen, h, d->logits, NULL);
  return 0;
}

/* The head's own L_r of the rows cand[0..n) into `logits`, each row as the whole product computes it (its
   rows are independent); -1 on a NaN (argmax_first's and the sampler's rules need every row then) */
static int screen_exact(const hfs_decoder_t* d, const float* h, int64_t n) {
  job_t j;
  if (!prepared_job(d->head, h, d->logits, NULL, &j)) return -1;
  for (int64_t k = 0; k < n; k++) {
    const int64_t r = d->cand[k];
    j.fn(&j, r, r + 1);
    if (d->logits[r] != d->logits[r]) return -1;
  }
  return 0;
}

/* the repetition penalty as the sampler applies it (sample.c): monotone, so bounds map to bounds */
static inline double penalized(double v, float p) { return v < 0.0 ? v * p : v / p; }

/* The rows of the hidden state `h` (after the final norm) that can be among the k largest logits, penalized
   (`penalty` > 0: the repetition penalty on the ids seen): after screen_pass, those whose upper bound reaches
   the k-th largest lower bound, less 2^-20 of it for the sampler's float rounding of the penalty and the
   temperature. Every other row's logit is below the k largest ones (ties at the k-th included), so it is
   neither the greedy token nor among top-k's survivors. Their ids go to cand[0..n), ascending, and
   screen_exact computes their L_r into `logits` (the other rows hold A_r). Returns n, or -1 (the caller runs
   the whole head) where screen_pass does, k is 0 or past screen_cap, or more than screen_cap rows remain.
   Uses screen_work (2 * vocab doubles). */
static int64_t screen_rows(hfs_decoder_t* d, const float* h, int64_t k, float penalty, const int64_t* seen,
                           int64_t n_seen) {
  const int64_t V = d->vocab;
  double nx;
  if (k < 1 || k > V || k > d->screen_cap || !d->screen_work || screen_pass(d, h, &nx)) return -1;
  const float *A = d->logits, *E = d->screen_err;
  double *lo = d->screen_work, *hi = lo + V;
  for (int64_t r = 0; r < V; r++) {
    lo[r] = (double)A[r] - (double)E[r] * nx;
    hi[r] = (double)A[r] + (double)E[r] * nx;
    if (lo[r] != lo[r]) return -1;
  }
  if (penalty > 0.0f)
    for (int64_t j = 0; j < n_seen; j++) {
      const int64_t r = seen[j];
      if (r < 0 || r >= V) continue;
      lo[r] = penalized((double)A[r] - (double)E[r] * nx, penalty);
      hi[r] = penalized((double)A[r] + (double)E[r] * nx, penalty);
    }
  double* heap = (double*)d->cand; /* the k largest lower bounds, a min-heap (cand is room for screen_cap) */
  for (int64_t r = 0; r < V; r++) {
    const double v = lo[r];
    int64_t i;
    if (r < k) { /* sift up */
      for (i = r; i > 0 && heap[(i - 1) / 2] > v; i = (i - 1) / 2) heap[i] = heap[(i - 1) / 2];
      heap[i] = v;
    } else if (v > heap[0]) { /* replace the least, sift down */
      for (i = 0;;) {
        int64_t c = 2 * i + 1;
        if (c >= k) break;
        if (c + 1 < k && heap[c + 1] < heap[c]) c++;
        if (heap[c] >= v) break;
        heap[i] = heap[c];
        i = c;
      }
      heap[i] = v;
    }
  }
  const double tau = heap[0] - fabs(heap[0]) * 0x1p-20 - 1e-30;
  int64_t n = 0;
  for (int64_t r = 0; r < V; r++)
    if (hi[r] >= tau) {
      if (n == d->screen_cap) return -1;
      d->cand[n++] = r;
    }
  return screen_exact(d, h, n) ? -1 : n;
}

/* The greedy token without the whole LM head: the first largest L_r of screen_rows' rows for k = 1, as
   argmax_first (-1: the caller runs the whole head). */
static int64_t screened_argmax(hfs_decoder_t* d, const float* h) {
  const int64_t n = screen_rows(d, h, 1, 0.0f, NULL, 0);
  if (n < 0) return -1;
  const float* A = d->logits;
  int64_t best = -1;
  for (int64_t k = 0; k < n; k++) {
    const int64_t r = d->cand[k];
    if (best < 0 || A[r] > A[best]) best = r;
  }
  d->screened = n;
  return best;
}

/* For sampling with top-k first: screen_rows' rows keep their L_r and every other row's logit becomes -inf,
   which top-k removes anyway. Returns the rows computed (-1: the caller runs the whole head). */
static int64_t screened_top_k(hfs_decoder_t* d, const float* h, int64_t k, float penalty, const int64_t* seen,
                              int64_t n_seen) {
  const int64_t n = screen_rows(d, h, k, penalty, seen, n_seen);
  if (n < 0) return -1;
  for (int64_t r = 0, c = 0; r < d->vocab; r++) {
    if (c < n && d->cand[c] == r)
      c++;
    else
      d->logits[r] = -INFINITY;
  }
  d->screened = n;
  return n;
}

/* The final norm of the hidden state decode_layers left (in the work buffer) */
static float* final_hidden(const hfs_decoder_t* d) {
  float *x = d->work, *h = x + d->hidden;
  norm(x, d->final_norm, d->final_norm_bias, h, d->hidden, d->eps);
  return h;
}

/* The final norm, the LM head and the argmax (argmax_first) of the hidden state decode_layers left; `greedy`
   (the same decoder, or NULL): through the screen where there is one (hfs_decode_step_greedy) */
static int64_t decode_head(const hfs_decoder_t* d, hfs_decoder_t* greedy) {
  float* h = final_hidden(d);
  if (greedy) {
    const int64_t best = d->screen && !d->head_bias ? screened_argmax(greedy, h) : -1;
    if (best >= 0) return best;
    greedy->screened = -1;
  }
  hfs_run_prepared(d->head, h, d->logits, d->head_bias);
  return argmax_first(d->logits, d->vocab);
}

/* One decoded token: the next token's id (-1: pos outside the cache) */
int64_t hfs_decode_step(const hfs_decoder_t* d, int64_t token, int64_t pos) {
  if (pos < 0 || pos >= d->max_len) return -1;
  tl_pool_only = 1;
  decode_layers(d, token, pos);
  const int64_t best = decode_head(d, NULL);
  tl_pool_only = 0;
  return best;
}

/* hfs_decode_step when only the greedy token is wanted: with a screen (d->screen) and no head bias, the LM
   head's rows that can hold the largest logit only (screened_argmax; d->screened says how many, -1: the
   whole head ran); `logits` then holds exact logits for those rows only. */
int64_t hfs_decode_step_greedy(hfs_decoder_t* d, int64_t token, int64_t pos) {
  if (pos < 0 || pos >= d->max_len) return -1;
  tl_pool_only = 1;
  decode_layers(d, token, pos);
  const int64_t best = decode_head(d, d);
  tl_pool_only = 0;
  return best;
}

/* hfs_decode_step for sampling whose first filter is top-k (`k`; the repetition penalty `penalty` on the ids
   `seen[0..n_seen)` before it, when > 0): with a screen and no head bias, `logits` holds the head's logits of
   the rows that can be among top-k's survivors and -inf elsewhere (screened_top_k; returns how many rows, also
   in d->screened), or all of them (-1: the whole head ran). Returns -2 where pos is outside the cache. */
int64_t hfs_decode_step_top_k(hfs_decoder_t* d, int64_t token, int64_t pos, int64_t k, float penalty,
                              const int64_t* seen, int64_t n_seen) {
  if (pos < 0 || pos >= d->max_len) return -2;
  tl_pool_only = 1;
  decode_layers(d, token, pos);
  float* h = final_hidden(d);
  d->screened = d->screen && !d->head_bias ? screened_top_k(d, h, k, penalty, seen, n_seen) : -1;
  if (d->screened < 0) {
    d->screened = -1;
    hfs_run_prepared(d->head, h, d->logits, d->head_bias);
  }
  tl_pool_only = 0;
  return d->screened;
}

/* A short prompt, one token at a time from `pos` (the cache holds the positions before it): the LM head runs
   for its last token only. Returns the first generated token's id (-1: the prompt does not fit the cache). */
int64_t hfs_decode_prompt(const hfs_decoder_t* d, const int64_t* tokens, int64_t n, int64_t pos) {
  if (n <= 0 || pos < 0 || pos + n > d->max_len) return -1;
  tl_pool_only = 1;
  for (int64_t i = 0; i < n; i++) decode_layers(d, tokens[i], pos + i);
  const int64_t best = decode_head(d, NULL);
  tl_pool_only = 0;
  return best;
}

/* ---- The step's vector pieces alone, for the tests (tests/test_native_kernels.py compares them with their
   definitions at every instruction-set level) */
double hfs_step_exp(float* x, int64_t n, float shift) { return exp_shift(x, n, shift); }
void hfs_step_silu_mul(float* g, const float* u, int64_t n) { silu_mul(g, u, n); }
int64_t hfs_step_argmax(const float* y, int64_t n) { return argmax_first(y, n); }
