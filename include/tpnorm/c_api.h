/* tpnorm/c_api.h — the C interface to tpnorm, for C, Fortran (through ISO_C_BINDING) and other
 * languages' FFIs. No MPI, NCCL or CUDA types here: an MPI communicator is passed as its
 * Fortran handle (MPI_Comm_c2f); tpnorm/c_api_mpi.h adds the MPI_Comm overload for C callers.
 *
 * Every function returns a tpnorm_status_t. On failure, tpnorm_last_error() returns a message
 * that stays valid in the calling thread until its next failing tpnorm call. A collective call that
 * fails fails on EVERY rank of its communicator with the same status and message (see
 * tpnorm/error.h) and leaves its outputs untouched.
 *
 * Ownership: tpnorm never owns the arrays passed to it. A communicator created from an MPI
 * handle works on a duplicate of it (MPI_Comm_dup); the caller keeps and frees its own handle
 * and must destroy the tpnorm communicator (collectively) before MPI_Finalize.
 *
 * Formulas, shapes and the one-collective-per-call rule are those of tpnorm/norm.h and
 * tpnorm/batch_norm.h. For LayerNorm / RMSNorm, x is
 * [rows, hidden_local] row-major, gamma / beta [hidden_local] or NULL, mean / rstd [rows] or
 * NULL (forward only). NULL means "absent", which must agree across ranks: on a rank with
 * hidden_local = 0, pass a non-NULL gamma / beta (never read) when the other ranks pass theirs;
 * x, y, dy, dx may be NULL there. */
#ifndef TPNORM_C_API_H_
#define TPNORM_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Values match tpnorm::ErrorCode. */
typedef enum {
  TPNORM_SUCCESS = 0,
  TPNORM_INVALID_ARGUMENT = 1, /* a null pointer, a bad shape, dtype or eps ... */
  TPNORM_MISMATCH = 2,         /* ranks disagree on the call */
  TPNORM_COMMUNICATION = 3,    /* the MPI / NCCL / CUDA layer failed */
  TPNORM_INTERNAL = 4          /* anything else, e.g. out of memory */
} tpnorm_status_t;

/* Values match tpnorm::DType. */
typedef enum { TPNORM_F32 = 0, TPNORM_F16 = 1, TPNORM_BF16 = 2, TPNORM_F64 = 3 } tpnorm_dtype_t;

/* Values match tpnorm::Stats. */
typedef enum {
  TPNORM_STATS_ROBUST = 0,
  TPNORM_STATS_NAIVE = 1,
  TPNORM_STATS_EXACT = 2 /* integer statistics: the same bits at every world size (tpnorm/norm.h) */
} tpnorm_stats_t;

/* Versioned options (NCCL's config style): `size` and `version` first, so that a library built
 * against a newer header still reads an older caller's struct (fields past `size` take their
 * defaults). Always start from TPNORM_NORM_OPTIONS_INITIALIZER; NULL means all defaults. A
 * struct with size or version 0 (not initialised) fails the call on every rank, as a bad eps. */
#define TPNORM_NORM_OPTIONS_VERSION 1
typedef struct {
  size_t size;          /* sizeof(tpnorm_norm_options_t) as the caller compiled it */
  unsigned int version; /* TPNORM_NORM_OPTIONS_VERSION */
  double eps;           /* > 0 and finite */
  int stats;            /* tpnorm_stats_t */
  int check_agreement;  /* nonzero: fold a fingerprint of the call into the collective */
  int num_threads;      /* CPU threads per rank; 0 = OpenMP's default */
} tpnorm_norm_options_t;
#define TPNORM_NORM_OPTIONS_INITIALIZER \
  { sizeof(tpnorm_norm_options_t), TPNORM_NORM_OPTIONS_VERSION, 1e-5, TPNORM_STATS_ROBUST, 1, 0 }

/* SyncBatchNorm options, versioned the same way; TPNORM_BATCH_NORM_OPTIONS_INITIALIZER gives
 * PyTorch's defaults (eps 1e-5, momentum 0.1, training, NCHW). */
typedef enum { TPNORM_LAYOUT_NCHW = 0, TPNORM_LAYOUT_CHANNELS_LAST = 1 } tpnorm_layout_t;
#define TPNORM_BATCH_NORM_OPTIONS_VERSION 1
typedef struct {
  size_t size;          /* sizeof(tpnorm_batch_norm_options_t) as the caller compiled it */
  unsigned int version; /* TPNORM_BATCH_NORM_OPTIONS_VERSION */
  double eps;           /* > 0 and finite */
  double momentum;      /* running-statistics momentum; NAN = cumulative average */
  int training;         /* nonzero: batch statistics (one collective); 0: running statistics */
  int layout;           /* tpnorm_layout_t */
  int stats;            /* tpnorm_stats_t */
  int check_agreement;  /* nonzero: fold a fingerprint of the call into the collective */
  int num_threads;      /* CPU threads per rank; 0 = OpenMP's default */
} tpnorm_batch_norm_options_t;
#define TPNORM_BATCH_NORM_OPTIONS_INITIALIZER                                             \
  {                                                                                       \
    sizeof(tpnorm_batch_norm_options_t), TPNORM_BATCH_NORM_OPTIONS_VERSION, 1e-5, 0.1, 1, \
        TPNORM_LAYOUT_NCHW, TPNORM_STATS_ROBUST, 1, 0                                     \
  }

typedef struct tpnorm_comm_s* tpnorm_comm_t;

