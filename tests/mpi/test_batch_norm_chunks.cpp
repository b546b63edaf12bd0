// SyncBatchNorm in channel chunks (ops/chunking.h; the rows of the plan are channels), run
// under mpiexec at 2, 3 and 4 ranks with TPNORM_CHUNK forcing the chunk size (the same on every
// rank): chunk k's sums in flight while chunk k+1's partials run, chunk k's apply right after.
//
// Uneven batches (3, 0, 5, 1 samples per rank: a rank with none), NCHW, 37 channels (chunks of
// 16 leave a last chunk of 5; chunks of 5 are not a multiple of the vector width), 7x7 planes,
// fp32 and bf16 with float32 parameters, momentum 0.1 and the cumulative average. Two training
// steps and one eval step (forward + backward): every output (y, dx, dgamma, dbeta, save_mean,
// save_invstd, running statistics, num_batches_tracked) bitwise equal to the unchunked call
// (TPNORM_CHUNK=off: a channel's sums do not depend on the other channels), and the chunked
// outputs against BatchNorm in float64 on the concatenated batch (tolerances as
// test_batch_norm_equiv.cpp, r = one rounding of the dtype: y r + r, dx r*max(1, invstd) + 10r,
// dgamma / dbeta summed over ranks r*count + r, save_mean 1e-6 + 1e-6, save_invstd 1e-5 rel,
// running statistics 1e-6 + 1e-5). A chunked training call makes the header's sum plus one sum
// per chunk, in either layout (a channels-last rank sums its whole partial in the chunks' sums),
// and with the layout differing by rank (even ranks channels-last, the empty rank 1 NCHW, as a
// convolution leaves an empty batch); Stats::kExact is never chunked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>

#include "batch_norm_reference.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

// TPNORM_CHUNK for the scope (set alike on every rank), restored after.
class ChunkEnv {
 public:
  explicit ChunkEnv(const char* value) {
    if (const char* old = std::getenv("TPNORM_CHUNK")) old_ = old, had_ = true;
    setenv("TPNORM_CHUNK", value, 1);
  }
  ~ChunkEnv() {
    if (had_)
      setenv("TPNORM_CHUNK", old_.c_str(), 1);
    else
      unsetenv("TPNORM_CHUNK");
  }

 private:
  std::string old_;
  bool had_ = false;
};

constexpr int64_t kC = 37, kH = 7, kW = 7, kInner = kH * kW;

struct Case {
  const char* name;
  DType dt;
  double momentum;
  Layout layout;
  bool mixed = false;  ///< even ranks channels-last, odd ranks NCHW (layout ignored)
};

bool channels_last_here(const Case& k) {
  return k.mixed ? world_rank() % 2 == 0 : k.layout == Layout::kChannelsLast;
}

std::vector<int64_t> batches() {
  const int64_t uneven[] = {3, 0, 5, 1};
  std::vector<int64_t> n(world_size());
  for (int i = 0; i < world_size(); ++i) n[i] = uneven[i % 4];
  return n;
}

