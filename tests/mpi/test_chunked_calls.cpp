// Chunked calls (ops/chunking.h, run_op's row chunks) under mpiexec at 2, 3, 4 ranks, with
// TPNORM_CHUNK forcing the chunk rows (the same on every rank):
// - LayerNorm / RMSNorm forward and backward cut into chunks against the float64 reference on
//   the full data, element by element: hidden uneven, a rank with no column (3+ ranks), one row,
//   rows not a multiple of the chunk, every statistics mode;
// - the same bits as the unchunked call where chunking changes no order of additions: every
//   output, dgamma/dbeta included, when chunks start at multiples of 16 rows (one OpenMP thread;
//   Stats::kExact at any thread count);
// - the counters: one header sum + K chunk sums when chunked, as many as the unchunked strict
//   call makes when not (one sum carrying the header, or the header's and the payload's);
// - split-phase calls with several chunks in flight, finished in reverse order;
// - the rule (TPNORM_CHUNK unset): one payload sum on a host; "on" chunks a large call.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "expect_error.h"
#include "harness.h"
#include "reference.h"
#include "tpnorm/fused.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"
#include "tpnorm/split.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

// TPNORM_CHUNK for the scope (set alike on every rank), restored after.
class ChunkEnv {
 public:
  explicit ChunkEnv(const char* value) {
    if (const char* old = std::getenv("TPNORM_CHUNK")) old_ = old, had_ = true;
    if (value)
      setenv("TPNORM_CHUNK", value, 1);
    else
      unsetenv("TPNORM_CHUNK");
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

// Hidden split: uneven, with nothing on rank 1 at 3+ ranks.
Split hidden_split(int64_t H) {
  std::vector<int> w(world_size(), 2);
  if (world_size() >= 3) w[1] = 0;
  w[0] = 3;
  return split_weighted(H, w);
}

struct Data {
  int64_t R, H, c0 = 0, h = 0;
  std::vector<float> X, G, B, DY;  // full data
  std::vector<float> x, g, b, dy;  // this rank's columns
  Data(uint64_t seed, int64_t rows, int64_t hidden, double offset) : R(rows), H(hidden) {
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
  std::vector<double> mine(const std::vector<double>& full, int64_t rows) const {
    std::vector<double> m(static_cast<size_t>(rows * h));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < h; ++c) m[r * h + c] = full[r * H + c0 + c];
    return m;
  }
};

struct Out {
  std::vector<float> y, mean, rstd, dx, dg, db;
  CommCounters fwd, bwd;  // counters of the forward and of the backward call
};

// Forward then backward of one row norm on `d`, each call's counters kept.
Out run(Communicator& comm, bool centered, const Data& d, const NormOptions& opt) {
  Out o;
  o.y.resize(d.x.size());
  o.dx.resize(d.x.size());
  o.mean.resize(d.R);
  o.rstd.resize(d.R);
  o.dg.resize(d.h);
  o.db.resize(d.h);
  const Shape s{d.R, d.h}, p{d.h}, r{d.R};
  comm.reset_counters();
  if (centered)
    layer_norm_forward(comm, view(d.x.data(), s), view(d.g.data(), p), view(d.b.data(), p),
                       view(o.y.data(), s), view(o.mean.data(), r), view(o.rstd.data(), r), opt);
  else
    rms_norm_forward(comm, view(d.x.data(), s), view(d.g.data(), p), view(o.y.data(), s),
                     view(o.rstd.data(), r), opt);
  o.fwd = comm.counters();
  comm.reset_counters();
  if (centered)
    layer_norm_backward(comm, view(d.dy.data(), s), view(d.x.data(), s), view(d.g.data(), p),
                        view(o.mean.data(), r), view(o.rstd.data(), r), view(o.dx.data(), s),
                        view(o.dg.data(), p), view(o.db.data(), p), opt);
  else
    rms_norm_backward(comm, view(d.dy.data(), s), view(d.x.data(), s), view(d.g.data(), p),
                      view(o.rstd.data(), r), view(o.dx.data(), s), view(o.dg.data(), p), opt);
  o.bwd = comm.counters();
  return o;
}

int64_t wrong_vs_reference(bool centered, const Data& d, const Out& o, Stats stats) {
  const RowRef ref = row_norm_reference(centered, d.X, d.R, d.H, d.G,
                                        centered ? d.B : std::vector<float>{}, 1e-5, d.DY);
  const double rt = stats == Stats::kNaive ? 2e-4 : 1e-4;
  double rs = 1;
  for (double v : ref.rstd) rs = std::max(rs, v);
  int64_t wrong = count_wrong("y", o.y, d.mine(ref.y, d.R), rt, rt) +
                  count_wrong("rstd", o.rstd, ref.rstd, 0, 1e-5) +
                  count_wrong("dx", o.dx, d.mine(ref.dx, d.R), rt * rs, 10 * rt) +
                  count_wrong("dgamma", o.dg, d.mine(ref.dgamma, 1), rt * d.R, rt);
  if (centered)
    wrong += count_wrong("mean", o.mean, ref.mean, 1e-5, 1e-5) +
             count_wrong("dbeta", o.db, d.mine(ref.dbeta, 1), rt * d.R, rt);
  return wrong;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Collectives of an unchunked strict call that sent `c.bytes_sent` bytes: one when header +
// payload fit the communicator's size-checked sum, else the header's sum and the payload's.
uint64_t unchunked_calls(const Communicator& comm, const CommCounters& c) {
  return c.bytes_sent <= comm.size_checked_sum_bytes() ? 1u : 2u;
}

struct Case {
  int64_t rows, hidden_per_rank, chunk_rows;
  double offset;
};

class ChunkedCalls : public ::testing::TestWithParam<std::tuple<Case, bool, Stats>> {};

TEST_P(ChunkedCalls, MatchReferenceCountChunksAndKeepTheUnchunkedBits) {
  const auto [c, centered, stats] = GetParam();
  // The naive mode's float32 sums lose the variance of data far from 0 (tpnorm/norm.h).
  const Data d(7, c.rows, c.hidden_per_rank * world_size() + 1,
               stats == Stats::kNaive ? 0.0 : c.offset);
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  NormOptions opt;
  opt.stats = stats;
  Out off, on;
  {
    ChunkEnv e("off");
    off = run(*comm, centered, d, opt);
  }
  {
    ChunkEnv e(std::to_string(c.chunk_rows).c_str());
    on = run(*comm, centered, d, opt);
  }
  EXPECT_EQ(sum_over_ranks(wrong_vs_reference(centered, d, on, stats)), 0) << "chunked";
  EXPECT_EQ(sum_over_ranks(wrong_vs_reference(centered, d, off, stats)), 0) << "unchunked";

  // Strict calls (the MPI default): unchunked, one sum carrying the header when it fits the
  // size-checked exchange, else the header's sum and the payload's; chunked (K > 1), the
  // header's sum and K chunk sums.
  const int64_t k = c.rows < 2 ? 1 : ceil_div(c.rows, std::min(c.chunk_rows, c.rows));
  EXPECT_EQ(off.fwd.calls, unchunked_calls(*comm, off.fwd));
  EXPECT_EQ(off.bwd.calls, unchunked_calls(*comm, off.bwd));
  EXPECT_EQ(on.fwd.calls, k > 1 ? static_cast<uint64_t>(1 + k) : off.fwd.calls);
  EXPECT_EQ(on.bwd.calls, k > 1 ? static_cast<uint64_t>(1 + k) : off.bwd.calls);
  EXPECT_EQ(on.fwd.bytes_sent, off.fwd.bytes_sent) << "the same payload, in slices";
  EXPECT_EQ(on.bwd.bytes_sent, off.bwd.bytes_sent);

  // The same bits: rows are independent, each sum adds the same values in the same order (at 2
  // ranks any order; at 3-4 ranks the exchange's rank order, for sums up to 64 KiB as here).
  EXPECT_EQ(on.y, off.y);
  EXPECT_EQ(on.mean, off.mean);
  EXPECT_EQ(on.rstd, off.rstd);
  EXPECT_EQ(on.dx, off.dx);
  // dgamma/dbeta: the unchunked call's order when chunks start at multiples of 16 rows.
  if (c.chunk_rows % 16 == 0) {
    EXPECT_EQ(on.dg, off.dg);
    EXPECT_EQ(on.db, off.db);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ChunkedCalls,
    ::testing::Combine(::testing::Values(Case{37, 5, 16, 3.0},  // rows not a multiple: 16,16,5
                                         Case{64, 3, 16, 50.0},  // 4 chunks, |mean| >> std (float saved stats)
                                         Case{1, 6, 16, 0.0},   // one row: not chunked
                                         Case{45, 4, 7, 0.0},   // unaligned chunks of 7 rows
                                         Case{600, 2, 256, 0.0}),  // chunks of 256: 256,256,88
                       ::testing::Bool(),
                       ::testing::Values(Stats::kRobust, Stats::kNaive, Stats::kExact)));

// Stats::kExact's dgamma/dbeta are summed in fixed 256-row blocks: the unchunked bits at any
// thread count, also when chunks split a block (chunks of 48 rows).
TEST(ChunkedCallsThreads, ExactParamGradientsKeepTheirBitsAtTwoThreads) {
  const Data d(9, 700, 3 * world_size() + 2, 1.0);
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  NormOptions opt;
  opt.stats = Stats::kExact;
  opt.num_threads = 2;
  Out off, on;
  {
    ChunkEnv e("off");
    off = run(*comm, true, d, opt);
  }
  {
    ChunkEnv e("48");
    on = run(*comm, true, d, opt);
  }
  EXPECT_EQ(on.bwd.calls, static_cast<uint64_t>(1 + ceil_div(700, 48)));
  EXPECT_EQ(on.dx, off.dx);
  EXPECT_EQ(on.dg, off.dg);
  EXPECT_EQ(on.db, off.db);
  EXPECT_EQ(sum_over_ranks(wrong_vs_reference(true, d, on, Stats::kExact)), 0);
}

// Split phase: two chunked calls and one unchunked in flight on one communicator (several
// chunk sums of each), finished in reverse order: the blocking calls' bits.
TEST(ChunkedCallsSplitPhase, SeveralChunksInFlightFinishInReverseOrder) {
  ChunkEnv e("8");
  const Data a(11, 40, 3 * world_size(), 2.0), b(12, 33, 2 * world_size() + 1, 0.0),
      t(13, 1, 5, 0.0);
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  std::vector<float> ya(a.x.size()), ra(a.R), yb(b.x.size()), rb(b.R), mb(b.R), yt(t.x.size()),
      rt(t.R);
  comm->reset_counters();
  PendingCall pa = rms_norm_forward_start(*comm, view(a.x.data(), {a.R, a.h}),
                                          view(a.g.data(), {a.h}), view(ya.data(), {a.R, a.h}),
                                          view(ra.data(), {a.R}));
  EXPECT_EQ(comm->in_flight(), 2u) << "chunks 0 and 1 of 5 in flight after the start";
  PendingCall pb = layer_norm_forward_start(
      *comm, view(b.x.data(), {b.R, b.h}), view(b.g.data(), {b.h}), view(b.b.data(), {b.h}),
      view(yb.data(), {b.R, b.h}), view(mb.data(), {b.R}), view(rb.data(), {b.R}));
  PendingCall pt = rms_norm_forward_start(*comm, view(t.x.data(), {t.R, t.h}),
                                          view(t.g.data(), {t.h}), view(yt.data(), {t.R, t.h}),
                                          view(rt.data(), {t.R}));
  EXPECT_EQ(comm->in_flight(), 5u);
  pt.finish();
  pb.finish();
  pa.finish();
  EXPECT_EQ(comm->in_flight(), 0u);
  EXPECT_EQ(comm->counters().calls, (1u + 5u) + (1u + 5u) + 1u);

  std::vector<float> ya2(ya.size()), ra2(ra.size()), yb2(yb.size()), rb2(rb.size()),
      mb2(mb.size());
  {
    ChunkEnv off("off");
    rms_norm_forward(*comm, view(a.x.data(), {a.R, a.h}), view(a.g.data(), {a.h}),
                     view(ya2.data(), {a.R, a.h}), view(ra2.data(), {a.R}));
    layer_norm_forward(*comm, view(b.x.data(), {b.R, b.h}), view(b.g.data(), {b.h}),
                       view(b.b.data(), {b.h}), view(yb2.data(), {b.R, b.h}),
                       view(mb2.data(), {b.R}), view(rb2.data(), {b.R}));
  }
  EXPECT_EQ(ya, ya2);
  EXPECT_EQ(ra, ra2);
  EXPECT_EQ(yb, yb2);
  EXPECT_EQ(mb, mb2);
  EXPECT_EQ(rb, rb2);
  const RowRef ref = row_norm_reference(false, a.X, a.R, a.H, a.G, {}, 1e-5);
  EXPECT_EQ(sum_over_ranks(count_wrong("a y", ya, a.mine(ref.y, a.R), 1e-4, 1e-4)), 0);
}

// A chunked call dropped without finish() on every rank: its remaining chunk sums are made
// (nothing hangs), nothing is written, the next call fails on every rank, the one after works.
TEST(ChunkedCallsSplitPhase, DroppedChunkedHandle) {
  ChunkEnv e("4");
  const Data a(14, 24, 2 * world_size(), 0.0);
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  std::vector<float> y(a.x.size(), -7.0f), r(a.R, -7.0f);
  auto call = [&] {
    return rms_norm_forward_start(*comm, view(a.x.data(), {a.R, a.h}), view(a.g.data(), {a.h}),
                                  view(y.data(), {a.R, a.h}), view(r.data(), {a.R}));
  };
  { PendingCall dropped = call(); }
  EXPECT_EQ(comm->in_flight(), 0u);
  for (float v : y) ASSERT_EQ(v, -7.0f);
  int threw = 0;
  try {
    call().finish();
  } catch (const Error&) {
    threw = 1;
  }
  EXPECT_EQ(sum_over_ranks(threw), world_size());
  call().finish();
  const RowRef ref = row_norm_reference(false, a.X, a.R, a.H, a.G, {}, 1e-5);
  EXPECT_EQ(sum_over_ranks(count_wrong("y", y, a.mine(ref.y, a.R), 1e-4, 1e-4)), 0);
}

// The rule. TPNORM_CHUNK unset ("auto"): one payload sum for a small call; on a host at P >= 2
// a large one in chunks of half an L2 (ops/chunking.h host_rule, measured to pay), with the
// bits of TPNORM_CHUNK=off's one sum, unless it is a started call. At one rank nothing is
// chunked.
TEST(ChunkedCallsRule, AutoKeepsOneSumOnSmallCallsAndChunksLargeOnes) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  ChunkEnv e(nullptr);
  const Data small(15, 64, 64 * world_size(), 0.0);
  const Out s = run(*comm, true, small, {});
  EXPECT_EQ(s.fwd.calls, unchunked_calls(*comm, s.fwd));
  EXPECT_EQ(s.bwd.calls, unchunked_calls(*comm, s.bwd));

  // 4096 rows x ~2048 columns per rank, float32: 32 MiB of x per rank, 64 MiB of x and dy.
  const int64_t R = 4096, h = 2048;
  std::vector<float> x = normal(16, world_rank(), R * h, 1.0, 2.0), g(h, 1.5f), b(h, 0.25f);
  std::vector<float> y1(x.size()), y2(x.size()), m1(R), m2(R), r1(R), r2(R);
  const Shape sh{R, h}, p{h}, rr{R};
  comm->reset_counters();
  layer_norm_forward(*comm, view(x.data(), sh), view(g.data(), p), view(b.data(), p),
                     view(y1.data(), sh), view(m1.data(), rr), view(r1.data(), rr));
  if (world_size() > 1)
    EXPECT_GT(comm->counters().calls, 3u) << "auto: a 32 MiB-per-rank forward in chunks";
  else
    EXPECT_EQ(comm->counters().calls, unchunked_calls(*comm, comm->counters()))
        << "auto: not chunked at one rank";
  {
    ChunkEnv off("off");
    comm->reset_counters();
    layer_norm_forward(*comm, view(x.data(), sh), view(g.data(), p), view(b.data(), p),
                       view(y2.data(), sh), view(m2.data(), rr), view(r2.data(), rr));
    EXPECT_EQ(comm->counters().calls, unchunked_calls(*comm, comm->counters()));
  }
  EXPECT_EQ(y1, y2);
  EXPECT_EQ(m1, m2);
  EXPECT_EQ(r1, r2);
  // A started call keeps one payload sum under auto (its caller overlaps it; see run_op.cpp),
  // with the same bits.
  std::vector<float> y3(x.size()), m3(R), r3(R);
  comm->reset_counters();
  PendingCall started = layer_norm_forward_start(*comm, view(x.data(), sh), view(g.data(), p),
                                                 view(b.data(), p), view(y3.data(), sh),
                                                 view(m3.data(), rr), view(r3.data(), rr));
  started.finish();
  EXPECT_EQ(comm->counters().calls, unchunked_calls(*comm, comm->counters()))
      << "auto: a started call in chunks";
  EXPECT_EQ(y1, y3);
  EXPECT_EQ(m1, m3);
  EXPECT_EQ(r1, r3);
}

// The fused residual add + LayerNorm, forward and backward (with dh_extra), chunked: the
// unchunked call's bits (h, y, mean, rstd, df, dx; dgamma/dbeta at 16-row chunks) and the
// float64 reference on h = alpha*x + f (y) and on df = dnorm + dh_extra.
TEST(ChunkedCallsFused, FusedAddLayerNormKeepsTheUnchunkedBits) {
  for (const int64_t rows : {37, 64}) {
    for (const Stats stats : {Stats::kRobust, Stats::kExact}) {
      const Data d(19, rows, 3 * world_size() + 2, 0.0);
      const std::vector<float> F = normal(20, 0, d.R * d.H), EX = normal(20, 1, d.R * d.H);
      const std::vector<float> f = columns(F, d.R, d.H, d.c0, d.h),
                               ex = columns(EX, d.R, d.H, d.c0, d.h);
      const float alpha = 1.5f;
      auto comm = make_mpi_communicator(MPI_COMM_WORLD);
      NormOptions opt;
      opt.stats = stats;
      struct FusedOut {
        std::vector<float> h, y, mean, rstd, dx, df, dg, db;
        uint64_t fwd_calls = 0, bwd_calls = 0;
      };
      auto run_fused = [&](const char* chunk) {
        ChunkEnv e(chunk);
        FusedOut o;
        const size_t n = d.x.size();
        o.h.resize(n), o.y.resize(n), o.dx.resize(n), o.df.resize(n);
        o.mean.resize(d.R), o.rstd.resize(d.R), o.dg.resize(d.h), o.db.resize(d.h);
        const Shape s{d.R, d.h}, p{d.h}, r{d.R};
        comm->reset_counters();
        fused_add_layer_norm_forward(*comm, view(d.x.data(), s), view(f.data(), s), alpha,
                                     view(d.g.data(), p), view(d.b.data(), p), view(o.h.data(), s),
                                     view(o.y.data(), s), view(o.mean.data(), r),
                                     view(o.rstd.data(), r), opt);
        o.fwd_calls = comm->counters().calls;
        comm->reset_counters();
        fused_add_layer_norm_backward(*comm, view(d.dy.data(), s), view(ex.data(), s),
                                      view(o.h.data(), s), view(d.g.data(), p),
                                      view(o.mean.data(), r), view(o.rstd.data(), r), alpha,
                                      view(o.dx.data(), s), view(o.df.data(), s),
                                      view(o.dg.data(), p), view(o.db.data(), p), opt);
        o.bwd_calls = comm->counters().calls;
        return o;
      };
      const FusedOut off = run_fused("off"), on = run_fused("16");
      const uint64_t k = static_cast<uint64_t>(ceil_div(rows, 16));
      EXPECT_EQ(on.fwd_calls, 1 + k);
      EXPECT_EQ(on.bwd_calls, 1 + k);
      EXPECT_EQ(on.h, off.h);
      EXPECT_EQ(on.y, off.y);
      EXPECT_EQ(on.mean, off.mean);
      EXPECT_EQ(on.rstd, off.rstd);
      EXPECT_EQ(on.df, off.df);
      EXPECT_EQ(on.dx, off.dx);
      if (rows % 16 == 0 || stats == Stats::kExact) {
        EXPECT_EQ(on.dg, off.dg);
        EXPECT_EQ(on.db, off.db);
      }
      // The reference on the full h (as the kernel rounds it: one float multiply-add).
      std::vector<float> H(d.X.size());
      for (size_t i = 0; i < H.size(); ++i) H[i] = alpha * d.X[i] + F[i];
      const RowRef ref = row_norm_reference(true, H, d.R, d.H, d.G, d.B, 1e-5, d.DY);
      std::vector<double> df_ref = d.mine(ref.dx, d.R);
      for (size_t i = 0; i < df_ref.size(); ++i) df_ref[i] += ex[i];
      int64_t wrong = count_wrong("fused y", on.y, d.mine(ref.y, d.R), 1e-4, 1e-4) +
                      count_wrong("fused df", on.df, df_ref, 1e-4, 1e-3);
      EXPECT_EQ(sum_over_ranks(wrong), 0) << rows << " rows";
    }
  }
}

// TPNORM_CHUNK differs between ranks (rank 0 forces chunks, the others do not): the ranks
// would make different collectives, so the call fails with the same kMismatch on every rank,
// naming the field; nothing is written and the next call (the same setting everywhere) works.
TEST(ChunkedCallsAgreement, RanksThatSetTpnormChunkDifferentlyDisagree) {
  const Data d(17, 40, 3 * world_size(), 0.0);
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  std::vector<float> y(d.x.size(), -3.0f), rs(d.R);
  auto call = [&] {
    rms_norm_forward(*comm, view(d.x.data(), {d.R, d.h}), view(d.g.data(), {d.h}),
                     view(y.data(), {d.R, d.h}), view(rs.data(), {d.R}));
  };
  std::string msg;
  {
    ChunkEnv e(world_rank() == 0 ? "8" : "off");
    msg = error_of(call, ErrorCode::kMismatch);
  }
  EXPECT_NE(msg.find("chunking"), std::string::npos) << msg;
  for (float v : y) ASSERT_EQ(v, -3.0f);
  {
    ChunkEnv e("8");
    call();
  }
  const RowRef ref = row_norm_reference(false, d.X, d.R, d.H, d.G, {}, 1e-5);
  EXPECT_EQ(sum_over_ranks(count_wrong("y", y, d.mine(ref.y, d.R), 1e-4, 1e-4)), 0);
}

}  // namespace
