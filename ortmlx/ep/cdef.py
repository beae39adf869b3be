"""C declarations of the ORT C API / plugin-EP ABI subset ortmlx uses.

The function tables (``OrtApi``, ``OrtEpApi``) are ABI: only the slot index of
each member matters. Slots we do not call are ``void*`` padding, so the layout
is exact without copying the whole header. Indices match the ``static_assert``
checks in ORT's ``onnxruntime_c_api.cc`` / ``ep_api.cc`` (e.g. ``GetEpApi`` is
317, ``OpAttr_GetTensorAttributeAsOrtValue`` is 362, ``TensorTypeAndShape_HasShape`` is 390) and were run on 1.31.1.
The type-info slots follow the same table: ``ReleaseCustomOpDomain`` is asserted 101 (so ``ReleaseTypeInfo``
is 98; ``CastTypeInfoToSequenceTypeInfo`` / ``GetSequenceElementType`` are 104 / 107 in version 2) and
``GetBuildInfoString`` is asserted 254 (so ``CastTypeInfoToOptionalTypeInfo`` / ``GetOptionalContainedTypeInfo``
are 250 / 251).

This is the one place that states the versions:
``ORT_API_VERSION`` is what we request from ``OrtApiBase::GetApi`` and
``EP_STRUCT_VERSION`` is what we claim in every struct we hand to ORT
(``OrtEpFactory``, ``OrtEp``, ``OrtNodeComputeInfo``, ``OrtNodeFusionOptions``).
ORT never reads members added after the claimed version.
"""

ORT_API_VERSION = 24          # TensorTypeAndShape_HasShape (slot 390) arrived in API 24
EP_STRUCT_VERSION = 23
MIN_ORT_VERSION = (1, 24)
#: onnxruntime releases (major, minor) this ABI table was run on; pyproject pins the same range
TESTED_ORT = ((1, 31), (1, 31))

