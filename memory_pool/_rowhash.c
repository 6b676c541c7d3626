/* The initial value of a table's rows (memory_pool/initializers.py, version 2), in C.
 *
 * The same definition as ``initializers.uniform_rows``' NumPy code, element for element: a
 * 64-bit key per row, then per column murmur3's 32-bit finaliser, the top 24 bits scaled in
 * float32. Bit-identical to it (tests/test_pool.py compares both over many rows, seeds and
 * widths) as long as the compiler keeps the two float32 operations apart: setup.py builds this
 * with -ffp-contract=off (a fused multiply-add would round once, not twice) and without
 * -ffast-math.
 *
 * Why: a DRAM cache creates ~2-5k never-trained rows a batch on `kaggle` (memory_pool/fresh.py),
 * ~20 tables a batch. NumPy spends ~12 passes over each row's floats and ~35 us of fixed work a
 * call; this is one pass and a call. Loaded with ctypes (memory_pool/_native.py): not a Python
 * module, no Python headers needed. */
#include <stdint.h>

static inline uint64_t fmix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

/* Rows ``rows[0..n)`` of a table initialised from ``seed``, ``dim`` floats each, uniform in
 * [-scale, scale) as x * two_s - scale (two_s = 2 scale / 2^24, rounded to float32 by the
 * caller). Row i goes to ``out + at[i] * stride`` (``at`` NULL: ``out + i * stride``). */
__attribute__((target_clones("avx2", "default")))   /* (one build, vector code where the CPU has it) */
void dlrm_uniform_rows(uint64_t seed, const int64_t *rows, int64_t n, int64_t dim, float two_s,
                       float scale, float *out, const int64_t *at, int64_t stride) {
    const uint64_t key = fmix64(seed ^ 0x5851F42D4C957F2DULL);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t k = (uint32_t)(fmix64((uint64_t)rows[i] * 0x9E3779B97F4A7C15ULL + key) >> 32);
        float *o = out + (at ? at[i] : i) * stride;
        for (int64_t j = 0; j < dim; j++) {
            uint32_t z = k + (uint32_t)j * 0x9E3779B9u;
            z ^= z >> 16;
            z *= 0x85EBCA6Bu;
            z ^= z >> 13;
            z *= 0xC2B2AE35u;
            z ^= z >> 16;
            float v = (float)(int32_t)(z >> 8);   /* exact: 24 bits (signed: a vector conversion) */
            v = v * two_s;               /* rounded once to float32 ... */
            o[j] = v - scale;            /* ... and once more: never fused */
        }
    }
}
