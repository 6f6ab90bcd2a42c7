/* Rows of a JPEG decoded by the libjpeg-turbo that Pillow itself decodes with.
 *
 * kimi_vision_prep.jpeg_bands drives it; this file only talks to libjpeg:
 *
 *   bind(imaging_path) -> str   resolve libjpeg's functions through Pillow's _imaging module
 *                               (dlsym on its handle searches the libraries it links, so these are
 *                               the very functions Pillow's JPEG decoder calls); returns the path
 *                               of the library they live in.
 *   decode_rows(data, out, width, height, row_begin, row_end, tolerant=False) -> (begin, end, entered)
 *                               decode rows [row_begin, row_end) of `data` as RGB into `out`, a
 *                               writable C-contiguous buffer of height * width * 3 bytes (row r at
 *                               offset r * width * 3); the rows above row_begin are skipped with
 *                               jpeg_skip_scanlines (entropy-decoded only), from a restart marker
 *                               where the stream has one above them (`entered`: the first row
 *                               decoded from there, else 0; see entry_row). Pillow's settings:
 *                               accurate integer IDCT, fancy upsampling. Strict: any libjpeg
 *                               error *or warning* (but bytes skipped before a marker, see
 *                               on_message) raises JpegError (a ValueError) with libjpeg's
 *                               message; bad arguments raise a plain ValueError. `tolerant`: the
 *                               damage libjpeg conceals (see on_message) is let through as Pillow
 *                               lets it, and no band enters at a restart marker.
 *                               The GIL is released while libjpeg runs.
 *   decode_share(data, out, width, height, regions, index, multiple, min_rows, skip_cost,
 *                row_cost, tolerant=False) -> (begin, end, entered)
 *                               band `index` of one image decoded by several threads: band 0
 *                               owns every row at first (regions[0] = height << 32); a band
 *                               that starts later steals the bottom of the region with the most
 *                               rows left (steal below), so a helper that wakes late takes less
 *                               and one that wakes after the end takes nothing (0, 0, 0).
 *
 * The headers are the system's libjpeg-turbo (Debian libjpeg62-turbo-dev); only the
 * JPEG_LIB_VERSION 62 ABI they describe is used, and jpeg_CreateDecompress checks it against the
 * library at every call (a mismatch is an error, never a wrong struct layout).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

static struct {
  __typeof__(&jpeg_std_error) std_error;
  __typeof__(&jpeg_CreateDecompress) create_decompress;
  __typeof__(&jpeg_mem_src) mem_src;
  __typeof__(&jpeg_resync_to_restart) resync_to_restart;
  __typeof__(&jpeg_read_header) read_header;
  __typeof__(&jpeg_start_decompress) start_decompress;
  __typeof__(&jpeg_skip_scanlines) skip_scanlines;
  __typeof__(&jpeg_read_scanlines) read_scanlines;
  __typeof__(&jpeg_finish_decompress) finish_decompress;
  __typeof__(&jpeg_destroy_decompress) destroy_decompress;
} lib;

static int bound = 0;
static PyObject *JpegError = NULL;

typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  int tolerant; /* see on_message */
  char message[JMSG_LENGTH_MAX];
} strict_error;

