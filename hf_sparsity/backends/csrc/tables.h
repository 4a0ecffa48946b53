/* The kernels' lookup tables by mask byte, in one place, built once at load (one constructor). */
/* Part of the native kernels' one translation unit, hfs_kernels.c (included there, not compiled alone). */
#ifndef HFS_TABLES_H
#define HFS_TABLES_H

/* 2:4 meta byte (p0 | p1 << 2 | p2 << 4 | p3 << 6) -> its four x lanes, one per byte: p0, p1, 4 + p2, 4 + p3
   (the fp32 2:4 products, packed_fp32.c) */
static uint32_t g_nm_lane[256];
#if HFS_SIMD
/* bitmask byte -> per lane i the rank of bit i among its set bits, or -1 (sign bit: the lane zeroed) where bit i
   is clear (expand_lanes, packed.h: the fp32 bitmask expansion) */
static int32_t g_bm_lanes[256][8] __attribute__((aligned(32)));
/* 2:4 meta byte -> per output lane which of the group pair's four values lands there, or -1 (unpack.c) */
static int32_t g_nm_inv[256][8] __attribute__((aligned(32)));
/* bitmask byte -> the positions of its set bits, in order (the blocked products, spmm.c) */
static int32_t g_bm_pos[256][8] __attribute__((aligned(32)));
/* the vpshufb control of 16 columns (mask bytes b0, b1) as the byte sum g_bm_c0[b0] + g_bm_c1[b1]
   (packed_int8_avx2.c): c0: per byte i < 8 the rank of bit i among b0's set bits, or 0x80 (vpshufb writes 0)
   where bit i is clear, and popcount(b0) in bytes 8-15; c1: 0 in bytes 0-7, in byte 8 + i the rank of bit i
   among b1's set bits, or 0x80. In the sum byte 8 + i points past b0's values; 0x80 + popcount (at most 0x88)
   keeps the sign bit: still 0. */
static uint8_t g_bm_c0[256][16] __attribute__((aligned(16)));
static uint8_t g_bm_c1[256][16] __attribute__((aligned(16)));
/* n = 0..8 -> lanes 0..n-1 all ones, the others 0 (the gathered bitmask's chunk of n values, packed_fp32.c) */
static int32_t g_bmg_tail[9][8] __attribute__((aligned(32)));
#endif

__attribute__((constructor)) static void init_tables(void) {
  for (int b = 0; b < 256; b++) {
    g_nm_lane[b] = (uint32_t)(b & 3) | (uint32_t)((b >> 2) & 3) << 8 | (uint32_t)(4 + ((b >> 4) & 3)) << 16 |
                   (uint32_t)(4 + ((b >> 6) & 3)) << 24;
#if HFS_SIMD
    const int lanes[4] = {b & 3, (b >> 2) & 3, 4 + ((b >> 4) & 3), 4 + ((b >> 6) & 3)};
    for (int i = 0; i < 8; i++) g_nm_inv[b][i] = -1;
    for (int k = 0; k < 4; k++) g_nm_inv[b][lanes[k]] = k;
    for (int i = 0, k = 0; i < 8; i++) {
      g_bm_lanes[b][i] = (b >> i & 1) ? k++ : -1;
      g_bm_pos[b][i] = 0;
    }
    for (int i = 0, k = 0; i < 8; i++)
      if (b >> i & 1) g_bm_pos[b][k++] = i;
    for (int i = 0, k = 0; i < 8; i++) {
      const uint8_t rank = (uint8_t)((b >> i & 1) ? k++ : 0x80);
      g_bm_c0[b][i] = rank;
      g_bm_c0[b][8 + i] = (uint8_t)__builtin_popcount((unsigned)b);
      g_bm_c1[b][i] = 0;
      g_bm_c1[b][8 + i] = rank;
    }
    if (b <= 8)
      for (int i = 0; i < 8; i++) g_bmg_tail[b][i] = i < b ? -1 : 0;
#endif
  }
}

#endif
