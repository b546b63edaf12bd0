// strategies.cpp — the four LayerNorm strategies of strategies.h.
#include "strategies.h"

#include <mpi.h>

#include <cmath>

#include "row_norm_case.h"
#include "timed_communicator.h"

namespace tpnorm_bench {
namespace {

using tpnorm::Communicator;
using tpnorm::DType;

constexpr double kEps = 1e-5;  // NormOptions' default, which the tpnorm strategy uses

float* data(Buffer& b) {
  return static_cast<float*>(b.view(tpnorm::Shape{static_cast<int64_t>(b.size())}).data);
}

// sum of v - c (squared: of (v - c)^2) over n floats, in double.
double sum(const float* v, int64_t n, double c, bool squared) {
  double s = 0;
  if (squared) {
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < n; ++j) s += (v[j] - c) * (v[j] - c);
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < n; ++j) s += v[j] - c;
  }
  return s;
}

// The strategies other than tpnorm: LayerNorm by hand on the RowNormCase's data and buffers.
class ManualCase : public RowNormCase {
 public:
  ManualCase(const BenchConfig& c, int rank, int size)
      : RowNormCase(true, c, rank, size), split_(tpnorm_test::split_even(c.hidden, size)) {}

 protected:
  // y, the saved mean and rstd of this rank's slice from each row's mean and M2 / H.
  void apply_forward(const std::vector<double>& mean, const std::vector<double>& var) {
    const float *x = data(x_), *g = data(g_), *b = data(b_);
    float* y = data(y_);
    for (int64_t r = 0; r < R_; ++r) {
      const double rstd = 1 / std::sqrt(var[r] + kEps), m = mean[r];
      mean_[r] = static_cast<float>(m);
      rstd_[r] = static_cast<float>(rstd);
      const float* xr = x + r * h_;
      float* yr = y + r * h_;
#pragma omp simd
      for (int64_t j = 0; j < h_; ++j) yr[j] = static_cast<float>((xr[j] - m) * rstd * g[j] + b[j]);
    }
  }

  // Per row of this rank's slice: sum g*dy and sum g*dy*xhat (xhat from the saved statistics).
  std::vector<double> backward_partials() {
    const float *x = data(x_), *dy = data(dy_), *g = data(g_);
    std::vector<double> ab(2 * R_, 0.0);
    for (int64_t r = 0; r < R_; ++r) {
      const double m = mean_[r], rstd = rstd_[r];
      const float *xr = x + r * h_, *dyr = dy + r * h_;
      double a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
      for (int64_t j = 0; j < h_; ++j) {
        const double gdy = double(g[j]) * dyr[j];
        a += gdy;
        b += gdy * (xr[j] - m) * rstd;
      }
      ab[r] = a;
      ab[R_ + r] = b;
    }
    return ab;
  }

  // dx from the whole rows' sums a = sum g*dy, b = sum g*dy*xhat; dgamma, dbeta of the slice.
  void apply_backward(const double* a, const double* b) {
    const float *x = data(x_), *dy = data(dy_), *g = data(g_);
    float *dx = data(dx_), *dg = data(dg_), *db = data(db_);
    std::vector<double> sdg(h_, 0.0), sdb(h_, 0.0);
    for (int64_t r = 0; r < R_; ++r) {
      const double m = mean_[r], rstd = rstd_[r], ah = a[r] / H_, bh = b[r] / H_;
      const float *xr = x + r * h_, *dyr = dy + r * h_;
      float* dxr = dx + r * h_;
#pragma omp simd
      for (int64_t j = 0; j < h_; ++j) {
        const double xhat = (xr[j] - m) * rstd, d = dyr[j];
        dxr[j] = static_cast<float>(rstd * (g[j] * d - ah - xhat * bh));
        sdg[j] += d * xhat;
        sdb[j] += d;
      }
    }
    for (int64_t j = 0; j < h_; ++j) {
      dg[j] = static_cast<float>(sdg[j]);
      db[j] = static_cast<float>(sdb[j]);
    }
  }

  tpnorm_test::Split split_;
};

class TwoPassCase : public ManualCase {
 public:
  using ManualCase::ManualCase;
  void forward(Communicator& comm) override {
    const float* x = data(x_);
    std::vector<double> mean(R_, 0.0), var(R_, 0.0);
    for (int64_t r = 0; r < R_; ++r) mean[r] = sum(x + r * h_, h_, 0.0, false);
    comm.all_reduce_sum(mean.data(), R_, DType::F64);  // 1: sum x
    for (double& m : mean) m /= H_;
    for (int64_t r = 0; r < R_; ++r) var[r] = sum(x + r * h_, h_, mean[r], true);
    comm.all_reduce_sum(var.data(), R_, DType::F64);  // 2: centred sum of squares
    for (double& v : var) v /= H_;
    apply_forward(mean, var);
  }
  void backward(Communicator& comm) override {
    std::vector<double> ab = backward_partials();
    comm.all_reduce_sum(ab.data(), R_, DType::F64);       // sum g*dy
    comm.all_reduce_sum(ab.data() + R_, R_, DType::F64);  // sum g*dy*xhat
    apply_backward(ab.data(), ab.data() + R_);
  }
};

