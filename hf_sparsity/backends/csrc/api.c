/* The exported functions (api.h): batched and batch-1 products, prepared and fused calls, the build's
   settings, and the layout of the mirrored structs. */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */

/* Batched product through the blocked kernel above: x [B, in] row-major, y [B, rows]; fmt as spmm_rows_'s F.
   Returns 0, or -1 when the work memory cannot be allocated or the build has no SIMD (callers then use the
   row kernels). */
int hfs_spmm(int fmt, int64_t rows, int64_t in, int nthreads, const int64_t* rowptr, const void* idx,
             const void* v, int vbf16, const float* x, float* y, int64_t B, const float* bias) {
  static void (*const fns[4])(const job_t*, int64_t, int64_t) = {spmm_csr16_rows, spmm_csr32_rows, spmm_bm_rows,
                                                                 spmm_nm24_rows};
  if (!HFS_SIMD || fmt < 0 || fmt > 3) return -1; /* the scalar build: the row kernels do better */
  if (nthreads < 1) nthreads = 1;
  const int64_t chunk = (rows + nthreads - 1) / nthreads, nchunks = rows > 0 ? (rows + chunk - 1) / chunk : 0;
  const size_t xsize = (size_t)((B + SBMAX - 1) / SBMAX) * (size_t)in * SBMAX;
  int owned;
  float* work = work_buf(xsize + (size_t)nchunks * SPMM_SCRATCH, &owned);
  if (!work) return -1;
  job_t p = {0, 0, in, (in + nthreads - 1) / nthreads, 0, B, NULL, NULL, NULL, x, work, NULL, spmm_pack_rows, in, 0,
             NULL};
  run(&p, nthreads);
  job_t j = {fmt, 0, rows, chunk, 0, B, rowptr, idx, (const float*)v, work, y, bias, fns[fmt], in, vbf16, work + xsize};
  run(&j, nthreads);
  if (owned) free(work);
  return 0;
}

/* CSR: y = x W^T (+ bias), x [B, in] row-major, y [B, rows]; kind 0/1: 16/32-bit column indices. Batches of
   SPMM_MIN_B rows or more go through the blocked kernel; smaller ones through SPMM_ROWS on x transposed
   (into the per-thread buffer), or, without that buffer, one batch-1 product per row. */
void hfs_matmul(int kind, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
                const void* idx, const float* v, const float* x, float* y, int64_t B, const float* bias) {
  if (B >= SPMM_MIN_B && hfs_spmm(kind, rows, in, nthreads, rowptr, idx, v, 0, x, y, B, bias) == 0) return;
  int owned = 0;
  float* xt = B > 1 ? work_buf((size_t)(B * in), &owned) : NULL;
  if (xt) {
    for (int64_t b = 0; b < B; b++)
      for (int64_t c = 0; c < in; c++) xt[c * B + b] = x[b * in + c];
    job_t j = {kind + 2, 0, rows, chunk, 0, B, rowptr, idx, v, xt, y, bias, NULL, 0, 0, NULL};
    run(&j, nthreads);
    if (owned) free(xt);
    return;
  }
  for (int64_t b = 0; b < B; b++) {
    job_t j = {kind, 0, rows, chunk, 0, 1, rowptr, idx, v, x + b * in, y + b * rows, bias, NULL, 0, 0, NULL};
    run(&j, nthreads);
  }
}

/* the row kernels by op: 0 bitmask, 1 2:4, 2 dense GEMV, 3 bitmask unpack, 4 2:4 unpack, 5 the gathered bitmask
   (bmg_rows, packed_fp32.c) */
static void (*const ROW_FNS[6])(const job_t*, int64_t, int64_t) = {bm_rows,        nm24_rows,        gemv_rows,
                                                                   bm_unpack_rows, nm24_unpack_rows, bmg_rows};
/* the batch-1 int8 x int8 products by op (0 bitmask, 1 2:4, 2 dense GEMV): 512-bit where the CPU has AVX-512
   VNNI (and VBMI2 for the byte expand), else 256-bit; none in the scalar build (NULL: the float kernels on the
   dequantized activations) */