API_SLOTS = {
    0: "OrtStatus* (*CreateStatus)(int code, const char* msg)",
    1: "int (*GetErrorCode)(const OrtStatus* status)",
    2: "const char* (*GetErrorMessage)(const OrtStatus* status)",
    51: "OrtStatus* (*GetTensorMutableData)(OrtValue* value, void** out)",
    55: "OrtStatus* (*CastTypeInfoToTensorInfo)(const OrtTypeInfo* type_info, const OrtTensorTypeAndShapeInfo** out)",
    56: "OrtStatus* (*GetOnnxTypeFromTypeInfo)(const OrtTypeInfo* type_info, int* out)",
    60: "OrtStatus* (*GetTensorElementType)(const OrtTensorTypeAndShapeInfo* info, int* out)",
    61: "OrtStatus* (*GetDimensionsCount)(const OrtTensorTypeAndShapeInfo* info, size_t* out)",
    62: "OrtStatus* (*GetDimensions)(const OrtTensorTypeAndShapeInfo* info, int64_t* dim_values, size_t n)",
    63: "OrtStatus* (*GetSymbolicDimensions)(const OrtTensorTypeAndShapeInfo* info, const char** dim_params, size_t n)",
    65: "OrtStatus* (*GetTensorTypeAndShape)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out)",
    88: "OrtStatus* (*KernelContext_GetInputCount)(const OrtKernelContext* context, size_t* out)",
    89: "OrtStatus* (*KernelContext_GetOutputCount)(const OrtKernelContext* context, size_t* out)",
    90: "OrtStatus* (*KernelContext_GetInput)(const OrtKernelContext* context, size_t index, const OrtValue** out)",
    91: "OrtStatus* (*KernelContext_GetOutput)(OrtKernelContext* context, size_t index, const int64_t* dims, size_t n, OrtValue** out)",
    93: "void (*ReleaseStatus)(OrtStatus* input)",
    96: "void (*ReleaseValue)(OrtValue* input)",
    98: "void (*ReleaseTypeInfo)(OrtTypeInfo* input)",
    99: "void (*ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo* input)",
    104: "OrtStatus* (*CastTypeInfoToSequenceTypeInfo)(const OrtTypeInfo* type_info, const OrtSequenceTypeInfo** out)",
    107: "OrtStatus* (*GetSequenceElementType)(const OrtSequenceTypeInfo* sequence_type_info, OrtTypeInfo** type_info)",
    250: "OrtStatus* (*CastTypeInfoToOptionalTypeInfo)(const OrtTypeInfo* type_info, const OrtOptionalTypeInfo** out)",
    251: "OrtStatus* (*GetOptionalContainedTypeInfo)(const OrtOptionalTypeInfo* optional_type_info, OrtTypeInfo** out)",
    272: "OrtStatus* (*ReadOpAttr)(const OrtOpAttr* op_attr, int type, void* data, size_t len, size_t* out)",
    289: "OrtStatus* (*GetValueInfoName)(const OrtValueInfo* value_info, const char** name)",
    290: "OrtStatus* (*GetValueInfoTypeInfo)(const OrtValueInfo* value_info, const OrtTypeInfo** type_info)",
    295: "void (*CreateKeyValuePairs)(OrtKeyValuePairs** out)",
    296: "void (*AddKeyValuePair)(OrtKeyValuePairs* kvps, const char* key, const char* value)",
    297: "const char* (*GetKeyValue)(const OrtKeyValuePairs* kvps, const char* key)",
    298: "void (*GetKeyValuePairs)(const OrtKeyValuePairs* kvps, const char* const** keys, const char* const** values, size_t* n)",
    300: "void (*ReleaseKeyValuePairs)(OrtKeyValuePairs* input)",
    307: "int (*HardwareDevice_Type)(const OrtHardwareDevice* device)",
    308: "uint32_t (*HardwareDevice_VendorId)(const OrtHardwareDevice* device)",
    309: "const char* (*HardwareDevice_Vendor)(const OrtHardwareDevice* device)",
    317: "const OrtEpApi* (*GetEpApi)(void)",
    326: "OrtStatus* (*ValueInfo_GetInitializerValue)(const OrtValueInfo* value_info, const OrtValue** value)",
    331: "OrtStatus* (*ValueInfo_IsConstantInitializer)(const OrtValueInfo* value_info, bool* out)",
    333: "OrtStatus* (*Graph_GetName)(const OrtGraph* graph, const char** graph_name)",
    334: "OrtStatus* (*Graph_GetModelPath)(const OrtGraph* graph, const char** model_path)",
    338: "OrtStatus* (*Graph_GetNumInputs)(const OrtGraph* graph, size_t* n)",
    339: "OrtStatus* (*Graph_GetInputs)(const OrtGraph* graph, const OrtValueInfo** inputs, size_t n)",
    340: "OrtStatus* (*Graph_GetNumOutputs)(const OrtGraph* graph, size_t* n)",
    341: "OrtStatus* (*Graph_GetOutputs)(const OrtGraph* graph, const OrtValueInfo** outputs, size_t n)",
    342: "OrtStatus* (*Graph_GetNumInitializers)(const OrtGraph* graph, size_t* n)",
    343: "OrtStatus* (*Graph_GetInitializers)(const OrtGraph* graph, const OrtValueInfo** initializers, size_t n)",
    344: "OrtStatus* (*Graph_GetNumNodes)(const OrtGraph* graph, size_t* n)",
    345: "OrtStatus* (*Graph_GetNodes)(const OrtGraph* graph, const OrtNode** nodes, size_t n)",
    346: "OrtStatus* (*Graph_GetParentNode)(const OrtGraph* graph, const OrtNode** node)",
    348: "OrtStatus* (*Node_GetId)(const OrtNode* node, size_t* node_id)",
    349: "OrtStatus* (*Node_GetName)(const OrtNode* node, const char** node_name)",
    350: "OrtStatus* (*Node_GetOperatorType)(const OrtNode* node, const char** operator_type)",
    351: "OrtStatus* (*Node_GetDomain)(const OrtNode* node, const char** domain_name)",
    352: "OrtStatus* (*Node_GetSinceVersion)(const OrtNode* node, int* since_version)",
    353: "OrtStatus* (*Node_GetNumInputs)(const OrtNode* node, size_t* n)",
    354: "OrtStatus* (*Node_GetInputs)(const OrtNode* node, const OrtValueInfo** inputs, size_t n)",
    355: "OrtStatus* (*Node_GetNumOutputs)(const OrtNode* node, size_t* n)",
    356: "OrtStatus* (*Node_GetOutputs)(const OrtNode* node, const OrtValueInfo** outputs, size_t n)",
    357: "OrtStatus* (*Node_GetNumImplicitInputs)(const OrtNode* node, size_t* n)",
    358: "OrtStatus* (*Node_GetImplicitInputs)(const OrtNode* node, const OrtValueInfo** inputs, size_t n)",
    359: "OrtStatus* (*Node_GetNumAttributes)(const OrtNode* node, size_t* n)",
    360: "OrtStatus* (*Node_GetAttributes)(const OrtNode* node, const OrtOpAttr** attributes, size_t n)",
    362: "OrtStatus* (*OpAttr_GetTensorAttributeAsOrtValue)(const OrtOpAttr* attribute, OrtValue** attr_tensor)",
    363: "OrtStatus* (*OpAttr_GetType)(const OrtOpAttr* attribute, int* type)",
    364: "OrtStatus* (*OpAttr_GetName)(const OrtOpAttr* attribute, const char** name)",
    365: "OrtStatus* (*Node_GetNumSubgraphs)(const OrtNode* node, size_t* n)",
    366: "OrtStatus* (*Node_GetSubgraphs)(const OrtNode* node, const OrtGraph** graphs, size_t n, const char** attribute_names)",
    378: "OrtStatus* (*GetTensorData)(const OrtValue* value, const void** out)",
    379: "OrtStatus* (*GetSessionOptionsConfigEntries)(const OrtSessionOptions* options, OrtKeyValuePairs** out)",
    390: "bool (*TensorTypeAndShape_HasShape)(const OrtTensorTypeAndShapeInfo* info)",
}

