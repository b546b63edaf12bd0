// Single-process batched norms (tpnorm/batched.h): a q-norm, a k-norm and a pre-norm of
// different widths, dtypes and kinds in one call, each against the float64 reference and
// against the same norm called alone (the same kernels, so the results are identical).
// Tolerances per item, r = one rounding of its storage dtype: y r + r; rstd/mean 1e-6 rel;
// dx r*max(1, rstd) + 10 r; dgamma/dbeta r*rows + r.
#include <gtest/gtest.h>

#include <algorithm>

#include "batched_runner.h"
#include "harness.h"
#include "reference.h"
#include "storage.h"
#include "tpnorm/batched.h"
#include "tpnorm/error.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

BatchedItem make_item(bool centered, DType dt, DType saved, int64_t rows, int64_t h, bool affine,
                      uint64_t seed) {
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  BatchedItem it{centered,
                 dt,
                 saved,
                 rows,
                 h,
                 affine,
                 round(normal(seed, 0, rows * h, 0.3, 2.0)),
                 {},
                 {},
                 round(normal(seed, 1, rows * h))};
  if (affine) {
    it.gamma = round(normal(seed, 2, h, 1.0, 0.5));
    if (centered) it.beta = round(normal(seed, 3, h));
  }
  return it;
}

std::vector<BatchedItem> qk_and_prenorm() {
  return {make_item(false, DType::F32, DType::F32, 24, 64, true, 1),   // q-norm: tokens x heads
          make_item(false, DType::BF16, DType::F32, 12, 64, true, 2),  // k-norm: fewer kv heads
          make_item(true, DType::F16, DType::F64, 6, 301, true, 3),    // pre-norm of the hidden
          make_item(true, DType::F32, DType::F32, 5, 7, false, 4)};    // plain LayerNorm
}

TEST(Batched, EachItemMatchesReference) {
  const auto items = qk_and_prenorm();
  auto comm = make_single_communicator();
  const auto out = run_batched(*comm, items);
  for (size_t i = 0; i < items.size(); ++i) {
    const BatchedItem& it = items[i];
    const RowRef ref =
        row_norm_reference(it.centered, it.x, it.rows, it.h, it.gamma, it.beta, 1e-5, it.dy);
    const double rt = storage_rtol(it.dt);
    const double rs = *std::max_element(ref.rstd.begin(), ref.rstd.end());
    SCOPED_TRACE("item " + std::to_string(i));
    EXPECT_EQ(count_wrong("y", out[i].y, ref.y, rt, rt), 0);
    EXPECT_EQ(count_wrong("rstd", out[i].rstd, ref.rstd, 0, 1e-6), 0);
    EXPECT_EQ(count_wrong("dx", out[i].dx, ref.dx, rt * std::max(1.0, rs), 10 * rt), 0);
    if (it.affine) {
      EXPECT_EQ(count_wrong("dgamma", out[i].dgamma, ref.dgamma, rt * it.rows, rt), 0);
    }
    if (it.centered) {
      EXPECT_EQ(count_wrong("mean", out[i].mean, ref.mean, 1e-6, 1e-6), 0);
      EXPECT_EQ(count_wrong("dbeta", out[i].dbeta, ref.dbeta, rt * it.rows, rt), 0);
    }
  }
}

TEST(Batched, SameAsSeparateCalls) {
  const auto items = qk_and_prenorm();
  auto comm = make_single_communicator();
  const auto together = run_batched(*comm, items);
  for (size_t i = 0; i < items.size(); ++i) {
    const auto alone = run_batched(*comm, {items[i]});
    EXPECT_EQ(together[i].y, alone[0].y) << i;
    EXPECT_EQ(together[i].rstd, alone[0].rstd) << i;
    EXPECT_EQ(together[i].dx, alone[0].dx) << i;
    EXPECT_EQ(together[i].dgamma, alone[0].dgamma) << i;
  }
  // ... and the same as norm.h's own call for a LayerNorm item.
  const BatchedItem& it = items[3];
  std::vector<float> y(it.x.size()), mean(it.rows), rstd(it.rows);
  const Shape s{it.rows, it.h}, r{it.rows};
  layer_norm_forward(*comm, view(it.x.data(), s), {}, {}, view(y.data(), s), view(mean.data(), r),
                     view(rstd.data(), r));
  EXPECT_EQ(together[3].y, y);
}

TEST(Batched, EmptyListAndEmptyItemStillOneCollective) {
  auto comm = make_single_communicator();
  comm->set_strict_calls(0);  // no separate agreement pre-check: the payload collective only
  comm->reset_counters();
  batched_norm_forward(*comm, nullptr, 0);
  batched_norm_backward(*comm, nullptr, 0);
  EXPECT_EQ(comm->counters().calls, 2u);
  const auto out = run_batched(*comm, {make_item(true, DType::F32, DType::F32, 0, 5, true, 9),
                                       make_item(false, DType::F32, DType::F32, 3, 4, false, 9)});
  EXPECT_EQ(out[0].y.size(), 0u);
  EXPECT_EQ(out[1].y.size(), 12u);
}

TEST(Batched, BadItemNamesItsIndex) {
  auto comm = make_single_communicator();
  std::vector<float> x(10), y(10);
  RowNormItem good{true, view(x.data(), {2, 5}), {}, {}, view(y.data(), {2, 5}), {}, {}};
  RowNormItem bad = good;
  bad.y = view(y.data(), {5, 2});
  const RowNormItem list[2] = {good, bad};
  try {
    batched_norm_forward(*comm, list, 2);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("items[1].y"), std::string::npos) << e.what();
  }
}

}  // namespace