class GatherRowCase : public ManualCase {
 public:
  using ManualCase::ManualCase;
  void forward(Communicator& comm) override {
    gather(comm, data(x_), x_all_);
    std::vector<double> mean = row_sums(x_all_, std::vector<double>(R_, 0.0), false);
    for (double& m : mean) m /= H_;
    std::vector<double> var = row_sums(x_all_, mean, true);
    for (double& v : var) v /= H_;
    apply_forward(mean, var);
  }
  // The whole rows' sums from the gathered dy and the forward's gathered x; gamma is whole on
  // every rank (a replicated parameter in this layout).
  void backward(Communicator& comm) override {
    std::vector<float> dy_all;
    gather(comm, data(dy_), dy_all);
    std::vector<double> ab(2 * R_, 0.0);
    for (int p = 0; p < static_cast<int>(split_.count.size()); ++p) {
      const int64_t hp = split_.count[p], c0 = split_.offset[p], at = R_ * c0;
      const float* g = &G_[c0];
      for (int64_t r = 0; r < R_; ++r) {
        const float *xr = &x_all_[at + r * hp], *dyr = &dy_all[at + r * hp];
        const double m = mean_[r], rstd = rstd_[r];
        double a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
        for (int64_t j = 0; j < hp; ++j) {
          const double gdy = double(g[j]) * dyr[j];
          a += gdy;
          b += gdy * (xr[j] - m) * rstd;
        }
        ab[r] += a;
        ab[R_ + r] += b;
      }
    }
    apply_backward(ab.data(), ab.data() + R_);
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
  // Per row, the sum over every rank's block of v - c[r] (squared: (v - c[r])^2).
  std::vector<double> row_sums(const std::vector<float>& all, const std::vector<double>& c,
                               bool squared) const {
    std::vector<double> s(R_, 0.0);
    for (size_t p = 0; p < split_.count.size(); ++p) {
      const int64_t hp = split_.count[p], at = R_ * split_.offset[p];
      for (int64_t r = 0; r < R_; ++r) s[r] += sum(&all[at + r * hp], hp, c[r], squared);
    }
    return s;
  }
  std::vector<float> x_all_;  // the forward's gathered x, kept for the backward
};

class GatherStatsCase : public ManualCase {
 public:
  using ManualCase::ManualCase;
  void forward(Communicator& comm) override {
    const float* x = data(x_);
    const int P = comm.size();
    std::vector<double> mine(3 * R_, 0.0), all(3 * R_ * P);
    for (int64_t r = 0; r < R_; ++r) {  // (count, mean, M2) of this rank's slice, two passes
      const double m = h_ > 0 ? sum(x + r * h_, h_, 0.0, false) / h_ : 0;
      mine[3 * r] = static_cast<double>(h_);
      mine[3 * r + 1] = m;
      mine[3 * r + 2] = sum(x + r * h_, h_, m, true);
    }
    all_gather(comm, mine.data(), all.data(),
               std::vector<int>(P, static_cast<int>(3 * R_ * sizeof(double))));
    std::vector<double> mean(R_), var(R_);
    for (int64_t r = 0; r < R_; ++r) {  // Chan et al.'s pairwise merge, in rank order
      double n = 0, m = 0, m2 = 0;
      for (int p = 0; p < P; ++p) {
        const double* s = &all[3 * (p * R_ + r)];
        if (s[0] == 0) continue;
        const double nn = n + s[0], delta = s[1] - m;
        m += delta * s[0] / nn;
        m2 += s[2] + delta * delta * n * s[0] / nn;
        n = nn;
      }
      mean[r] = m;
      var[r] = m2 / n;
    }
    apply_forward(mean, var);
  }
  void backward(Communicator& comm) override {
    std::vector<double> ab = backward_partials();
    comm.all_reduce_sum(ab.data(), ab.size(), DType::F64);  // both sums in one all-reduce
    apply_backward(ab.data(), ab.data() + R_);
  }
};

template <class Case>
std::unique_ptr<BenchCase> make(const BenchConfig& c, int rank, int size) {
  return std::make_unique<Case>(c, rank, size);
}

std::unique_ptr<BenchCase> make_tpnorm(const BenchConfig& c, int rank, int size) {
  return std::make_unique<RowNormCase>(true, c, rank, size);
}

double rows(const BenchConfig& c) { return static_cast<double>(c.rows); }

std::vector<Collective> plan_tpnorm(const BenchConfig& c, int, int, bool) {
  const double b = (2 * rows(c) + header_values(true)) * sizeof(double);
  return {{Collective::kAllReduce, b, b}};
}
std::vector<Collective> plan_two_pass(const BenchConfig& c, int, int, bool) {
  const double b = rows(c) * sizeof(double);
  return {{Collective::kAllReduce, b, b}, {Collective::kAllReduce, b, b}};
}
std::vector<Collective> plan_gather_row(const BenchConfig& c, int P, int rank, bool) {
  const double total = rows(c) * static_cast<double>(c.hidden) * sizeof(float);
  const double mine =
      rank < 0 ? total / P
               : rows(c) * tpnorm_test::split_even(c.hidden, P).count[rank] * sizeof(float);
  return {{Collective::kAllGather, mine, total}};
}
std::vector<Collective> plan_gather_stats(const BenchConfig& c, int P, int, bool forward) {
  if (!forward) {
    const double b = 2 * rows(c) * sizeof(double);
    return {{Collective::kAllReduce, b, b}};
  }
  const double mine = 3 * rows(c) * sizeof(double);
  return {{Collective::kAllGather, mine, mine * P}};
}

}  // namespace

