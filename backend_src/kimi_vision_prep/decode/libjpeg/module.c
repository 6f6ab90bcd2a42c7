/* Rows of a JPEG decoded by the libjpeg-turbo that Pillow itself decodes with.
 *
 * kimi_vision_prep.decode.jpeg_bands drives it; these files only talk to libjpeg (README.md). The
 * module's functions:
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

#include "libjpeg.h"

PyObject *JpegError = NULL;

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

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(imaging_path) -> path of the libjpeg Pillow's _imaging links"},
    {"decode_rows", decode_rows, METH_VARARGS,
     "decode_rows(data, out, width, height, row_begin, row_end) -> (begin, end, entered): RGB rows into out"
     " (strict)"},
    {"decode_share", decode_share, METH_VARARGS,
     "decode_share(data, out, width, height, regions, index, multiple, min_rows, skip_cost, row_cost)"
     " -> (begin, end, entered): band `index` of a shared decode (strict)"},
    {"coefficient_header", coefficient_header, METH_VARARGS,
     "coefficient_header(data) -> (width, height, precision, progressive, arithmetic, color_space, components)"
     " (strict; coefficients.c)"},
    {"read_coefficients", read_coefficients, METH_VARARGS,
     "read_coefficients(data, blocks, quant) -> (smoothing, dc_missing): the quantized DCT blocks and tables"
     " (strict; coefficients.c)"},
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
