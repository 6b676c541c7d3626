/* A compaction's newest rows, in C: which record holds each row's newest value and where that
 * value goes in the sorted result (the plan, memory_pool/newest.py's newest_places), and the
 * copies of those values out of the records (its pass 2).
 *
 * With torch the plan was a scatter with max over a table-sized buffer, a mask, a nonzero, a
 * sort of the kept ids and a scatter of their order; the copies an index_select and an
 * index_copy_ per record and table. On `kaggle` behind a 2.2 GB cache (a compaction of ~1 GiB
 * of journal, 1.9 M newest rows in 52 tables) that was ~0.28 s and ~0.35 s of the compactor's
 * thread, which on 2 cores comes out of the steps'. Here the plan is four passes over the ids
 * and a bitmap (sorted without a sort, as memory_pool/_rowsets.c does for a batch), and each
 * copy is one memcpy a row, straight from the record to its place.
 *
 * The torch code stays the definition (memory_pool/newest.py runs it when this file was not
 * built, or with DLRM_CXL_NO_NATIVE=1, and tests/test_newest_native.py compares both). Loaded
 * with ctypes (memory_pool/_native.py), the GIL let go: it runs on the compactor's thread. */
#include <stdint.h>
#include <string.h>

#include "_bitmap.h"

/* The plan of one table. ids[0..n): its ids in journal order, each in [0, rows). last: int32
 * scratch of rows elements (any contents on entry; n < 2^31). bits: (rows + 63) / 64 words and
 * summary: (words + 63) / 64 words, zero on entry and on return. kept, pos, dst: room for n.
 *
 * Writes kept[0..m): every id once, ascending; pos[0..m): the positions in ids of each id's last
 * occurrence (its newest value), ascending; dst[0..m): where the value at pos[k] goes, the
 * index in kept of ids[pos[k]]. Returns m, or -(i + 1) when ids[i] is outside [0, rows)
 * (nothing written then, the bitmaps untouched). */
int64_t dlrm_newest_places(const int64_t *ids, int64_t n, int64_t rows, int32_t *last, uint64_t *bits,
                           uint64_t *summary, int64_t *kept, int64_t *pos, int64_t *dst) {
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)ids[i] >= (uint64_t)rows)   /* (negative ids too) */
            return -(i + 1);
    /* 1. Each row's last position (a later one overwrites: journal order is age order). */
    for (int64_t i = 0; i < n; i++) {
        const uint64_t r = (uint64_t)ids[i];
        last[r] = (int32_t)i;
        bitmap_set(bits, summary, r);
    }
    /* 2. The newest positions, ascending (so grouped by record, as the caller cuts them). */
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        pos[m] = i;          /* (written always, kept when newest: no branch to mispredict) */
        m += last[ids[i]] == (int32_t)i;
    }
    /* 3. The rows, ascending, off the bitmap (cleared as it is read); last[] becomes each row's
     *    rank -- its place in the result. (Every position of 2. was read before.) */
    const int64_t distinct = bitmap_drain(bits, summary, rows, kept);
    for (int64_t j = 0; j < distinct; j++)
        last[kept[j]] = (int32_t)j;
    /* 4. Where each newest value goes. */
    for (int64_t k = 0; k < m; k++)
        dst[k] = last[ids[pos[k]]];
    return m;
}

/* dst row places[k] = src row rows[k], for k in [0, n): rows of rb bytes, dst holding dst_rows
 * of them and src src_rows (both laid end to end). Returns 0, or -(k + 1) when places[k] or
 * rows[k] is out of range (nothing copied then). */
int64_t dlrm_copy_rows_at(uint8_t *dst, int64_t dst_rows, const int64_t *places, const uint8_t *src,
                          int64_t src_rows, const int64_t *rows, int64_t n, int64_t rb) {
    for (int64_t k = 0; k < n; k++)
        if ((uint64_t)places[k] >= (uint64_t)dst_rows || (uint64_t)rows[k] >= (uint64_t)src_rows)
            return -(k + 1);
    for (int64_t k = 0; k < n; k++)
        memcpy(dst + places[k] * rb, src + rows[k] * rb, (size_t)rb);
    return 0;
}
