/* test_c_api.c — the C API from C at P ranks: sharded LayerNorm / RMSNorm forward and backward
 * against a float64 reference on the full rows, SyncBatchNorm (uneven batches) against a float64
 * BatchNorm on the concatenated batch, and error paths (eps <= 0 on one rank, an
 * uninitialised options struct) that must fail on every rank with the same status and message
 * and leave the outputs untouched. Every rank makes every call; the verdict is all-reduced. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tpnorm/c_api_mpi.h"

enum { ROWS = 5, H = 13, MSG = 512 };

static int rank, nranks, wrong;

/* Inputs from a formula of (row, column), so every rank knows the full rows. */
static double x_at(int r, int c) { return 0.5 + sin(1.0 + 0.37 * r + 1.3 * c) * (1 + r); }
static double dy_at(int r, int c) { return cos(0.7 * r - 0.45 * c); }
static double g_at(int c) { return 1.0 + 0.1 * c; }
static double b_at(int c) { return 0.05 * c - 0.3; }

/* float64 reference of one full row: y and dx at column c (gamma = g_at, beta = b_at when
 * centered). */
static void reference(int centered, int r, int c, double* y, double* dx) {
  double mu = 0, var = 0, sg = 0, sgx = 0;
  int k;
  if (centered) {
    for (k = 0; k < H; ++k) mu += x_at(r, k) / H;
  }
  for (k = 0; k < H; ++k) var += (x_at(r, k) - mu) * (x_at(r, k) - mu) / H;
  {
    const double rstd = 1.0 / sqrt(var + 1e-5);
    for (k = 0; k < H; ++k) {
      const double g = dy_at(r, k) * g_at(k);
      sg += g;
      sgx += g * (x_at(r, k) - mu) * rstd;
    }
    {
      const double xh = (x_at(r, c) - mu) * rstd, g = dy_at(r, c) * g_at(c);
      *y = g_at(c) * xh + (centered ? b_at(c) : 0.0);
      *dx = rstd * (g - (centered ? sg / H : 0.0) - xh * sgx / H);
    }
  }
}

static void expect(int ok, const char* what) {
  if (!ok) {
    ++wrong;
    printf("rank %d: FAILED %s\n", rank, what);
  }
}

static void check_status(tpnorm_status_t s, const char* what) {
  if (s != TPNORM_SUCCESS) printf("rank %d: %s: %s\n", rank, what, tpnorm_last_error());
  expect(s == TPNORM_SUCCESS, what);
}

/* SyncBatchNorm on x [n, BC, BS] (batch BN split over ranks, sample b from a formula): y, the
 * running statistics after one step, dx and the all-reduced dgamma / dbeta against float64. */
enum { BN = 5, BC = 3, BS = 4 };
static double bx(int b, int c, int s) { return 2.0 + sin(0.9 * b + 1.7 * c + 0.31 * s) * (1 + c); }
static double bdy(int b, int c, int s) { return cos(0.4 * b - 0.8 * c + 0.5 * s); }

