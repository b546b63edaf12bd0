// Absurd shapes for SyncBatchNorm, GroupNorm, fused residual + norm and batched norms at 2, 3
// and 4 ranks (the row norms' are in test_row_norm_bad_inputs.cpp): dims whose product
// overflows int64 — also behind an empty dim, [0, 2^40, 2^40] — and GroupNorm's caller-given
// groups and channel offset, whose products and sums used to overflow. Each must be the same
// tpnorm::Error on every rank, naming the argument and the rank, with every output untouched;
// never undefined behaviour (the sanitizer build runs this file too).
//
// An absurd x changes that rank's payload length (its geometry is zeroed), like any size that
// differs across ranks, so the one-rank cases run in strict mode (the header's own collective
// catches them; see docs/failure-behaviour.md); shapes absurd on every rank, and absurd
// GroupNorm offsets (which leave the payload length alone), run in strict and folded mode.
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "expect_error.h"
#include "harness.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/batched.h"
#include "tpnorm/fused.h"
#include "tpnorm/group_norm.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

constexpr float kSentinel = -7.f;
constexpr int64_t kHuge = int64_t{1} << 40;  // kHuge * kHuge overflows int64
const char* kOverflow = "has a negative dimension or dimensions whose product exceeds 2^63";

// One rank's small, real buffers. x holds data; every output starts as kSentinel. An absurd
// shape still points at these (validation must fail before anything is read or written).
struct Bufs {
  std::vector<float> x = normal(3, world_rank(), 64, 0.5, 1.5), f = normal(4, world_rank(), 64);
  std::vector<float> y = filled(64), h = filled(64), mean = filled(64), rstd = filled(64),
                     rm = filled(8), rv = filled(8);
  int64_t tracked = 5;
  static std::vector<float> filled(size_t n) { return std::vector<float>(n, kSentinel); }
  /// with_h false: h may hold alpha*x + f (tpnorm/fused.h writes it before the collective).
  bool untouched(bool with_h) const {
    for (const auto* v : {&y, &h, &mean, &rstd, &rm, &rv})
      for (float e : *v)
        if (e != kSentinel && (v != &h || with_h)) return false;
    return tracked == 5;
  }
};

