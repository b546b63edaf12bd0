// op_sync_bn.cpp — SyncBatchNorm (training) for the benchmark: x NCHW [N, C, *spatial] with the
// batch N split evenly over the ranks (data parallelism; a rank may hold 0 samples). Every rank
// makes the full batch from a seed and keeps its samples; the float64 reference of
// tests/reference runs on the full batch.
#include <algorithm>
#include <cmath>

#include "batch_norm_reference.h"
#include "bench_op.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/batch_norm.h"

namespace tpnorm_bench {
namespace {

using namespace tpnorm;
using tpnorm_test::Buffer;

class SyncBnCase : public BenchCase {
 public:
  SyncBnCase(const BenchConfig& c, int rank, int size) : cfg_(c) {
    const std::vector<int64_t>& s = c.shape;
    N_ = s.empty() ? 0 : s[0];
    C_ = s.size() > 1 ? s[1] : 1;
    S_ = 1;
    for (size_t i = 2; i < s.size(); ++i) S_ *= s[i];
    const auto split = tpnorm_test::split_even(N_, size);
    n0_ = split.offset[rank];
    n_ = split.count[rank];
    X_ = tpnorm_test::normal(11, 0, N_ * C_ * S_, 0.5);
    DY_ = tpnorm_test::normal(12, 0, N_ * C_ * S_);
    G_ = tpnorm_test::normal(13, 0, C_, 1.0);
    B_ = tpnorm_test::normal(14, 0, C_);
    const size_t per = static_cast<size_t>(C_ * S_), lo = n0_ * per, hi = (n0_ + n_) * per;
    x_ = Buffer(c.dtype, std::vector<float>(X_.begin() + lo, X_.begin() + hi));
    dy_ = Buffer(c.dtype, std::vector<float>(DY_.begin() + lo, DY_.begin() + hi));
    g_ = Buffer(c.dtype, G_);
    b_ = Buffer(c.dtype, B_);
    y_ = Buffer(c.dtype, hi - lo);
    dx_ = Buffer(c.dtype, hi - lo);
    dg_ = Buffer(c.dtype, C_);
    db_ = Buffer(c.dtype, C_);
    rm_.assign(C_, 0.f);
    rv_.assign(C_, 1.f);
    mean_.resize(C_);
    invstd_.resize(C_);
    local_ = s;
    if (!local_.empty()) local_[0] = n_;
  }

  std::string local_shape() const override {
    std::string r;
    for (int64_t d : local_) r += (r.empty() ? "" : "x") + std::to_string(d);
    return r;
  }

  void forward(Communicator& comm) override {
    const Shape c{C_};
    sync_batch_norm_forward(comm, x_.view(shape()), g_.view(c), b_.view(c), view(rm_.data(), c),
                            view(rv_.data(), c), &tracked_, y_.view(shape()), view(mean_.data(), c),
                            view(invstd_.data(), c), options());
  }

  void backward(Communicator& comm) override {
    const Shape c{C_};
    sync_batch_norm_backward(comm, dy_.view(shape()), x_.view(shape()), g_.view(c),
                             view(mean_.data(), c), view(invstd_.data(), c), dx_.view(shape()),
                             dg_.view(c), db_.view(c), options());
  }

  // Tolerances as in tests/mpi/test_batch_norm_equiv.cpp. dgamma/dbeta are this rank's sums:
  // summed over the ranks (every rank calls count_wrong) they must match the whole batch's.
  int64_t count_wrong() override {
    auto round = [&](const std::vector<float>& v) { return Buffer(cfg_.dtype, v).floats(); };
    const auto ref = tpnorm_test::batch_norm_reference(round(X_), N_, C_, S_, round(G_), round(B_),
                                                       1e-5, round(DY_));
    const size_t per = static_cast<size_t>(C_ * S_);
    auto mine = [&](const std::vector<double>& v) {
      return std::vector<double>(v.begin() + n0_ * per, v.begin() + (n0_ + n_) * per);
    };
    auto summed = [](const std::vector<float>& v) {
      std::vector<double> d(v.begin(), v.end());
      MPI_Allreduce(MPI_IN_PLACE, d.data(), static_cast<int>(d.size()), MPI_DOUBLE, MPI_SUM,
                    MPI_COMM_WORLD);
      return std::vector<float>(d.begin(), d.end());
    };
    std::vector<double> invstd(C_);
    for (int64_t ch = 0; ch < C_; ++ch) invstd[ch] = 1 / std::sqrt(ref.var[ch] + 1e-5);
    const double rt = tpnorm_test::storage_rtol(cfg_.dtype), count = static_cast<double>(N_ * S_);
    const double is_max = *std::max_element(invstd.begin(), invstd.end());
    return tpnorm_test::count_wrong("y", y_.floats(), mine(ref.y), rt, rt) +
           tpnorm_test::count_wrong("dx", dx_.floats(), mine(ref.dx), rt * std::max(1.0, is_max),
                                    10 * rt) +
           tpnorm_test::count_wrong("save_mean", mean_, ref.mean, 1e-6, 1e-6) +
           tpnorm_test::count_wrong("save_invstd", invstd_, invstd, 0, 1e-5) +
           tpnorm_test::count_wrong("dgamma summed", summed(dg_.floats()), ref.dgamma, rt * count,
                                    rt) +
           tpnorm_test::count_wrong("dbeta summed", summed(db_.floats()), ref.dbeta, rt * count,
                                    rt);
  }

  // docs/cpp-api.md, "One collective per call": forward C x 2 values + count, backward C x 2 values. The
  // forward's count is the call header's element count ("2 x C values + header" both ways).
  // Stats::kExact (tpnorm/batch_norm.h): C x 13 int64 forward, C x 11 backward.
  uint64_t payload_values(bool forward) const override {
    if (cfg_.stats == tpnorm::Stats::kExact) return (forward ? 13 : 11) * static_cast<uint64_t>(C_);
    return 2 * static_cast<uint64_t>(C_);
  }

 private:
  Shape shape() const {
    Shape s;
    s.ndim = static_cast<int>(local_.size());
    for (size_t i = 0; i < local_.size(); ++i) s.dims[i] = local_[i];
    return s;
  }
  BatchNormOptions options() const {
    BatchNormOptions o;
    o.stats = cfg_.stats;
    return o;
  }

  BenchConfig cfg_;
  int64_t N_ = 0, C_ = 1, S_ = 1, n0_ = 0, n_ = 0, tracked_ = 0;
  std::vector<int64_t> local_;
  std::vector<float> X_, DY_, G_, B_, rm_, rv_, mean_, invstd_;
  Buffer x_, dy_, g_, b_, y_, dx_, dg_, db_;
};

}  // namespace

std::unique_ptr<BenchCase> make_syncbn(const BenchConfig& c, int rank, int size) {
  return std::make_unique<SyncBnCase>(c, rank, size);
}

}  // namespace tpnorm_bench
