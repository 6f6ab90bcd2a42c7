/* The Triton C API (1.x) the C step calls, declared as tritonserver.h and tritonbackend.h declare
 * it, and weak: the shared object then also loads outside tritonserver (ctypes, for the kernel tests);
 * TRITONBACKEND_Initialize (backend.c) refuses a server that lacks any of them, by name (TRITON_API). */

#ifndef KIMI_TRITON_API_H
#define KIMI_TRITON_API_H

#include <stdint.h>

typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONSERVER_Message TRITONSERVER_Message;
typedef struct TRITONBACKEND_Backend TRITONBACKEND_Backend;
typedef struct TRITONBACKEND_Model TRITONBACKEND_Model;
typedef struct TRITONBACKEND_ModelInstance TRITONBACKEND_ModelInstance;
typedef struct TRITONBACKEND_Request TRITONBACKEND_Request;
typedef struct TRITONBACKEND_Response TRITONBACKEND_Response;
typedef struct TRITONBACKEND_Input TRITONBACKEND_Input;
typedef struct TRITONBACKEND_Output TRITONBACKEND_Output;
typedef struct TRITONBACKEND_ResponseFactory TRITONBACKEND_ResponseFactory;
typedef struct TRITONSERVER_MetricFamily TRITONSERVER_MetricFamily;
typedef struct TRITONSERVER_Metric TRITONSERVER_Metric;
typedef struct TRITONSERVER_Parameter TRITONSERVER_Parameter;

typedef enum { TYPE_UINT8 = 2, TYPE_INT32 = 8, TYPE_INT64 = 9, TYPE_FP32 = 11 } DataType;
typedef enum { MEMORY_CPU = 0, MEMORY_CPU_PINNED = 1, MEMORY_GPU = 2 } MemoryType;
typedef enum { LOG_INFO = 0, LOG_ERROR = 2 } LogLevel;
enum { REQUEST_RELEASE_ALL = 1, RESPONSE_COMPLETE_FINAL = 1, BACKEND_API_MAJOR = 1 };
enum { METRIC_KIND_COUNTER = 0, PARAMETER_STRING = 0 };

#define WEAK __attribute__((weak))
WEAK TRITONSERVER_Error *TRITONSERVER_ErrorNew(int code, const char *msg);
WEAK void TRITONSERVER_ErrorDelete(TRITONSERVER_Error *error);
WEAK const char *TRITONSERVER_ErrorMessage(TRITONSERVER_Error *error);
WEAK TRITONSERVER_Error *TRITONSERVER_MessageSerializeToJson(TRITONSERVER_Message *message, const char **base,
                                                             size_t *byte_size);
WEAK TRITONSERVER_Error *TRITONSERVER_MessageDelete(TRITONSERVER_Message *message);
WEAK TRITONSERVER_Error *TRITONSERVER_LogMessage(int level, const char *filename, int line, const char *msg);
WEAK TRITONSERVER_Error *TRITONBACKEND_ApiVersion(uint32_t *major, uint32_t *minor);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelName(TRITONBACKEND_Model *model, const char **name);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelConfig(TRITONBACKEND_Model *model, uint32_t config_version,
                                                   TRITONSERVER_Message **model_config);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelState(TRITONBACKEND_Model *model, void **state);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelSetState(TRITONBACKEND_Model *model, void *state);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceModel(TRITONBACKEND_ModelInstance *instance,
                                                          TRITONBACKEND_Model **model);
WEAK TRITONSERVER_Error *TRITONBACKEND_RequestInput(TRITONBACKEND_Request *request, const char *name,
                                                    TRITONBACKEND_Input **input);
WEAK TRITONSERVER_Error *TRITONBACKEND_InputProperties(TRITONBACKEND_Input *input, const char **name,
                                                       int *datatype, const int64_t **shape, uint32_t *dims_count,
                                                       uint64_t *byte_size, uint32_t *buffer_count);
WEAK TRITONSERVER_Error *TRITONBACKEND_InputBuffer(TRITONBACKEND_Input *input, uint32_t index, const void **buffer,
                                                   uint64_t *buffer_byte_size, int *memory_type,
                                                   int64_t *memory_type_id);
WEAK TRITONSERVER_Error *TRITONBACKEND_RequestOutputCount(TRITONBACKEND_Request *request, uint32_t *count);
WEAK TRITONSERVER_Error *TRITONBACKEND_RequestOutputName(TRITONBACKEND_Request *request, uint32_t index,
                                                         const char **output_name);
WEAK TRITONSERVER_Error *TRITONBACKEND_RequestRelease(TRITONBACKEND_Request *request, uint32_t release_flags);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseNew(TRITONBACKEND_Response **response, TRITONBACKEND_Request *request);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseFactoryNew(TRITONBACKEND_ResponseFactory **factory,
                                                         TRITONBACKEND_Request *request);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseFactoryDelete(TRITONBACKEND_ResponseFactory *factory);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseNewFromFactory(TRITONBACKEND_Response **response,
                                                             TRITONBACKEND_ResponseFactory *factory);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseOutput(TRITONBACKEND_Response *response, TRITONBACKEND_Output **output,
                                                      const char *name, int datatype, const int64_t *shape,
                                                      uint32_t dims_count);
WEAK TRITONSERVER_Error *TRITONBACKEND_OutputBuffer(TRITONBACKEND_Output *output, void **buffer,
                                                    uint64_t buffer_byte_size, int *memory_type,
                                                    int64_t *memory_type_id);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseSend(TRITONBACKEND_Response *response, uint32_t send_flags,
                                                    TRITONSERVER_Error *error);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceName(TRITONBACKEND_ModelInstance *instance, const char **name);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceState(TRITONBACKEND_ModelInstance *instance, void **state);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceSetState(TRITONBACKEND_ModelInstance *instance, void *state);
WEAK TRITONSERVER_Error *TRITONSERVER_MetricFamilyNew(TRITONSERVER_MetricFamily **family, int kind, const char *name,
                                                      const char *description);
WEAK TRITONSERVER_Error *TRITONSERVER_MetricNew(TRITONSERVER_Metric **metric, TRITONSERVER_MetricFamily *family,
                                                const TRITONSERVER_Parameter **labels, uint64_t label_count);
WEAK TRITONSERVER_Error *TRITONSERVER_MetricDelete(TRITONSERVER_Metric *metric);
WEAK TRITONSERVER_Error *TRITONSERVER_MetricIncrement(TRITONSERVER_Metric *metric, double value);
WEAK TRITONSERVER_Parameter *TRITONSERVER_ParameterNew(const char *name, int type, const void *value);
WEAK void TRITONSERVER_ParameterDelete(TRITONSERVER_Parameter *parameter);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportStatistics(TRITONBACKEND_ModelInstance *instance,
                                                                     TRITONBACKEND_Request *request, bool success,
                                                                     uint64_t exec_start_ns, uint64_t compute_start_ns,
                                                                     uint64_t compute_end_ns, uint64_t exec_end_ns);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportBatchStatistics(TRITONBACKEND_ModelInstance *instance,
                                                                          uint64_t batch_size, uint64_t exec_start_ns,
                                                                          uint64_t compute_start_ns,
                                                                          uint64_t compute_end_ns,
                                                                          uint64_t exec_end_ns);


#endif
