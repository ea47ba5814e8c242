// SPDX-License-Identifier: Apache-2.0
/* The backend plugin ABI: what crosses dlopen between the server and a backend plugin
 * (liblossd_cuda.so). Plain C: fixed-width integers, plain-data structs, opaque handles and
 * function pointers; no C++ type, no exception and no allocator ever crosses it. Compiles as
 * C and as C++; says nothing of how either side implements it (kernels/plugin_export.h serves
 * it over a lossd::Backend, kernels/plugin_backend.h is a lossd::Backend over it).
 *
 * A plugin exports one symbol, LossdPluginGetApi. The server asks it with the ABI version it
 * speaks; the plugin answers with its table of functions when the majors agree, else with
 * null, and in both cases writes the version it speaks, so the server can name both.
 *
 * Versions are major.minor (LOSSD_PLUGIN_ABI_VERSION packs them). The server loads a plugin
 * of its own major and a minor no newer than its own; it refuses any other, naming both
 * versions. An older minor loads because everything a minor adds goes at the end: a field at
 * the end of a struct, a function at the end of LossdBackendApi (whose struct_size tells how
 * far a plugin's table goes), a new value of an enumeration. So, under a MINOR bump:
 *   - a field appended to a struct the plugin writes (LossdBackendInfo, LossdStats): the server
 *     zeroes the struct first, so from an older plugin the field reads 0, which must mean
 *     absent (the value before the field existed);
 *   - a field appended to a struct the server fills (LossdProblem, LossdOutputs,
 *     LossdWorkspaceShape, LossdCudaOptions): an older plugin never reads it, so the server
 *     must not count on it there (a capability the plugin reports, as loss_kinds, or the
 *     plugin's minor, tells it may);
 *   - a function appended to LossdBackendApi: the server calls it only where struct_size
 *     covers it, and does without (or refuses, naming the plugin's version) where not;
 *   - a new enumeration value that a plugin of an older minor refuses (INVALID_ARGUMENT or
 *     UNIMPLEMENTED), or that a reported capability guards.
 * Anything else bumps the MAJOR (and resets the minor to 0): a field or function removed,
 * moved, resized or given another type or meaning, a field inserted before the end, a
 * changed entry point. Each field and function after 6.0 says the minor that added it, and
 * sits under #if LOSSD_PLUGIN_ABI_MINOR >= N: defining LOSSD_PLUGIN_ABI_MINOR to an older
 * minor before including this header builds a plugin of that minor (structs of that minor's
 * size; kernels/BUILD builds such a plugin for the loader's test). The server is always built
 * at the current minor.
 *
 * History, before major.minor (one number, refused now; a number below 1 << 16 is one of
 * these): 1 was a C++ lossd::Backend* across dlopen (LossdCudaAbiVersion); 3 added the hosted
 * head's optimizer_step and sum_of_squares; 4 the loss kinds (logprob, policy, distill): their
 * inputs, options and outputs, and which kinds a backend computes; 5 the policy loss types
 * cispo, sapo and luspo and their options. 6.0: version 5's structs and functions, versioned
 * major.minor (the entry point answers every minor of its major). 6.1: LossdBackendInfo's
 * compute_path. 6.2: a head group's communicator (lossd::Backend's CommAvailable, NewCommId,
 * ConnectComm and lossd::BackendComm's methods): the comm_* functions and LossdComm. 6.3: the
 * policy kind's rollout correction (is_ratio), importance-sampling level and verl's options
 * (the KL estimator and straight-through, entropy_coeff, the aggregation and its
 * loss_scale_factor) and distill's weight_hard_loss / weight_soft_loss at the end of
 * LossdProblem, and the loss type gpg; a plugin that computes
 * them says so in loss_kinds' option bits (core/loss_problem.h's kPolicy*Bit). 6.4: the loss
 * types geo_mean and kl_cov (LOSSD_POLICY_GEO_MEAN, _KL_COV, announced by kPolicyGeoMeanBit,
 * kPolicyKlCovBit) and kl_cov's kl_cov_ratio and ppo_kl_coef at the end of LossdProblem.
 * 6.5: the loss type vespo (LOSSD_POLICY_VESPO, announced by kPolicyVespoBit) and its gamma
 * shapes and rates at the end of LossdProblem. 6.6: the loss type cispo_clamp
 * (LOSSD_POLICY_CISPO_CLAMP, announced by kPolicyCispoClampBit); no new field.
 */
