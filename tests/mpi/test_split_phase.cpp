// Split-phase calls (tpnorm/split.h) under mpiexec at 2, 3, 4 ranks:
// - a q-norm, a k-norm and a LayerNorm backward in flight together on one communicator,
//   finished in reverse order, against the float64 reference on the full data (hidden uneven,
//   a rank with no column) and bit for bit against the blocking calls;
// - every other op started, all in flight at once, then finished: the same bits as its
//   blocking call (whose accuracy the op's own tests check), so in-flight calls share nothing;
// - a bad argument on one rank throws from the start on every rank, nothing left in flight;
//   past the strict calls a disagreement throws from finish() on every rank;
// - a handle dropped on ONE rank without finish(): no hang, nothing written, the next call
//   fails on every rank naming the dropped call, the one after works;
// - a started call's sums are added by the communicator's progress thread while no rank is in
//   tpnorm (shared-memory sums), a blocking call's never; the same bits either way;
// - a started call finished after the thread added its sums takes the quick wait (it looks
//   only at the communicator): the blocking bits, a rank with no column / no sample.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "expect_error.h"
#include "harness.h"
#include "mpi_world.h"
#include "batch_norm_reference.h"
#include "reference.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/batched.h"
#include "tpnorm/error.h"
#include "tpnorm/fused.h"
#include "tpnorm/group_norm.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"
#include "tpnorm/split.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

// Hidden split with nothing on rank 1 (at 3+ ranks) and an uneven rest.
Split hidden_split(int64_t H) {
  std::vector<int> w(world_size(), 2);
  if (world_size() >= 3) w[1] = 0;
  w[0] = 3;
  return split_weighted(H, w);
}

struct RowCase {
  int64_t R, H, c0 = 0, h = 0;
  std::vector<float> X, G, B, DY;  // full data
  std::vector<float> x, g, b, dy;  // this rank's columns
  RowCase(uint64_t seed, int64_t rows, int64_t hidden, double offset) : R(rows), H(hidden) {
    const Split s = hidden_split(H);
    c0 = s.offset[world_rank()];
    h = s.count[world_rank()];
    X = normal(seed, 0, R * H, offset, 2.0);
    G = normal(seed, 1, H, 1.0, 0.5);
    B = normal(seed, 2, H);
    DY = normal(seed, 3, R * H);
    x = columns(X, R, H, c0, h);
    g = columns(G, 1, H, c0, h);
    b = columns(B, 1, H, c0, h);
    dy = columns(DY, R, H, c0, h);
  }
  // RMSNorm forward of this rank's shard into y, r (blocking, or started).
  void rms(Communicator& c, std::vector<float>& y, std::vector<float>& r) const {
    rms_norm_forward(c, view(x.data(), {R, h}), view(g.data(), {h}), view(y.data(), {R, h}),
                     view(r.data(), {R}));
  }
  PendingCall rms_start(Communicator& c, std::vector<float>& y, std::vector<float>& r) const {
    return rms_norm_forward_start(c, view(x.data(), {R, h}), view(g.data(), {h}),
                                  view(y.data(), {R, h}), view(r.data(), {R}));
  }
  std::vector<double> mine(const std::vector<double>& full) const {
    std::vector<double> m(static_cast<size_t>(R * h));
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < h; ++c) m[r * h + c] = full[r * H + c0 + c];
    return m;
  }
};