#if HFS_VNNI && HFS_VNNI_EXPAND
#define Q8_FNS_ {bm_q8_rows, nm24_q8_rows, gemv_q8_rows}
#elif HFS_VNNI
#define Q8_FNS_ {bm_q8v_rows, nm24_q8v_rows, gemv_q8_rows}
#elif HFS_Q8V
#define Q8_FNS_ {bm_q8v_rows, nm24_q8v_rows, gemv_q8v_rows}
#else
#define Q8_FNS_ {NULL, NULL, NULL}
#endif
static void (*const Q8_FNS[3])(const job_t*, int64_t, int64_t) = Q8_FNS_;
/* x quantized into buf (xq_floats(in) floats) for Q8_FNS */
static void quantize_q8(const float* x, int64_t in, float* buf) {
#if HFS_VNNI
  quantize_row_vnni(x, in, buf);
#elif HFS_Q8V
  quantize_row_avx2(x, in, buf);
#else
  quantize_row(x, in, buf, NULL);
#endif
}
/* value type 3 (op 0-2): see quantize_row */
static void run_q8(int op, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
                   const void* meta, const void* v, const float* x, float* y, int64_t B, const float* bias) {
  const int64_t nf = xq_floats(in);
  if (B == 1 && op <= 2 && Q8_FNS[op]) {
    int owned;
    float* buf = work_buf((size_t)nf, &owned);
    if (buf) {
      quantize_q8(x, in, buf);
      job_t j = {0, 0, rows, chunk, 0, 1, rowptr, meta, (const float*)v, x, y, bias, Q8_FNS[op], in, 2, buf};
      run(&j, nthreads);
      if (owned) free(buf);
      return;
    }
  }
  /* the dequantized activations, in memory of their own (the batched kernels use the work buffer) */
  float* xd = aligned_alloc(64, (((size_t)(B * in + nf) * sizeof(float)) + 63) & ~(size_t)63);
  if (!xd) return;
  for (int64_t b = 0; b < B; b++) quantize_row(x + b * in, in, xd + B * in, xd + b * in);
  hfs_run(op, rows, in, chunk, nthreads, rowptr, meta, v, 2, xd, y, B, bias);
  free(xd);
}

/* op: 0 bitmask, 1 2:4, 2 dense GEMV, 3 bitmask unpack, 4 2:4 unpack (y: [rows, in]), 5 the gathered bitmask
   (`meta`: hfs_bm_gather's chunks). x: [B, in]; y: [B, rows]. */
void hfs_run(int op, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
             const void* meta, const void* v, int vbf16, const float* x, float* y, int64_t B,
             const float* bias) {
  if (op < 0 || op > 5) return;
  if (vbf16 == 3) { /* int8 activations: the VNNI products at batch 1, else the dequantized activations */
    if (op == 3 || op == 4) {
      vbf16 = 2;
    } else {
      run_q8(op, rows, in, chunk, nthreads, rowptr, meta, v, x, y, B, bias);
      return;
    }
  }
  if (op <= 1 && B >= SPMM_MIN_B && hfs_spmm(op + 2, rows, in, nthreads, rowptr, meta, v, vbf16, x, y, B, bias) == 0)
    return;
  job_t j = {0, 0, rows, chunk, 0, B, rowptr, meta, (const float*)v, x, y, bias, ROW_FNS[op], in, vbf16, NULL};
  run(&j, nthreads);
}

/* op 0-5 as hfs_run; 16 + kind: CSR (hfs_matmul's batch-1 kinds 0/1, `meta` = the column indices). */
void hfs_run_prepared(const prepared_t* p, const float* x, float* y, const float* bias) {
  if (p->op >= 16) {
    hfs_matmul((int)p->op - 16, p->rows, p->in, p->chunk, (int)p->nthreads, p->rowptr, p->meta, (const float*)p->v, x,
               y, 1, bias);
    return;
  }
  hfs_run((int)p->op, p->rows, p->in, p->chunk, (int)p->nthreads, p->rowptr, p->meta, p->v, (int)p->vbf16, x, y,
          1, bias);
}

/* Batch-1 products of the same input x as one hand-off to the pool (the decoding step's q / k / v, and
   gate / up): their chunks are claimed from one pool, so the threads wait once instead of once per product,
   and int8 activations are quantized once for all of them. Products a fused call cannot take (CSR, or int8
   activations without the VNNI kernel) make the whole call fall back to one call per product. */
static int prepared_job(const prepared_t* p, const float* x, float* y, const float* bias, job_t* j) {
  if (p->op < 0 || (p->op > 2 && p->op != 5)) return 0;
  void (*fn)(const job_t*, int64_t, int64_t) = ROW_FNS[p->op];
  if (p->vbf16 == 3) { /* the int8 x int8 kernel; its `work` (the quantized x) is set by the caller */
    fn = p->op <= 2 ? Q8_FNS[p->op] : NULL;
    if (!fn) return 0;
  }
  const job_t jj = {0, 0, p->rows, p->chunk, 0, 1, p->rowptr, p->meta, (const float*)p->v, x, y, bias, fn,
                    p->in, p->vbf16 == 3 ? 2 : (int)p->vbf16, NULL};
  *j = jj;
  return 1;
}

