// bench_flags.h — the benchmark's command line. Parsed before MPI_Init, so `--help` and a bad
// flag need no MPI: --help prints the flags and exits 0, a bad flag is one line naming it
// (printed by rank 0 only) and exit status 2, never an MPI_Abort banner.
#pragma once

#include <cstdio>
#include <string>

#include "bench_op.h"

namespace tpnorm_bench {

struct Flags {
  BenchConfig cfg;
  std::string op = "all";  // op mode: layernorm, rmsnorm, syncbn or all
  std::string strategies;  // strategy mode when set: a list of strategies.h names, or "all"
  std::string csv, json, proj, plotdata;
  int iters = 20, warmup = 5;
  double host_beta_ns = -1;  // --host-beta: the hosts' own ns/B, subtracted for the link's; < 0: unset
  bool header = false, project = false, check = true, progress = false;
  bool help = false, check_flags = false;
};

/// Parses argv into `f`; false with a one-line `error` naming the flag on a bad one.
bool parse_flags(int argc, char** argv, Flags& f, std::string& error);

void print_help(std::FILE* out);

}  // namespace tpnorm_bench
