/* Rows of a JPEG decoded by the libjpeg-turbo that Pillow itself decodes with.
 *
 * kimi_vision_prep.jpeg_bands drives it; this file only talks to libjpeg:
 *
 *   bind(imaging_path) -> str   resolve libjpeg's functions through Pillow's _imaging module
 *                               (dlsym on its handle searches the libraries it links, so these are
 *                               the very functions Pillow's JPEG decoder calls); returns the path
 *                               of the library they live in.
 *   decode_rows(data, out, width, height, row_begin, row_end) -> (begin, end)
 *                               decode rows [row_begin, row_end) of `data` as RGB into `out`, a
 *                               writable C-contiguous buffer of height * width * 3 bytes (row r at
 *                               offset r * width * 3); the rows above row_begin are skipped with
 *                               jpeg_skip_scanlines (entropy-decoded only). Pillow's settings:
 *                               accurate integer IDCT, fancy upsampling. Strict: any libjpeg
 *                               error *or warning* (but bytes skipped before a marker, see
 *                               on_message) raises JpegError (a ValueError) with libjpeg's
 *                               message; bad arguments raise a plain ValueError.
 *                               The GIL is released while libjpeg runs.
 *   decode_share(data, out, width, height, regions, index, multiple, min_rows, skip_cost,
 *                row_cost) -> (begin, end)
 *                               band `index` of one image decoded by several threads: band 0
 *                               owns every row at first (regions[0] = height << 32); a band
 *                               that starts later steals the bottom of the region with the most
 *                               rows left (steal below), so a helper that wakes late takes less
 *                               and one that wakes after the end takes nothing (0, 0).
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
#include <string.h>

#include <jpeglib.h>

static struct {
  __typeof__(&jpeg_std_error) std_error;
  __typeof__(&jpeg_CreateDecompress) create_decompress;
  __typeof__(&jpeg_mem_src) mem_src;
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
 * text: message numbers are not fixed across libjpeg-turbo versions, this text is. */
static const char EXTRANEOUS_DATA[] = "Corrupt JPEG data: %u extraneous bytes before marker 0x%02x";

static int pixel_neutral(const struct jpeg_error_mgr *err) {
  return err->msg_code > 0 && err->msg_code <= err->last_jpeg_message &&
         err->jpeg_message_table[err->msg_code] != NULL &&
         strcmp(err->jpeg_message_table[err->msg_code], EXTRANEOUS_DATA) == 0;
}

static void on_message(j_common_ptr cinfo, int level) {
  if (level < 0 && !pixel_neutral(cinfo->err)) on_error(cinfo);
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
} sharing;

/* Take the bottom of the region with the most rows left, split so that its owner and the thief
 * (who skips the rows above it first) finish together; 0 when none is worth taking. On success
 * the thief's own region word is [*begin, old limit). */
