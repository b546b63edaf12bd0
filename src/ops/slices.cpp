// slices.cpp — the slice table's rows and its verdict (see slices.h).
#include "ops/slices.h"

#include <algorithm>
#include <sstream>

#include "common/slice_tiling.h"
#include "tpnorm/error.h"

namespace tpnorm::detail {

std::string slice_table_problem(const std::vector<double>& table, int ranks, int64_t total,
                                const char* dim) {
  if (slices_tile([&](int i) { return table[static_cast<size_t>(i)]; }, ranks, total)) return {};
  struct Piece {
    int64_t begin, end;
    int rank;
  };
  std::vector<Piece> pieces;
  for (int r = 0; r < ranks; ++r) {
    const auto o = static_cast<int64_t>(table[2 * static_cast<size_t>(r)]);
    const auto n = static_cast<int64_t>(table[2 * static_cast<size_t>(r) + 1]);
    if (n > 0) pieces.push_back({o, o + n, r});
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  // The first element the sorted slices miss (a gap) or cover again (an overlap).
  std::string fault;
  int64_t next = 0;
  for (const Piece& p : pieces) {
    if (p.begin > next) {
      fault = std::string(dim) + "s [" + std::to_string(next) + ", " + std::to_string(p.begin) +
              ") are held by no rank";
      break;
    }
    if (p.begin < next) {
      fault = std::string(dim) + " " + std::to_string(p.begin) + " is held by more than one rank";
      break;
    }
    next = p.end;
  }
  if (fault.empty() && next != total)
    fault = next < total ? std::string(dim) + "s [" + std::to_string(next) + ", " +
                               std::to_string(total) + ") are held by no rank"
                         : std::string("the slices end at ") + std::to_string(next);
  if (fault.empty()) return {};
  std::ostringstream m;
  m << "the ranks' " << dim << " slices do not tile [0, " << total << "): " << fault
    << " (rank: [offset, offset + count)";
  for (int r = 0; r < ranks; ++r) {
    const auto o = static_cast<int64_t>(table[2 * static_cast<size_t>(r)]);
    const auto n = static_cast<int64_t>(table[2 * static_cast<size_t>(r) + 1]);
    m << (r ? ", " : " ") << r << ": [" << o << ", " << o + n << ")";
  }
  m << "); give each rank its own offset, or leave the offsets to tpnorm (consecutive slices in "
       "rank order)";
  return m.str();
}

void check_slice_table(const std::vector<double>& table, int ranks, const Slice& s,
                       const char* op) {
  const std::string problem = slice_table_problem(table, ranks, s.total, s.dim);
  if (!problem.empty())
    throw Error(ErrorCode::kInvalidArgument, std::string("tpnorm: ") + op + ": " + problem);
}

}  // namespace tpnorm::detail
