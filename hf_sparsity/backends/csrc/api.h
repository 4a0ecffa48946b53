/* The C API of the native kernels: the structs Python mirrors with ctypes (_native.Prepared,
   decoding.py's _Layer and _Decoder; tests/test_struct_mirrors.py checks they agree) and the exported
   functions (_native.load declares their argument types). */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */
#ifndef HFS_API_H
#define HFS_API_H

#include <stdint.h>

/* A batch-1 call whose fixed arguments were prepared once (Python: _native.Prepared): four arguments
   cross ctypes per call instead of thirteen (~1 us instead of ~3 us; ~200 calls per decoded token). */
typedef struct {
  int64_t op, rows, in, chunk, nthreads;
  const int64_t* rowptr;
  const void* meta;
  const void* v;
  int64_t vbf16;
} prepared_t;

/* One decoded token of a Llama-family or GPT-2 model in one call: a layer's projections (prepared calls)
   and tensors, and the model (decode.c describes the step). */
typedef struct {
  const prepared_t *q, *k, *v, *o, *gate, *up, *down;
  const float *bq, *bk, *bv, *bo, *bgate, *bup, *bdown;
  const float *norm1, *norm2;
  float *kc, *vc;               /* [kv_heads, max_len, head_dim] */
  const float *nbias1, *nbias2; /* LayerNorm biases (GPT-2) */
  const float *qnorm, *knorm;   /* per-head RMSNorm of q and k before the rotary embedding (Qwen3); NULL: none */
} hfs_layer_t;

typedef struct {
  int64_t nlayers, hidden, heads, kv_heads, head_dim, ffn, max_len, vocab, threads;
  double eps, scale;
  const hfs_layer_t* layers;
  const prepared_t* head;
  const float* head_bias;
  const float* final_norm;
  const float* embed; /* [embedding rows, hidden] */
  const float* cos;   /* [max_len, head_dim] */
  const float* sin;
  float* work;   /* hfs_decode_work_floats() floats */
  float* logits; /* [vocab] */
  int64_t arch;  /* 0: Llama family (RMSNorm, rotary, SiLU-gated MLP); 1: GPT-2 (see above) */
  int64_t act;   /* GPT-2's MLP activation: 0 GELU with the tanh approximation, 1 GELU (erf) */
  const float* pos_embed;       /* [positions, hidden] (GPT-2) */
  const float* final_norm_bias; /* (GPT-2) */
  const int8_t* embed_codes;    /* non-NULL: the embedding is int8 codes [rows, hidden] (a tied int8 LM head's), */
  const float* embed_scales;    /* row r = embed_codes[r] * embed_scales[r]; `embed` is then unused */
  /* The greedy step's screened LM head (hfs_decode_step_greedy, decode.c); NULL `screen`: the whole head */
  const prepared_t* screen; /* the head's int8 copy: int8 codes with row scales, float32 activations */
  const float* screen_err;  /* [vocab]: |head row r - screen row r| <= screen_err[r] * ||x||_2 */
  int64_t* cand;            /* room for screen_cap row ids */
  int64_t screen_cap;
  int64_t screened; /* out: rows the last screened step computed exactly (-1: the whole head ran) */
  double* screen_work; /* 2 * vocab doubles for a top-k step (hfs_decode_step_top_k); NULL: none */
} hfs_decoder_t;

/* One generation's sampling processors (sample.c; Python: sampling.py's _Sampler): the repetition penalty and
   the temperature before top-k (<= 0: none), top-k (or top-p where top_k is 0), the warpers after it
   (tail_op: HFS_WARP_*, with their value and min_tokens_to_keep), and the buffers: idx / val / order / work
   for `cap` survivors, heap for `cap` floats, saved for `seen_room` ids. */
#define HFS_WARP_TEMPERATURE 1
#define HFS_WARP_TOP_K 2
#define HFS_WARP_TOP_P 3
#define HFS_WARP_MIN_P 4
#define HFS_MAX_TAIL 4
typedef struct {
  int64_t vocab, top_k, cap, seen_room, n_tail;
  int64_t tail_op[HFS_MAX_TAIL], tail_keep[HFS_MAX_TAIL];
  double tail_value[HFS_MAX_TAIL];
  float penalty, temperature;
  int64_t *idx, *order;
  float *val, *heap, *saved;
  double* work;
  double top_p;       /* top_k 0: top-p over the whole row first (TopPLogitsWarper), keeping top_p_keep at least */
  int64_t top_p_keep;
} hfs_sampler_t;

int hfs_spmm(int fmt, int64_t rows, int64_t in, int nthreads, const int64_t* rowptr, const void* idx,
             const void* v, int vbf16, const float* x, float* y, int64_t B, const float* bias);
void hfs_matmul(int kind, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
                const void* idx, const float* v, const float* x, float* y, int64_t B, const float* bias);
void hfs_run(int op, int64_t rows, int64_t in, int64_t chunk, int nthreads, const int64_t* rowptr,
             const void* meta, const void* v, int vbf16, const float* x, float* y, int64_t B,
             const float* bias);
void hfs_run_prepared(const prepared_t* p, const float* x, float* y, const float* bias);
void hfs_run_fused(const prepared_t* const* ps, int n, const float* x, float* const* ys, const float* const* bs);
int64_t hfs_bm_gather(int64_t rows, int64_t in, const uint8_t* bits, int64_t* cp, uint64_t* ch);
void hfs_set_spin(int64_t spin);
int hfs_set_openmp(int on);
int hfs_version(void);
int hfs_simd(void);
int hfs_isa(void);
int hfs_int8_dot(void);
int64_t hfs_decode_work_floats(const hfs_decoder_t* d);
int64_t hfs_decode_step(const hfs_decoder_t* d, int64_t token, int64_t pos);
int64_t hfs_decode_step_greedy(hfs_decoder_t* d, int64_t token, int64_t pos);
int64_t hfs_decode_step_top_k(hfs_decoder_t* d, int64_t token, int64_t pos, int64_t k, float penalty,
                              const int64_t* seen, int64_t n_seen);
int64_t hfs_decode_prompt(const hfs_decoder_t* d, const int64_t* tokens, int64_t n, int64_t pos);
double hfs_step_exp(float* x, int64_t n, float shift);
void hfs_step_silu_mul(float* g, const float* u, int64_t n);
int64_t hfs_step_argmax(const float* y, int64_t n);
int64_t hfs_sample(const hfs_sampler_t* s, float* x, const int64_t* seen, int64_t n_seen, double u,
                   int64_t* survivors);
int64_t hfs_struct_size(const char* type);
int hfs_struct_field(const char* type, int i, const char** field, int64_t* offset, int64_t* size);

#endif