EP_API_SLOTS = {
    0: "OrtStatus* (*CreateEpDevice)(OrtEpFactory* f, const OrtHardwareDevice* hw, const OrtKeyValuePairs* meta, const OrtKeyValuePairs* opts, OrtEpDevice** out)",
    1: "void (*ReleaseEpDevice)(OrtEpDevice* input)",
    2: "OrtStatus* (*EpGraphSupportInfo_AddNodesToFuse)(OrtEpGraphSupportInfo* info, const OrtNode* const* nodes, size_t n, const OrtNodeFusionOptions* opts)",
    3: "OrtStatus* (*EpGraphSupportInfo_AddSingleNode)(OrtEpGraphSupportInfo* info, const OrtNode* node)",
    4: "const char* (*NodeComputeContext_NodeName)(const OrtNodeComputeContext* context)",
}


def _table(name: str, slots: dict[int, str]) -> str:
    """A struct of function pointers with ``void*`` padding in the slots we don't use."""
    body = [f"    {slots[i]};" if i in slots else f"    void* _slot{i};" for i in range(max(slots) + 1)]
    return "\n".join([f"struct {name} {{", *body, "};"])


TYPES = """
typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtTypeInfo OrtTypeInfo;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtSequenceTypeInfo OrtSequenceTypeInfo;
typedef struct OrtOptionalTypeInfo OrtOptionalTypeInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtLogger OrtLogger;
typedef struct OrtOpAttr OrtOpAttr;
typedef struct OrtValueInfo OrtValueInfo;
typedef struct OrtNode OrtNode;
typedef struct OrtGraph OrtGraph;
typedef struct OrtHardwareDevice OrtHardwareDevice;
typedef struct OrtEpDevice OrtEpDevice;
typedef struct OrtKeyValuePairs OrtKeyValuePairs;
typedef struct OrtMemoryInfo OrtMemoryInfo;
typedef struct OrtMemoryDevice OrtMemoryDevice;
typedef struct OrtAllocator OrtAllocator;
typedef struct OrtRunOptions OrtRunOptions;
typedef struct OrtEpGraphSupportInfo OrtEpGraphSupportInfo;
typedef struct OrtNodeComputeContext OrtNodeComputeContext;
typedef struct OrtDataTransferImpl OrtDataTransferImpl;
typedef struct OrtSyncStreamImpl OrtSyncStreamImpl;
typedef struct OrtKernelRegistry OrtKernelRegistry;
typedef struct OrtApi OrtApi;
typedef struct OrtEpApi OrtEpApi;
typedef struct OrtEp OrtEp;
typedef struct OrtEpFactory OrtEpFactory;
typedef struct OrtNodeComputeInfo OrtNodeComputeInfo;

typedef struct OrtApiBase {
    const OrtApi* (*GetApi)(uint32_t version);
    const char* (*GetVersionString)(void);
} OrtApiBase;

typedef struct OrtNodeFusionOptions {
    uint32_t ort_version_supported;
    bool drop_constant_initializers;
} OrtNodeFusionOptions;

struct OrtNodeComputeInfo {
    uint32_t ort_version_supported;
    OrtStatus* (*CreateState)(OrtNodeComputeInfo* this_ptr, OrtNodeComputeContext* ctx, void** state);
    OrtStatus* (*Compute)(OrtNodeComputeInfo* this_ptr, void* state, OrtKernelContext* kernel_context);
    void (*ReleaseState)(OrtNodeComputeInfo* this_ptr, void* state);
};

/* Member order of the released headers. We fill members up to 1.23 and claim 23;
   the later members and a zero tail exist so a wrong claim reads NULL, not heap garbage. */
struct OrtEp {
    uint32_t ort_version_supported;
    const char* (*GetName)(const OrtEp* this_ptr);
    OrtStatus* (*GetCapability)(OrtEp* this_ptr, const OrtGraph* graph, OrtEpGraphSupportInfo* info);
    OrtStatus* (*Compile)(OrtEp* this_ptr, const OrtGraph** graphs, const OrtNode** fused_nodes, size_t count,
                          OrtNodeComputeInfo** node_compute_infos, OrtNode** ep_context_nodes);
    void (*ReleaseNodeComputeInfos)(OrtEp* this_ptr, OrtNodeComputeInfo** infos, size_t n);
    void* GetPreferredDataLayout;
    void* ShouldConvertDataLayoutForOp;
    void* SetDynamicOptions;
    void* OnRunStart;
    void* OnRunEnd;
    void* CreateAllocator;
    void* CreateSyncStreamForDevice;
    void* GetCompiledModelCompatibilityInfo;   /* last 1.23 member */
    void* _after_1_23[32];
};

struct OrtEpFactory {
    uint32_t ort_version_supported;
    const char* (*GetName)(const OrtEpFactory* this_ptr);
    const char* (*GetVendor)(const OrtEpFactory* this_ptr);
    OrtStatus* (*GetSupportedDevices)(OrtEpFactory* this_ptr, const OrtHardwareDevice* const* devices, size_t num_devices,
                                      OrtEpDevice** ep_devices, size_t max_ep_devices, size_t* num_ep_devices);
    OrtStatus* (*CreateEp)(OrtEpFactory* this_ptr, const OrtHardwareDevice* const* devices,
                           const OrtKeyValuePairs* const* ep_metadata, size_t num_devices,
                           const OrtSessionOptions* session_options, const OrtLogger* logger, OrtEp** ep);
    void (*ReleaseEp)(OrtEpFactory* this_ptr, OrtEp* ep);
    uint32_t (*GetVendorId)(const OrtEpFactory* this_ptr);
    const char* (*GetVersion)(const OrtEpFactory* this_ptr);
    void* ValidateCompiledModelCompatibilityInfo;
    void* CreateAllocator;
    void* ReleaseAllocator;
    OrtStatus* (*CreateDataTransfer)(OrtEpFactory* this_ptr, OrtDataTransferImpl** data_transfer);
    bool (*IsStreamAware)(const OrtEpFactory* this_ptr);
    void* CreateSyncStreamForDevice;            /* last 1.23 member */
    void* _after_1_23[32];
};
"""