#ifndef LOSSD_KERNELS_PLUGIN_ABI_H_
#define LOSSD_KERNELS_PLUGIN_ABI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* major.minor packed into 32 bits: (major << 16) | minor. */
#define LOSSD_PLUGIN_ABI_MAJOR 6u
#define LOSSD_PLUGIN_ABI_CURRENT_MINOR 6u
#ifndef LOSSD_PLUGIN_ABI_MINOR
#define LOSSD_PLUGIN_ABI_MINOR LOSSD_PLUGIN_ABI_CURRENT_MINOR
#endif
#if LOSSD_PLUGIN_ABI_MINOR > LOSSD_PLUGIN_ABI_CURRENT_MINOR
#error "LOSSD_PLUGIN_ABI_MINOR is newer than this header"
#endif
#define LOSSD_PLUGIN_ABI_VERSION_OF(major, minor) \
  ((uint32_t)(((uint32_t)(major) << 16) | (uint32_t)(minor)))
#define LOSSD_PLUGIN_ABI_VERSION \
  LOSSD_PLUGIN_ABI_VERSION_OF(LOSSD_PLUGIN_ABI_MAJOR, LOSSD_PLUGIN_ABI_MINOR)
/* A version's major and minor; a number from before major.minor (below 1 << 16) is its own
 * major, minor 0. */
#define LOSSD_PLUGIN_ABI_MAJOR_OF(version) \
  ((uint32_t)(version) >> 16 == 0 ? (uint32_t)(version) : (uint32_t)(version) >> 16)
#define LOSSD_PLUGIN_ABI_MINOR_OF(version) \
  ((uint32_t)(version) >> 16 == 0 ? 0u : (uint32_t)(version) & 0xFFFFu)
#define LOSSD_PLUGIN_ENTRY_SYMBOL "LossdPluginGetApi"
/* What a version 1 plugin exported instead: uint32_t LossdCudaAbiVersion(void). */
#define LOSSD_PLUGIN_V1_VERSION_SYMBOL "LossdCudaAbiVersion"

/* Message prefix of a create that found no usable GPU (no device, or a driver too old for
 * the runtime), so callers can fall back to the CPU backend quietly. */
#define LOSSD_CUDA_NO_GPU_PREFIX "no GPU: "

/* Enumerations cross as int32_t with these values (lossd::DType, Memory, Reduction, GradOut,
 * LossKind, PolicyLossType). */
#define LOSSD_DTYPE_BF16 0
#define LOSSD_DTYPE_F16 1
#define LOSSD_DTYPE_F32 2
#define LOSSD_DTYPE_I32 3
#define LOSSD_DTYPE_I64 4
#define LOSSD_MEMORY_HOST 0
#define LOSSD_MEMORY_BACKEND 1 /* from the table's allocate (device memory on a GPU) */
#define LOSSD_REDUCTION_MEAN 0
#define LOSSD_REDUCTION_SUM 1
#define LOSSD_REDUCTION_NONE 2
#define LOSSD_GRAD_NONE 0
#define LOSSD_GRAD_WRITTEN 1
#define LOSSD_GRAD_ACCUMULATED 2
#define LOSSD_OPTIMIZER_SGD 0
#define LOSSD_OPTIMIZER_ADAMW 1
#define LOSSD_LOSS_CROSS_ENTROPY 0
#define LOSSD_LOSS_LOGPROB 1
#define LOSSD_LOSS_POLICY 2
#define LOSSD_LOSS_DISTILL 3
#define LOSSD_POLICY_DAPO 0
#define LOSSD_POLICY_GRPO 1
#define LOSSD_POLICY_BNPO 2
#define LOSSD_POLICY_DR_GRPO 3
#define LOSSD_POLICY_CISPO 4 /* version 5, as the two below */
#define LOSSD_POLICY_SAPO 5
#define LOSSD_POLICY_LUSPO 6
#define LOSSD_POLICY_GPG 7 /* 6.3 */
#define LOSSD_POLICY_GEO_MEAN 8 /* 6.4, as the one below */
#define LOSSD_POLICY_KL_COV 9
#define LOSSD_POLICY_VESPO 10 /* 6.5 */
#define LOSSD_POLICY_CISPO_CLAMP 11 /* 6.6 */
#define LOSSD_IMPORTANCE_SAMPLING_TOKEN 0 /* 6.3, as the values below */
#define LOSSD_IMPORTANCE_SAMPLING_SEQUENCE 1
#define LOSSD_KL_K3 0
#define LOSSD_KL_K1 1
#define LOSSD_KL_K2 2
#define LOSSD_KL_ABS 3
#define LOSSD_KL_LOW_VAR_KL 4
#define LOSSD_AGGREGATION_LOSS_TYPE 0
#define LOSSD_AGGREGATION_TOKEN_MEAN 1
#define LOSSD_AGGREGATION_SEQ_MEAN_TOKEN_SUM 2
#define LOSSD_AGGREGATION_SEQ_MEAN_TOKEN_MEAN 3
#define LOSSD_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM 4

