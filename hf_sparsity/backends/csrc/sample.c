/* A sampled token (hf_sparsity/inference/sampling.py, _Sampler): transformers' usual sampling processors on the
   decoding step's logits in one call, instead of about twenty torch operations a token, most of them on the
   whole vocabulary. After a decoding step each torch operation also starts with cold caches (its dispatch
   code and data evicted by the step's weight stream): a top-p on 50 values took 27 us warm and 218 us after
   streaming 200 MB. In order, as transformers' RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper and
   TopKLogitsWarper compute them (bit for bit: float32, the penalty and the temperature rounded to float32 as
   torch's scalar operations round them):
   1. the repetition penalty on the ids seen (each id once: v < 0 ? v * penalty : v / penalty);
   2. the temperature (v / temperature);
   3. top-k: the ids whose value is at least the k-th largest (ties at the boundary kept), in ascending id
      order (as `nonzero` lists them): two passes over the row (a min-heap of the k largest values, then a
      collecting pass), the temperature's division only for the survivors (see below), nothing written back;
      or, without top-k, top-p over the whole row (top_p_survivors: the largest tokens until their probability
      reaches p, over the softmax's denominator of the whole row);
   4. the warpers after top-k on its survivors (temperature, top-k, top-p, min-p, in the list's order; the
      softmax and cumulative sums of top-p and min-p in double, where transformers sums in float32);
   5. the draw: the first survivor whose cumulative probability exceeds u (a uniform in [0, 1) from torch's
      generator), the same distribution as torch.multinomial of the softmax.
   Where the native call does not match transformers' definition (a NaN in the row, fewer than k values above
   -inf, more survivors than room for them, a top-p nucleus past that room, a negative id) it returns -1 and
   leaves the logits as they were: sampling.py then runs the processors in torch. */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */

/* A min-heap of the k largest values seen (h[0]: the smallest of them) */
static void heap_sift_down(float* h, int64_t k, int64_t i) {
  const float v = h[i];
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= k) break;
    if (c + 1 < k && h[c + 1] < h[c]) c++;
    if (!(h[c] < v)) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = v;
}

static void heap_offer(float* h, int64_t k, int64_t* size, float v) {
  if (*size < k) {
    int64_t i = (*size)++;
    while (i > 0) {
      const int64_t p = (i - 1) / 2;
      if (!(v < h[p])) break;
      h[i] = h[p];
      i = p;
    }
    h[i] = v;
  } else if (v > h[0]) {
    h[0] = v;
    heap_sift_down(h, k, 0);
  }
}

/* The k-th largest of v[0..m) (m >= k >= 1), -inf values included */
static float kth_largest(const float* v, int64_t m, int64_t k, float* heap) {
  int64_t size = 0;
  for (int64_t i = 0; i < m; i++) heap_offer(heap, k, &size, v[i]);
  return heap[0];
}

/* The order of v[0..m) by ascending value, ties in index order: insertion sort for a few (top-k's survivors,
   tens), else qsort of keys that sort as the values, then the index (up to s->cap survivors) */
static int cmp_u64(const void* a, const void* b) {
  const uint64_t x = *(const uint64_t*)a, y = *(const uint64_t*)b;
  return (x > y) - (x < y);
}

static void order_ascending(const float* v, int64_t m, int64_t* order) {
  if (m <= 64) {
    for (int64_t i = 0; i < m; i++) {
      int64_t j = i;
      while (j > 0 && v[order[j - 1]] > v[i]) {
        order[j] = order[j - 1];
        j--;
      }
      order[j] = i;
    }
    return;
  }
  uint64_t* key = (uint64_t*)order;
  for (int64_t i = 0; i < m; i++) {
    uint32_t b;
    memcpy(&b, &v[i], 4);
    b = (b & 0x80000000u) ? ~b : b | 0x80000000u; /* IEEE order as unsigned order (-inf lowest) */
    key[i] = ((uint64_t)b << 32) | (uint64_t)i;
  }
  qsort(key, (size_t)m, sizeof(uint64_t), cmp_u64);
  for (int64_t i = 0; i < m; i++) order[i] = (int64_t)(key[i] & 0xffffffffu);
}

/* softmax(v[0..m)) in double, to p; returns the largest probability */
static double softmax_d(const float* v, int64_t m, double* p) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < m; i++)
    if (v[i] > mx) mx = v[i];
  double sum = 0.0, top = 0.0;
  for (int64_t i = 0; i < m; i++) sum += (p[i] = v[i] == -INFINITY ? 0.0 : exp((double)v[i] - (double)mx));
  for (int64_t i = 0; i < m; i++) {
    p[i] /= sum;
    if (p[i] > top) top = p[i];
  }
  return top;
}

