// row_norm_case.h — LayerNorm / RMSNorm for the benchmark: x [rows, hidden] with the hidden
// dimension sharded evenly over the ranks (tensor parallelism), gamma/beta sliced likewise.
// Every rank makes the full input from a seed and keeps its columns, so checking needs no data
// exchange: the float64 reference runs on the full input on every rank (tests/reference).
// forward/backward call tpnorm's ops; the other strategies of strategies.cpp override them and
// keep the data, the buffers and the check.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "bench_op.h"
#include "tpnorm/batched.h"
#include "harness.h"
#include "reference.h"
#include "storage.h"

namespace tpnorm_bench {

using tpnorm_test::Buffer;

class RowNormCase : public BenchCase {
 public:
  // `seed` picks the data: two cases of one step (a layer's q and k) get different ones.
  RowNormCase(bool centered, const BenchConfig& c, int rank, int size, uint64_t seed = 1)
      : centered_(centered), cfg_(c), R_(c.rows), H_(c.hidden) {
    const auto split = tpnorm_test::split_even(H_, size);
    c0_ = split.offset[rank];
    h_ = split.count[rank];
    X_ = tpnorm_test::normal(seed, 0, R_ * H_, 0.5);
    DY_ = tpnorm_test::normal(seed + 1, 0, R_ * H_);
    G_ = tpnorm_test::normal(seed + 2, 0, H_, 1.0);
    B_ = tpnorm_test::normal(seed + 3, 0, H_);
    const tpnorm::DType t = c.dtype;
    x_ = Buffer(t, tpnorm_test::columns(X_, R_, H_, c0_, h_));
    dy_ = Buffer(t, tpnorm_test::columns(DY_, R_, H_, c0_, h_));
    g_ = Buffer(t, tpnorm_test::columns(G_, 1, H_, c0_, h_));
    b_ = Buffer(t, tpnorm_test::columns(B_, 1, H_, c0_, h_));
    y_ = Buffer(t, R_ * h_);
    dx_ = Buffer(t, R_ * h_);
    dg_ = Buffer(t, h_);
    db_ = Buffer(t, h_);
    mean_.resize(R_);
    rstd_.resize(R_);
    rstd_rows_ = {0, R_};
  }

  std::string local_shape() const override { return std::to_string(R_) + "x" + std::to_string(h_); }

  void forward(tpnorm::Communicator& comm) override {
    const tpnorm::Shape s{R_, h_}, p{h_}, r{R_};
    if (centered_)
      layer_norm_forward(comm, x_.view(s), g_.view(p), b_.view(p), y_.view(s),
                         view(mean_.data(), r), view(rstd_.data(), r), options());
    else
      rms_norm_forward(comm, x_.view(s), g_.view(p), y_.view(s), view(rstd_.data(), r), options());
  }

  void backward(tpnorm::Communicator& comm) override {
    const tpnorm::Shape s{R_, h_}, p{h_}, r{R_};
    if (centered_)
      layer_norm_backward(comm, dy_.view(s), x_.view(s), g_.view(p), view(mean_.data(), r),
                          view(rstd_.data(), r), dx_.view(s), dg_.view(p), db_.view(p), options());
    else
      rms_norm_backward(comm, dy_.view(s), x_.view(s), g_.view(p), view(rstd_.data(), r),
                        dx_.view(s), dg_.view(p), options());
  }

  // Tolerances as in tests/mpi/test_row_norm_equiv.cpp; the reference sees the inputs rounded
  // to the storage dtype, exactly as the op does.
  int64_t count_wrong() override {
    auto round = [&](const std::vector<float>& v) { return Buffer(cfg_.dtype, v).floats(); };
    const auto ref = tpnorm_test::row_norm_reference(centered_, round(X_), R_, H_, round(G_),
                                                     centered_ ? round(B_) : std::vector<float>{},
                                                     1e-5, round(DY_));
    auto cols = [&](const std::vector<double>& m, int64_t rows) {
      std::vector<double> o(static_cast<size_t>(rows * h_));
      for (int64_t i = 0; i < rows; ++i) std::copy_n(&m[i * H_ + c0_], h_, &o[i * h_]);
      return o;
    };
    const double rt = tpnorm_test::storage_rtol(cfg_.dtype);
    const double rs = *std::max_element(ref.rstd.begin(), ref.rstd.end());
    const double dx_tol = rt * std::max(1.0, rs);
    using tpnorm_test::count_wrong;
    const auto [r0, r1] = rstd_rows_;  // the rows whose rstd this case holds
    int64_t wrong = count_wrong("y", y_.floats(), cols(ref.y, R_), rt, rt) +
                    count_wrong("rstd", rstd_.data() + r0, ref.rstd.data() + r0,
                                static_cast<size_t>(r1 - r0), 0, 1e-6) +
                    count_wrong("dx", dx_.floats(), cols(ref.dx, R_), dx_tol, 10 * rt) +
                    count_wrong("dgamma", dg_.floats(), cols(ref.dgamma, 1), rt * R_, rt);
    if (centered_)
      wrong += count_wrong("mean", mean_, ref.mean, 1e-6, 1e-6) +
               count_wrong("dbeta", db_.floats(), cols(ref.dbeta, 1), rt * R_, rt);
    return wrong;
  }

  // docs/cpp-api.md, "One collective per call": LayerNorm R x 2 values, RMSNorm R x 1 value, forward and
  // backward alike; Stats::kExact (tpnorm/norm.h) R x 13 / 8 int64 forward, R x 11 / 6 backward.
  uint64_t payload_values(bool forward) const override {
    return row_values(forward) * static_cast<uint64_t>(R_);
  }
  uint64_t row_values(bool forward) const {
    if (cfg_.stats == tpnorm::Stats::kExact)
      return forward ? (centered_ ? 13 : 8) : (centered_ ? 11 : 6);
    return centered_ ? 2 : 1;
  }

  // This case's op as one item of a batched call (tpnorm/batched.h).
  tpnorm::RowNormItem item() {
    const tpnorm::Shape s{R_, h_}, p{h_}, r{R_};
    tpnorm::RowNormItem i;
    i.centered = centered_;
    i.x = x_.view(s);
    i.gamma = g_.view(p);
    if (centered_) {
      i.beta = b_.view(p);
      i.mean = view(mean_.data(), r);
    }
    i.y = y_.view(s);
    i.rstd = view(rstd_.data(), r);
    return i;
  }
  tpnorm::RowNormGradItem grad_item() {
    const tpnorm::Shape s{R_, h_}, p{h_}, r{R_};
    tpnorm::RowNormGradItem i;
    i.centered = centered_;
    i.dy = dy_.view(s);
    i.x = x_.view(s);
    i.gamma = g_.view(p);
    if (centered_) {
      i.mean = view(mean_.data(), r);
      i.dbeta = db_.view(p);
    }
    i.rstd = view(rstd_.data(), r);
    i.dx = dx_.view(s);
    i.dgamma = dg_.view(p);
    return i;
  }

 protected:
  tpnorm::NormOptions options() const {
    tpnorm::NormOptions o;
    o.stats = cfg_.stats;
    return o;
  }

  bool centered_;
  BenchConfig cfg_;
  int64_t R_, H_, c0_ = 0, h_ = 0;
  std::vector<float> X_, DY_, G_, B_, mean_, rstd_;
  std::pair<int64_t, int64_t> rstd_rows_;  // [first, last) rows of rstd_ that count_wrong checks
  Buffer x_, dy_, g_, b_, y_, dx_, dg_, db_;
};

}  // namespace tpnorm_bench