static void on_error(j_common_ptr cinfo) {
  strict_error *err = (strict_error *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

/* Level -1 is a warning (corrupt data libjpeg would skip over): strict, like simplejpeg's
 * strict mode, so such a file goes on to the next route and keeps Pillow's verdict there. One
 * warning is let through: bytes discarded before a marker (JWRN_EXTRANEOUS_DATA, e.g. padding
 * after a restart interval's last MCU). libjpeg reports it once the bytes are skipped, and the
 * marker after them is read as in a clean stream, so no pixel depends on it; a restart marker out
 * of sequence warns again (JWRN_MUST_RESYNC) and refuses. Matched by the library's own message
 * text: message numbers are not fixed across libjpeg-turbo versions, this text is.
 *
 * Tolerant (a stream whose damage the caller knows of, jpeg_scan's verdict): every warning is let
 * through, as Pillow lets it (its decoder ignores warnings), but the end of the data before EOI.
 * libjpeg then conceals the damage (grey for a segment's missing codes, resynchronising at the
 * next restart marker) exactly as in Pillow's decode of the same bytes; the memory source's end
 * is where Pillow's would wait for more data and then call the file truncated. */
static const char EXTRANEOUS_DATA[] = "Corrupt JPEG data: %u extraneous bytes before marker 0x%02x";
static const char END_OF_DATA[] = "Premature end of JPEG file";

static int is_message(const struct jpeg_error_mgr *err, const char *text) {
  return err->msg_code > 0 && err->msg_code <= err->last_jpeg_message &&
         err->jpeg_message_table[err->msg_code] != NULL && strcmp(err->jpeg_message_table[err->msg_code], text) == 0;
}

static void on_message(j_common_ptr cinfo, int level) {
  const strict_error *err = (const strict_error *)cinfo->err;
  if (level >= 0) return;
  if (err->tolerant ? is_message(&err->pub, END_OF_DATA) : !is_message(&err->pub, EXTRANEOUS_DATA)) on_error(cinfo);
}

#define ROWS_PER_CALL 16

/* A region word: the rows [committed, limit) a band still owns, as limit << 32 | committed. The
 * band commits each chunk before decoding it; a thief lowers the limit. Both by compare-and-swap,
 * so a band never decodes a row past a limit it was given and a thief never takes a committed row. */
#define REGION(limit, committed) (((uint64_t)(limit) << 32) | (uint64_t)(committed))
#define LIMIT(word) ((JDIMENSION)((word) >> 32))
#define COMMITTED(word) ((JDIMENSION)((word)&0xffffffffu))

typedef struct {
  uint64_t *regions; /* NULL: decode [row_begin, row_end) as given */
  Py_ssize_t count;
  Py_ssize_t index;
  JDIMENSION multiple;  /* a stolen region starts on a multiple of this */
  JDIMENSION min_rows;  /* and holds at least this many rows */
  double skip_cost;     /* a skipped row's cost against decoding it */
  double row_cost;      /* a decoded row's cost with its consumer's work (1 + row_work) */
  int tolerant;         /* damage let through (on_message); no band enters at a restart marker */
} sharing;

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
static JDIMENSION entry_row(j_decompress_ptr cinfo, JDIMENSION row, JDIMENSION *interval) {
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

/* A source of two pieces, read where they are: the headers (a copy with the SOF's height
 * patched) and then the scan's data from a restart interval on, in the caller's buffer. Past its
 * end it refuses the file (a whole stream's end would be a warning, which refuses it too). */
typedef struct {
  struct jpeg_source_mgr pub;
  const unsigned char *tail;
  size_t tail_size;
  int tail_given;
} entered_source;

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
static unsigned char *entered_headers(const unsigned char *d, size_t n, JDIMENSION height, JDIMENSION first_row,
                                      JDIMENSION interval, size_t *header_size, const unsigned char **tail,
                                      size_t *tail_size) {
  size_t sof_height, scan_data, start;
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
static void read_entered(j_decompress_ptr cinfo, entered_source *src, const unsigned char *headers,
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
static int steal(const sharing *share, j_decompress_ptr cinfo, JDIMENSION *begin) {
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
static JDIMENSION commit_chunk(const sharing *share, JDIMENSION scanline) {
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

/* 0 on success, with [*begin, *end) the rows decoded and *entered the first row of the stream
 * decoded (0: the whole stream; else entered at a restart marker); -1 with err->message set. Runs
 * without the GIL. Without sharing it decodes [*begin, *end) as given; with it, the band's region. */
static int decode_rows_nogil(const unsigned char *data, size_t size, unsigned char *out, JDIMENSION width,
                             JDIMENSION height, JDIMENSION *begin, JDIMENSION *end, JDIMENSION *entered,
                             const sharing *share, strict_error *err) {
  struct jpeg_decompress_struct cinfo;
  JSAMPROW rows[ROWS_PER_CALL];
  const size_t stride = (size_t)width * 3;
  unsigned char *volatile headers = NULL; /* freed after a longjmp too */
  entered_source source;
  JDIMENSION first = 0, interval = 0;

  memset(&cinfo, 0, sizeof(cinfo)); /* a failed create leaves nothing for destroy to free */
  cinfo.err = lib.std_error(&err->pub);
  err->pub.error_exit = on_error;
  err->pub.emit_message = on_message;
  err->tolerant = share->tolerant;
  if (setjmp(err->jump)) {
    lib.destroy_decompress(&cinfo);
    free(headers);
    return -1;
  }
  lib.create_decompress(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
  lib.mem_src(&cinfo, data, (unsigned long)size);
  lib.read_header(&cinfo, TRUE);
  /* Band 0 starts at row 0 (decode_share passes it); a helper starts where it steals. */
  if (share->regions != NULL && share->index > 0 && !steal(share, &cinfo, begin)) {
    lib.destroy_decompress(&cinfo);
    *end = *begin = *entered = 0;
    return 0;
  }
  if (*begin > 0 && !share->tolerant && (first = entry_row(&cinfo, *begin, &interval)) > 0) {
    const unsigned char *tail = NULL;
    size_t header_size = 0, tail_size = 0;
    headers = entered_headers(data, size, height, first, interval, &header_size, &tail, &tail_size);
    if (headers == NULL) {
      first = 0;
    } else {
      lib.destroy_decompress(&cinfo);
      lib.create_decompress(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
      read_entered(&cinfo, &source, headers, header_size, tail, tail_size);
      lib.read_header(&cinfo, TRUE);
    }
  }
  cinfo.out_color_space = JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  lib.start_decompress(&cinfo);
  if (cinfo.output_width != width || cinfo.output_height != height - first || cinfo.output_components != 3) {
    snprintf(err->message, sizeof(err->message), "libjpeg decodes %ux%ux%d from row %u, expected %ux%ux3",
             cinfo.output_width, cinfo.output_height, cinfo.output_components, first, width, height);
    lib.destroy_decompress(&cinfo);
    free(headers);
    return -1;
  }
  if (*begin > first) lib.skip_scanlines(&cinfo, *begin - first);
  for (;;) {
    const JDIMENSION row = first + cinfo.output_scanline;
    JDIMENSION count, i;
    if (share->regions != NULL)
      count = commit_chunk(share, row);
    else
      count = *end - row < ROWS_PER_CALL ? *end - row : ROWS_PER_CALL;
    if (count == 0) break;
    for (i = 0; i < count; i++) rows[i] = out + (size_t)(row + i) * stride;
    for (i = 0; i < count;) { /* read_scanlines may return fewer rows than asked for */
      JDIMENSION read = lib.read_scanlines(&cinfo, rows + i, count - i);
      if (read == 0) {
        snprintf(err->message, sizeof(err->message), "libjpeg returned no row at %u", first + cinfo.output_scanline);
        longjmp(err->jump, 1);
      }
      i += read;
    }
  }
  *end = first + cinfo.output_scanline;
  *entered = first;
  /* The band that ends the image reads on to EOI, so a warning after the last row still refuses. */
  if (*end == height) lib.finish_decompress(&cinfo);
  lib.destroy_decompress(&cinfo);
  free(headers);
  return 0;
}

static int check_out(const Py_buffer *out, unsigned int width, unsigned int height) {
  if (!bound) {
    PyErr_SetString(PyExc_RuntimeError, "libjpeg is not bound: call bind() first");
    return -1;
  }
  if ((size_t)out->len != (size_t)width * height * 3 || width == 0 || height == 0) {
    PyErr_Format(PyExc_ValueError, "out must be a C-contiguous %ux%ux3 buffer", height, width);
    return -1;
  }
  return 0;
}

static PyObject *run(Py_buffer *data, Py_buffer *out, unsigned int width, unsigned int height, JDIMENSION begin,
                     JDIMENSION end, const sharing *share) {
  strict_error err;
  JDIMENSION entered = 0;
  int status;

  Py_BEGIN_ALLOW_THREADS
  status = decode_rows_nogil(data->buf, (size_t)data->len, out->buf, width, height, &begin, &end, &entered, share,
                             &err);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(data);
  PyBuffer_Release(out);
  if (status != 0) {
    PyErr_SetString(JpegError, err.message);
    return NULL;
  }
  return Py_BuildValue("III", begin, end, entered);
}

static PyObject *decode_rows(PyObject *self, PyObject *args) {
  Py_buffer data, out;
  unsigned int width, height, row_begin, row_end;
  int tolerant = 0;
  sharing alone = {NULL, 0, 0, 1, 1, 0.0, 1.0, 0};

  if (!PyArg_ParseTuple(args, "y*w*IIII|p", &data, &out, &width, &height, &row_begin, &row_end, &tolerant))
    return NULL;
  alone.tolerant = tolerant;
  if (check_out(&out, width, height) < 0 || row_begin >= row_end || row_end > height) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_ValueError, "rows [%u, %u) are not within the %u rows", row_begin, row_end, height);
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return NULL;
  }
  return run(&data, &out, width, height, row_begin, row_end, &alone);
}

static PyObject *decode_share(PyObject *self, PyObject *args) {
  Py_buffer data, out, regions;
  unsigned int width, height, multiple, min_rows;
  Py_ssize_t index;
  double skip_cost, row_cost;
  sharing share;
  int tolerant = 0;
  PyObject *result;

  if (!PyArg_ParseTuple(args, "y*w*IIw*nIIdd|p", &data, &out, &width, &height, &regions, &index, &multiple,
                        &min_rows, &skip_cost, &row_cost, &tolerant))
    return NULL;
  share.tolerant = tolerant;
  share.regions = regions.buf;
  share.count = regions.len / (Py_ssize_t)sizeof(uint64_t);
  share.index = index;
  share.multiple = multiple;
  share.min_rows = min_rows;
  share.skip_cost = skip_cost;
  share.row_cost = row_cost;
  if (check_out(&out, width, height) < 0 || regions.len % sizeof(uint64_t) != 0 || index < 0 ||
      index >= share.count || multiple == 0 || !(row_cost > skip_cost / 2.0)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad regions, index, multiple or costs");
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    PyBuffer_Release(&regions);
    return NULL;
  }
  result = run(&data, &out, width, height, 0, height, &share);
  PyBuffer_Release(&regions); /* the caller keeps the array alive until every band has returned */
  return result;
}

#define RESOLVE(field, symbol)                                                      \
  do {                                                                              \
    *(void **)(&lib.field) = dlsym(handle, symbol);                                 \
    if (lib.field == NULL) {                                                        \
      PyErr_Format(PyExc_ImportError, "%s not found beside %s", symbol, imaging);   \
      return NULL;                                                                  \
    }                                                                               \
  } while (0)

/* Whether the library takes a decompressor of this build's JPEG_LIB_VERSION and struct size
 * (headers of another ABI, e.g. Ubuntu's version 80 against Pillow's 62, would fail every call). */
static int abi_matches(strict_error *err) {
  struct jpeg_decompress_struct probe;

  memset(&probe, 0, sizeof(probe));
  probe.err = lib.std_error(&err->pub);
  err->pub.error_exit = on_error;
  err->pub.emit_message = on_message;
  err->tolerant = 0;
  if (setjmp(err->jump)) {
    lib.destroy_decompress(&probe);
    return 0;
  }
  lib.create_decompress(&probe, JPEG_LIB_VERSION, sizeof(probe));
  lib.destroy_decompress(&probe);
  return 1;
}

static PyObject *bind(PyObject *self, PyObject *args) {
  const char *imaging;
  void *handle;
  Dl_info where;
  strict_error message;

  if (!PyArg_ParseTuple(args, "s", &imaging)) return NULL;
  /* Never closed: the module stays loaded for the life of the process, as Pillow's does. */
  handle = dlopen(imaging, RTLD_NOW | RTLD_LOCAL);
  if (handle == NULL) {
    PyErr_Format(PyExc_ImportError, "dlopen(%s): %s", imaging, dlerror());
    return NULL;
  }
  RESOLVE(std_error, "jpeg_std_error");
  RESOLVE(create_decompress, "jpeg_CreateDecompress");
  RESOLVE(mem_src, "jpeg_mem_src");
  RESOLVE(resync_to_restart, "jpeg_resync_to_restart");
  RESOLVE(read_header, "jpeg_read_header");
  RESOLVE(start_decompress, "jpeg_start_decompress");
  RESOLVE(skip_scanlines, "jpeg_skip_scanlines");
  RESOLVE(read_scanlines, "jpeg_read_scanlines");
  RESOLVE(finish_decompress, "jpeg_finish_decompress");
  RESOLVE(destroy_decompress, "jpeg_destroy_decompress");
  if (!abi_matches(&message)) {
    PyErr_Format(PyExc_ImportError, "the libjpeg beside %s does not take these headers' ABI (%s)", imaging,
                 message.message);
    return NULL;
  }
  bound = 1;
  if (dladdr(*(void **)(&lib.read_scanlines), &where) == 0 || where.dli_fname == NULL) return PyUnicode_FromString(imaging);
  return PyUnicode_FromString(where.dli_fname);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(imaging_path) -> path of the libjpeg Pillow's _imaging links"},
    {"decode_rows", decode_rows, METH_VARARGS,
     "decode_rows(data, out, width, height, row_begin, row_end) -> (begin, end, entered): RGB rows into out"
     " (strict)"},
    {"decode_share", decode_share, METH_VARARGS,
     "decode_share(data, out, width, height, regions, index, multiple, min_rows, skip_cost, row_cost)"
     " -> (begin, end, entered): band `index` of a shared decode (strict)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_libjpeg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__libjpeg(void) {
  PyObject *m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  JpegError = PyErr_NewException("kimi_vision_prep._libjpeg.JpegError", PyExc_ValueError, NULL);
  if (JpegError == NULL || PyModule_AddObjectRef(m, "JpegError", JpegError) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