TEST(SplitPhase, SeveralInFlightMatchReferenceAndBlockingCall) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  RowCase q(41, 9, 7 * world_size() + 3, 0.0), k(42, 9, 5 * world_size() + 1, 1e4),
      l(43, 6, 6 * world_size() + 2, 3.0);
  std::vector<float> yq(q.x.size()), rq(q.R), yk(k.x.size()), rk(k.R);
  // LayerNorm forward (blocking) first: its saved statistics feed the backward in flight.
  std::vector<float> yl(l.x.size()), ml(l.R), rl(l.R), dxl(l.x.size()), dgl(l.h), dbl(l.h);
  const Shape sl{l.R, l.h}, pl{l.h}, rows_l{l.R};
  layer_norm_forward(*comm, view(l.x.data(), sl), view(l.g.data(), pl), view(l.b.data(), pl),
                     view(yl.data(), sl), view(ml.data(), rows_l), view(rl.data(), rows_l));

  comm->reset_counters();
  PendingCall pq = q.rms_start(*comm, yq, rq);
  PendingCall pk = k.rms_start(*comm, yk, rk);
  PendingCall pl_ = layer_norm_backward_start(*comm, view(l.dy.data(), sl), view(l.x.data(), sl),
                                              view(l.g.data(), pl), view(ml.data(), rows_l),
                                              view(rl.data(), rows_l), view(dxl.data(), sl),
                                              view(dgl.data(), pl), view(dbl.data(), pl));
  EXPECT_TRUE(pq.pending() && pk.pending() && pl_.pending());
  EXPECT_EQ(comm->in_flight(), 3u) << "three payload sums in flight";
  pl_.finish();
  pk.finish();
  pq.finish();
  EXPECT_FALSE(pq.pending());
  EXPECT_EQ(comm->in_flight(), 0u);
  // Strict calls (the MPI default) this small: one sum each, the header inside it (a
  // size-checked sum); bytes as the blocking calls.
  EXPECT_EQ(comm->counters().calls, 3u);
  EXPECT_EQ(comm->counters().bytes_sent, (3 * 10 + q.R + k.R + 2 * l.R) * 8u);

  const RowRef refq = row_norm_reference(false, q.X, q.R, q.H, q.G, {}, 1e-5);
  const RowRef refk = row_norm_reference(false, k.X, k.R, k.H, k.G, {}, 1e-5);
  const RowRef refl = row_norm_reference(true, l.X, l.R, l.H, l.G, l.B, 1e-5, l.DY);
  int64_t wrong = 0;
  wrong += count_wrong("q y", yq, q.mine(refq.y), 1e-4, 1e-4);
  wrong += count_wrong("q rstd", rq, refq.rstd, 0, 1e-5);
  wrong += count_wrong("k y", yk, k.mine(refk.y), 1e-4, 1e-4);
  wrong += count_wrong("l dx", dxl, l.mine(refl.dx), 1e-3, 1e-3);
  EXPECT_EQ(sum_over_ranks(wrong), 0);

  // The blocking calls give the same bits.
  std::vector<float> yq2(yq.size()), rq2(rq.size()), dxl2(dxl.size()), dgl2(dgl.size()),
      dbl2(dbl.size());
  q.rms(*comm, yq2, rq2);
  layer_norm_backward(*comm, view(l.dy.data(), sl), view(l.x.data(), sl), view(l.g.data(), pl),
                      view(ml.data(), rows_l), view(rl.data(), rows_l), view(dxl2.data(), sl),
                      view(dgl2.data(), pl), view(dbl2.data(), pl));
  EXPECT_EQ(yq, yq2);
  EXPECT_EQ(rq, rq2);
  EXPECT_EQ(dxl, dxl2);
  EXPECT_EQ(dgl, dgl2);
  EXPECT_EQ(dbl, dbl2);
}

