/* A product the thread pool (pool.c) runs in chunks of rows: every kernel computes rows [r0, r1) of a
   job_t. */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */
#ifndef HFS_POOL_H
#define HFS_POOL_H

#include <stdint.h>

typedef struct job job_t;
struct job {
  int kind, active;
  int64_t rows, chunk, nchunks, B;
  const int64_t* rowptr; const void* idx; const float* v; const float* x; float* y;
  const float* bias;
  /* formats other than CSR: fn(job, r0, r1) computes rows [r0, r1); `in` = input features;
     vbf16: the value type, 0 float32, 1 bfloat16 bit patterns (uint16), 2 int8 with per-row scales
     (see VSCALE_BYTES) */
  void (*fn)(const job_t*, int64_t, int64_t);
  int64_t in;
  int vbf16;
  float* work; /* the blocked products' per-chunk scratch (accumulators, column offsets, positions) */
};

#endif
