// rms_norm_gated_case.h — the gated RMSNorm (Mamba-2's RMSNormGated, tpnorm/rms_norm_gated.h)
// for the benchmark: x and the gate z [rows, hidden] with the channels split evenly over the
// ranks, weight sliced likewise, gate first (norm_before_gate = false, Mamba-2's order) and
// kGroups groups of hidden / kGroups channels (Mamba-2 checkpoints use n_groups = 1 or 8; with
// 8, a group spans ranks at P > 8 and straddles boundaries whenever P does not divide 8), or
// one group when kGroups does not divide hidden. Every rank makes the full input from a seed
// and keeps its columns; the float64 reference of tests/reference runs on the full rows on
// every rank. forward/backward call tpnorm's op; gated_strategies.cpp's all-gather strategy
// overrides them and keeps the data, the buffers and the check.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "bench_op.h"
#include "gated_reference.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/rms_norm_gated.h"

namespace tpnorm_bench {

using tpnorm_test::Buffer;

/// Groups of the benchmark's shapes (1 when it does not divide hidden).
constexpr int64_t kGroups = 8;

class GatedCase : public BenchCase {
 public:
  GatedCase(const BenchConfig& c, int rank, int size)
      : cfg_(c), R_(c.rows), H_(c.hidden), G_(H_ % kGroups == 0 ? kGroups : 1), P_(size) {
    const auto split = tpnorm_test::split_even(H_, size);
    c0_ = split.offset[rank];
    h_ = split.count[rank];
    X_ = tpnorm_test::normal(21, 0, R_ * H_, 0.5);
    Z_ = tpnorm_test::normal(22, 0, R_ * H_, 0.0, 2.0);
    DY_ = tpnorm_test::normal(23, 0, R_ * H_);
    W_ = tpnorm_test::normal(24, 0, H_, 1.0);
    x_ = Buffer(c.dtype, tpnorm_test::columns(X_, R_, H_, c0_, h_));
    z_ = Buffer(c.dtype, tpnorm_test::columns(Z_, R_, H_, c0_, h_));
    dy_ = Buffer(c.dtype, tpnorm_test::columns(DY_, R_, H_, c0_, h_));
    w_ = Buffer(c.dtype, tpnorm_test::columns(W_, 1, H_, c0_, h_));
    y_ = Buffer(c.dtype, R_ * h_);
    dx_ = Buffer(c.dtype, R_ * h_);
    dz_ = Buffer(c.dtype, R_ * h_);
    dw_ = Buffer(c.dtype, h_);
    rstd_.resize(R_ * G_);
  }

  std::string local_shape() const override {
    return std::to_string(R_) + "x" + std::to_string(h_) + "/g" + std::to_string(G_);
  }

  void forward(tpnorm::Communicator& comm) override {
    const tpnorm::Shape s{R_, h_}, p{h_}, r{R_, G_};
    tpnorm::rms_norm_gated_forward(comm, x_.view(s), z_.view(s), groups(), w_.view(p), y_.view(s),
                                   tpnorm::view(rstd_.data(), r), options());
  }

  void backward(tpnorm::Communicator& comm) override {
    const tpnorm::Shape s{R_, h_}, p{h_}, r{R_, G_};
    tpnorm::rms_norm_gated_backward(comm, dy_.view(s), x_.view(s), z_.view(s), groups(), w_.view(p),
                                    tpnorm::view(rstd_.data(), r), dx_.view(s), dz_.view(s),
                                    dw_.view(p), options());
  }

  // Tolerances as tests/mpi/test_rms_norm_gated_equiv.cpp.
  int64_t count_wrong() override {
    auto round = [&](const std::vector<float>& v) { return Buffer(cfg_.dtype, v).floats(); };
    const auto ref = tpnorm_test::rms_norm_gated_reference(round(X_), round(Z_), R_, H_, H_ / G_,
                                                           false, round(W_), 1e-5, round(DY_));
    auto cols = [&](const std::vector<double>& m, int64_t rows) {
      std::vector<double> o(static_cast<size_t>(rows * h_));
      for (int64_t i = 0; i < rows; ++i) std::copy_n(&m[i * H_ + c0_], h_, &o[i * h_]);
      return o;
    };
    const double rt = tpnorm_test::storage_rtol(cfg_.dtype);
    const double rs = *std::max_element(ref.rstd.begin(), ref.rstd.end());
    const double d_tol = rt * std::max(1.0, rs);
    using tpnorm_test::count_wrong;
    return count_wrong("y", y_.floats(), cols(ref.y, R_), rt, rt) +
           count_wrong("rstd", rstd_, ref.rstd, 0, 1e-6) +
           count_wrong("dx", dx_.floats(), cols(ref.dx, R_), d_tol, 10 * rt) +
           count_wrong("dz", dz_.floats(), cols(ref.dz, R_), d_tol, 10 * rt) +
           count_wrong("dweight", dw_.floats(), cols(ref.dweight, 1), rt * R_, rt);
  }

  // tpnorm/rms_norm_gated.h: one value per (row, group), forward and backward alike;
  // Stats::kExact 8 int64 per (row, group) forward, 6 backward; at P > 1 the slice table,
  // 2 values per rank.
  uint64_t payload_values(bool forward) const override {
    const auto slots = static_cast<uint64_t>(R_ * G_);
    const uint64_t table = P_ > 1 ? 2 * static_cast<uint64_t>(P_) : 0;
    if (cfg_.stats == tpnorm::Stats::kExact) return slots * (forward ? 8 : 6) + table;
    return slots + table;
  }

 protected:
  tpnorm::GatedGroups groups() const { return {H_ / G_, H_, c0_, false}; }
  tpnorm::NormOptions options() const {
    tpnorm::NormOptions o;
    o.stats = cfg_.stats;
    return o;
  }

  BenchConfig cfg_;
  int64_t R_, H_, G_;
  int P_;
  int64_t c0_ = 0, h_ = 0;
  std::vector<float> X_, Z_, DY_, W_, rstd_;
  Buffer x_, z_, dy_, w_, y_, dx_, dz_, dw_;
};

}  // namespace tpnorm_bench