TEST(SplitPhase, StartedCallsAreSummedInTheBackgroundBlockingCallsAreNot) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const char* v = std::getenv("TPNORM_SHM");
  const bool shm = world_size() > 1 && !(v && std::strcmp(v, "0") == 0);
  RowCase q(51, 7, 9 * world_size() + 2, 0.5), k(52, 33, 4 * world_size() + 3, -2.0);
  std::vector<float> yq(q.x.size()), rq(q.R), yk(k.x.size()), rk(k.R);
  std::vector<float> yq2(yq.size()), rq2(rq.size()), yk2(yk.size()), rk2(rk.size());
  q.rms(*comm, yq2, rq2);
  k.rms(*comm, yk2, rk2);
  EXPECT_EQ(mpi_background_sums(*comm), 0u) << "a blocking call handed its sum over";

  PendingCall pq = q.rms_start(*comm, yq, rq);
  PendingCall pk = k.rms_start(*comm, yk, rk);
  // Nobody waits: the thread adds both calls' sums (one each, header inside) on its own.
  const uint64_t want = shm ? 2 : 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (mpi_background_sums(*comm) < want && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(mpi_background_sums(*comm), want);
  pk.finish();
  pq.finish();
  EXPECT_EQ(yq, yq2);
  EXPECT_EQ(rq, rq2);
  EXPECT_EQ(yk, yk2);
  EXPECT_EQ(rk, rk2);
  const RowRef refq = row_norm_reference(false, q.X, q.R, q.H, q.G, {}, 1e-5);
  const RowRef refk = row_norm_reference(false, k.X, k.R, k.H, k.G, {}, 1e-5);
  int64_t wrong = 0;
  wrong += count_wrong("q y", yq, q.mine(refq.y), 1e-4, 1e-4);
  wrong += count_wrong("q rstd", rq, refq.rstd, 0, 1e-5);
  wrong += count_wrong("k y", yk, k.mine(refk.y), 1e-4, 1e-4);
  wrong += count_wrong("k rstd", rk, refk.rstd, 0, 1e-5);
  EXPECT_EQ(sum_over_ranks(wrong), 0);
}

// The quick wait (comm/mpi.cpp): a started call whose sums the progress thread has already
// added is finished by waits that only look at the communicator. Its outputs must be the
// blocking call's bits, on a rank with no column (RMSNorm, 3+ ranks) and a rank with no
// sample (SyncBatchNorm, the last rank), several rounds (records recycled between them).
TEST(SplitPhase, StartedCallFinishedAfterTheThreadAddedItGivesTheBlockingBits) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const char* v = std::getenv("TPNORM_SHM");
  const bool shm = world_size() > 1 && !(v && std::strcmp(v, "0") == 0);
  RowCase q(71, 6, 6 * world_size() + 1, 1.5);
  std::vector<float> yq(q.x.size()), rq(q.R), yq2(yq.size()), rq2(rq.size());
  // SyncBatchNorm, NCHW [n, 3, 2, 2]: n = rank + 1 samples, none on the last rank.
  const int64_t C = 3, S = 4, P = world_size();
  int64_t total = 0, first = 0;
  for (int r = 0; r < P; ++r) {
    const int64_t n_r = r == P - 1 ? 0 : r + 1;
    if (r < world_rank()) first += n_r;
    total += n_r;
  }
  const int64_t n = world_rank() == P - 1 ? 0 : world_rank() + 1;
  const std::vector<float> BX = normal(72, 0, static_cast<size_t>(total * C * S), 2.0, 3.0);
  const std::vector<float> bx(BX.begin() + first * C * S, BX.begin() + (first + n) * C * S);
  const std::vector<float> bg = normal(73, 0, C, 1.0, 0.3), bb = normal(74, 0, C);
  const Shape bs{n, C, 2, 2}, cs{C};
  std::vector<float> by(bx.size()), bm(C), bi(C), by2(bx.size()), bm2(C), bi2(C);
  auto bn_start = [&] {
    return sync_batch_norm_forward_start(*comm, view(bx.data(), bs), view(bg.data(), cs),
                                         view(bb.data(), cs), {}, {}, nullptr,
                                         view(by.data(), bs), view(bm.data(), cs),
                                         view(bi.data(), cs));
  };
  q.rms(*comm, yq2, rq2);
  sync_batch_norm_forward(*comm, view(bx.data(), bs), view(bg.data(), cs), view(bb.data(), cs),
                          {}, {}, nullptr, view(by2.data(), bs), view(bm2.data(), cs),
                          view(bi2.data(), cs));
  EXPECT_EQ(mpi_quick_waits(*comm), 0u) << "a blocking call's wait took the quick path";

  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::fill(yq.begin(), yq.end(), -7.f), std::fill(by.begin(), by.end(), -7.f);
    const uint64_t calls = comm->counters().calls, added = mpi_background_sums(*comm),
                   quick = mpi_quick_waits(*comm);
    PendingCall pq = q.rms_start(*comm, yq, rq);
    PendingCall pb = bn_start();
    // Every sum of both calls is started (nothing was waited): the thread adds them all
    // while this rank waits for nothing; then finish() finds them done.
    const uint64_t started = comm->counters().calls - calls, want = shm ? started : 0;
    EXPECT_EQ(comm->in_flight(), started);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (mpi_background_sums(*comm) - added < want && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(mpi_background_sums(*comm) - added, want);
    pb.finish();
    pq.finish();
    EXPECT_EQ(comm->in_flight(), 0u);
    EXPECT_EQ(mpi_quick_waits(*comm) - quick, want) << "finish() did not take the quick wait";
    EXPECT_EQ(yq, yq2);
    EXPECT_EQ(rq, rq2);
    EXPECT_EQ(by, by2);
    EXPECT_EQ(bm, bm2);
    EXPECT_EQ(bi, bi2);
  }
  const RowRef refq = row_norm_reference(false, q.X, q.R, q.H, q.G, {}, 1e-5);
  const BnRef refb = batch_norm_reference(BX, total, C, S, bg, bb, 1e-5);
  const std::vector<double> bmine(refb.y.begin() + first * C * S,
                                  refb.y.begin() + (first + n) * C * S);
  int64_t wrong = 0;
  wrong += count_wrong("q y", yq, q.mine(refq.y), 1e-4, 1e-4);
  wrong += count_wrong("q rstd", rq, refq.rstd, 0, 1e-5);
  wrong += count_wrong("bn y", by, bmine, 1e-4, 1e-4);
  wrong += count_wrong("bn mean", bm, refb.mean, 1e-5, 1e-5);
  EXPECT_EQ(sum_over_ranks(wrong), 0);
  // The communicator stays usable: a blocking call after the quick waits (which put away
  // the records the quick waits left) gives the same bits again.
  std::vector<float> yq3(yq.size()), rq3(rq.size());
  q.rms(*comm, yq3, rq3);
  EXPECT_EQ(yq3, yq2);
}