/* The outcome of a call. code: 0 is OK, anything else a canonical status code (absl's and
 * gRPC's numbers: 3 INVALID_ARGUMENT, 8 RESOURCE_EXHAUSTED, 14 UNAVAILABLE ...). The caller
 * owns message: the callee writes a NUL-terminated text into it, cut to message_capacity - 1
 * bytes, and leaves it alone on success. */
typedef struct LossdStatus {
  int32_t code;
  char* message;
  size_t message_capacity;
} LossdStatus;

/* What create takes. */
typedef struct LossdCudaOptions {
  int32_t device;               /* CUDA device index */
  uint64_t memory_budget_bytes; /* most device bytes the backend may hold; 0 = no own limit */
  uint64_t chunk_budget_bytes;  /* chunk buffer + GEMM workspaces per Compute; 0 = the default
                                   (512 MiB, more for V > ~128K: DefaultChunkBudget) */
  /* 0: time cuBLASLt's candidates on the first Compute of each shape and keep the fastest;
   * 1: its first choice, the same in every process. */
  int32_t fixed_gemm_algorithms;
} LossdCudaOptions;

/* lossd::LossOptions (core/loss_problem.h says what each means). */
typedef struct LossdLossOptions {
  int64_t ignore_index;
  int32_t reduction; /* LOSSD_REDUCTION_* */
  float label_smoothing;
  float z_loss_scale;
  float softcap;
  float grad_scale;
  int64_t chunk_rows;
  int32_t token_scaling; /* 0 or 1 */
  float temperature;     /* version 4 */
} LossdLossOptions;

/* lossd::PolicyParams (version 4; the last four fields version 5). */
typedef struct LossdPolicyParams {
  int32_t loss_type; /* LOSSD_POLICY_* */
  float epsilon_low;
  float epsilon_high;
  float beta;
  int64_t sequences;
  int64_t max_completion_length;
  double dapo_normalizer;
  float sapo_temperature_pos;
  float sapo_temperature_neg;
  float delta;                    /* 0 = none */
  int32_t use_bias_correction_kl; /* 0 or 1 */
} LossdPolicyParams;

/* lossd::DistillParams (version 4). */
typedef struct LossdDistillParams {
  float jsd_beta;
} LossdDistillParams;

/* Rows of X that arrive while a Compute runs, and rows of dX that may leave (lossd::RowStream).
 * The plugin calls wait_x(ctx, r) before it reads rows [0, r) of X, in non-decreasing r; a
 * non-zero return (written into *status as well) ends the Compute with that status. It calls
 * dx_ready(ctx, r) once rows [0, r) of dx are final, in increasing r, ending with BT; dx_ready
 * never blocks and may run on any thread, a device runtime's callback thread included. */
typedef struct LossdRowStream {
  void* ctx;
  int32_t (*wait_x)(void* ctx, int64_t rows, LossdStatus* status);
  void (*dx_ready)(void* ctx, int64_t rows);
} LossdRowStream;

