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
   4. the warpers after top-k on its survivors (temperature, top-k, top-p, min-p, in the list's order; the
      softmax and cumulative sums of top-p and min-p in double, where transformers sums in float32);
   5. the draw: the first survivor whose cumulative probability exceeds u (a uniform in [0, 1) from torch's
      generator), the same distribution as torch.multinomial of the softmax.
   Where the native call does not match transformers' definition (a NaN in the row, fewer than k values above
   -inf, more survivors than room for them, a negative id) it returns -1 and leaves the logits as they were:
   sampling.py then runs the processors in torch. */
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

/* The order of v[0..m) by ascending value (insertion sort: m is top-k's survivors, tens) */
static void order_ascending(const float* v, int64_t m, int64_t* order) {
  for (int64_t i = 0; i < m; i++) {
    int64_t j = i;
    while (j > 0 && v[order[j - 1]] > v[i]) {
      order[j] = order[j - 1];
      j--;
    }
    order[j] = i;
  }
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
    order_ascending(v, m, s->order);
    for (int64_t i = 0; i < m; i++) s->fwork[i] = v[s->order[i]];
    softmax_d(s->fwork, m, s->work);
    const float limit = (float)(1.0 - value);
    double cum = 0.0;
    for (int64_t i = 0; i < m - keep; i++) {
      cum += s->work[i];
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

int64_t hfs_sample(const hfs_sampler_t* s, float* x, const int64_t* seen, int64_t n_seen, double u,
                   int64_t* survivors) {
  const int64_t n = s->vocab, k = s->top_k;
  const float t = s->temperature > 0.0f && s->temperature != 1.0f ? s->temperature : 1.0f;
  const int divide = t != 1.0f;
  *survivors = 0;
  if (k < 1 || k > n || n_seen > s->seen_room) return -1;
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
  /* 2 and 3: top-k of y = x / t, on x: the division by t > 0 is correctly rounded, so it keeps the order (a >= b:
     a / t >= b / t), and the k-th largest y is the k-th largest x divided by t. The survivors are the x at or
     above the smallest float whose quotient still equals it (below the k-th largest x where rounding makes
     neighbours' quotients equal, for t > 1); only theirs are divided. */
  float* heap = s->heap;
  int64_t size = 0, i = 0, m = 0, result = -1;
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
  if (!(heap[0] > -INFINITY)) goto done; /* fewer than k values above -inf, or a NaN among the first k */
  float lower = heap[0];
  if (divide) {
    const float kth = heap[0] / t;
    for (int steps = 0;; steps++) {
      const float below = nextafterf(lower, -INFINITY);
      if (below / t != kth) break;
      if (steps == 4096) goto done; /* a temperature in the thousands: torch's path */
      lower = below;
    }
  }
  /* every id at or above it, in order; a NaN anywhere: torch.topk ranks NaN above every value */
  i = 0;
#if HFS_SIMD && defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) goto done;
    __mmask16 ge = _mm512_cmp_ps_mask(v, _mm512_set1_ps(lower), _CMP_GE_OQ);
    while (ge) {
      const int b = __builtin_ctz(ge);
      ge &= ge - 1;
      if (m == s->cap) goto done;
      s->idx[m] = i + b;
      s->val[m++] = divide ? x[i + b] / t : x[i + b];
    }
  }
#endif
  for (; i < n; i++) {
    if (x[i] != x[i]) goto done;
    if (x[i] >= lower) {
      if (m == s->cap) goto done;
      s->idx[m] = i;
      s->val[m++] = divide ? x[i] / t : x[i];
    }
  }
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