void hfs_run_fused(const prepared_t* const* ps, int n, const float* x, float* const* ys, const float* const* bs) {
  job_t js[MAX_JOBS];
  int ok = n > 0 && n <= MAX_JOBS, q8 = 0, nthreads = 1, owned = 0;
  for (int k = 0; ok && k < n; k++) {
    ok = ps[k]->in == ps[0]->in && prepared_job(ps[k], x, ys[k], bs[k], js + k);
    q8 |= ps[k]->vbf16 == 3;
    if (ps[k]->nthreads > nthreads) nthreads = (int)ps[k]->nthreads;
  }
  float* xq = NULL;
  if (ok && q8) { /* quantized once for every int8 x int8 product */
    xq = work_buf((size_t)xq_floats(ps[0]->in), &owned);
    ok = xq != NULL;
    if (ok) quantize_q8(x, ps[0]->in, xq);
    for (int k = 0; ok && k < n; k++)
      if (ps[k]->vbf16 == 3) js[k].work = xq;
  }
  if (ok)
    run_jobs(js, n, nthreads);
  else
    for (int k = 0; k < n; k++) hfs_run_prepared(ps[k], x, ys[k], bs[k]);
  if (owned) free(xq);
}

/* op 5's `meta` for a bitmask (bm_gather, packed_fp32.c): cp [rows + 1] chunk offsets and, unless ch is NULL,
   the chunks; returns their number (-1: in < 16 or in >= 2^24, no gathered layout) */
int64_t hfs_bm_gather(int64_t rows, int64_t in, const uint8_t* bits, int64_t* cp, uint64_t* ch) {
  return bm_gather(rows, in, bits, cp, ch);
}

void hfs_set_spin(int64_t spin) { g_spin = spin; }
/* 1: chunks on the OpenMP team (when built with -fopenmp); 0: the pthread pool above; -1: no change.
   Returns the mode in use. */
int hfs_set_openmp(int on) {
#if defined(_OPENMP)
  if (on >= 0) g_use_omp = on != 0;
#endif
  return g_use_omp;
}
int hfs_version(void) { return 13; }
int hfs_simd(void) { return HFS_SIMD; }
/* The instruction set the library was built for: 0 scalar, 1 AVX2 + FMA, 2 AVX2 + AVX-VNNI, 3 AVX-512,
   4 AVX-512 with VNNI (_native.isa() names them) */
int hfs_isa(void) {
#if HFS_VNNI
  return 4;
#elif HFS_SIMD && defined(__AVX512F__)
  return 3;
#elif HFS_SIMD && defined(__AVXVNNI__)
  return 2;
#else
  return HFS_SIMD;
#endif
}
/* How batch-1 products with int8 activations multiply (_native.int8_dot() names them): 0 the float kernels on
   the dequantized activations (scalar build), 1 vpmaddubsw (AVX2), 2 256-bit vpdpbusd, 3 AVX-512 VNNI for the
   dense GEMV and 256-bit vpdpbusd for bitmask / 2:4 (no VBMI2), 4 AVX-512 VNNI for every format */
int hfs_int8_dot(void) {
#if HFS_VNNI
  return 3 + HFS_VNNI_EXPAND;
#else
  return HFS_Q8V + HFS_DPBUSD256;
#endif
}

/* ---- The layout of the structs Python mirrors with ctypes (tests/test_struct_mirrors.py compares) -----------
   prepared_t: _native.Prepared; hfs_layer_t, hfs_decoder_t: native_step.py's _Layer, _Decoder; hfs_sampler_t:
   sampling.py's _Sampler. Every field, in declaration order. */
