/* Sets of rows a step touches, in C: the batch's distinct rows (the plan, dlrm_cxl/model.py) and
 * the recovery window's first touches (checkpointing/window.py).
 *
 * Both are per-step set operations over one numbering of a group of tables (table f's row r is
 * base[f] + r). NumPy does them with a sort (53k ids a step on `small`: ~0.6 ms, and ~1.4 ms of
 * the prefetch thread's CPU a step with the masks and splits around it) and with three fancy-
 * indexing passes over a byte map (~0.45 ms of the trainer's thread). Here each is one pass over
 * the ids and a bitmap that stays in the L2 cache (`small`'s 2.6M rows: 325 KB of bits).
 *
 * The NumPy code stays the definition (memory_pool/rowsets.py runs it when this file was not
 * built, and tests/test_rowsets.py compares both). Loaded with ctypes (memory_pool/_native.py):
 * not a Python module, no Python headers needed. */
#include <stdint.h>

#include "_bitmap.h"

/* The distinct rows of a batch, sorted, in one numbering.
 *
 * ids[0..n): table 0's ids, then table 1's, ... (lengths[f] of table f: a KeyedJaggedTensor's
 * values); table f has base[f + 1] - base[f] rows. bits: (base[ntables] + 63) / 64 words and
 * summary: (words + 63) / 64 words, all zero on entry and on return (one bit per row, one
 * summary bit per word of rows: the scan skips 4096 untouched rows at a time). out: room for n.
 *
 * Returns the number of distinct rows written to out (ascending), or -(i + 1) when ids[i] is
 * outside its table (nothing written then, and the bitmaps are zero again). */
int64_t dlrm_distinct_rows(const int64_t *ids, int64_t n, const int64_t *lengths, int64_t ntables,
                           const int64_t *base, uint64_t *bits, uint64_t *summary, int64_t *out) {
    int64_t i = 0, bad = -1;
    for (int64_t f = 0; f < ntables && bad < 0; f++) {
        const int64_t b = base[f], rows = base[f + 1] - base[f], end = i + lengths[f];
        for (; i < end; i++) {
            const int64_t r = ids[i];
            if ((uint64_t)r >= (uint64_t)rows) {   /* (negative ids too) */
                bad = i;
                break;
            }
            bitmap_set(bits, summary, (uint64_t)(b + r));
        }
    }
    /* In ascending order, the bitmaps cleared for the next batch (nothing written on an error). */
    const int64_t m = bitmap_drain(bits, summary, base[ntables], bad >= 0 ? (int64_t *)0 : out);
    return bad >= 0 ? -(bad + 1) : m;
}

/* The recovery window's first touches: of rows[0..n) (distinct rows in one numbering), those
 * whose byte in seen[0..nseen) is 0, in order, written to out (room for n); their bytes are set
 * to 1. Returns how many, or -(i + 1) when rows[i] is outside seen (nothing marked then). (One
 * byte a row, as the NumPy bool map it shares: its reset clears the window's rows with NumPy.) */
int64_t dlrm_first_touch(const int64_t *rows, int64_t n, uint8_t *seen, int64_t nseen, int64_t *out) {
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)rows[i] >= (uint64_t)nseen)
            return -(i + 1);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = rows[i];
        out[m] = r;          /* (written always, kept when new: no branch to mispredict) */
        m += !seen[r];
        seen[r] = 1;
    }
    return m;
}