// Outputs of one op, for comparing a started-then-finished call with the blocking call.
using Outs = std::vector<std::vector<float>>;

TEST(SplitPhase, EveryOpStartedTogetherGivesTheBlockingBits) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  RowCase a(51, 5, 4 * world_size() + 1, 2.0);
  const Shape s{a.R, a.h}, p{a.h}, r{a.R};
  // Batch norm: N per rank = rank + 1 (uneven), C = 3, spatial 2x2, NCHW.
  const int64_t C = 3, S = 4, n = world_rank() + 1;
  const std::vector<float> bx = normal(52, world_rank(), n * C * S, 1.0, 2.0),
                           bdy = normal(53, world_rank(), n * C * S);
  const std::vector<float> bg = normal(54, 0, C, 1.0, 0.3), bb = normal(55, 0, C);
  const Shape bs{n, C, 2, 2}, cs{C};
  // Group norm: channels sharded, 2 samples, 2 groups over 2 * P channels, spatial 3.
  const int64_t GN = 2, GC = 2 * world_size(), GS = 3, gcl = 2;
  const ChannelGroups cg{2, GC, gcl * world_rank()};
  const std::vector<float> gx = normal(56, world_rank(), GN * gcl * GS, 0.5, 1.0),
                           gdy = normal(57, world_rank(), GN * gcl * GS);
  const Shape gs{GN, gcl, GS};

  auto run = [&](bool split) {
    Outs o(22);
    o[0].resize(a.x.size()), o[1].resize(a.R), o[2].resize(a.R);  // fused fwd
    o[3].resize(a.x.size()), o[4].resize(a.x.size()), o[5].resize(a.h),
        o[6].resize(a.h);                                         // fused bwd
    o[7].resize(a.x.size()), o[8].resize(a.R), o[9].resize(a.R);  // batched
    o[10].resize(bx.size()), o[11].resize(C), o[12].resize(C), o[13].assign(C, 0.f),
        o[14].assign(C, 1.f);
    o[15].resize(bx.size()), o[16].resize(C), o[17].resize(C);            // bn bwd
    o[18].resize(gx.size()), o[19].resize(GN * 2), o[20].resize(GN * 2);  // group
    o[21].resize(gx.size());
    std::vector<float> h(a.x.size()), f = a.dy;
    int64_t tracked = 0;
    RowNormItem item{true,
                     view(a.x.data(), s),
                     view(a.g.data(), p),
                     view(a.b.data(), p),
                     view(o[7].data(), s),
                     view(o[8].data(), r),
                     view(o[9].data(), r)};
    BatchNormOptions bo;
    // Forward-type calls first (independent of each other), all in flight.
    std::vector<PendingCall> calls;
    auto go = [&](PendingCall c) {
      if (split)
        calls.push_back(std::move(c));
      else
        c.finish();
    };
    go(fused_add_layer_norm_forward_start(*comm, view(a.x.data(), s), view(f.data(), s), 1.5,
                                          view(a.g.data(), p), view(a.b.data(), p),
                                          view(h.data(), s), view(o[0].data(), s),
                                          view(o[1].data(), r), view(o[2].data(), r)));
    go(batched_norm_forward_start(*comm, &item, 1));
    go(sync_batch_norm_forward_start(*comm, view(bx.data(), bs), view(bg.data(), cs),
                                     view(bb.data(), cs), view(o[13].data(), cs),
                                     view(o[14].data(), cs), &tracked, view(o[10].data(), bs),
                                     view(o[11].data(), cs), view(o[12].data(), cs), bo));
    go(group_norm_forward_start(*comm, view(gx.data(), gs), cg, {}, {}, view(o[18].data(), gs),
                                view(o[19].data(), {GN, 2}), view(o[20].data(), {GN, 2})));
    for (auto& c : calls) c.finish();
    calls.clear();
    // Backward-type calls, on the forwards' saved statistics.
    go(fused_add_layer_norm_backward_start(
        *comm, view(a.dy.data(), s), view(a.dy.data(), s), view(h.data(), s), view(a.g.data(), p),
        view(o[1].data(), r), view(o[2].data(), r), 1.5, view(o[3].data(), s), view(o[4].data(), s),
        view(o[5].data(), p), view(o[6].data(), p)));
    go(sync_batch_norm_backward_start(*comm, view(bdy.data(), bs), view(bx.data(), bs),
                                      view(bg.data(), cs), view(o[11].data(), cs),
                                      view(o[12].data(), cs), view(o[15].data(), bs),
                                      view(o[16].data(), cs), view(o[17].data(), cs), bo));
    go(group_norm_backward_start(*comm, view(gdy.data(), gs), view(gx.data(), gs), cg, {},
                                 view(o[19].data(), {GN, 2}), view(o[20].data(), {GN, 2}),
                                 view(o[21].data(), gs), {}, {}));
    for (size_t i = calls.size(); i-- > 0;) calls[i].finish();  // in reverse, why not
    return o;
  };
  const Outs blocking = run(false), split = run(true);
  int64_t differ = 0;
  for (size_t i = 0; i < blocking.size(); ++i)
    if (!blocking[i].empty() &&
        std::memcmp(blocking[i].data(), split[i].data(), blocking[i].size() * 4) != 0) {
      ADD_FAILURE() << "output " << i << " differs";
      ++differ;
    }
  EXPECT_EQ(differ, 0);
  int64_t finite = 0;
  for (float v : split[15]) finite += std::isfinite(v) && v != 0.f;
  EXPECT_GT(finite, 0) << "the SyncBatchNorm backward wrote dx";
}