/* One validated problem (lossd::LossProblem): views of caller-owned buffers. */
typedef struct LossdProblem {
  int64_t bt;
  int64_t h;
  int64_t v;
  int32_t dtype;               /* of x, w and bias: LOSSD_DTYPE_BF16, _F16 or _F32 */
  int32_t w_memory;            /* LOSSD_MEMORY_* of w and bias */
  const void* x;               /* (BT, H) row-major, dtype, host */
  const void* w;               /* (V, H) row-major, dtype, in w_memory */
  const void* bias;            /* (V) dtype, in w_memory; null = no bias */
  const void* targets;         /* (BT) target_dtype, host */
  int32_t target_dtype;        /* LOSSD_DTYPE_I32 or _I64 */
  const float* class_weights;  /* (V) host; null = all ones */
  const float* grad_output;    /* (BT) host; reduction none only; null = ones */
  LossdLossOptions options;
  const LossdRowStream* rows;  /* null: X is complete */
  /* Version 4: the loss kind and its inputs (core/loss_problem.h says what each means). */
  int32_t kind;                /* LOSSD_LOSS_* */
  const float* dlogp;          /* (BT) host; logprob; null = zeros */
  const float* dentropy;       /* (BT) host; logprob; null = zeros */
  const float* advantages;     /* (BT) host; policy */
  const float* old_logp;       /* (BT) host; policy; null = ratio 1 */
  const float* ref_logp;       /* (BT) host; policy; null = no KL term */
  LossdPolicyParams policy;
  int64_t teacher_h;           /* distill: the teacher's hidden size */
  int32_t teacher_w_memory;    /* LOSSD_MEMORY_* of teacher_w and teacher_bias */
  const void* teacher_x;       /* (BT, teacher_h) dtype, host */
  const void* teacher_w;       /* (V, teacher_h) dtype, in teacher_w_memory */
  const void* teacher_bias;    /* (V) dtype, in teacher_w_memory; null = none */
  LossdDistillParams distill;
#if LOSSD_PLUGIN_ABI_MINOR >= 3
  /* 6.3: the policy kind's options beyond version 5's (core/loss_problem.h's PolicyParams). A
   * plugin of an older minor never reads them: the server sends them only to a plugin whose
   * loss_kinds has the option's bit. */
  const float* is_ratio;       /* (BT) host; policy; null = 1 */
  int32_t importance_sampling; /* LOSSD_IMPORTANCE_SAMPLING_* */
  int32_t kl_estimator;        /* LOSSD_KL_* */
  int32_t kl_straight_through; /* 0 or 1 */
  float entropy_coeff;
  int32_t aggregation;         /* LOSSD_AGGREGATION_* */
  double loss_scale_factor;    /* 0 = the sequence length */
  /* 6.3: distill's hard-label term (LossdDistillParams' neighbours, core's DistillParams). */
  float distill_weight_hard_loss; /* 0: the divergence alone */
  float distill_weight_soft_loss; /* 1: the divergence alone */
#endif
#if LOSSD_PLUGIN_ABI_MINOR >= 4
  /* 6.4: the loss type kl_cov's options (read with LOSSD_POLICY_KL_COV only). */
  double kl_cov_ratio; /* (0, 1] */
  float ppo_kl_coef;   /* >= 0 */
#endif
#if LOSSD_PLUGIN_ABI_MINOR >= 5
  /* 6.5: the loss type vespo's gamma weight (read with LOSSD_POLICY_VESPO only): shapes k
   * (finite) and rates lambda (finite, >= 0), for advantages >= 0 and < 0. */
  float vespo_k_pos;
  float vespo_lambda_pos;
  float vespo_k_neg;
  float vespo_lambda_neg;
#endif
} LossdProblem;

/* Where the results go (lossd::LossOutputs); host memory unless noted, null = not wanted. */
typedef struct LossdOutputs {
  int32_t grad_dtype;    /* of dx, dw, db */
  float* loss;           /* (BT) with reduction none, else (1) */
  float* z_loss;         /* (BT) with reduction none, else (1) */
  float* lse;            /* (BT) */
  int64_t* predictions;  /* (BT) */
  float* accuracy;       /* (1) */
  int64_t* tokens;       /* (1) */
  void* dx;              /* (BT, H) grad_dtype */
  void* dw;              /* (V, H) grad_dtype */
  void* db;              /* (V) grad_dtype */
  float* dw_accum;       /* (V, H) fp32 in accum_memory, added into */
  float* db_accum;       /* (V) fp32 in accum_memory, added into */
  int32_t accum_memory;  /* LOSSD_MEMORY_* */
  float* logp;           /* (BT) logprob, policy (version 4, as the three below) */
  float* entropy;        /* (BT) logprob */
  float* kl;             /* (1) policy */
  float* clip_fraction;  /* (1) policy */
} LossdOutputs;

/* lossd::LossStats. The caller's values go in and come back where the plugin wrote none. */
typedef struct LossdStats {
  double compute_seconds;
  uint64_t peak_extra_bytes;
  int64_t chunk_rows;
  int64_t gemm_tunings;
  uint32_t nonfinite; /* lossd::NonFiniteBits */
} LossdStats;

