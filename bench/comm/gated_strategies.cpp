// gated_strategies.cpp — two ways to compute Mamba-2's gated RMSNorm with the channels split
// over P ranks (./launch/tpnorm bench --strategies gated; rms_norm_gated_case.h's shapes:
// gate first, 8 groups):
//   gated_tpnorm   tpnorm's rms_norm_gated: ONE all-reduce per pass of one float64 per
//                  (row, group)
//   gated_gather   all-gather x and z, normalise whole rows locally, keep this rank's columns;
//                  backward all-gathers dy (what a framework without cross-rank statistics
//                  does when a group spans ranks, e.g. vLLM when the groups do not divide P)
// Both are a GatedCase (same seeded data, same float64 check); gated_gather computes in
// float64 from the fp32 inputs and makes its all-gathers with MPI_Allgatherv.
#include <cmath>

#include "rms_norm_gated_case.h"
#include "strategies.h"
#include "timed_communicator.h"

namespace tpnorm_bench {
namespace {

using tpnorm::Communicator;

float* f32(Buffer& b) {
  return static_cast<float*>(b.view(tpnorm::Shape{static_cast<int64_t>(b.size())}).data);
}

class GatherGatedCase : public GatedCase {
 public:
  GatherGatedCase(const BenchConfig& c, int rank, int size)
      : GatedCase(c, rank, size), split_(tpnorm_test::split_even(c.hidden, size)) {}

  void forward(Communicator& comm) override {
    gather(comm, f32(x_), x_all_);
    gather(comm, f32(z_), z_all_);
    float* y = f32(y_);
    const int64_t gs = H_ / G_;
    for (int64_t r = 0; r < R_; ++r)
      for (int64_t g = 0; g < G_; ++g) {
        double ss = 0;
        for (int64_t c = g * gs; c < (g + 1) * gs; ++c) ss += u(r, c) * u(r, c);
        rstd_[r * G_ + g] = static_cast<float>(1 / std::sqrt(ss / gs + 1e-5));
      }
    for (int64_t r = 0; r < R_; ++r)
      for (int64_t j = 0; j < h_; ++j) {
        const int64_t c = c0_ + j;
        y[r * h_ + j] = static_cast<float>(u(r, c) * rstd(r, c) * W_[c]);
      }
  }

  // Each group's sum g*uhat over the gathered dy and the forward's gathered x, z (the weight is
  // whole on every rank, a replicated parameter in this layout).
  void backward(Communicator& comm) override {
    gather(comm, f32(dy_), dy_all_);
    float *dx = f32(dx_), *dz = f32(dz_), *dw = f32(dw_);
    const int64_t gs = H_ / G_;
    std::vector<double> m(static_cast<size_t>(R_ * G_)), sdw(static_cast<size_t>(h_), 0.0);
    for (int64_t r = 0; r < R_; ++r)
      for (int64_t g = 0; g < G_; ++g) {
        double b = 0;
        for (int64_t c = g * gs; c < (g + 1) * gs; ++c)
          b += at(dy_all_, r, c) * W_[c] * u(r, c) * rstd(r, c);
        m[r * G_ + g] = b / gs;
      }
    for (int64_t r = 0; r < R_; ++r)
      for (int64_t j = 0; j < h_; ++j) {
        const int64_t c = c0_ + j;
        const double rs = rstd(r, c), uhat = u(r, c) * rs, dyv = at(dy_all_, r, c);
        const double zv = at(z_all_, r, c), s = 1 / (1 + std::exp(-zv));
        const double du = rs * (dyv * W_[c] - uhat * m[r * G_ + c / gs]);
        dx[r * h_ + j] = static_cast<float>(du * zv * s);
        dz[r * h_ + j] = static_cast<float>(du * at(x_all_, r, c) * s * (1 + zv * (1 - s)));
        sdw[j] += dyv * uhat;
      }
    for (int64_t j = 0; j < h_; ++j) dw[j] = static_cast<float>(sdw[j]);
  }

 private:
  // Every rank's [R, h_p] block, in rank order (block p starts at R * offset[p]).
  void gather(Communicator& comm, const float* mine, std::vector<float>& all) {
    std::vector<int> bytes(split_.count.size());
    for (size_t p = 0; p < bytes.size(); ++p)
      bytes[p] = static_cast<int>(R_ * split_.count[p] * sizeof(float));
    all.resize(static_cast<size_t>(R_ * H_));
    all_gather(comm, mine, all.data(), bytes);
  }
  // Element (r, c) of the full rows in a gathered buffer.
  double at(const std::vector<float>& all, int64_t r, int64_t c) const {
    size_t p = 0;
    while (c >= split_.offset[p] + split_.count[p]) ++p;
    return all[R_ * split_.offset[p] + r * split_.count[p] + (c - split_.offset[p])];
  }
  double u(int64_t r, int64_t c) const {
    const double zv = at(z_all_, r, c);
    return at(x_all_, r, c) * zv / (1 + std::exp(-zv));
  }
  double rstd(int64_t r, int64_t c) const { return rstd_[r * G_ + c / (H_ / G_)]; }

  tpnorm_test::Split split_;
  std::vector<float> x_all_, z_all_, dy_all_;
};

template <class Case>
std::unique_ptr<BenchCase> make(const BenchConfig& c, int rank, int size) {
  return std::make_unique<Case>(c, rank, size);
}

int64_t groups_of(const BenchConfig& c) { return c.hidden % kGroups == 0 ? kGroups : 1; }

// tpnorm/rms_norm_gated.h: one float64 per (row, group) after the call's header, then the slice
// table (2 values per rank at P > 1).
std::vector<Collective> plan_tpnorm(const BenchConfig& c, int P, int, bool) {
  const double table = P > 1 ? 2.0 * P : 0.0;
  const double b = (static_cast<double>(c.rows * groups_of(c)) + header_values(true) + table) * 8;
  return {{Collective::kAllReduce, b, b}};
}
// Forward: x and z gathered; backward: dy.
std::vector<Collective> plan_gather(const BenchConfig& c, int P, int rank, bool forward) {
  const double total = static_cast<double>(c.rows * c.hidden) * sizeof(float);
  const double mine = rank < 0
                          ? total / P
                          : static_cast<double>(c.rows) *
                                tpnorm_test::split_even(c.hidden, P).count[rank] * sizeof(float);
  const Collective gather{Collective::kAllGather, mine, total};
  if (forward) return {gather, gather};
  return {gather};
}

}  // namespace

std::vector<BenchStrategy> gated_strategies() {
  return {
      {"gated_tpnorm", "gated RMSNorm: tpnorm, 1 all-reduce / pass", make<GatedCase>, plan_tpnorm,
       "gated"},
      {"gated_gather", "all-gather x and z, local norm, slice", make<GatherGatedCase>, plan_gather,
       "gated"},
  };
}

}  // namespace tpnorm_bench
