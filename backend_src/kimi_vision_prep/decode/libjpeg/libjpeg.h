/* What the C files of kimi_vision_prep._libjpeg share (README.md): the libjpeg functions bound at
 * run time (binding.c), the strict error manager, a band's share of one image's rows (bands.c), the
 * entry at a restart marker (restart.c) and the decode loop (decode.c). Every function one file
 * calls in another is hidden: the extension exports PyInit__libjpeg only (module.c). */

#ifndef KIMI_LIBJPEG_H
#define KIMI_LIBJPEG_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#define INTERNAL __attribute__((visibility("hidden")))

/* -- the binding (binding.c) --------------------------------------------------------------- */

typedef struct {
  __typeof__(&jpeg_std_error) std_error;
  __typeof__(&jpeg_CreateDecompress) create_decompress;
  __typeof__(&jpeg_mem_src) mem_src;
  __typeof__(&jpeg_resync_to_restart) resync_to_restart;
  __typeof__(&jpeg_read_header) read_header;
  __typeof__(&jpeg_start_decompress) start_decompress;
  __typeof__(&jpeg_skip_scanlines) skip_scanlines;
  __typeof__(&jpeg_read_scanlines) read_scanlines;
  __typeof__(&jpeg_read_coefficients) read_coefficients;
  __typeof__(&jpeg_finish_decompress) finish_decompress;
  __typeof__(&jpeg_destroy_decompress) destroy_decompress;
} jpeg_functions;


INTERNAL extern jpeg_functions lib;
INTERNAL extern int bound; /* bind() succeeded */

typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  int tolerant; /* see on_message */
  char message[JMSG_LENGTH_MAX];
} strict_error;

/* libjpeg's error_exit and emit_message for a strict_error: an error, or a warning the decode does
 * not let through, jumps to err->jump with err->message set. */
INTERNAL void on_error(j_common_ptr cinfo);
INTERNAL void on_message(j_common_ptr cinfo, int level);
INTERNAL PyObject *bind(PyObject *self, PyObject *args);

/* -- a band's rows (bands.c) ---------------------------------------------------------------- */

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

INTERNAL int steal(const sharing *share, j_decompress_ptr cinfo, JDIMENSION *begin);
INTERNAL JDIMENSION commit_chunk(const sharing *share, JDIMENSION scanline);

/* -- entering the scan at a restart marker (restart.c) ---------------------------------------- */

/* A source of two pieces, read where they are: the headers (a copy with the SOF's height
 * patched) and then the scan's data from a restart interval on, in the caller's buffer. Past its
 * end it refuses the file (a whole stream's end would be a warning, which refuses it too). */
typedef struct {
  struct jpeg_source_mgr pub;
  const unsigned char *tail;
  size_t tail_size;
  int tail_given;
} entered_source;

INTERNAL JDIMENSION entry_row(j_decompress_ptr cinfo, JDIMENSION row, JDIMENSION *interval);
INTERNAL unsigned char *entered_headers(const unsigned char *d, size_t n, JDIMENSION height, JDIMENSION first_row,
                                        JDIMENSION interval, size_t *header_size, const unsigned char **tail,
                                        size_t *tail_size);
INTERNAL void read_entered(j_decompress_ptr cinfo, entered_source *src, const unsigned char *headers,
                           size_t header_size, const unsigned char *tail, size_t tail_size);

/* -- the decode loop (decode.c) -------------------------------------------------------------- */

INTERNAL int decode_rows_nogil(const unsigned char *data, size_t size, unsigned char *out, JDIMENSION width,
                               JDIMENSION height, JDIMENSION *begin, JDIMENSION *end, JDIMENSION *entered,
                               const sharing *share, strict_error *err);

/* -- the coefficients of a stream (coefficients.c) ------------------------------------------ */

INTERNAL extern PyObject *JpegError; /* module.c */
INTERNAL PyObject *coefficient_header(PyObject *self, PyObject *args);
INTERNAL PyObject *read_coefficients(PyObject *self, PyObject *args);

#endif