/* lossd::BackendInfo; the strings are NUL-terminated and cut to fit. */
typedef struct LossdBackendInfo {
  char name[32];
  char device[256];
  uint64_t memory_total_bytes;
  uint64_t memory_used_bytes;
  uint64_t memory_peak_bytes;
  uint64_t memory_held_bytes;
  uint64_t memory_budget_bytes;
  int32_t healthy; /* 0 after a sticky device error */
  uint32_t loss_kinds; /* version 4: bit (1 << LOSSD_LOSS_*) of every kind it computes */
#if LOSSD_PLUGIN_ABI_MINOR >= 1
  /* 6.1: lossd::BackendInfo::compute_path, the path a Compute takes; empty (all zero, as from
   * a 6.0 plugin) = not reported. */
  char compute_path[128];
#endif
} LossdBackendInfo;

/* What a Compute's workspace depends on (lossd::WorkspaceShape): shapes and which buffers
 * exist, never data. */
typedef struct LossdWorkspaceShape {
  int64_t bt;
  int64_t h;
  int64_t v;
  int32_t dtype;
  int32_t grad_dtype;
  int32_t w_memory;
  int32_t has_bias;
  int32_t has_class_weights;
  int32_t has_grad_output;
  int32_t rows_streamed;
  int64_t chunk_rows;
  int32_t want_dx;
  int32_t dw; /* LOSSD_GRAD_* */
  int32_t db; /* LOSSD_GRAD_* */
  int32_t accum_memory;
  int32_t kind;             /* version 4: LOSSD_LOSS_* */
  int64_t teacher_h;        /* distill */
  int32_t teacher_w_memory; /* distill: LOSSD_MEMORY_* */
  int32_t want_entropy;     /* logprob: the entropy output exists */
} LossdWorkspaceShape;

/* One optimizer step's scalars (lossd::OptimizerParams, kernels/optimizer.h says what each
 * means); flags are 0 or 1. */
typedef struct LossdOptimizerParams {
  int32_t kind; /* LOSSD_OPTIMIZER_* */
  double lr;
  double weight_decay;
  double momentum;
  double dampening;
  int32_t nesterov;
  int32_t momentum_initialised;
  double beta1;
  double beta2;
  double eps;
  int32_t amsgrad;
  int64_t step;
  float grad_scale;
} LossdOptimizerParams;

/* One parameter's buffers (lossd::OptimizerTensors): n fp32 elements each, in backend memory
 * (the table's allocate); null where the update needs none. */
typedef struct LossdOptimizerTensors {
  int64_t n;
  float* param;       /* (n) the fp32 master, updated in place */
  const float* grad;  /* (n) the summed gradient */
  float* state1;      /* (n) AdamW exp_avg; SGD momentum buffer */
  float* state2;      /* (n) AdamW exp_avg_sq */
  float* state3;      /* (n) AdamW max_exp_avg_sq (amsgrad) */
  void* copy;         /* (n) copy_dtype: the cast of the new master; null = none */
  int32_t copy_dtype; /* LOSSD_DTYPE_BF16, _F16 or _F32 */
} LossdOptimizerTensors;

/* Opaque handles, defined by the plugin. A buffer may outlive its backend; a host memory
 * lives as long as the process. */
typedef struct LossdBackend LossdBackend;
typedef struct LossdBuffer LossdBuffer;
typedef struct LossdHostMemory LossdHostMemory;
/* 6.2: a head group's communicator (lossd::BackendComm), from comm_connect. */
typedef struct LossdComm LossdComm;

/* 6.2: the size of a communicator's id (lossd::kBackendCommIdBytes, NCCL's ncclUniqueId). */
#define LOSSD_COMM_ID_BYTES 128

/* The functions of one ABI major. Functions that return int32_t return the status code
 * they also write into *status. Every function is thread-safe as lossd::Backend's are. */
