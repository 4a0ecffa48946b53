/* Native CPU kernels of hf_sparsity (see hf_sparsity/backends/_native.py). C11 + pthreads, no torch headers. */
/* The one translation unit the library is built from (cc -O3 -march=native -shared -fopenmp hfs_kernels.c):
   the pieces below, each one concern, included in this order so that the compiler sees (and inlines across)
   all of them. _native.py's cache key hashes every file of this folder. */
#define _GNU_SOURCE
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#include "simd.h"        /* SIMD macros: instruction set, vector width, prefetch */
#include "api.h"         /* the exported functions and the structs Python mirrors */
#include "pool.h"        /* job_t: a product run in chunks of rows */
#include "csr.c"         /* CSR kernels */
#include "tables.h"      /* the lookup tables by mask byte */
#include "packed.h"      /* packed formats: value types, lane expansion */
#include "packed_fp32.c" /* bitmask / 2:4 / dense rows on float32 activations */
#include "packed_int8.c" /* int8 activations: quantization, AVX-512 VNNI kernels */
#include "packed_int8_avx2.c" /* int8 activations: the 256-bit kernels */
#include "unpack.c"      /* bitmask / 2:4 -> dense rows */
#include "spmm.c"        /* batched products: the blocked kernel */
#include "pool.c"        /* the thread pool, OpenMP, work memory */
#include "api.c"         /* the exported functions */
#include "decode.c"      /* the decoding step */
#include "sample.c"      /* a sampled token */
