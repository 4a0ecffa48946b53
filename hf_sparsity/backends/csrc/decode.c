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

/* torch.argmax of y[0..n): the first largest value, or the first NaN where there is one. With AVX-512 two
   vector passes (the largest value and whether a NaN occurs, then its first index): a few microseconds for a
   49,152-token vocabulary, where the scalar loop's dependent comparisons took tens. */
static int64_t argmax_first(const float* y, int64_t n) {
  int64_t best = 0, i = 1;
#if HFS_SIMD && defined(__AVX512F__)
  if (n >= 16) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(y + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, v);
    }
    float top = _mm512_reduce_max_ps(mx);
    for (int64_t j = i; j < n; j++) {
      nan |= y[j] != y[j];
      if (y[j] > top) top = y[j];
    }
    if (nan) {
      for (int64_t j = 0; j < n; j++)
        if (y[j] != y[j]) return j;
    }
    for (i = 0; i + 16 <= n; i += 16) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(y + i), _mm512_set1_ps(top), _CMP_EQ_OQ);
      if (eq) return i + __builtin_ctz(eq);
    }
    best = i;
    i++;
  }
#endif
  for (; i < n; i++)
    if (y[i] > y[best] || (y[i] != y[i] && y[best] == y[best])) best = i;
  return best;
}

/* The final norm, the LM head and the argmax (argmax_first) of the hidden state decode_layers left */
static int64_t decode_head(const hfs_decoder_t* d) {
  float *x = d->work, *h = x + d->hidden;
  norm(x, d->final_norm, d->final_norm_bias, h, d->hidden, d->eps);
  hfs_run_prepared(d->head, h, d->logits, d->head_bias);
  return argmax_first(d->logits, d->vocab);
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