struct Outputs {
  std::vector<std::vector<float>> y, dx, dgamma, dbeta, save_mean, save_invstd;
  std::vector<float> running_mean, running_var;
  int64_t tracked = 0;
  std::vector<uint64_t> calls;  // collectives of each training step (forward + backward)
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  // (memcmp of an empty vector's null data is undefined: a rank may hold no samples)
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// The full batch's x or dy of a step, rounded to the dtype (NCHW).
std::vector<float> full(const Case& k, int64_t N, uint64_t stream, double mean, double sd) {
  return Buffer(k.dt, normal(43, stream, N * kC * kInner, mean, sd)).floats();
}

Outputs run_steps(Communicator& comm, const Case& k) {
  const std::vector<int64_t> n = batches();
  const int me = world_rank();
  const int64_t N = std::accumulate(n.begin(), n.end(), int64_t{0});
  const int64_t nb = n[me], b0 = std::accumulate(n.begin(), n.begin() + me, int64_t{0});
  const bool cl = channels_last_here(k);
  const Shape xs = cl ? Shape{nb, kH, kW, kC} : Shape{nb, kC, kH, kW}, cs{kC};
  std::vector<float> gamma = normal(43, 1, kC, 1.0, 0.5), beta = normal(43, 2, kC);
  BatchNormOptions opt;
  opt.momentum = k.momentum;
  opt.layout = cl ? Layout::kChannelsLast : Layout::kNCHW;
  Outputs o;
  o.running_mean.assign(kC, 0.f);
  o.running_var.assign(kC, 1.f);
  auto mine = [&](const std::vector<float>& f) {
    std::vector<float> v(f.begin() + b0 * kC * kInner, f.begin() + (b0 + nb) * kC * kInner);
    return cl ? to_channels_last(v, nb, kC, kInner) : v;
  };
  for (int step = 0; step < 3; ++step) {
    opt.training = step < 2;
    const auto x = mine(full(k, N, 10 + step, 2.0 + step, 1.5));
    const auto dy = mine(full(k, N, 20 + step, 0.0, 1.0));
    Buffer xb(k.dt, x), dyb(k.dt, dy), y(k.dt, x.size()), dx(k.dt, x.size());
    std::vector<float> dg(kC), db(kC), sm(kC), si(kC);
    comm.reset_counters();
    sync_batch_norm_forward(comm, xb.view(xs), view(gamma.data(), cs), view(beta.data(), cs),
                            view(o.running_mean.data(), cs), view(o.running_var.data(), cs),
                            &o.tracked, y.view(xs), view(sm.data(), cs), view(si.data(), cs), opt);
    sync_batch_norm_backward(comm, dyb.view(xs), xb.view(xs), view(gamma.data(), cs),
                             view(sm.data(), cs), view(si.data(), cs), dx.view(xs),
                             view(dg.data(), cs), view(db.data(), cs), opt);
    o.calls.push_back(comm.counters().calls);
    auto nchw = [&](const Buffer& b) {
      return cl ? from_channels_last(b.floats(), nb, kC, kInner) : b.floats();
    };
    o.y.push_back(nchw(y));
    o.dx.push_back(nchw(dx));
    o.dgamma.push_back(dg);
    o.dbeta.push_back(db);
    o.save_mean.push_back(sm);
    o.save_invstd.push_back(si);
  }
  return o;
}

std::string bit_differences(const Outputs& a, const Outputs& b) {
  std::string d;
  for (size_t s = 0; s < a.y.size(); ++s) {
    const std::string at = " (step " + std::to_string(s) + ")";
    if (!same_bits(a.y[s], b.y[s])) d += " y" + at;
    if (!same_bits(a.dx[s], b.dx[s])) d += " dx" + at;
    if (!same_bits(a.dgamma[s], b.dgamma[s])) d += " dgamma" + at;
    if (!same_bits(a.dbeta[s], b.dbeta[s])) d += " dbeta" + at;
    if (!same_bits(a.save_mean[s], b.save_mean[s])) d += " save_mean" + at;
    if (!same_bits(a.save_invstd[s], b.save_invstd[s])) d += " save_invstd" + at;
  }
  if (!same_bits(a.running_mean, b.running_mean)) d += " running_mean";
  if (!same_bits(a.running_var, b.running_var)) d += " running_var";
  if (a.tracked != b.tracked) d += " num_batches_tracked";
  return d;
}

// Sum over the ranks (in double, rounded once to float for count_wrong).
std::vector<float> summed(const std::vector<float>& v) {
  std::vector<double> in(v.begin(), v.end()), out(v.size());
  MPI_Allreduce(in.data(), out.data(), static_cast<int>(in.size()), MPI_DOUBLE, MPI_SUM,
                MPI_COMM_WORLD);
  return {out.begin(), out.end()};
}

int64_t wrong_vs_reference(const Case& k, const Outputs& o) {
  const std::vector<int64_t> n = batches();
  const int me = world_rank();
  const int64_t N = std::accumulate(n.begin(), n.end(), int64_t{0}), count = N * kInner;
  const int64_t b0 = std::accumulate(n.begin(), n.begin() + me, int64_t{0}), nb = n[me];
  const std::vector<float> gamma = normal(43, 1, kC, 1.0, 0.5), beta = normal(43, 2, kC);
  std::vector<double> rm(kC, 0.0), rv(kC, 1.0);
  const double rt = storage_rtol(k.dt), rtp = storage_rtol(DType::F32);
  auto want = [&](const std::vector<double>& f) {
    return std::vector<double>(f.begin() + b0 * kC * kInner, f.begin() + (b0 + nb) * kC * kInner);
  };
  int64_t wrong = 0;
  for (int step = 0; step < 3; ++step) {
    const auto x = full(k, N, 10 + step, 2.0 + step, 1.5), dy = full(k, N, 20 + step, 0.0, 1.0);
    BnRef ref;
    if (step == 2) {
      ref = batch_norm_eval_reference(x, N, kC, kInner, gamma, beta, rm, rv, 1e-5, dy);
    } else {
      ref = batch_norm_reference(x, N, kC, kInner, gamma, beta, 1e-5, dy);
      const double m = std::isnan(k.momentum) ? 1.0 / (step + 1) : k.momentum;
      for (int64_t ch = 0; ch < kC; ++ch) {
        rm[ch] = (1 - m) * rm[ch] + m * ref.mean[ch];
        rv[ch] = (1 - m) * rv[ch] + m * ref.var[ch] * count / (count - 1);
      }
    }
    std::vector<double> invstd(kC);
    for (int64_t ch = 0; ch < kC; ++ch) invstd[ch] = 1.0 / std::sqrt(ref.var[ch] + 1e-5);
    const double is_max = *std::max_element(invstd.begin(), invstd.end());
    wrong += count_wrong("y", o.y[step], want(ref.y), rt, rt);
    wrong += count_wrong("dx", o.dx[step], want(ref.dx), rt * std::max(1.0, is_max), 10 * rt);
    wrong += count_wrong("dgamma summed", summed(o.dgamma[step]), ref.dgamma, rtp * count, rtp);
    wrong += count_wrong("dbeta summed", summed(o.dbeta[step]), ref.dbeta, rtp * count, rtp);
    if (step < 2) {
      wrong += count_wrong("save_mean", o.save_mean[step], ref.mean, 1e-6, 1e-6);
      wrong += count_wrong("save_invstd", o.save_invstd[step], invstd, 0, 1e-5);
    }
  }
  wrong += count_wrong("running_mean", o.running_mean, rm, 1e-6, 1e-5);
  wrong += count_wrong("running_var", o.running_var, rv, 1e-6, 1e-5);
  return wrong;
}

class BatchNormChunks : public ::testing::TestWithParam<Case> {};

TEST_P(BatchNormChunks, SameBitsAsTheUnchunkedCall) {
  const Case k = GetParam();
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  Outputs plain;
  {
    ChunkEnv env("off");
    plain = run_steps(*comm, k);
  }
  int64_t wrong = 0;
  for (const char* rows : {"16", "5"}) {
    ChunkEnv env(rows);
    const Outputs chunked = run_steps(*comm, k);
    const std::string diff = bit_differences(chunked, plain);
    if (!diff.empty()) {
      ADD_FAILURE() << "TPNORM_CHUNK=" << rows << ": bits differ from the unchunked call in"
                    << diff;
      ++wrong;
    }
    // Forward and backward: the header's sum and one sum per chunk each when chunked; the
    // unchunked call's count otherwise.
    const int64_t chunks = (kC + std::atoi(rows) - 1) / std::atoi(rows);
    for (int step = 0; step < 2; ++step) {
      const uint64_t want = 2 * (1 + chunks);
      if (chunked.calls[step] != want) {
        ADD_FAILURE() << "TPNORM_CHUNK=" << rows << " step " << step << ": " << chunked.calls[step]
                      << " collectives, want " << want;
        ++wrong;
      }
    }
    wrong += wrong_vs_reference(k, chunked);
  }
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "wrong elements or fields, summed over ranks";
}

const double kCumulative = BatchNormOptions::cumulative();
const Case kCases[] = {
    {"f32_momentum_nchw", DType::F32, 0.1, Layout::kNCHW},
    {"bf16_cumulative_nchw", DType::BF16, kCumulative, Layout::kNCHW},
    {"f32_channels_last", DType::F32, 0.1, Layout::kChannelsLast},
    {"bf16_mixed_layouts", DType::BF16, 0.1, Layout::kNCHW, true},
};

INSTANTIATE_TEST_SUITE_P(Chunks, BatchNormChunks, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