static int steal(const sharing *share, JDIMENSION *begin) {
  for (;;) {
    Py_ssize_t victim = -1, i;
    uint64_t seen = 0;
    JDIMENSION most = 0;
    for (i = 0; i < share->count; i++) {
      uint64_t word = __atomic_load_n(&share->regions[i], __ATOMIC_ACQUIRE);
      if (i != share->index && word != 0 && LIMIT(word) > COMMITTED(word) && LIMIT(word) - COMMITTED(word) > most) {
        most = LIMIT(word) - COMMITTED(word);
        victim = i;
        seen = word;
      }
    }
    if (victim < 0) return 0;
    {
      const double c = COMMITTED(seen), l = LIMIT(seen), r = share->row_cost;
      /* owner: (s - c) r; thief: skip_cost s + (l - s) r; equal at: */
      double split = r * (c + l) / (2.0 * r - share->skip_cost);
      JDIMENSION s = (JDIMENSION)split;
      s = (s + share->multiple - 1) / share->multiple * share->multiple;
      if (s < COMMITTED(seen)) s = (COMMITTED(seen) + share->multiple - 1) / share->multiple * share->multiple;
      if (s >= LIMIT(seen) || LIMIT(seen) - s < share->min_rows) return 0;
      if (__atomic_compare_exchange_n(&share->regions[victim], &seen, REGION(s, COMMITTED(seen)), 0, __ATOMIC_ACQ_REL,
                                      __ATOMIC_ACQUIRE)) {
        __atomic_store_n(&share->regions[share->index], REGION(LIMIT(seen), s), __ATOMIC_RELEASE);
        *begin = s;
        return 1;
      }
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

/* 0 on success, with [*begin, *end) the rows decoded; -1 with err->message set. Runs without the
 * GIL. Without sharing it decodes [*begin, *end) as given; with it, the band's region. */
static int decode_rows_nogil(const unsigned char *data, size_t size, unsigned char *out, JDIMENSION width,
                             JDIMENSION height, JDIMENSION *begin, JDIMENSION *end, const sharing *share,
                             strict_error *err) {
  struct jpeg_decompress_struct cinfo;
  JSAMPROW rows[ROWS_PER_CALL];
  const size_t stride = (size_t)width * 3;

  /* Band 0 starts at row 0 (decode_share passes it); a helper starts where it steals. */
  if (share->regions != NULL && share->index > 0 && !steal(share, begin)) {
    *end = *begin = 0;
    return 0;
  }
  memset(&cinfo, 0, sizeof(cinfo)); /* a failed create leaves nothing for destroy to free */
  cinfo.err = lib.std_error(&err->pub);
  err->pub.error_exit = on_error;
  err->pub.emit_message = on_message;
  if (setjmp(err->jump)) {
    lib.destroy_decompress(&cinfo);
    return -1;
  }
  lib.create_decompress(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
  lib.mem_src(&cinfo, data, (unsigned long)size);
  lib.read_header(&cinfo, TRUE);
  cinfo.out_color_space = JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  lib.start_decompress(&cinfo);
  if (cinfo.output_width != width || cinfo.output_height != height || cinfo.output_components != 3) {
    snprintf(err->message, sizeof(err->message), "libjpeg decodes %ux%ux%d, expected %ux%ux3",
             cinfo.output_width, cinfo.output_height, cinfo.output_components, width, height);
    lib.destroy_decompress(&cinfo);
    return -1;
  }
  if (*begin > 0) lib.skip_scanlines(&cinfo, *begin);
  for (;;) {
    JDIMENSION count, i;
    if (share->regions != NULL)
      count = commit_chunk(share, cinfo.output_scanline);
    else
      count = *end - cinfo.output_scanline < ROWS_PER_CALL ? *end - cinfo.output_scanline : ROWS_PER_CALL;
    if (count == 0) break;
    for (i = 0; i < count; i++) rows[i] = out + (size_t)(cinfo.output_scanline + i) * stride;
    for (i = 0; i < count;) { /* read_scanlines may return fewer rows than asked for */
      JDIMENSION read = lib.read_scanlines(&cinfo, rows + i, count - i);
      if (read == 0) {
        snprintf(err->message, sizeof(err->message), "libjpeg returned no row at %u", cinfo.output_scanline);
        longjmp(err->jump, 1);
      }
      i += read;
    }
  }
  *end = cinfo.output_scanline;
  /* The band that ends the image reads on to EOI, so a warning after the last row still refuses. */
  if (*end == height) lib.finish_decompress(&cinfo);
  lib.destroy_decompress(&cinfo);
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
  int status;

  Py_BEGIN_ALLOW_THREADS
  status = decode_rows_nogil(data->buf, (size_t)data->len, out->buf, width, height, &begin, &end, share, &err);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(data);
  PyBuffer_Release(out);
  if (status != 0) {
    PyErr_SetString(JpegError, err.message);
    return NULL;
  }
  return Py_BuildValue("II", begin, end);
}

static PyObject *decode_rows(PyObject *self, PyObject *args) {
  Py_buffer data, out;
  unsigned int width, height, row_begin, row_end;
  const sharing alone = {NULL, 0, 0, 1, 1, 0.0, 1.0};

  if (!PyArg_ParseTuple(args, "y*w*IIII", &data, &out, &width, &height, &row_begin, &row_end)) return NULL;
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
  PyObject *result;

  if (!PyArg_ParseTuple(args, "y*w*IIw*nIIdd", &data, &out, &width, &height, &regions, &index, &multiple, &min_rows,
                        &skip_cost, &row_cost))
    return NULL;
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
     "decode_rows(data, out, width, height, row_begin, row_end) -> (begin, end): RGB rows into out (strict)"},
    {"decode_share", decode_share, METH_VARARGS,
     "decode_share(data, out, width, height, regions, index, multiple, min_rows, skip_cost, row_cost)"
     " -> (begin, end): band `index` of a shared decode (strict)"},
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