void all_gather(Communicator& comm, const void* mine, void* out,
                const std::vector<int>& bytes_by_rank) {
  std::vector<int> displs(bytes_by_rank.size(), 0);
  for (size_t p = 1; p < displs.size(); ++p) displs[p] = displs[p - 1] + bytes_by_rank[p - 1];
  const int my_bytes = bytes_by_rank[comm.rank()];
  auto run = [&] {
    MPI_Allgatherv(mine, my_bytes, MPI_BYTE, out, bytes_by_rank.data(), displs.data(), MPI_BYTE,
                   MPI_COMM_WORLD);
  };
  if (auto* t = dynamic_cast<TimedCommunicator*>(&comm))
    t->external(static_cast<uint64_t>(my_bytes), run);
  else
    run();
}

void all_to_all(Communicator& comm, const void* mine, const std::vector<int>& send_bytes,
                void* out, const std::vector<int>& recv_bytes) {
  auto displs = [](const std::vector<int>& n) {
    std::vector<int> d(n.size(), 0);
    for (size_t p = 1; p < d.size(); ++p) d[p] = d[p - 1] + n[p - 1];
    return d;
  };
  const std::vector<int> sd = displs(send_bytes), rd = displs(recv_bytes);
  uint64_t sent = 0;
  for (int b : send_bytes) sent += static_cast<uint64_t>(b);
  auto run = [&] {
    MPI_Alltoallv(mine, send_bytes.data(), sd.data(), MPI_BYTE, out, recv_bytes.data(), rd.data(),
                  MPI_BYTE, MPI_COMM_WORLD);
  };
  if (auto* t = dynamic_cast<TimedCommunicator*>(&comm))
    t->external(sent, run);
  else
    run();
}

const std::vector<BenchStrategy>& bench_strategies() {
  static const std::vector<BenchStrategy> s = [] {
    std::vector<BenchStrategy> all = {
        {"tpnorm", "tpnorm: 1 all-reduce / pass", make_tpnorm, plan_tpnorm},
        {"two_pass", "2 all-reduces / pass (Colossal-AI 2D, MindSpeed)", make<TwoPassCase>,
         plan_two_pass},
        {"gather_row", "all-gather x, local norm (DTensor Shard(-1))", make<GatherRowCase>,
         plan_gather_row},
        {"gather_stats", "all-gather (n, mean, M2) + Chan merge (SyncBN)", make<GatherStatsCase>,
         plan_gather_stats},
    };
    for (BenchStrategy& q : qk_strategies()) all.push_back(q);
    for (BenchStrategy& g : gated_strategies()) all.push_back(g);
    return all;
  }();
  return s;
}

double wire_bytes(const std::vector<Collective>& plan, int P) {
  double w = 0;
  for (const Collective& c : plan)
    w += c.kind == Collective::kAllGather  ? (P - 1.0) / P * c.total
         : c.kind == Collective::kAllToAll ? (P - 1.0) / P * c.bytes
                                           : 2.0 * (P - 1) / P * c.bytes;
  return w;
}

double plan_seconds(const std::vector<Collective>& plan, int P, const Topology& ar,
                    const Topology& ag, Algo algo) {
  double t = 0;
  for (const Collective& c : plan)
    t += c.kind == Collective::kAllGather  ? allgather_seconds(ag, P, c.total / P)
         : c.kind == Collective::kAllToAll ? alltoall_seconds(ag, P, c.total / P)
                                           : allreduce_seconds(ar, P, c.bytes, algo);
  return t;
}

}  // namespace tpnorm_bench