// Runs call(comm, bufs, absurd) on every rank, where `absurd` is true on the ranks that pass
// the absurd argument, in the given strict modes; each must fail everywhere with `what` in the
// message, naming an absurd rank, with this rank's outputs untouched (but for h on the sane
// ranks of a fused call, which the fused ops document as written).
void expect_fails(const std::function<void(Communicator&, Bufs&, bool)>& call, bool every_rank,
                  std::initializer_list<int64_t> strict_modes, const std::string& what,
                  bool fused = false) {
  const int bad = world_size() - 1;
  for (int64_t strict : strict_modes) {
    auto c = make_mpi_communicator(MPI_COMM_WORLD);
    c->set_strict_calls(strict);
    Bufs b;
    const bool absurd = every_rank || world_rank() == bad;
    const std::string msg = error_of([&] { call(*c, b, absurd); }, ErrorCode::kInvalidArgument);
    EXPECT_NE(msg.find("rank " + std::to_string(every_rank ? 0 : bad)), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_TRUE(b.untouched(absurd || !fused))
        << "strict " << strict << ": an output was written; " << msg;
  }
}

const std::initializer_list<int64_t> kStrict = {-1}, kBoth = {-1, 0};
const std::string kX = std::string("argument 'x' ") + kOverflow;

// Shapes: a sane [2, 4, 8]; absurd ones overflow outright or behind an empty dim.
const Shape kSane{2, 4, 8};
const Shape kAbsurd[] = {{kHuge, 4, kHuge}, {0, 4, kHuge, kHuge}};

TEST(ShapeOverflow, SyncBatchNorm) {
  for (const Shape& bad : kAbsurd)
    for (bool every : {false, true})
      expect_fails(
          [&](Communicator& c, Bufs& b, bool absurd) {
            const Shape s = absurd ? bad : kSane, ch{4};
            sync_batch_norm_forward(c, view(b.x.data(), s), {}, {}, view(b.rm.data(), ch),
                                    view(b.rv.data(), ch), &b.tracked, view(b.y.data(), s),
                                    view(b.mean.data(), ch), view(b.rstd.data(), ch));
          },
          every, every ? kBoth : kStrict, kX);
}

// This rank holds channels [4r, 4r + 4) of 4P in groups of 2 channels.
ChannelGroups sane_groups() { return {2 * world_size(), 4 * world_size(), 4 * world_rank()}; }

void group_forward(Communicator& c, Bufs& b, const Shape& s, const ChannelGroups& cg) {
  const Shape st{2, cg.groups};  // [N, G]; never reached with absurd groups
  group_norm_forward(c, view(b.x.data(), s), cg, {}, {}, view(b.y.data(), s),
                     view(b.mean.data(), st), view(b.rstd.data(), st));
}

TEST(ShapeOverflow, GroupNormShapes) {
  for (const Shape& bad : kAbsurd)
    for (bool every : {false, true})
      expect_fails([&](Communicator& c, Bufs& b,
                       bool absurd) { group_forward(c, b, absurd ? bad : kSane, sane_groups()); },
                   every, every ? kBoth : kStrict, kX);
}

// groups and channel_offset are the caller's numbers: N * groups and offset + C_local overflowed
// before they were checked (an offset near 2^63 wrapped negative and passed the range check).
TEST(ShapeOverflow, GroupNormGroupsAndOffset) {
  const int64_t top = std::numeric_limits<int64_t>::max();
  expect_fails(
      [&](Communicator& c, Bufs& b, bool absurd) {
        ChannelGroups cg = sane_groups();
        if (absurd) cg.channel_offset = top;
        group_forward(c, b, kSane, cg);
      },
      false, kBoth, "argument 'channel_offset'");
  const int64_t g = int64_t{1} << 62;  // 2 samples x 2^62 groups overflows; 2^62 divides 2^62
  expect_fails(
      [&](Communicator& c, Bufs& b, bool) {
        group_forward(c, b, kSane, {g, g, 4 * world_rank()});
      },
      true, kBoth, "argument 'groups' 2 samples x 4611686018427387904 groups overflows int64");
}

TEST(ShapeOverflow, FusedResidualNorm) {
  const Shape sane{8, 8};
  for (const Shape& bad : {Shape{kHuge, kHuge}, Shape{0, kHuge, kHuge, 8}})
    for (bool every : {false, true})
      for (bool centered : {true, false})
        expect_fails(
            [&](Communicator& c, Bufs& b, bool absurd) {
              const Shape s = absurd ? bad : sane, r{8};
              const double alpha = deepnorm_alpha(DeepNormStack::kEncoderOnly, 6, 0);
              if (centered)
                fused_add_layer_norm_forward(c, view(b.x.data(), s), view(b.f.data(), s), alpha, {},
                                             {}, view(b.h.data(), s), view(b.y.data(), s),
                                             view(b.mean.data(), r), view(b.rstd.data(), r));
              else
                fused_add_rms_norm_forward(c, view(b.x.data(), s), view(b.f.data(), s), alpha, {},
                                           view(b.h.data(), s), view(b.y.data(), s),
                                           view(b.rstd.data(), r));
            },
            every, every ? kBoth : kStrict, kX, true);
}

TEST(ShapeOverflow, BatchedNorms) {
  for (const Shape& bad : {Shape{kHuge, kHuge}, Shape{0, kHuge, kHuge, 4}})
    for (bool every : {false, true})
      expect_fails(
          [&](Communicator& c, Bufs& b, bool absurd) {
            // Item 0 is sane; item 1, an RMSNorm over the second half of the buffers, is not.
            const Shape s0{4, 8}, s1 = absurd ? bad : Shape{4, 8}, r{4};
            const RowNormItem items[] = {{true,
                                          view(b.x.data(), s0),
                                          {},
                                          {},
                                          view(b.y.data(), s0),
                                          view(b.mean.data(), r),
                                          view(b.rstd.data(), r)},
                                         {false,
                                          view(b.x.data() + 32, s1),
                                          {},
                                          {},
                                          view(b.y.data() + 32, s1),
                                          {},
                                          view(b.rstd.data() + 32, r)}};
            batched_norm_forward(c, items, 2);
          },
          every, every ? kBoth : kStrict, std::string("argument 'items[1].x' ") + kOverflow);
}

}  // namespace
