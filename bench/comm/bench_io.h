// bench_io.h — what both benchmark modes share: the clock, per-iteration series, bare
// collectives for the fits, and one writer for a row (table on stdout, CSV, JSON lines).
#pragma once

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cost_model.h"
#include "tpnorm/communicator.h"

namespace tpnorm_bench {

double now_s();

/// Per-iteration values, each the slowest rank's; quantiles over iterations.
struct Series {
  std::vector<double> v;
  double at(double q) const;  // q = 0: min, 0.5: median, 1: max
};

/// Median over `iters` of the slowest rank's time of bare all-reduces of each count in
/// `values` (one after the other, wire dtype `wire`) on `c`.
double bare_allreduce_s(tpnorm::Communicator& c, const std::vector<size_t>& values,
                        tpnorm::DType wire, int iters);

/// The links fitted in this job (P >= 2) from bare collectives of several sizes: all-reduce on
/// the benchmark's communicator, all-gather with MPI_Allgather on MPI_COMM_WORLD.
/// `beta_bw` is the seconds per byte of one-way transfers between rank pairs (2k -> 2k+1)
/// fitted on bandwidth-bound sizes only (256 KiB..4 MiB), where the latency is a small part
/// of the time: the link's per-byte cost per direction plus the hosts' own (copies, the TCP
/// stack). It is fitted on plain transfers rather than on the all-reduce because MPI picks its
/// own all-reduce algorithm per size, and not every one is the ring.
struct Fits {
  Link allreduce, allgather;
  double beta_bw = 0;
  Topology ar() const { return flat_topology("fitted", allreduce); }
  Topology ag() const { return flat_topology("fitted", allgather); }
};
Fits fit_here(tpnorm::Communicator& c, int iters, bool with_allgather);

/// One output field: its CSV/JSON name, its value, whether JSON quotes it, its table width
/// (negative: left-aligned; 0: not in the table) and its table heading.
struct Field {
  const char* name;
  std::string value;
  bool text;
  int width;
  const char* heading;
};
std::string fmt(double v, const char* f);

/// Prints the table heading of `row`'s fields.
void print_heading(const std::vector<Field>& row);
/// Prints `row` on stdout and appends it to `csv` / `json` (JSON lines) when they are set.
void write_row(const std::vector<Field>& row, const std::string& csv, const std::string& json);

/// Opens `path` for appending; exits with a one-line error when it cannot.
std::FILE* open_append(const std::string& path);

}  // namespace tpnorm_bench
