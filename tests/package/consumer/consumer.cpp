// consumer.cpp — a C++ program built against the installed tpnorm: sharded RMSNorm through
// the C++ API, compared with the same op on the full rows in one process.
#include <mpi.h>
#include <tpnorm/mpi.h>
#include <tpnorm/norm.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, P = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  const int64_t R = 3, H = 10, c0 = H * rank / P, h = H * (rank + 1) / P - c0;
  std::vector<float> X(R * H), x(R * h), y(R * h), Y(R * H), rstd(R), RSTD(R);
  for (int64_t i = 0; i < R * H; ++i) X[i] = std::sin(0.3f * i) + 0.5f;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < h; ++c) x[r * h + c] = X[r * H + c0 + c];

  using tpnorm::Shape;
  using tpnorm::view;
  auto world = tpnorm::make_mpi_communicator(MPI_COMM_WORLD);
  auto single = tpnorm::make_single_communicator();
  tpnorm::rms_norm_forward(*world, view(x.data(), Shape{R, h}), {}, view(y.data(), Shape{R, h}),
                           view(rstd.data(), Shape{R}));
  tpnorm::rms_norm_forward(*single, view(X.data(), Shape{R, H}), {}, view(Y.data(), Shape{R, H}),
                           view(RSTD.data(), Shape{R}));

  int wrong = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < h; ++c)
      wrong += !(std::fabs(y[r * h + c] - Y[r * H + c0 + c]) <= 1e-5f);
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf("tpnorm C++ consumer at %d ranks: %d wrong elements\n", P, wrong);
  world.reset();
  MPI_Finalize();
  return wrong != 0;
}
