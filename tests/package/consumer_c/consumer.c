/* consumer.c — a C program built against the installed tpnorm: sharded RMSNorm through the C
 * API over MPI_COMM_WORLD, compared with the same call on the full rows on a single-process
 * communicator. */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <tpnorm/c_api_mpi.h>

enum { R = 3, H = 10 };

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, P = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  const int64_t c0 = (int64_t)H * rank / P, h = (int64_t)H * (rank + 1) / P - c0;
  float X[R * H], Y[R * H], x[R * H], y[R * H], rstd[R], RSTD[R];
  for (int i = 0; i < R * H; ++i) X[i] = sinf(0.3f * (float)i) + 0.5f;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < h; ++c) x[r * h + c] = X[r * H + c0 + c];

  tpnorm_comm_t world = NULL, single = NULL;
  tpnorm_status_t s = tpnorm_comm_create_mpi(MPI_COMM_WORLD, &world);
  if (s == TPNORM_SUCCESS) s = tpnorm_comm_create_single(&single);
  if (s == TPNORM_SUCCESS)
    s = tpnorm_rms_norm_forward(world, TPNORM_F32, R, h, x, NULL, y, TPNORM_F32, rstd, NULL);
  if (s == TPNORM_SUCCESS)
    s = tpnorm_rms_norm_forward(single, TPNORM_F32, R, H, X, NULL, Y, TPNORM_F32, RSTD, NULL);
  if (s != TPNORM_SUCCESS) printf("rank %d: %s\n", rank, tpnorm_last_error());
  tpnorm_comm_destroy(single);
  tpnorm_comm_destroy(world);

  int wrong = s != TPNORM_SUCCESS;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < h; ++c) wrong += !(fabsf(y[r * h + c] - Y[r * H + c0 + c]) <= 1e-5f);
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("tpnorm C consumer at %d ranks: %d wrong elements\n", P, wrong);
  MPI_Finalize();
  return wrong != 0;
}
