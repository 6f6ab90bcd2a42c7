/* One image's rows shared by several bands (README.md): each band's region is one word, committed
 * a chunk at a time by its owner and lowered by a thief, both by compare-and-swap. */

#include "libjpeg.h"

/* The row at which a thief taking [committed, limit) off its owner should start: where the owner
 * ((s - c) r) and the thief (skip_cost s + (l - s) r) finish together, on a multiple. */
static JDIMENSION split_row(const sharing *share, uint64_t seen, double skip_cost) {
  const double c = COMMITTED(seen), l = LIMIT(seen), r = share->row_cost;
  JDIMENSION s = (JDIMENSION)(r * (c + l) / (2.0 * r - skip_cost));
  s = (s + share->multiple - 1) / share->multiple * share->multiple;
  if (s < COMMITTED(seen)) s = (COMMITTED(seen) + share->multiple - 1) / share->multiple * share->multiple;
  return s;
}

/* Take the bottom of the region with the most rows left, split so that its owner and the thief
 * finish together: the thief enters at a restart marker where `cinfo` (headers read) has one
 * above the split (a few rows skipped), else skips every row above it; 0 when none is worth
 * taking. On success the thief's own region word is [*begin, old limit). */
int steal(const sharing *share, j_decompress_ptr cinfo, JDIMENSION *begin) {
  for (;;) {
    Py_ssize_t victim = -1, i;
    uint64_t seen = 0;
    JDIMENSION most = 0, s, interval;
    for (i = 0; i < share->count; i++) {
      uint64_t word = __atomic_load_n(&share->regions[i], __ATOMIC_ACQUIRE);
      if (i != share->index && word != 0 && LIMIT(word) > COMMITTED(word) && LIMIT(word) - COMMITTED(word) > most) {
        most = LIMIT(word) - COMMITTED(word);
        victim = i;
        seen = word;
      }
    }
    if (victim < 0) return 0;
    s = split_row(share, seen, 0.0);
    if (share->tolerant || entry_row(cinfo, s, &interval) == 0) s = split_row(share, seen, share->skip_cost);
    if (s >= LIMIT(seen) || LIMIT(seen) - s < share->min_rows) return 0;
    if (__atomic_compare_exchange_n(&share->regions[victim], &seen, REGION(s, COMMITTED(seen)), 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
      __atomic_store_n(&share->regions[share->index], REGION(LIMIT(seen), s), __ATOMIC_RELEASE);
      *begin = s;
      return 1;
    }
  }
}

/* How many rows from `scanline` to decode next: up to ROWS_PER_CALL within the limit, committed
 * first; 0 when the region is done (or taken). */
JDIMENSION commit_chunk(const sharing *share, JDIMENSION scanline) {
  uint64_t *word = &share->regions[share->index];
  uint64_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  for (;;) {
    JDIMENSION count;
    if (scanline >= LIMIT(seen)) return 0;
    count = LIMIT(seen) - scanline;
    if (count > ROWS_PER_CALL) count = ROWS_PER_CALL;
    if (__atomic_compare_exchange_n(word, &seen, REGION(LIMIT(seen), scanline + count), 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return count;
  }
}
