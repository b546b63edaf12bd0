// batched.cpp — K row norms, one collective: validate all -> partial of each into its slice of
// one payload -> ONE reduce -> apply each with its own global column count.
//
// Payload: [K column counts][item 0 stats][item 1 stats]... Every rank computes the same
// offsets from (rows_i, centered_i), which the agreement fingerprint covers.
#include "tpnorm/batched.h"

#include <cstdint>
#include <string>
#include <vector>

#include "ops/packed_call.h"
#include "ops/row_stages.h"

namespace tpnorm {
namespace {

using detail::row_geometry;
using detail::row_stat_width;

// A digest of what every rank must agree on per item; PackedCall keeps a bounded number of
// named fields, so the items are folded into one exact integer (52 bits fit a double).
struct Digest {
  uint64_t h = 0xcbf29ce484222325ULL;
  void add(int64_t v) {
    for (int i = 0; i < 8; ++i)
      h = (h ^ ((static_cast<uint64_t>(v) >> (8 * i)) & 0xff)) * 0x100000001b3ULL;
  }
  double value() const { return static_cast<double>(h & ((1ULL << 52) - 1)); }
};

// Values the payload holds for the items, and each item's offset into it (after the K counts).
template <class Item>
std::vector<size_t> layout(const Item* items, size_t count, size_t& total) {
  std::vector<size_t> off(count);
  total = count;
  for (size_t i = 0; i < count; ++i) {
    off[i] = total;
    total += static_cast<size_t>(row_geometry(items[i].x).rows * row_stat_width(items[i].centered));
  }
  return off;
}

template <class Item, class Validate, class Partial, class Apply>
void run(const char* op, Communicator& comm, const Item* items, size_t count,
         const NormOptions& opt, bool forward, Validate validate, Partial partial, Apply apply) {
  detail::PackedCall call(comm, op, detail::wire_of(opt.stats), opt.check_agreement);
  detail::Validator v(call, comm.device());
  if (count > 0 && !items) v.fail("items", "is null but count is " + std::to_string(count));
  detail::host_only(v, comm.device());
  if (forward) v.eps(opt.eps);
  Digest d;
  int64_t rows_total = 0;
  for (size_t i = 0; i < count && items; ++i) {
    const Item& it = items[i];
    validate(v, "items[" + std::to_string(i) + "].", it);
    const int64_t rows = row_geometry(it.x).rows;
    rows_total += rows;
    d.add(rows);
    d.add(it.centered);
    d.add(static_cast<int64_t>(it.x.dtype));
    d.add(it.gamma.present());
  }
  call.agree("items", static_cast<double>(items ? count : 0));
  call.agree("rows_total", static_cast<double>(rows_total));
  call.agree("item_digest", d.value());
  call.agree("stats", static_cast<double>(opt.stats));
  if (forward) call.agree("eps", opt.eps);

  size_t total = 0;
  const std::vector<size_t> off = items ? layout(items, count, total) : std::vector<size_t>{};
  call.prepare(total, 0);
  const size_t vsize = dtype_size(call.wire());
  auto at = [&](size_t value) {
    return static_cast<char*>(detail::payload_of(call)) + value * vsize;
  };
  if (!call.failed()) {
    for (size_t i = 0; i < off.size(); ++i) {
      const double cols = static_cast<double>(row_geometry(items[i].x).h);
      if (call.wire() == DType::F64)
        reinterpret_cast<double*>(at(0))[i] = cols;
      else
        reinterpret_cast<float*>(at(0))[i] = static_cast<float>(cols);
      partial(items[i], at(off[i]));
    }
  }
  call.reduce();
  for (size_t i = 0; i < off.size(); ++i) {
    const double n = call.wire() == DType::F64 ? reinterpret_cast<double*>(at(0))[i]
                                               : reinterpret_cast<float*>(at(0))[i];
    detail::check_naive_count(opt.stats, n);
    apply(items[i], at(off[i]), n);
  }
}

detail::RowForwardArgs as_args(const RowNormItem& it) {
  return {it.centered, it.x, it.gamma, it.beta, it.y, it.mean, it.rstd};
}
detail::RowBackwardArgs as_args(const RowNormGradItem& it) {
  return {it.centered, it.dy, it.x, it.gamma, it.mean, it.rstd, it.dx, it.dgamma, it.dbeta};
}

}  // namespace

void batched_norm_forward(Communicator& comm, const RowNormItem* items, size_t count,
                          const NormOptions& opt) {
  const DType wire = detail::wire_of(opt.stats);
  run(
      "batched_norm_forward", comm, items, count, opt, true,
      [](detail::Validator& v, const std::string& p, const RowNormItem& it) {
        detail::validate_row_forward(v, p, as_args(it));
      },
      [&](const RowNormItem& it, void* s) {
        detail::row_forward_partial(as_args(it), wire, s, opt.num_threads);
      },
      [&](const RowNormItem& it, void* s, double n) {
        detail::row_forward_apply(as_args(it), wire, s, n, opt.eps, opt.num_threads);
      });
}

void batched_norm_backward(Communicator& comm, const RowNormGradItem* items, size_t count,
                           const NormOptions& opt) {
  const DType wire = detail::wire_of(opt.stats);
  run(
      "batched_norm_backward", comm, items, count, opt, false,
      [](detail::Validator& v, const std::string& p, const RowNormGradItem& it) {
        detail::validate_row_backward(v, p, as_args(it));
      },
      [&](const RowNormGradItem& it, void* s) {
        detail::row_backward_partial(as_args(it), wire, s, opt.num_threads);
      },
      [&](const RowNormGradItem& it, void* s, double n) {
        detail::row_backward_apply(as_args(it), wire, s, n, opt.num_threads);
      });
}

}  // namespace tpnorm