/* The message of this thread's last failed call ("" if none). */
const char* tpnorm_last_error(void);
/* "success", "invalid argument", ... */
const char* tpnorm_status_string(tpnorm_status_t status);

/* [in] fortran_comm: MPI_Comm_c2f(comm) of an MPI communicator (MPI initialised); collective.
 * [out] out: the new communicator, on a duplicate of comm. */
tpnorm_status_t tpnorm_comm_create_mpi_fortran(int fortran_comm, tpnorm_comm_t* out);
/* A communicator of one rank on the CPU (all-reduce is the identity). */
tpnorm_status_t tpnorm_comm_create_single(tpnorm_comm_t* out);
/* Collective for MPI communicators. NULL is a no-op. */
tpnorm_status_t tpnorm_comm_destroy(tpnorm_comm_t comm);
tpnorm_status_t tpnorm_comm_rank(tpnorm_comm_t comm, int* rank);
tpnorm_status_t tpnorm_comm_size(tpnorm_comm_t comm, int* size);

/* LayerNorm / RMSNorm. `dtype` is the storage type of x, y, dy, dx, gamma, beta, dgamma, dbeta;
 * `stats_dtype` (TPNORM_F32 or TPNORM_F64) that of mean and rstd. dgamma / dbeta may be NULL. */
tpnorm_status_t tpnorm_layer_norm_forward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                          int64_t hidden_local, const void* x, const void* gamma,
                                          const void* beta, void* y, tpnorm_dtype_t stats_dtype,
                                          void* mean, void* rstd, const tpnorm_norm_options_t* opt);
tpnorm_status_t tpnorm_layer_norm_backward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                           int64_t hidden_local, const void* dy, const void* x,
                                           const void* gamma, tpnorm_dtype_t stats_dtype,
                                           const void* mean, const void* rstd, void* dx,
                                           void* dgamma, void* dbeta,
                                           const tpnorm_norm_options_t* opt);
tpnorm_status_t tpnorm_rms_norm_forward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                        int64_t hidden_local, const void* x, const void* gamma,
                                        void* y, tpnorm_dtype_t stats_dtype, void* rstd,
                                        const tpnorm_norm_options_t* opt);
tpnorm_status_t tpnorm_rms_norm_backward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                         int64_t hidden_local, const void* dy, const void* x,
                                         const void* gamma, tpnorm_dtype_t stats_dtype,
                                         const void* rstd, void* dx, void* dgamma,
                                         const tpnorm_norm_options_t* opt);

/* Gated RMSNorm (tpnorm/rms_norm_gated.h; Mamba-2's RMSNormGated). x, z, y, dy, dx, dz are
 * [rows, c_local]: this rank's channels [offset, offset + c_local) of `hidden`, in groups of
 * `group_size` channels (dividing hidden; -1: one group of all channels); z / dz NULL: no gate.
 * norm_before_gate nonzero: y = rmsnorm(x) * weight * silu(z), else rmsnorm(x * silu(z)) *
 * weight. weight / dweight [c_local] or NULL in `param_dtype` (dtype, or TPNORM_F32 next to
 * fp16/bf16); rstd [rows, hidden / group_size] in `stats_dtype` (every group), optional in the
 * forward. One collective per call, as tpnorm/rms_norm_gated.h says. */
tpnorm_status_t tpnorm_rms_norm_gated_forward(tpnorm_comm_t comm, tpnorm_dtype_t dtype,
                                              int64_t rows, int64_t c_local, int64_t hidden,
                                              int64_t offset, int64_t group_size,
                                              int norm_before_gate, const void* x, const void* z,
                                              tpnorm_dtype_t param_dtype, const void* weight,
                                              void* y, tpnorm_dtype_t stats_dtype, void* rstd,
                                              const tpnorm_norm_options_t* opt);
tpnorm_status_t tpnorm_rms_norm_gated_backward(
    tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows, int64_t c_local, int64_t hidden,
    int64_t offset, int64_t group_size, int norm_before_gate, const void* dy, const void* x,
    const void* z, tpnorm_dtype_t param_dtype, const void* weight, tpnorm_dtype_t stats_dtype,
    const void* rstd, void* dx, void* dz, void* dweight, const tpnorm_norm_options_t* opt);

/* SyncBatchNorm. x is [N_local, C, *spatial] (NCHW) or [N_local, *spatial, C] (channels last),
 * given as `ndim` (2..8) dims at `shape`; N_local may be 0 on some ranks. gamma, beta [C] in
 * `dtype` or NULL (affine off); running_mean / running_var [C] in `stats_dtype` or NULL (no
 * running statistics); num_batches_tracked may be NULL unless momentum is NAN; save_mean /
 * save_invstd [C] in `stats_dtype`, written by the forward and read by the backward. */
tpnorm_status_t tpnorm_sync_batch_norm_forward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int ndim,
                                               const int64_t* shape, const void* x,
                                               const void* gamma, const void* beta,
                                               tpnorm_dtype_t stats_dtype, void* running_mean,
                                               void* running_var, int64_t* num_batches_tracked,
                                               void* y, void* save_mean, void* save_invstd,
                                               const tpnorm_batch_norm_options_t* opt);
tpnorm_status_t tpnorm_sync_batch_norm_backward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int ndim,
                                                const int64_t* shape, const void* dy, const void* x,
                                                const void* gamma, tpnorm_dtype_t stats_dtype,
                                                const void* save_mean, const void* save_invstd,
                                                void* dx, void* dgamma, void* dbeta,
                                                const tpnorm_batch_norm_options_t* opt);

#ifdef __cplusplus
}
#endif
#endif /* TPNORM_C_API_H_ */