CALLBACKS = """
extern "Python" {
    const char* ortmlx_factory_get_name(const OrtEpFactory*);
    const char* ortmlx_factory_get_vendor(const OrtEpFactory*);
    uint32_t ortmlx_factory_get_vendor_id(const OrtEpFactory*);
    const char* ortmlx_factory_get_version(const OrtEpFactory*);
    OrtStatus* ortmlx_factory_get_supported_devices(OrtEpFactory*, const OrtHardwareDevice* const*, size_t,
                                                    OrtEpDevice**, size_t, size_t*);
    OrtStatus* ortmlx_factory_create_ep(OrtEpFactory*, const OrtHardwareDevice* const*, const OrtKeyValuePairs* const*,
                                        size_t, const OrtSessionOptions*, const OrtLogger*, OrtEp**);
    void ortmlx_factory_release_ep(OrtEpFactory*, OrtEp*);
    OrtStatus* ortmlx_factory_create_data_transfer(OrtEpFactory*, OrtDataTransferImpl**);
    bool ortmlx_factory_is_stream_aware(const OrtEpFactory*);

    const char* ortmlx_ep_get_name(const OrtEp*);
    OrtStatus* ortmlx_ep_get_capability(OrtEp*, const OrtGraph*, OrtEpGraphSupportInfo*);
    OrtStatus* ortmlx_ep_compile(OrtEp*, const OrtGraph**, const OrtNode**, size_t, OrtNodeComputeInfo**, OrtNode**);
    void ortmlx_ep_release_node_compute_infos(OrtEp*, OrtNodeComputeInfo**, size_t);

    OrtStatus* ortmlx_nci_create_state(OrtNodeComputeInfo*, OrtNodeComputeContext*, void**);
    OrtStatus* ortmlx_nci_compute(OrtNodeComputeInfo*, void*, OrtKernelContext*);
    void ortmlx_nci_release_state(OrtNodeComputeInfo*, void*);
}
"""

