/* test_c_api_gated.c — the gated RMSNorm through the C API from C at P ranks: channels split
 * over the ranks with groups that straddle rank boundaries, both gate orders, forward and
 * backward against a float64 reference on the full rows (y, dx, dz: 1e-5 abs + 1e-4 rel;
 * dweight, a sum over ROWS rows: 1e-4 abs + 1e-4 rel), and an error path (a group size that
 * does not divide hidden) that fails on every rank with the same status and leaves y untouched.
 * Every rank makes every call; the verdict is all-reduced. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tpnorm/c_api_mpi.h"

enum { ROWS = 4, H = 12, GS = 6, G = H / GS };

static int rank, wrong;

static double x_at(int r, int c) { return 0.3 + sin(1.0 + 0.37 * r + 1.3 * c) * (1 + r); }
static double z_at(int r, int c) { return 1.5 * cos(0.2 + 0.61 * r - 0.9 * c); }
static double dy_at(int r, int c) { return cos(0.7 * r - 0.45 * c); }
static double w_at(int c) { return 1.0 + 0.1 * c; }
static double sig(double z) { return 1.0 / (1.0 + exp(-z)); }
static double silu(double z) { return z * sig(z); }
static double dsilu(double z) { return sig(z) * (1.0 + z * (1.0 - sig(z))); }

/* float64 reference at (r, c): y, dx, dz and this row's share of dweight. */
static void reference(int nbg, int r, int c, double* y, double* dx, double* dz, double* dw) {
  const int g0 = (c / GS) * GS;
  double ss = 0, sgu = 0, rs, u, uh, post, d;
  int k;
  for (k = g0; k < g0 + GS; ++k) {
    u = nbg ? x_at(r, k) : x_at(r, k) * silu(z_at(r, k));
    ss += u * u;
  }
  rs = 1.0 / sqrt(ss / GS + 1e-5);
  for (k = g0; k < g0 + GS; ++k) {
    u = nbg ? x_at(r, k) : x_at(r, k) * silu(z_at(r, k));
    post = nbg ? silu(z_at(r, k)) : 1.0;
    sgu += dy_at(r, k) * w_at(k) * post * u * rs;
  }
  u = nbg ? x_at(r, c) : x_at(r, c) * silu(z_at(r, c));
  uh = u * rs;
  post = nbg ? silu(z_at(r, c)) : 1.0;
  *y = uh * w_at(c) * post;
  d = rs * (dy_at(r, c) * w_at(c) * post - uh * sgu / GS);
  *dx = nbg ? d : d * silu(z_at(r, c));
  *dz = nbg ? dy_at(r, c) * w_at(c) * uh * dsilu(z_at(r, c)) : d * x_at(r, c) * dsilu(z_at(r, c));
  *dw = dy_at(r, c) * uh * post;
}

static void expect(int ok, const char* what) {
  if (!ok) {
    ++wrong;
    printf("rank %d: FAILED %s\n", rank, what);
  }
}

static int close_to(double got, double want, double atol, double rtol) {
  return fabs(got - want) <= atol + rtol * fabs(want);
}

int main(int argc, char** argv) {
  tpnorm_comm_t comm = NULL;
  int nranks, c0, h, r, c, nbg, total, statuses[2];
  float x[ROWS * H], z[ROWS * H], dy[ROWS * H], y[ROWS * H], dx[ROWS * H], dz[ROWS * H], w[H],
      dw[H];
  float rstd[ROWS * G];
  tpnorm_status_t s;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  c0 = H * rank / nranks;
  h = H * (rank + 1) / nranks - c0;
  for (r = 0; r < ROWS; ++r)
    for (c = 0; c < h; ++c) {
      x[r * h + c] = (float)x_at(r, c0 + c);
      z[r * h + c] = (float)z_at(r, c0 + c);
      dy[r * h + c] = (float)dy_at(r, c0 + c);
    }
  for (c = 0; c < h; ++c) w[c] = (float)w_at(c0 + c);
  expect(tpnorm_comm_create_mpi(MPI_COMM_WORLD, &comm) == TPNORM_SUCCESS, "create");

  for (nbg = 0; nbg <= 1; ++nbg) {
    double want_dw[H];
    memset(want_dw, 0, sizeof want_dw);
    s = tpnorm_rms_norm_gated_forward(comm, TPNORM_F32, ROWS, h, H, c0, GS, nbg, x, z, TPNORM_F32,
                                      w, y, TPNORM_F32, rstd, NULL);
    if (s != TPNORM_SUCCESS) printf("rank %d: %s\n", rank, tpnorm_last_error());
    expect(s == TPNORM_SUCCESS, "rms_norm_gated_forward");
    s = tpnorm_rms_norm_gated_backward(comm, TPNORM_F32, ROWS, h, H, c0, GS, nbg, dy, x, z,
                                       TPNORM_F32, w, TPNORM_F32, rstd, dx, dz, dw, NULL);
    if (s != TPNORM_SUCCESS) printf("rank %d: %s\n", rank, tpnorm_last_error());
    expect(s == TPNORM_SUCCESS, "rms_norm_gated_backward");
    for (r = 0; r < ROWS; ++r)
      for (c = 0; c < h; ++c) {
        double ry, rdx, rdz, rdw;
        reference(nbg, r, c0 + c, &ry, &rdx, &rdz, &rdw);
        want_dw[c] += rdw;
        expect(close_to(y[r * h + c], ry, 1e-5, 1e-4), "y vs float64 reference");
        expect(close_to(dx[r * h + c], rdx, 1e-5, 1e-4), "dx vs float64 reference");
        expect(close_to(dz[r * h + c], rdz, 1e-5, 1e-4), "dz vs float64 reference");
      }
    for (c = 0; c < h; ++c) expect(close_to(dw[c], want_dw[c], 1e-4, 1e-4), "dweight");
  }

  /* A group size that does not divide hidden: every rank fails, y untouched. */
  memset(y, 0x7f, sizeof y);
  s = tpnorm_rms_norm_gated_forward(comm, TPNORM_F32, ROWS, h, H, c0, 5, 0, x, z, TPNORM_F32, w,
                                    y, TPNORM_F32, rstd, NULL);
  expect(s == TPNORM_INVALID_ARGUMENT, "a bad group size is TPNORM_INVALID_ARGUMENT");
  expect(strstr(tpnorm_last_error(), "group_size") != NULL, "the message names group_size");
  for (r = 0; r < ROWS * h; ++r) expect(((unsigned char*)y)[r * 4] == 0x7f, "y untouched");
  statuses[0] = (int)s;
  MPI_Allreduce(&statuses[0], &statuses[1], 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  expect(statuses[1] == (int)s, "the same status on every rank");
  expect(tpnorm_comm_destroy(comm) == TPNORM_SUCCESS, "destroy");

  MPI_Allreduce(&wrong, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("C API gated RMSNorm at %d ranks: %d failed checks\n", nranks, total);
  MPI_Finalize();
  return total != 0;
}