static void check_sync_batch_norm(tpnorm_comm_t comm) {
  const int b0 = BN * rank / nranks, n = BN * (rank + 1) / nranks - b0, m = BN * BS;
  const int64_t shape[3] = {n, BC, BS};
  float x[BN * BC * BS], dy[BN * BC * BS], y[BN * BC * BS], dx[BN * BC * BS];
  float gamma[BC], beta[BC], dg[BC], db[BC], rm[BC], rv[BC], sm[BC], si[BC];
  int64_t tracked = 0;
  int b, c, s;
  const tpnorm_batch_norm_options_t opt = TPNORM_BATCH_NORM_OPTIONS_INITIALIZER;
  for (b = 0; b < n; ++b)
    for (c = 0; c < BC; ++c)
      for (s = 0; s < BS; ++s) {
        x[(b * BC + c) * BS + s] = (float)bx(b0 + b, c, s);
        dy[(b * BC + c) * BS + s] = (float)bdy(b0 + b, c, s);
      }
  for (c = 0; c < BC; ++c) {
    gamma[c] = (float)g_at(c);
    beta[c] = (float)b_at(c);
    rm[c] = 0.0f;
    rv[c] = 1.0f;
  }
  check_status(tpnorm_sync_batch_norm_forward(comm, TPNORM_F32, 3, shape, x, gamma, beta,
                                              TPNORM_F32, rm, rv, &tracked, y, sm, si, &opt),
               "sync_batch_norm_forward");
  check_status(tpnorm_sync_batch_norm_backward(comm, TPNORM_F32, 3, shape, dy, x, gamma, TPNORM_F32,
                                               sm, si, dx, dg, db, &opt),
               "sync_batch_norm_backward");
  MPI_Allreduce(MPI_IN_PLACE, dg, BC, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, db, BC, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  expect(tracked == 1, "num_batches_tracked incremented");
  for (c = 0; c < BC; ++c) {
    double mu = 0, var = 0, sdy = 0, sdyx = 0, is;
    for (b = 0; b < BN; ++b)
      for (s = 0; s < BS; ++s) mu += bx(b, c, s) / m;
    for (b = 0; b < BN; ++b)
      for (s = 0; s < BS; ++s) {
        var += (bx(b, c, s) - mu) * (bx(b, c, s) - mu) / m;
        sdy += bdy(b, c, s);
        sdyx += bdy(b, c, s) * (bx(b, c, s) - mu);
      }
    is = 1.0 / sqrt(var + 1e-5);
    expect(fabs(rm[c] - 0.1 * mu) <= 1e-6 + 1e-5 * fabs(mu), "running_mean");
    expect(fabs(rv[c] - (0.9 + 0.1 * var * m / (m - 1))) <= 1e-5, "running_var");
    expect(fabs(dg[c] - sdyx * is) <= 1e-4, "dgamma (all-reduced)");
    expect(fabs(db[c] - sdy) <= 1e-4, "dbeta (all-reduced)");
    for (b = 0; b < n; ++b)
      for (s = 0; s < BS; ++s) {
        const int i = (b * BC + c) * BS + s;
        const double xm = bx(b0 + b, c, s) - mu;
        const double ry = g_at(c) * xm * is + b_at(c);
        const double rdx = g_at(c) * is * (bdy(b0 + b, c, s) - sdy / m - xm * is * is * sdyx / m);
        expect(fabs(y[i] - ry) <= 1e-5 + 1e-5 * fabs(ry), "batch norm y vs float64 reference");
        expect(fabs(dx[i] - rdx) <= 1e-5 + 1e-4 * fabs(rdx), "batch norm dx vs float64 reference");
      }
  }
}

int main(int argc, char** argv) {
  tpnorm_comm_t comm = NULL;
  int c0, h, r, c, centered, size = 0, total;
  float x[ROWS * H], dy[ROWS * H], y[ROWS * H], dx[ROWS * H], gamma[H], beta[H], dg[H], db[H];
  double mean[ROWS], rstd[ROWS];
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  c0 = H * rank / nranks;
  h = H * (rank + 1) / nranks - c0;
  for (r = 0; r < ROWS; ++r)
    for (c = 0; c < h; ++c) {
      x[r * h + c] = (float)x_at(r, c0 + c);
      dy[r * h + c] = (float)dy_at(r, c0 + c);
    }
  for (c = 0; c < h; ++c) {
    gamma[c] = (float)g_at(c0 + c);
    beta[c] = (float)b_at(c0 + c);
  }

  check_status(tpnorm_comm_create_mpi(MPI_COMM_WORLD, &comm), "create");
  check_status(tpnorm_comm_size(comm, &size), "size");
  expect(size == nranks, "communicator size");

  for (centered = 0; centered <= 1; ++centered) {
    const tpnorm_norm_options_t opt = TPNORM_NORM_OPTIONS_INITIALIZER;
    if (centered) {
      check_status(tpnorm_layer_norm_forward(comm, TPNORM_F32, ROWS, h, x, gamma, beta, y,
                                             TPNORM_F64, mean, rstd, &opt),
                   "layer_norm_forward");
      check_status(tpnorm_layer_norm_backward(comm, TPNORM_F32, ROWS, h, dy, x, gamma, TPNORM_F64,
                                              mean, rstd, dx, dg, db, &opt),
                   "layer_norm_backward");
    } else {
      check_status(
          tpnorm_rms_norm_forward(comm, TPNORM_F32, ROWS, h, x, gamma, y, TPNORM_F64, rstd, NULL),
          "rms_norm_forward");
      check_status(tpnorm_rms_norm_backward(comm, TPNORM_F32, ROWS, h, dy, x, gamma, TPNORM_F64,
                                            rstd, dx, dg, NULL),
                   "rms_norm_backward");
    }
    for (r = 0; r < ROWS; ++r)
      for (c = 0; c < h; ++c) {
        double ry, rdx;
        reference(centered, r, c0 + c, &ry, &rdx);
        expect(fabs(y[r * h + c] - ry) <= 1e-5 + 1e-5 * fabs(ry), "y vs float64 reference");
        expect(fabs(dx[r * h + c] - rdx) <= 1e-5 + 1e-4 * fabs(rdx), "dx vs float64 reference");
      }
  }

  check_sync_batch_norm(comm);

  { /* Error paths: every rank fails with the same status and message; y stays untouched. */
    tpnorm_norm_options_t bad = TPNORM_NORM_OPTIONS_INITIALIZER, zeroed;
    char mine[MSG], all[4 * MSG];
    int i, k;
    memset(&zeroed, 0, sizeof zeroed);
    if (rank == nranks - 1) bad.eps = -1.0;
    for (k = 0; k < 2; ++k) {
      const tpnorm_status_t s =
          tpnorm_rms_norm_forward(comm, TPNORM_F32, ROWS, h, x, gamma, memset(y, 0x7f, sizeof y),
                                  TPNORM_F64, rstd, k == 0 ? &bad : &zeroed);
      int statuses[4];
      expect(s == TPNORM_INVALID_ARGUMENT, "error status is TPNORM_INVALID_ARGUMENT");
      expect(strstr(tpnorm_last_error(), "eps") != NULL, "error message names eps");
      for (i = 0; i < ROWS * h; ++i) expect(((unsigned char*)y)[i * 4] == 0x7f, "y untouched");
      memset(mine, 0, sizeof mine);
      strncpy(mine, tpnorm_last_error(), MSG - 1);
      MPI_Allgather(mine, MSG, MPI_CHAR, all, MSG, MPI_CHAR, MPI_COMM_WORLD);
      MPI_Allgather((int*)&s, 1, MPI_INT, statuses, 1, MPI_INT, MPI_COMM_WORLD);
      for (i = 0; i < nranks && i < 4; ++i) {
        expect(strcmp(all + i * MSG, mine) == 0, "same message on every rank");
        expect(statuses[i] == (int)s, "same status on every rank");
      }
      if (rank == 0 && k == 0) printf("error path message: %s\n", mine);
    }
  }
  expect(tpnorm_rms_norm_forward(NULL, TPNORM_F32, ROWS, h, x, gamma, y, TPNORM_F64, rstd, NULL) ==
             TPNORM_INVALID_ARGUMENT,
         "null communicator");
  check_status(tpnorm_comm_destroy(comm), "destroy");

  MPI_Allreduce(&wrong, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("C API at %d ranks: %d failed checks\n", nranks, total);
  MPI_Finalize();
  return total != 0;
}