# Small C helpers in the same library: one C call gathers every input of a Compute.
HELPERS_DECL = """
#define ORTMLX_MAX_RANK 16
OrtStatus* ortmlx_gather_inputs(const OrtApi* api, const OrtKernelContext* ctx, size_t n,
                                const void** data, int64_t* dims, size_t* ndims, int* types);
OrtStatus* ortmlx_get_output(const OrtApi* api, OrtKernelContext* ctx, size_t index,
                             const int64_t* dims, size_t ndim, void** data);
OrtStatus* ortmlx_get_outputs(const OrtApi* api, OrtKernelContext* ctx, size_t n,
                              const int64_t* dims, const int64_t* ndims, uint64_t* data);
void ortmlx_copy_blocks(size_t n, const uint64_t* dst, const uint64_t* src, const uint64_t* len);
int64_t ortmlx_compare_blocks(size_t n, const uint64_t* a, const uint64_t* b, const uint64_t* len);
size_t ortmlx_same_inputs(size_t n, size_t r, const void** data, const int64_t* dims, const size_t* ndims,
                          const int* types, const void** prev_data, int64_t* prev_dims, size_t* prev_ndims,
                          int* prev_types, int have_prev, int32_t* changed);
int64_t ortmlx_kv_write(size_t nbuf, const int32_t* starts, const int64_t* max_start, const int64_t* nblk,
                        const uint64_t* base, const uint64_t* rb, const uint64_t* rel_src, const uint64_t* len,
                        uint64_t flat, const uint64_t* row0_src, uint64_t* check_dst, uint64_t* check_src);
int ortmlx_pin_self(void);
"""