typedef struct {
  const char *type, *field;
  int64_t offset, size;
} hfs_field_t;
#define HFS_FIELD(T, F) {#T, #F, (int64_t)offsetof(T, F), (int64_t)sizeof(((T*)0)->F)}
static const hfs_field_t g_fields[] = {
    HFS_FIELD(prepared_t, op), HFS_FIELD(prepared_t, rows), HFS_FIELD(prepared_t, in), HFS_FIELD(prepared_t, chunk),
    HFS_FIELD(prepared_t, nthreads), HFS_FIELD(prepared_t, rowptr), HFS_FIELD(prepared_t, meta),
    HFS_FIELD(prepared_t, v), HFS_FIELD(prepared_t, vbf16),
    HFS_FIELD(hfs_layer_t, q), HFS_FIELD(hfs_layer_t, k), HFS_FIELD(hfs_layer_t, v), HFS_FIELD(hfs_layer_t, o),
    HFS_FIELD(hfs_layer_t, gate), HFS_FIELD(hfs_layer_t, up), HFS_FIELD(hfs_layer_t, down),
    HFS_FIELD(hfs_layer_t, bq), HFS_FIELD(hfs_layer_t, bk), HFS_FIELD(hfs_layer_t, bv), HFS_FIELD(hfs_layer_t, bo),
    HFS_FIELD(hfs_layer_t, bgate), HFS_FIELD(hfs_layer_t, bup), HFS_FIELD(hfs_layer_t, bdown),
    HFS_FIELD(hfs_layer_t, norm1), HFS_FIELD(hfs_layer_t, norm2), HFS_FIELD(hfs_layer_t, kc),
    HFS_FIELD(hfs_layer_t, vc), HFS_FIELD(hfs_layer_t, nbias1), HFS_FIELD(hfs_layer_t, nbias2),
    HFS_FIELD(hfs_layer_t, qnorm), HFS_FIELD(hfs_layer_t, knorm),
    HFS_FIELD(hfs_decoder_t, nlayers), HFS_FIELD(hfs_decoder_t, hidden), HFS_FIELD(hfs_decoder_t, heads),
    HFS_FIELD(hfs_decoder_t, kv_heads), HFS_FIELD(hfs_decoder_t, head_dim), HFS_FIELD(hfs_decoder_t, ffn),
    HFS_FIELD(hfs_decoder_t, max_len), HFS_FIELD(hfs_decoder_t, vocab), HFS_FIELD(hfs_decoder_t, threads),
    HFS_FIELD(hfs_decoder_t, eps), HFS_FIELD(hfs_decoder_t, scale), HFS_FIELD(hfs_decoder_t, layers),
    HFS_FIELD(hfs_decoder_t, head), HFS_FIELD(hfs_decoder_t, head_bias), HFS_FIELD(hfs_decoder_t, final_norm),
    HFS_FIELD(hfs_decoder_t, embed), HFS_FIELD(hfs_decoder_t, cos), HFS_FIELD(hfs_decoder_t, sin),
    HFS_FIELD(hfs_decoder_t, work), HFS_FIELD(hfs_decoder_t, logits), HFS_FIELD(hfs_decoder_t, arch),
    HFS_FIELD(hfs_decoder_t, act), HFS_FIELD(hfs_decoder_t, pos_embed), HFS_FIELD(hfs_decoder_t, final_norm_bias),
    HFS_FIELD(hfs_decoder_t, embed_codes), HFS_FIELD(hfs_decoder_t, embed_scales), HFS_FIELD(hfs_decoder_t, screen),
    HFS_FIELD(hfs_decoder_t, screen_err), HFS_FIELD(hfs_decoder_t, cand), HFS_FIELD(hfs_decoder_t, screen_cap),
    HFS_FIELD(hfs_decoder_t, screened), HFS_FIELD(hfs_decoder_t, screen_work),
    HFS_FIELD(hfs_sampler_t, vocab), HFS_FIELD(hfs_sampler_t, top_k), HFS_FIELD(hfs_sampler_t, cap),
    HFS_FIELD(hfs_sampler_t, seen_room), HFS_FIELD(hfs_sampler_t, n_tail), HFS_FIELD(hfs_sampler_t, tail_op),
    HFS_FIELD(hfs_sampler_t, tail_keep), HFS_FIELD(hfs_sampler_t, tail_value), HFS_FIELD(hfs_sampler_t, penalty),
    HFS_FIELD(hfs_sampler_t, temperature), HFS_FIELD(hfs_sampler_t, idx), HFS_FIELD(hfs_sampler_t, order),
    HFS_FIELD(hfs_sampler_t, val), HFS_FIELD(hfs_sampler_t, heap),
    HFS_FIELD(hfs_sampler_t, saved), HFS_FIELD(hfs_sampler_t, work), HFS_FIELD(hfs_sampler_t, top_p),
    HFS_FIELD(hfs_sampler_t, top_p_keep),
};
#undef HFS_FIELD

/* sizeof the struct named `type` (-1: not a mirrored struct) */
int64_t hfs_struct_size(const char* type) {
  if (!strcmp(type, "prepared_t")) return (int64_t)sizeof(prepared_t);
  if (!strcmp(type, "hfs_layer_t")) return (int64_t)sizeof(hfs_layer_t);
  if (!strcmp(type, "hfs_decoder_t")) return (int64_t)sizeof(hfs_decoder_t);
  if (!strcmp(type, "hfs_sampler_t")) return (int64_t)sizeof(hfs_sampler_t);
  return -1;
}

/* field i (declaration order) of the struct named `type`: its name, offset and size; 0 past the last */
int hfs_struct_field(const char* type, int i, const char** field, int64_t* offset, int64_t* size) {
  for (size_t k = 0; k < sizeof(g_fields) / sizeof(g_fields[0]); k++) {
    if (strcmp(g_fields[k].type, type)) continue;
    if (i-- > 0) continue;
    *field = g_fields[k].field;
    *offset = g_fields[k].offset;
    *size = g_fields[k].size;
    return 1;
  }
  return 0;
}
