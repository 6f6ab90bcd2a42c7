/* Entering a JPEG's scan at a restart marker (README.md): a band that starts below one decodes
 * the headers, then the scan's data from that interval on, rather than entropy-decoding every row
 * above it. */

#include "libjpeg.h"

/* -- entering the scan at a restart marker ----------------------------------------------------
 * A stream with restart markers can be decoded from the start of any restart interval: the DC
 * predictions start over there, so the interval's codes mean the same as in a whole decode. A
 * band that starts at such an interval rather than skipping (entropy-decoding) every row above
 * decodes the headers, then the scan's data from that interval on, as an image whose height is
 * the rows left (the SOF's height patched). Its first iMCU row is only the context of the next
 * (the chroma upsampler reads the row above), so the band enters one iMCU row above its own rows,
 * at an interval numbered 8k: its restart markers then count from RST0 as a whole stream's do.
 * Sequential Huffman scans of every component at once (or one component of 1x1 sampling) only. */

static JDIMENSION ceil_div(JDIMENSION a, JDIMENSION b) { return (a + b - 1) / b; }

/* Where a band whose first row is `row` can enter the stream: the first row of the lowest iMCU
 * row above `row`'s that begins a restart interval numbered 8k, k >= 1 (that number in
 * *interval), so that at least the iMCU row above `row`'s is decoded as context; 0 when there is
 * none (then the band skips from the top). `cinfo` has read the headers. */
JDIMENSION entry_row(j_decompress_ptr cinfo, JDIMENSION row, JDIMENSION *interval) {
  const JDIMENSION imcu = (JDIMENSION)cinfo->max_v_samp_factor * DCTSIZE;
  JDIMENSION per_row, j;

  if (cinfo->restart_interval == 0 || cinfo->progressive_mode || cinfo->arith_code ||
      cinfo->comps_in_scan != cinfo->num_components ||
      (cinfo->num_components == 1 && (cinfo->max_h_samp_factor != 1 || cinfo->max_v_samp_factor != 1)))
    return 0;
  per_row = ceil_div(cinfo->image_width, (JDIMENSION)cinfo->max_h_samp_factor * DCTSIZE);
  for (j = row / imcu; j >= 2; j--) { /* iMCU row j - 1 is the context of j */
    const unsigned long mcu = (unsigned long)(j - 1) * per_row;
    if (mcu % cinfo->restart_interval == 0 && (mcu / cinfo->restart_interval) % 8 == 0) {
      *interval = (JDIMENSION)(mcu / cinfo->restart_interval);
      return (j - 1) * imcu;
    }
  }
  return 0;
}

/* Offsets in a JPEG's header of the SOF's 2-byte height and of the first byte after the SOS
 * segment; 0 when the segments are not the plain SOI, ..., SOF0/1, ..., SOS sequence. */
static int header_offsets(const unsigned char *d, size_t n, size_t *sof_height, size_t *scan_data) {
  size_t k = 2;
  int sof = 0;
  if (n < 4 || d[0] != 0xFF || d[1] != 0xD8) return 0;
  while (k + 4 <= n) {
    size_t length;
    if (d[k] != 0xFF) return 0;
    if (d[k + 1] == 0xFF) { /* a fill byte before a marker */
      k++;
      continue;
    }
    length = ((size_t)d[k + 2] << 8) | d[k + 3];
    if (length < 2 || k + 2 + length > n) return 0;
    if (d[k + 1] == 0xC0 || d[k + 1] == 0xC1) {
      *sof_height = k + 5; /* FF Cn, length (2), precision (1), height (2) */
      sof = 1;
    } else if (d[k + 1] == 0xDA) {
      *scan_data = k + 2 + length;
      return sof;
    }
    k += 2 + length;
  }
  return 0;
}

/* The offset just past the `count`-th restart marker (counted from 1) of the scan data from
 * `from`, each in sequence (RST0, RST1, ..., RST7, RST0, ...); 0 when the data ends or holds
 * anything else first. */