typedef struct LossdBackendApi {
  uint32_t struct_size; /* sizeof(LossdBackendApi) the plugin was built with */
  uint32_t abi_version; /* LOSSD_PLUGIN_ABI_VERSION the plugin was built with (major.minor) */

  /* A new backend in *backend, or an error (the no-GPU prefix above when there is none). */
  int32_t (*create)(const LossdCudaOptions* options, LossdBackend** backend,
                    LossdStatus* status);
  void (*destroy)(LossdBackend* backend);
  void (*info)(LossdBackend* backend, LossdBackendInfo* info);

  /* Backend memory of `bytes`: its handle, its address in the backend's space and its size
   * (lossd::BackendBuffer's data() and size()). */
  int32_t (*allocate)(LossdBackend* backend, size_t bytes, LossdBuffer** buffer, void** data,
                      size_t* size, LossdStatus* status);
  void (*free_buffer)(LossdBuffer* buffer);
  int32_t (*copy_to_backend)(LossdBackend* backend, LossdBuffer* dst, size_t offset,
                             const void* src, size_t bytes, LossdStatus* status);
  int32_t (*copy_from_backend)(LossdBackend* backend, const LossdBuffer* src, size_t offset,
                               void* dst, size_t bytes, LossdStatus* status);
  int32_t (*zero)(LossdBackend* backend, LossdBuffer* buffer, LossdStatus* status);

  uint64_t (*workspace_bytes)(LossdBackend* backend, const LossdWorkspaceShape* shape);
  /* stats may be null. */
  int32_t (*compute)(LossdBackend* backend, const LossdProblem* problem,
                     const LossdOutputs* outputs, LossdStats* stats, LossdStatus* status);

  /* Pinned host memory, or null when ordinary memory is as good. alloc returns null when
   * none can be had. */
  LossdHostMemory* (*host_memory)(LossdBackend* backend);
  void* (*host_alloc)(LossdHostMemory* memory, size_t bytes);
  void (*host_free)(LossdHostMemory* memory, void* ptr);

  /* Version 3. One optimizer step over backend memory (lossd::Backend::OptimizerStep). */
  int32_t (*optimizer_step)(LossdBackend* backend, const LossdOptimizerParams* params,
                            const LossdOptimizerTensors* tensors, LossdStatus* status);
  /* *sum = the sum of data[i]^2 over n fp32 elements in backend memory, in double
   * (lossd::Backend::SumOfSquares); *sum is 0 on error. */
  int32_t (*sum_of_squares)(LossdBackend* backend, const float* data, int64_t n, double* sum,
                            LossdStatus* status);

#if LOSSD_PLUGIN_ABI_MINOR >= 2
  /* 6.2: a head group's collectives on the backend's memory (kernels/backend.h says what each
   * does and returns). A server calls them only where struct_size covers them. */
  /* lossd::Backend::CommAvailable: 0 when the backend can form a communicator. */
  int32_t (*comm_available)(LossdBackend* backend, LossdStatus* status);
  /* lossd::Backend::NewCommId: LOSSD_COMM_ID_BYTES bytes into id; id is left alone on error. */
  int32_t (*comm_new_id)(LossdBackend* backend, uint8_t* id, LossdStatus* status);
  /* lossd::Backend::ConnectComm: id holds LOSSD_COMM_ID_BYTES bytes; *comm is the new
   * communicator (destroy it with comm_destroy), null on error. Blocks until every member
   * has joined or timeout_ms has passed. */
  int32_t (*comm_connect)(LossdBackend* backend, const uint8_t* id, uint32_t size, uint32_t rank,
                          int64_t timeout_ms, LossdComm** comm, LossdStatus* status);
  /* lossd::BackendComm::ReduceScatter over buf: (n) fp32 in backend memory. */
  int32_t (*comm_reduce_scatter)(LossdComm* comm, float* buf, int64_t n, LossdStatus* status);
  /* lossd::BackendComm::AllGather over buf: (n, elem_bytes) bytes in backend memory. */
  int32_t (*comm_all_gather)(LossdComm* comm, void* buf, int64_t n, size_t elem_bytes,
                             LossdStatus* status);
  /* lossd::BackendComm::Abort: safe from another thread while a collective runs on comm. */
  void (*comm_abort)(LossdComm* comm);
  /* Frees comm (after its collectives have returned); it may outlive its backend. */
  void (*comm_destroy)(LossdComm* comm);
#endif
} LossdBackendApi;

/* The entry point's type: the plugin's table when abi_version (the server's) has the plugin's
 * major, whatever its minor (the server checks the minors), else null; *plugin_abi_version
 * gets the version the plugin speaks either way. */
typedef const LossdBackendApi* (*LossdPluginGetApiFn)(uint32_t abi_version,
                                                      uint32_t* plugin_abi_version);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* LOSSD_KERNELS_PLUGIN_ABI_H_ */
