// strategies.h — four ways to compute a LayerNorm whose hidden dimension is sharded over P
// ranks, side by side on the same shapes (./launch/tpnorm bench --strategies all):
//   tpnorm        partial statistics, ONE all-reduce per pass (tpnorm's layer_norm_*)
//   two_pass      two all-reduces per pass: sum x, then the centred sum of squares; backward
//                 sum g*dy, then sum g*dy*xhat (Colossal-AI's 2D LayerNorm, MindSpeed)
//   gather_row    all-gather x, normalise the whole row locally, keep this rank's slice;
//                 backward all-gathers dy (what PyTorch DTensor does for a Shard(-1) layer_norm:
//                 the input is redistributed to Replicate)
//   gather_stats  all-gather each rank's (count, mean, M2) per row and merge them with Chan's
//                 formula; backward one all-reduce of (sum g*dy, sum g*dy*xhat) (PyTorch / apex
//                 SyncBatchNorm's scheme, applied to rows)
// qk_strategies.cpp adds an attention's QK-norm (two RMSNorms per layer) done four ways.
// Each is a BenchCase of row_norm_case.h (same seeded data, same float64 check); the others
// than tpnorm compute in float64 accumulators with fp32 storage and make their all-reduces on
// the benchmark's communicator and their all-gathers and all-to-alls with MPI_Allgatherv and
// MPI_Alltoallv on MPI_COMM_WORLD (the same ranks; tpnorm's Communicator has neither).
#pragma once

#include <memory>
#include <vector>

#include "bench_op.h"
#include "cost_model.h"

namespace tpnorm_bench {

/// One collective of a pass: an all-reduce of `bytes`; an all-gather to which this rank gives
/// `bytes` and which gathers `total` bytes from all ranks; or an all-to-all in which this rank
/// sends `bytes` (its own part included) and all ranks together `total`.
struct Collective {
  enum Kind { kAllReduce, kAllGather, kAllToAll };
  Kind kind = kAllReduce;
  double bytes = 0, total = 0;
};

struct BenchStrategy {
  const char* name;   // the --strategies name
  const char* label;  // for the plot's legend
  std::unique_ptr<BenchCase> (*make)(const BenchConfig& cfg, int rank, int size);
  /// The collectives of one pass (forward or backward) on rank `rank` of P; rank < 0: a rank
  /// holding the mean share (for projections).
  std::vector<Collective> (*plan)(const BenchConfig& cfg, int P, int rank, bool forward);
  /// The comparison it belongs to: "layernorm" (--strategies all), "qknorm" (--strategies
  /// qk, qk_strategies.cpp) or "gated" (--strategies gated, gated_strategies.cpp); one run
  /// compares strategies of one family.
  const char* family = "layernorm";
};

/// Every strategy, in report order: the LayerNorm ones, then qk_strategies(), then
/// gated_strategies().
const std::vector<BenchStrategy>& bench_strategies();
/// The QK-norm strategies (qk_strategies.cpp).
std::vector<BenchStrategy> qk_strategies();
/// The gated RMSNorm's strategies (gated_strategies.cpp).
std::vector<BenchStrategy> gated_strategies();

/// All-gather of `bytes_by_rank[p]` bytes from every rank p into `out` (rank order) with
/// MPI_Allgatherv on MPI_COMM_WORLD (the ranks of the benchmark's communicator; tpnorm's
/// Communicator has no all-gather); timed and counted by `comm` when it is a TimedCommunicator.
void all_gather(tpnorm::Communicator& comm, const void* mine, void* out,
                const std::vector<int>& bytes_by_rank);

/// All-to-all with MPI_Alltoallv on MPI_COMM_WORLD: `send_bytes[p]` bytes of `mine` to rank p
/// and `recv_bytes[p]` bytes from rank p into `out`, each side's blocks consecutive in rank
/// order; timed and counted (the bytes this rank sends, its own block included) as all_gather.
void all_to_all(tpnorm::Communicator& comm, const void* mine, const std::vector<int>& send_bytes,
                void* out, const std::vector<int>& recv_bytes);

/// Bytes this rank sends on the wire for `plan` under ring algorithms: all-reduce 2(P-1)/P B,
/// all-gather (P-1)/P of the gathered total; an all-to-all (P-1)/P of its own bytes.
double wire_bytes(const std::vector<Collective>& plan, int P);

/// Modelled seconds of `plan` at P ranks: all-reduces on `ar` (ring, tree or the faster),
/// all-gathers and all-to-alls on `ag` with the mean share total / P.
double plan_seconds(const std::vector<Collective>& plan, int P, const Topology& ar,
                    const Topology& ag, Algo algo);

}  // namespace tpnorm_bench