/* One warper after top-k on its survivors v[0..m) (removed: -inf) */
static void tail_warper(const hfs_sampler_t* s, int64_t w, float* v, int64_t m) {
  const int64_t op = s->tail_op[w], keep = s->tail_keep[w] < m ? s->tail_keep[w] : m;
  const double value = s->tail_value[w];
  if (op == HFS_WARP_TEMPERATURE) {
    const float t = (float)value;
    for (int64_t i = 0; i < m; i++) v[i] = v[i] / t;
  } else if (op == HFS_WARP_TOP_K) { /* keep >= the k-th largest; value: k */
    const int64_t k = (int64_t)value < m ? (int64_t)value : m;
    const float kth = kth_largest(v, m, k, s->heap);
    for (int64_t i = 0; i < m; i++)
      if (v[i] < kth) v[i] = -INFINITY;
  } else if (op == HFS_WARP_TOP_P) { /* drop the ascending prefix whose cumulative probability <= 1 - p */
    softmax_d(v, m, s->work);
    order_ascending(v, m, s->order);
    const float limit = (float)(1.0 - value);
    double cum = 0.0;
    for (int64_t i = 0; i < m - keep; i++) {
      cum += s->work[s->order[i]];
      if ((float)cum <= limit) v[s->order[i]] = -INFINITY;
    }
  } else if (op == HFS_WARP_MIN_P) { /* drop p < min_p * max p, but for the `keep` most probable */
    const double top = softmax_d(v, m, s->work);
    const double floor = value * top;
    order_ascending(v, m, s->order);
    for (int64_t i = 0; i < m - keep; i++)
      if (s->work[s->order[i]] < floor) v[s->order[i]] = -INFINITY;
  }
}

/* Top-k of y = x / t: the ids whose y is at least the k-th largest, ties at the boundary kept, in ascending order,
   with their y, to s->idx / s->val; returns their number, -1 for a NaN in the row, fewer than k values above
   -inf or more ids than s->cap. On x: the division by t > 0 is correctly rounded, so it keeps the order (a >= b:
   a / t >= b / t), and the k-th largest y is the k-th largest x divided by t. The survivors are the x at or
   above the smallest float whose quotient still equals it (below the k-th largest x where rounding makes
   neighbours' quotients equal, for t > 1); only theirs are divided. */
static int64_t top_k_survivors(const hfs_sampler_t* s, const float* x, int64_t n, int64_t k, float t, int divide) {
  float* heap = s->heap;
  int64_t size = 0, i = 0, m = 0;
#if HFS_SIMD && defined(__AVX512F__)
  for (; i < n && size < k; i++) heap_offer(heap, k, &size, x[i]);
  for (; i + 16 <= n; i += 16) {
    __mmask16 gt = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(heap[0]), _CMP_GT_OQ);
    while (gt) {
      const int b = __builtin_ctz(gt);
      gt &= gt - 1;
      heap_offer(heap, k, &size, x[i + b]);
    }
  }
#endif
  for (; i < n; i++) heap_offer(heap, k, &size, x[i]);
  if (!(heap[0] > -INFINITY)) return -1; /* fewer than k values above -inf, or a NaN among the first k */
  float lower = heap[0];
  if (divide) {
    const float kth = heap[0] / t;
    for (int steps = 0;; steps++) {
      const float below = nextafterf(lower, -INFINITY);
      if (below / t != kth) break;
      if (steps == 4096) return -1; /* a temperature in the thousands: torch's path */
      lower = below;
    }
  }
  /* every id at or above it, in order; a NaN anywhere: torch.topk ranks NaN above every value */
  i = 0;
#if HFS_SIMD && defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return -1;
    __mmask16 ge = _mm512_cmp_ps_mask(v, _mm512_set1_ps(lower), _CMP_GE_OQ);
    while (ge) {
      const int b = __builtin_ctz(ge);
      ge &= ge - 1;
      if (m == s->cap) return -1;
      s->idx[m] = i + b;
      s->val[m++] = divide ? x[i + b] / t : x[i + b];
    }
  }
#endif
  for (; i < n; i++) {
    if (x[i] != x[i]) return -1;
    if (x[i] >= lower) {
      if (m == s->cap) return -1;
      s->idx[m] = i;
      s->val[m++] = divide ? x[i] / t : x[i];
    }
  }
  return m;
}