// A bad argument on one rank: a call that checks its header first (large, or on a
// communicator without size-checked sums) throws from start on every rank, nothing in flight;
// a small call carries its header in its one sum and throws from finish() on every rank.
TEST(SplitPhase, BadArgumentOnOneRankThrowsEverywhereFromStartOrFinish) {
  for (int64_t mode : {kHeaderFirst, int64_t{-1}}) {
    SCOPED_TRACE(mode == kHeaderFirst ? "header first" : "header inside the one sum");
    auto comm = mpi_world(mode);
    RowCase a(61, 4, 3 * world_size(), 0.0);
    std::vector<float> y(a.x.size(), -7.f), rs(a.R, -7.f);
    NormOptions opt;
    if (world_rank() == world_size() - 1) opt.eps = -1;
    PendingCall c;
    auto start = [&] {
      c = rms_norm_forward_start(*comm, view(a.x.data(), {a.R, a.h}), {},
                                 view(y.data(), {a.R, a.h}), view(rs.data(), {a.R}), opt);
    };
    std::string msg;
    if (mode == kHeaderFirst) {
      msg = error_of(start, ErrorCode::kInvalidArgument);
      EXPECT_FALSE(c.pending());
      EXPECT_EQ(comm->in_flight(), 0u);
    } else {
      start();
      EXPECT_TRUE(c.pending());
      msg = error_of([&] { c.finish(); }, ErrorCode::kInvalidArgument);
      EXPECT_FALSE(c.pending());
    }
    EXPECT_NE(msg.find("argument 'eps'"), std::string::npos) << msg;
    for (float v : y) EXPECT_EQ(v, -7.f);
  }
}

