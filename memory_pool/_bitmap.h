/* A set of rows as a bitmap with a summary (one bit per row; one summary bit per word of rows,
 * so that a scan skips 4096 untouched rows at a time), shared by memory_pool/_rowsets.c and
 * memory_pool/_newest.c. */
#ifndef DLRM_BITMAP_H
#define DLRM_BITMAP_H
#include <stdint.h>

static inline void bitmap_set(uint64_t *bits, uint64_t *summary, uint64_t g) {
    bits[g >> 6] |= 1ULL << (g & 63);
    summary[g >> 12] |= 1ULL << ((g >> 6) & 63);
}

/* The rows set in [0, rows), ascending, written to out (when out is not NULL); every word
 * visited is cleared, so the bitmaps are zero again on return. Returns how many. */
static inline int64_t bitmap_drain(uint64_t *bits, uint64_t *summary, int64_t rows, int64_t *out) {
    const int64_t words = (rows + 63) >> 6, sw = (words + 63) >> 6;
    int64_t m = 0;
    for (int64_t s = 0; s < sw; s++) {
        uint64_t sb = summary[s];
        if (!sb)
            continue;
        summary[s] = 0;
        while (sb) {
            const int64_t w = (s << 6) + __builtin_ctzll(sb);
            sb &= sb - 1;
            uint64_t x = bits[w];
            bits[w] = 0;
            if (!out)
                continue;
            while (x) {
                out[m++] = (w << 6) + __builtin_ctzll(x);
                x &= x - 1;
            }
        }
    }
    return m;
}
#endif