HELPERS_SRC = r"""
#include <dlfcn.h>
#include <string.h>
#define ORTMLX_MAX_RANK 16
/* Python objects point into this library: ORT's unregister must never unmap it. */
int ortmlx_pin_self(void) {
    Dl_info info;
    if (!dladdr((void*)&ortmlx_pin_self, &info) || !info.dli_fname) return -1;
    return dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE) ? 0 : -2;
}
OrtStatus* ortmlx_gather_inputs(const OrtApi* api, const OrtKernelContext* ctx, size_t n,
                                const void** data, int64_t* dims, size_t* ndims, int* types) {
    for (size_t i = 0; i < n; ++i) {
        const OrtValue* v = NULL;
        OrtTensorTypeAndShapeInfo* info = NULL;
        size_t nd = 0;
        OrtStatus* st = api->KernelContext_GetInput(ctx, i, &v);
        if (st) return st;
        if (!v) { ndims[i] = (size_t)-1; data[i] = NULL; types[i] = 0; continue; }  /* omitted optional */
        if ((st = api->GetTensorTypeAndShape(v, &info))) return st;
        if ((st = api->GetDimensionsCount(info, &nd))) goto done;
        if (nd > ORTMLX_MAX_RANK) { st = api->CreateStatus(2, "MLXExecutionProvider: input rank > 16"); goto done; }
        if ((st = api->GetDimensions(info, dims + i * ORTMLX_MAX_RANK, nd))) goto done;
        if ((st = api->GetTensorElementType(info, &types[i]))) goto done;
        ndims[i] = nd;
        st = api->GetTensorData(v, &data[i]);
    done:
        api->ReleaseTensorTypeAndShapeInfo(info);
        if (st) return st;
    }
    return NULL;
}
OrtStatus* ortmlx_get_output(const OrtApi* api, OrtKernelContext* ctx, size_t index,
                             const int64_t* dims, size_t ndim, void** data) {
    OrtValue* v = NULL;
    OrtStatus* st = api->KernelContext_GetOutput(ctx, index, dims, ndim, &v);
    if (st) return st;
    return api->GetTensorMutableData(v, data);
}
/* Outputs 0..n-1 with the given shapes (row i of dims, ndims[i] dims; ndims[i] < 0: skip it):
   their data addresses in data[i] (0 for a skipped output). */
OrtStatus* ortmlx_get_outputs(const OrtApi* api, OrtKernelContext* ctx, size_t n,
                              const int64_t* dims, const int64_t* ndims, uint64_t* data) {
    for (size_t i = 0; i < n; ++i) {
        void* p = NULL;
        data[i] = 0;
        if (ndims[i] < 0) continue;
        OrtStatus* st = ortmlx_get_output(api, ctx, i, dims + i * ORTMLX_MAX_RANK, (size_t)ndims[i], &p);
        if (st) return st;
        data[i] = (uint64_t)(uintptr_t)p;
    }
    return NULL;
}
/* Block copies and compares between addresses the caller checked (ORT's buffers, numpy arrays). */
void ortmlx_copy_blocks(size_t n, const uint64_t* dst, const uint64_t* src, const uint64_t* len) {
    for (size_t i = 0; i < n; ++i)
        memcpy((void*)(uintptr_t)dst[i], (const void*)(uintptr_t)src[i], (size_t)len[i]);
}
int64_t ortmlx_compare_blocks(size_t n, const uint64_t* a, const uint64_t* b, const uint64_t* len) {
    for (size_t i = 0; i < n; ++i)
        if (memcmp((const void*)(uintptr_t)a[i], (const void*)(uintptr_t)b[i], (size_t)len[i])) return (int64_t)i;
    return -1;
}
/* Which of n gathered inputs (ortmlx_gather_inputs' out-parameters; r: dims per input) do not have the address,
   rank, dims and type they had in the previous gather (prev_*, valid when have_prev): their indices, in order, in
   changed[0..k); returns k. Then prev_* = this gather's. An omitted input (rank (size_t)-1) always counts as changed. */
size_t ortmlx_same_inputs(size_t n, size_t r, const void** data, const int64_t* dims, const size_t* ndims,
                          const int* types, const void** prev_data, int64_t* prev_dims, size_t* prev_ndims,
                          int* prev_types, int have_prev, int32_t* changed) {
    size_t k = 0;
    for (size_t i = 0; i < n; ++i) {
        size_t nd = ndims[i];
        int same = have_prev && nd != (size_t)-1 && nd <= r && data[i] == prev_data[i] && nd == prev_ndims[i] &&
                   types[i] == prev_types[i] && !memcmp(dims + i * r, prev_dims + i * r, nd * sizeof(int64_t));
        if (!same) changed[k++] = (int32_t)i;
    }
    memcpy((void*)prev_data, data, n * sizeof(void*));
    memcpy(prev_dims, dims, n * r * sizeof(int64_t));
    memcpy(prev_ndims, ndims, n * sizeof(size_t));
    memcpy(prev_types, types, n * sizeof(int));
    return k;
}
/* One KV batch's copy-out (runtime/kvbatch.py, KvBatches.write). Buffer b's new rows start at row starts[b], which
   must lie in 0..max_start[b]; its nblk[b] blocks k (in order, nb = sum nblk in all) go from flat + rel_src[k] to
   base[k] + starts[b] * rb[k], len[k] bytes each. The next call's check is left in check_dst / check_src (2 nb
   each): [0, nb) the blocks' row 0 (base; their copies' addresses from row0_src when it is given and no start
   is 0), [nb, 2 nb) the rows just written. Returns the smallest start, or -1 - b for the first buffer b out of
   range (nothing written). */
int64_t ortmlx_kv_write(size_t nbuf, const int32_t* starts, const int64_t* max_start, const int64_t* nblk,
                        const uint64_t* base, const uint64_t* rb, const uint64_t* rel_src, const uint64_t* len,
                        uint64_t flat, const uint64_t* row0_src, uint64_t* check_dst, uint64_t* check_src) {
    int64_t lo = INT64_MAX;
    size_t nb = 0;
    for (size_t b = 0; b < nbuf; ++b) {
        if (starts[b] < 0 || (int64_t)starts[b] > max_start[b] || nblk[b] < 0) return -1 - (int64_t)b;
        if (starts[b] < lo) lo = starts[b];
        nb += (size_t)nblk[b];
    }
    size_t k = 0;
    for (size_t b = 0; b < nbuf; ++b)
        for (int64_t j = 0; j < nblk[b]; ++j, ++k) {
            uint64_t d = base[k] + (uint64_t)starts[b] * rb[k], s = flat + rel_src[k];
            memcpy((void*)(uintptr_t)d, (const void*)(uintptr_t)s, (size_t)len[k]);
            check_dst[k] = base[k];
            check_dst[nb + k] = d;
            check_src[nb + k] = s;
        }
    if (row0_src && lo > 0) memcpy(check_src, row0_src, nb * sizeof(uint64_t));
    return nbuf ? lo : 0;
}
"""

EXPORTS = """
OrtStatus* CreateEpFactories(const char* registered_name, const OrtApiBase* ort_api_base,
                             const OrtLogger* default_logger, OrtEpFactory** factories,
                             size_t max_factories, size_t* num_factories);
OrtStatus* ReleaseEpFactory(OrtEpFactory* factory);
"""


def c_types() -> str:
    """Valid C for both the cdef and the extension source."""
    return "\n".join([TYPES, _table("OrtApi", API_SLOTS), _table("OrtEpApi", EP_API_SLOTS)])


def cdef() -> str:
    return "\n".join([c_types(), CALLBACKS, HELPERS_DECL])