TEST(SplitPhase, FoldedDisagreementThrowsFromFinishEverywhere) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  comm->set_strict_calls(0);  // the header rides with the payload: checked when it is back
  RowCase a(62, 4, 3 * world_size(), 0.0);
  std::vector<float> y(a.x.size(), -7.f), rs(a.R, -7.f);
  NormOptions opt;
  if (world_rank() == 0) opt.eps = 1e-3;
  PendingCall c = rms_norm_forward_start(*comm, view(a.x.data(), {a.R, a.h}), {},
                                         view(y.data(), {a.R, a.h}), view(rs.data(), {a.R}), opt);
  const std::string msg = error_of([&] { c.finish(); }, ErrorCode::kMismatch);
  EXPECT_NE(msg.find("ranks disagree on 'eps'"), std::string::npos) << msg;
  EXPECT_FALSE(c.pending());
  for (float v : y) EXPECT_EQ(v, -7.f);
}

TEST(SplitPhase, HandleDroppedOnOneRankIsTheNextCallsErrorEverywhere) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  RowCase a(63, 4, 3 * world_size() + 1, 0.0);
  const Shape s{a.R, a.h}, r{a.R};
  std::vector<float> y(a.x.size(), -7.f), rs(a.R, -7.f);
  {
    PendingCall c = rms_norm_forward_start(*comm, view(a.x.data(), s), {}, view(y.data(), s),
                                           view(rs.data(), r));
    if (world_rank() != 0) c.finish();  // rank 0 drops it
  }
  if (world_rank() == 0) {
    for (float v : y) EXPECT_EQ(v, -7.f) << "a dropped call wrote its output";
  }
  const std::string msg = error_of(
      [&] {
        rms_norm_forward(*comm, view(a.x.data(), s), {}, view(y.data(), s), view(rs.data(), r));
      },
      ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("rank 0: a started rms_norm_forward (call 1 on this communicator) was "
                     "destroyed without finish()"),
            std::string::npos)
      << msg;
  // Reported once: the next call works and is right.
  rms_norm_forward(*comm, view(a.x.data(), s), {}, view(y.data(), s), view(rs.data(), r));
  const RowRef ref = row_norm_reference(false, a.X, a.R, a.H, {}, {}, 1e-5);
  EXPECT_EQ(sum_over_ranks(count_wrong("y", y, a.mine(ref.y), 1e-4, 1e-4)), 0);
}

}  // namespace
