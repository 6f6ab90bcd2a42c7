/* The decode loop (README.md): rows of a JPEG as RGB into the caller's buffer, a band's or a
 * given range's, through libjpeg with Pillow's settings. Runs without the GIL. */

#include "libjpeg.h"

/* After the headers are read: a helper band steals its rows (0: none worth taking), then a band
 * that starts below a restart marker it may enter at reads the stream from there (*first: the
 * first row of the stream read; 0: the whole stream). `*headers` holds the patched headers for the
 * caller to free (volatile: a longjmp may come back to the caller's setjmp). */
static int open_band(j_decompress_ptr cinfo, const unsigned char *data, size_t size, JDIMENSION height,
                     JDIMENSION *begin, const sharing *share, entered_source *source,
                     unsigned char *volatile *headers, JDIMENSION *first) {
  JDIMENSION interval = 0;
  /* Band 0 starts at row 0 (decode_share passes it); a helper starts where it steals. */
  if (share->regions != NULL && share->index > 0 && !steal(share, cinfo, begin)) return 0;
  if (*begin > 0 && !share->tolerant && (*first = entry_row(cinfo, *begin, &interval)) > 0) {
    const unsigned char *tail = NULL;
    size_t header_size = 0, tail_size = 0;
    *headers = entered_headers(data, size, height, *first, interval, &header_size, &tail, &tail_size);
    if (*headers == NULL) {
      *first = 0;
    } else {
      lib.destroy_decompress(cinfo);
      lib.create_decompress(cinfo, JPEG_LIB_VERSION, sizeof(*cinfo));
      read_entered(cinfo, source, *headers, header_size, tail, tail_size);
      lib.read_header(cinfo, TRUE);
    }
  }
  return 1;
}

/* Rows from the decompressor's next one (row `first` + output_scanline of the image) into `out`,
 * a chunk at a time: to *end as given, or while the band's region has rows (commit_chunk). */
static void read_rows(j_decompress_ptr cinfo, unsigned char *out, size_t stride, JDIMENSION first, JDIMENSION end,
                      const sharing *share, strict_error *err) {
  JSAMPROW rows[ROWS_PER_CALL];
  for (;;) {
    const JDIMENSION row = first + cinfo->output_scanline;
    JDIMENSION count, i;
    if (share->regions != NULL)
      count = commit_chunk(share, row);
    else
      count = end - row < ROWS_PER_CALL ? end - row : ROWS_PER_CALL;
    if (count == 0) return;
    for (i = 0; i < count; i++) rows[i] = out + (size_t)(row + i) * stride;
    for (i = 0; i < count;) { /* read_scanlines may return fewer rows than asked for */
      JDIMENSION read = lib.read_scanlines(cinfo, rows + i, count - i);
      if (read == 0) {
        snprintf(err->message, sizeof(err->message), "libjpeg returned no row at %u", first + cinfo->output_scanline);
        longjmp(err->jump, 1);
      }
      i += read;
    }
  }
}

/* 0 on success, with [*begin, *end) the rows decoded and *entered the first row of the stream
 * decoded (0: the whole stream; else entered at a restart marker); -1 with err->message set. Runs
 * without the GIL. Without sharing it decodes [*begin, *end) as given; with it, the band's region. */
int decode_rows_nogil(const unsigned char *data, size_t size, unsigned char *out, JDIMENSION width, JDIMENSION height,
                      JDIMENSION *begin, JDIMENSION *end, JDIMENSION *entered, const sharing *share,
                      strict_error *err) {
  struct jpeg_decompress_struct cinfo;
  unsigned char *volatile headers = NULL; /* freed after a longjmp too */
  entered_source source;
  JDIMENSION first = 0;

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
  if (!open_band(&cinfo, data, size, height, begin, share, &source, &headers, &first)) {
    lib.destroy_decompress(&cinfo);
    *end = *begin = *entered = 0;
    return 0;
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
  read_rows(&cinfo, out, (size_t)width * 3, first, *end, share, err);
  *end = first + cinfo.output_scanline;
  *entered = first;
  /* The band that ends the image reads on to EOI, so a warning after the last row still refuses. */
  if (*end == height) lib.finish_decompress(&cinfo);
  lib.destroy_decompress(&cinfo);
  free(headers);
  return 0;
}