static size_t after_restart(const unsigned char *d, size_t n, size_t from, JDIMENSION count) {
  size_t k = from;
  JDIMENSION seen = 0;
  while (k + 1 < n) {
    const unsigned char *ff = memchr(d + k, 0xFF, n - 1 - k);
    unsigned char code;
    if (ff == NULL) return 0;
    k = (size_t)(ff - d);
    code = d[k + 1];
    if (code == 0x00) { /* a stuffed zero */
      k += 2;
    } else if (code == 0xFF) { /* a fill byte */
      k += 1;
    } else if (code == 0xD0 + seen % 8) {
      if (++seen == count) return k + 2;
      k += 2;
    } else {
      return 0;
    }
  }
  return 0;
}

static void entered_init(j_decompress_ptr cinfo) { (void)cinfo; }

static void entered_term(j_decompress_ptr cinfo) { (void)cinfo; }

static boolean entered_fill(j_decompress_ptr cinfo) {
  entered_source *src = (entered_source *)cinfo->src;
  strict_error *err = (strict_error *)cinfo->err;
  if (src->tail_given) {
    snprintf(err->message, sizeof(err->message), "premature end of the JPEG data");
    longjmp(err->jump, 1);
  }
  src->tail_given = 1;
  src->pub.next_input_byte = src->tail;
  src->pub.bytes_in_buffer = src->tail_size;
  return TRUE;
}

static void entered_skip(j_decompress_ptr cinfo, long count) {
  struct jpeg_source_mgr *src = cinfo->src;
  if (count <= 0) return;
  while ((size_t)count > src->bytes_in_buffer) {
    count -= (long)src->bytes_in_buffer;
    (void)(*src->fill_input_buffer)(cinfo);
  }
  src->next_input_byte += count;
  src->bytes_in_buffer -= (size_t)count;
}

/* The patched headers of the stream entered at restart interval `interval` as an image of the
 * rows from `first_row` on, and in *tail the scan's data from that interval on; NULL when the
 * stream does not allow it or memory is short. The caller frees the headers. */
unsigned char *entered_headers(const unsigned char *d, size_t n, JDIMENSION height, JDIMENSION first_row,
                               JDIMENSION interval, size_t *header_size, const unsigned char **tail,
                               size_t *tail_size) {
  size_t sof_height = 0, scan_data = 0, start;
  unsigned char *headers;
  if (!header_offsets(d, n, &sof_height, &scan_data)) return NULL;
  if (((JDIMENSION)d[sof_height] << 8 | d[sof_height + 1]) != height) return NULL;
  start = after_restart(d, n, scan_data, interval);
  if (start == 0) return NULL;
  headers = malloc(scan_data);
  if (headers == NULL) return NULL;
  memcpy(headers, d, scan_data);
  headers[sof_height] = (unsigned char)((height - first_row) >> 8);
  headers[sof_height + 1] = (unsigned char)((height - first_row) & 0xFF);
  *header_size = scan_data;
  *tail = d + start;
  *tail_size = n - start;
  return headers;
}

/* Reads `cinfo` from `headers` then `tail` (entered_source in `src`, which must outlive it). */
void read_entered(j_decompress_ptr cinfo, entered_source *src, const unsigned char *headers,
                  size_t header_size, const unsigned char *tail, size_t tail_size) {
  src->pub.init_source = entered_init;
  src->pub.fill_input_buffer = entered_fill;
  src->pub.skip_input_data = entered_skip;
  src->pub.resync_to_restart = lib.resync_to_restart;
  src->pub.term_source = entered_term;
  src->pub.next_input_byte = headers;
  src->pub.bytes_in_buffer = header_size;
  src->tail = tail;
  src->tail_size = tail_size;
  src->tail_given = 0;
  cinfo->src = &src->pub;
}
