/* test_gpu_c_api.c — the C API on device (tpnorm/c_api_cuda.h), from C99, under mpiexec: an
 * MPI-staged device communicator (ranks share the GPU), hidden-sharded LayerNorm forward of
 * device buffers against a float64 reference computed here on the full rows (mean, rstd, y,
 * element by element: y 1e-5 + 1e-5|want|, mean and rstd 1e-6 relative); eps = -1 on the last
 * rank is TPNORM_INVALID_ARGUMENT on every rank (a strict call) with y untouched; and
 * tpnorm_cuda_check_errors reports success after the good call. Without a GPU it prints the
 * GPU tests' skip marker and exits 0. */
#include <cuda_runtime_api.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "tpnorm/c_api_cuda.h"

#define ROWS 5
#define HIDDEN 37

static int fails = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      fprintf(stderr, "rank %d: ", rank); \
      fprintf(stderr, __VA_ARGS__);       \
      fprintf(stderr, "\n");              \
      ++fails;                            \
    }                                     \
  } while (0)

static float value(int r, int j) { return 100.0f + (float)((r * 31 + j * 17) % 23) / 3.0f; }

int main(int argc, char** argv) {
  int rank = 0, size = 1, ngpu = 0, all = 0;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu == 0) {
    if (rank == 0) printf("tpnorm-gpu: no CUDA device (test_gpu_c_api)\n");
    MPI_Finalize();
    return 0;
  }
  /* This rank's columns [c0, c0 + h). */
  const int64_t c0 = HIDDEN * rank / size, h = HIDDEN * (rank + 1) / size - c0;
  float x[ROWS * HIDDEN], y[ROWS * HIDDEN], mean[ROWS], rstd[ROWS];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < h; ++j) x[r * h + j] = value(r, (int)(c0 + j));
  const int dev = rank % ngpu;
  cudaSetDevice(dev);
  cudaStream_t s = NULL;
  cudaStreamCreate(&s);
  float *dx = NULL, *dy = NULL, *dm = NULL, *dr = NULL;
  cudaMalloc((void**)&dx, sizeof x);
  cudaMalloc((void**)&dy, sizeof y);
  cudaMalloc((void**)&dm, sizeof mean);
  cudaMalloc((void**)&dr, sizeof rstd);
  cudaMemcpy(dx, x, (size_t)(ROWS * h) * sizeof(float), cudaMemcpyHostToDevice);
  tpnorm_comm_t comm = NULL;
  CHECK(tpnorm_comm_create_mpi_staged_cuda(MPI_COMM_WORLD, s, dev, &comm) == TPNORM_SUCCESS,
        "create: %s", tpnorm_last_error());
  tpnorm_norm_options_t opt = TPNORM_NORM_OPTIONS_INITIALIZER;
  CHECK(tpnorm_layer_norm_forward(comm, TPNORM_F32, ROWS, h, dx, NULL, NULL, dy, TPNORM_F32, dm, dr,
                                  &opt) == TPNORM_SUCCESS,
        "forward: %s", tpnorm_last_error());
  CHECK(tpnorm_cuda_check_errors(comm) == TPNORM_SUCCESS, "check: %s", tpnorm_last_error());
  cudaMemcpy(y, dy, (size_t)(ROWS * h) * sizeof(float), cudaMemcpyDeviceToHost);
  cudaMemcpy(mean, dm, sizeof mean, cudaMemcpyDeviceToHost);
  cudaMemcpy(rstd, dr, sizeof rstd, cudaMemcpyDeviceToHost);
  for (int r = 0; r < ROWS; ++r) {
    double m = 0, v = 0;
    for (int j = 0; j < HIDDEN; ++j) m += value(r, j);
    m /= HIDDEN;
    for (int j = 0; j < HIDDEN; ++j) v += (value(r, j) - m) * (value(r, j) - m);
    const double rs = 1.0 / sqrt(v / HIDDEN + 1e-5);
    CHECK(fabs(mean[r] - m) <= 1e-6 * fabs(m), "mean[%d] %g, want %g", r, mean[r], m);
    CHECK(fabs(rstd[r] - rs) <= 1e-6 * rs, "rstd[%d] %g, want %g", r, rstd[r], rs);
    for (int j = 0; j < h; ++j) {
      const double want = (value(r, (int)(c0 + j)) - m) * rs;
      CHECK(fabs(y[r * h + j] - want) <= 1e-5 + 1e-5 * fabs(want), "y[%d][%d] %g, want %g", r,
            (int)(c0 + j), y[r * h + j], want);
    }
  }
  /* eps = -1 on the last rank: the same error on every rank, y untouched. */
  cudaMemset(dy, 0, sizeof y);
  opt.eps = rank == size - 1 ? -1.0 : 1e-5;
  const tpnorm_status_t st = tpnorm_layer_norm_forward(comm, TPNORM_F32, ROWS, h, dx, NULL, NULL,
                                                       dy, TPNORM_F32, dm, dr, &opt);
  CHECK(st == TPNORM_INVALID_ARGUMENT, "eps -1: status %d (%s)", (int)st, tpnorm_last_error());
  cudaMemcpy(y, dy, (size_t)(ROWS * h) * sizeof(float), cudaMemcpyDeviceToHost);
  for (int i = 0; i < ROWS * h; ++i) CHECK(y[i] == 0.0f, "y[%d] written by a failed call", i);
  tpnorm_comm_destroy(comm);
  cudaFree(dx);
  cudaFree(dy);
  cudaFree(dm);
  cudaFree(dr);
  cudaStreamDestroy(s);
  MPI_Allreduce(&fails, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("%s: %d failed checks over all ranks\n", all ? "FAILED" : "PASSED", all);
  MPI_Finalize();
  return all ? 1 : 0;
}