/* sum over the row of exp(x / t - top), in double (the softmax's denominator over the whole vocabulary) */
static double exp_sum(const float* x, int64_t n, float t, int divide, float top) {
  double z = 0.0;
  int64_t i = 0;
#if HFS_VEXP == 16
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    __m512 y = _mm512_loadu_ps(x + i);
    if (divide) y = _mm512_div_ps(y, _mm512_set1_ps(t));
    const __m512 e = exp16(_mm512_sub_ps(y, _mm512_set1_ps(top)));
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
  }
  z = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
#endif
  for (; i < n; i++) z += exp((double)(divide ? x[i] / t : x[i]) - (double)top);
  return z;
}

/* Top-p over the whole row (no top-k before it; transformers' TopPLogitsWarper): every token except the
   ascending run whose cumulative probability is at most 1 - p, and the `keep` most probable always. The
   candidates are the K largest (K = 64, then 256, then s->cap), enough once their probability reaches p: every
   token below them then lies in the removed run. To s->idx / s->val in ascending id order; -1 where even
   s->cap candidates hold less than p (a flat distribution: torch's path), or top_k_survivors' -1. */
static int64_t top_p_survivors(const hfs_sampler_t* s, const float* x, int64_t n, float t, int divide) {
  const float limit = (float)(1.0 - s->top_p);
  double z = -1.0;
  for (int64_t K = 64;; K = K * 4 < s->cap ? K * 4 : s->cap) {
    const int64_t m = top_k_survivors(s, x, n, K < n ? K : n, t, divide);
    if (m < 0) return -1;
    float top = -INFINITY;
    for (int64_t j = 0; j < m; j++)
      if (s->val[j] > top) top = s->val[j];
    if (z < 0.0) z = exp_sum(x, n, t, divide, top);
    double mass = 0.0;
    for (int64_t j = 0; j < m; j++) mass += s->work[j] = exp((double)s->val[j] - (double)top) / z;
    const int64_t keep = s->top_p_keep < m ? s->top_p_keep : m;
    if ((float)(1.0 - mass) <= limit || m == n) {
      order_ascending(s->val, m, s->order); /* descending from its end; a survivor keeps its place */
      double above = 0.0;
      for (int64_t r = m - 1; r >= 0; r--) {
        const int64_t j = s->order[r];
        if (m - 1 - r >= keep && (float)(1.0 - above) <= limit) s->idx[j] = -1;
        above += s->work[j];
      }
      int64_t kept = 0;
      for (int64_t j = 0; j < m; j++)
        if (s->idx[j] >= 0) {
          s->idx[kept] = s->idx[j];
          s->val[kept++] = s->val[j];
        }
      return kept;
    }
    if (K >= s->cap || K >= n) return -1;
  }
}

int64_t hfs_sample(const hfs_sampler_t* s, float* x, const int64_t* seen, int64_t n_seen, double u,
                   int64_t* survivors) {
  const int64_t n = s->vocab, k = s->top_k;
  const float t = s->temperature > 0.0f && s->temperature != 1.0f ? s->temperature : 1.0f;
  const int divide = t != 1.0f;
  int64_t result = -1, m;
  *survivors = 0;
  if (k < 0 || k > n || (k == 0 && !(s->top_p > 0.0)) || n_seen > s->seen_room) return -1;
  for (int64_t j = 0; j < n_seen; j++)
    if (seen[j] < 0) return -1;
  /* 1. the penalty in place (each id's value read before any is written, so an id seen twice is penalized
     once); the values are put back before returning */
  const int penalize = s->penalty > 0.0f;
  if (penalize) {
    for (int64_t j = 0; j < n_seen; j++) s->saved[j] = seen[j] < n ? x[seen[j]] : 0.0f;
    for (int64_t j = 0; j < n_seen; j++)
      if (seen[j] < n) x[seen[j]] = s->saved[j] < 0.0f ? s->saved[j] * s->penalty : s->saved[j] / s->penalty;
  }
  /* 2 and 3: the temperature and top-k (or top-p without top-k) */
  m = k > 0 ? top_k_survivors(s, x, n, k, t, divide) : top_p_survivors(s, x, n, t, divide);
  if (m <= 0) goto done;
  /* 4. the warpers after top-k, 5. the draw */
  for (int64_t w = 0; w < s->n_tail; w++) tail_warper(s, w, s->val, m);
  softmax_d(s->val, m, s->work);
  double cum = 0.0;
  for (int64_t j = 0; j < m; j++) {
    if (!(s->work[j] > 0.0)) continue;
    result = s->idx[j]; /* the last survivor with a probability, should rounding leave u above the sum */
    cum += s->work[j];
    if (cum > u) break;
  }
  *survivors = m;
done:
  if (penalize)
    for (int64_t j = n_seen - 1; j >= 0; j--)
      if (seen[j] < n) x[seen[j]] = s->saved[j];
  return result;
}
