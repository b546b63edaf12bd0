// peers.h — the problems that `./launch/tpnorm perf --peers` times in tpnorm and in other
// libraries (oneDNN here: peer_onednn.cpp; PyTorch: peers_torch.py), and tpnorm's result on each,
// which every peer's output is checked against before the peer is timed.
//
// A problem is one row of the peers table: op (LayerNorm, RMSNorm, SyncBN), pass (forward,
// backward), shape and layout (rows, NCHW, NHWC). Its checked inputs are deterministic and
// reproducible outside C++ (peers_torch.py makes the same floats): x and dy as fill_inputs
// (micro.h), gamma[i] = 1 + ((7 i) & 15) / 32, beta[i] = ((5 i) & 7) / 8 - 1/2, eps = 1e-5.
// The backward's inputs are x, dy and the forward's statistics (mean and rstd / invstd).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "micro.h"

namespace tpnorm_perf {

struct Problem {
  std::string op, pass, layout;  // layout: "rows" (row norms), "NCHW" or "NHWC" (SyncBN)
  std::vector<int64_t> dims;     // rows x h, or the tensor's dims in memory order
  bool backward() const { return pass == "backward"; }
  std::string shape() const;
  int64_t numel() const;
  int64_t rows() const { return dims[0]; }                  // row norms
  int64_t h() const { return dims[1]; }                     // row norms
  int64_t channels() const;                                 // SyncBN
  int64_t bytes() const;  // the minimum traffic, as micro_*.cpp count it
  // The micro benchmark's name of tpnorm's own case at `threads`.
  std::string tpnorm_name(int threads) const;
};

constexpr double kPeerEps = 1e-5;
/// A peer's output matches when max |peer - tpnorm| <= kPeerTol * max(1, max |tpnorm|).
/// 4e-3: float32 channel sums over 10^5 values around 3.5 (NHWC SyncBatchNorm at one thread)
/// put oneDNN's and torch's y 1.8e-3 of its scale from the float64 value, which tpnorm
/// matches; a wrong eps (1e-3 for 1e-5) moves y by 5e-3 of it and still fails.
constexpr double kPeerTol = 4e-3;

/// Every problem of the peers table, in the table's order.
const std::vector<Problem>& peer_problems();

/// The checked inputs of a problem.
struct PeerInputs {
  Floats x, dy, gamma, beta;
  explicit PeerInputs(const Problem& p);
};

/// tpnorm's outputs on the checked inputs, by name: forward y, mean, rstd (row norms; RMSNorm
/// has no mean) or y, mean, invstd (SyncBN); backward dx, dgamma, dbeta (RMSNorm: no dbeta).
/// For the backward, `stats` are the forward's mean and rstd / invstd (also returned).
struct PeerResult {
  std::vector<std::pair<std::string, Floats>> out;
  const Floats& get(const std::string& name) const;
};
PeerResult tpnorm_result(const Problem& p, const PeerInputs& in, int threads = 1);

/// "" when `got` (n values) matches `ref`, else a message naming the output and the difference.
std::string compare(const std::string& name, const float* got, const Floats& ref);

/// A peer's call at its thread count, made and run once, and how its output differs from
/// tpnorm's ("" when it matches; peers check at the first make at each thread count).
struct PeerCall {
  Call call;
  std::string mismatch;
};

/// Registers a peer's benchmark, "peer/LIB/OP/PASS/SHAPE/threads:T", on the clock of tpnorm's
/// case at the same threads; `make(T)` runs outside the timed loop. A mismatch is printed as an
/// error and kept in the benchmark's label ("MISMATCH: ..."); the peer is still timed (the table
/// marks the cell and does not count it as the best peer). An exception from `make` is the
/// benchmark's error, and it is not timed.
void add_peer(const std::string& lib, const Problem& p, std::function<PeerCall(int threads)> make);

/// What a peer library is (its version) or why it is not in this build: `--peers_info` prints it.
void add_peer_info(const std::string& lib, const std::string& text);

/// tpnorm_micro's --peers_info and --peers_ref flags (micro_peers.cpp): true when argv has one
/// (the command ran, `rc` is its exit status), false when the benchmarks are to run.
bool peers_command(int argc, char** argv, int& rc);

}  // namespace tpnorm_perf
