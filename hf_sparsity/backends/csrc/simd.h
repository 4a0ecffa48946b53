/* The SIMD macros of the native kernels, in one place: which instruction set the build targets (from the
   compiler's -march flags), the vector width of the blocked products, software prefetch and a spin pause.
   Every kernel keeps its AVX-512 / AVX2 / scalar ladder under these macros. */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */
#ifndef HFS_SIMD_H
#define HFS_SIMD_H

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() ((void)0)
#endif
/* v stays in a register: the compiler cannot fold the load that made it into the instruction using it (gcc folds
   the values' load into vexpandps, whose memory form measured slower on AMD Zen 5: bm_dot1_) */
#define HFS_REG(v) __asm__("" : "+v"(v))

/* Software prefetch of the packed value stream, PF_BYTES ahead. The rows of a packed weight are short
   (a 576-column row at 50% is 1.2 KB of values) and threads take chunks of rows, so the hardware
   prefetcher ramps up and stops too often: measured on a 2-core Xeon VM, 1536x576 at 50% out of cache,
   the bitmask kernel went from 1.1x to 1.7x dense with one prefetch per 64 bytes of values 4 KB ahead
   (2 KB and 1 KB ahead: 1.6x, 1.45x; prefetching dense rows gained nothing). */
#define PF_BYTES 4096
#define PREFETCH(p) __builtin_prefetch((const char*)(p) + PF_BYTES, 0, 3)
/* The bitmask batch-1 kernels (bm_dot1_, bmg_rows, the AVX-512 int8 x int8 bm_q8_rows) prefetch 8 KB ahead.
   Measured on an AMD EPYC Zen 5 VM (1 thread, out of cache, benchmarks/isa_layers.py --threads 1, the time at
   8 KB over 4 KB): float32 AVX-512 at 25% sparse 0.90-0.99x, 50% 0.92-0.94x, 70% 0.98-1.01x; float32 AVX2 at 25%
   0.89-0.93x, the gathered layout at 50% 0.84-0.85x, 70% 0.93-0.97x; int8 x int8 AVX-512 at 25% 0.83-0.98x
   (6 KB: between; 12 KB: as 8 KB; 16 KB: 1.02-1.12x). */
#ifndef PF_FAR_BYTES
#define PF_FAR_BYTES 8192
#endif
#define PREFETCH_FAR(p) __builtin_prefetch((const char*)(p) + PF_FAR_BYTES, 0, 3)
/* the lines of [p, p + bytes): the start of a chunk's stream, which PREFETCH_FAR (PF_FAR_BYTES ahead) does not
   cover */
static inline void prefetch_span(const void* p, int64_t bytes) {
  for (int64_t a = 0; a < bytes; a += 64) __builtin_prefetch((const char*)p + a, 0, 3);
}

/* HFS_SIMD: AVX2 + FMA (the vector paths; AVX-512 where __AVX512F__ is defined too), else the scalar
   loops. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HFS_SIMD 1
static inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#define HFS_SIMD 0
#endif

/* HFS_VNNI: the int8 x int8 products with int8 activations on 512-bit vectors (packed_int8.c) */
#if HFS_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__BMI2__)
#define HFS_VNNI 1
#if defined(__AVX512VBMI2__)
#define HFS_VNNI_EXPAND 1 /* vpexpandb: the bitmask and 2:4 codes into their columns' lanes */
#else
#define HFS_VNNI_EXPAND 0
#endif
#else
#define HFS_VNNI 0
#define HFS_VNNI_EXPAND 0
#endif

#if HFS_VNNI_EXPAND
/* vpexpandb with zero-masking of the 64 bytes at p, its destination zeroed first (vpxord on itself: an idiom the
   register renamer resolves, no dependency): on AMD Zen 5 the zero-masked expand behaves as if it read its
   destination's old value (a C loop of expands given one destination register by the compiler ran 2.4x slower
   than with four), so expands the compiler gives one register wait on each other. Measured
   (benchmarks/isa_layers.py --threads 1, AMD EPYC Zen 5 VM, the int8 x int8 bitmask product; time over the
   intrinsic's): out of cache
   0.89x on 576 x 1536 at 50-70% sparse, 0.94-0.97x on 1536 x 576, 0.95-0.99x on 576 x 576; in cache 0.87-0.94x.
   (The float32 vexpandps of bm_dot1_ gained nothing from it.) */
static inline __attribute__((always_inline)) __m512i expand_epi8_z(__mmask64 k, const void* p) {
  __m512i w;
  __asm__("vpxord %0, %0, %0\n\tvpexpandb %1, %0%{%2%}%{z%}" : "=&v"(w) : "m"(*(const char(*)[64])p), "Yk"(k));
  return w;
}
#endif

/* HFS_Q8V: the int8 x int8 products on 256-bit vectors (packed_int8_avx2.c): every AVX2 build, for the formats
   the 512-bit kernels leave (all of them without AVX-512 VNNI). HFS_DPBUSD256: their byte products by vpdpbusd
   (AVX-VNNI, or AVX-512 VNNI's 256-bit form), else vpmaddubsw + vpmaddwd (plain AVX2, e.g. Zen 2 / Zen 3). */
#define HFS_Q8V HFS_SIMD
#if HFS_SIMD && defined(__AVXVNNI__)
#define HFS_DPBUSD256 1
#define DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif HFS_SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HFS_DPBUSD256 1
#define DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#else
#define HFS_DPBUSD256 0
#endif

/* The blocked products' vector (spmm.c): VW floats */
#if HFS_SIMD && defined(__AVX512F__)
#define VW 16
typedef __m512 vw_t;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_load_ps(p)
#define VSTORE(p, a) _mm512_store_ps(p, a)
#define VFMA(w, p, a) _mm512_fmadd_ps(w, _mm512_load_ps(p), a)
#define VSET1(w) _mm512_set1_ps(w)
#define VADD(a, b) _mm512_add_ps(a, b)
#elif HFS_SIMD
#define VW 8
typedef __m256 vw_t;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_load_ps(p)
#define VSTORE(p, a) _mm256_store_ps(p, a)
#define VFMA(w, p, a) _mm256_fmadd_ps(w, _mm256_load_ps(p), a)
#define VSET1(w) _mm256_set1_ps(w)
#define VADD(a, b) _mm256_add_ps(a, b)
#else
#define VW 4
#endif

/* HFS_VEXP: the width of the decoding step's vector exp and of its other vector loops (decode.c): 16 (exp16,
   AVX-512), 8 (exp8, AVX2 + FMA), 0 (expf, the scalar build) */
#if HFS_SIMD && defined(__AVX512F__)
#define HFS_VEXP 16
#elif HFS_SIMD
#define HFS_VEXP 8
#else
#define HFS_VEXP 0
#endif

#endif
