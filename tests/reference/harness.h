// harness.h — what every tpnorm test shares: the world, seeded data, shards, and element-wise
// comparison whose verdict every rank agrees on (nccl-tests' "count of wrong elements,
// all-reduced"). Rule for multi-rank tests: run every collective on every rank first, assert
// after, so a failure on one rank never leaves another waiting in a collective.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tpnorm_test {

int world_rank();
int world_size();

/// n values of mean + stddev * N(0,1) from (seed, stream): the same on every rank.
std::vector<float> normal(uint64_t seed, uint64_t stream, size_t n, double mean = 0.0,
                          double stddev = 1.0);

/// A contiguous split of `total` items over `parts`: offsets[p], counts[p].
struct Split {
  std::vector<int64_t> offset, count;
};
/// Even split; the first total % parts parts get one more.
Split split_even(int64_t total, int parts);
/// Split with explicit weights; a weight 0 gives that part nothing.
Split split_weighted(int64_t total, const std::vector<int>& weights);

/// Columns [c0, c0+nc) of a row-major [rows, cols] matrix.
std::vector<float> columns(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t c0,
                           int64_t nc);

/// Counts elements with |got - want| > atol + rtol * |want| (NaN counts as wrong), prints the
/// first few with the rank and `what`, and returns the count. Also updates max_abs_err() and
/// max_tolerance_used().
int64_t count_wrong(const char* what, const float* got, const double* want, size_t n, double atol,
                    double rtol);
int64_t count_wrong(const char* what, const std::vector<float>& got,
                    const std::vector<double>& want, double atol, double rtol);
double max_abs_err();
/// The largest err / (atol + rtol*|want|) seen: how much of its tolerance the worst element used.
double max_tolerance_used();
/// Resets max_abs_err() and max_tolerance_used().
void reset_max_abs_err();

/// Sum of `local` over every rank of MPI_COMM_WORLD (or `comm`).
int64_t sum_over_ranks(int64_t local, MPI_Comm comm = MPI_COMM_WORLD);
double max_over_ranks(double local, MPI_Comm comm = MPI_COMM_WORLD);

}  // namespace tpnorm_test
