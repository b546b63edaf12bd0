// chunking.h — when and how a large call is cut into row chunks (the runner's pipelining,
// ops/run_op.cpp): chunk k's statistics are summed while chunk k+1's partial runs, and chunk k's
// apply re-reads its inputs (x; x and dy backward) from cache instead of memory. Each chunk costs
// one collective, so a call is chunked only when its re-read inputs are many times the cache
// budget of one chunk; small calls keep their one collective.
//
// Pure C++ (no tpnorm types, no I/O): the numbers come from the runner, the unit test
// (tests/unit/test_chunking.cpp) checks the rule. Every input must be the same on every rank
// (the plan decides how many collectives the call makes): the rows and the element size are
// agreed fields, `columns` is the GLOBAL column count (the summed call header), so a rank with
// fewer (or no) columns plans the same chunks as the others.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace tpnorm::detail::chunking {

/// TPNORM_CHUNK: "off" / "0" never chunks; "auto" (or unset) lets the rule decide; "on" chunks
/// every chunkable call with at least two rows into the rule's chunks (at least 2); a positive
/// integer N chunks every chunkable call into chunks of N rows (tests, benchmarks).
enum class Mode { kAuto, kOff, kOn };

struct Request {
  Mode mode = Mode::kAuto;
  int64_t rows = 0;  ///< forced rows per chunk (Mode::kOn with a number), 0: the rule's
};

/// Parses TPNORM_CHUNK's value (nullptr: unset). Anything unrecognised is kAuto.
inline Request parse(const char* v) {
  Request r;
  if (!v || !*v || std::strcmp(v, "auto") == 0) return r;
  if (std::strcmp(v, "off") == 0 || std::strcmp(v, "0") == 0) {
    r.mode = Mode::kOff;
  } else if (std::strcmp(v, "on") == 0) {
    r.mode = Mode::kOn;
  } else {
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (end && *end == 0 && n > 0) r = {Mode::kOn, n};
  }
  return r;
}

/// The rule's constants (docs/measurements.md has the measurements behind them).
struct Rule {
  /// Whether auto chunks at all: false where chunking was measured not to pay (or was not
  /// measured); TPNORM_CHUNK=on still chunks.
  bool auto_chunks = true;
  int64_t chunk_bytes = 4 << 20;  ///< re-read input bytes per chunk (a share of the cache)
  int64_t min_chunks = 4;         ///< auto: chunk only a call of at least this many chunks
  int64_t max_chunks = 64;        ///< at most this many collectives a call
  int64_t align_rows = 16;        ///< chunk rows are a multiple of this (except the last chunk)
  /// Auto: a call whose header would ride in its one (small) payload sum is considered for
  /// chunks only from this many rows (the runner then sends its header first, one more small
  /// sum, even if the plan is one chunk).
  int64_t header_rows = 2048;
};

/// The rule on a host: chunks of half of one core's L2 of re-read input (x; x and dy backward),
/// but not below min(L2, 512 KiB) nor 256 KiB. The runner keeps two chunks live (the one
/// applied, the next one's partial) and the apply prefetches a third, so a chunk's inputs are
/// re-read from L2 or the L3 next to it. On 1 MiB-L2 cores (2 ranks) half-L2 chunks took
/// 0.91-0.99x the backward time of one-L2 ones in 16 of 16 interleaved runs at 4096 x 2048 per
/// rank (LayerNorm and RMSNorm), and 3 of 3 at 8192 x 1024 and 2048 x 4096; quarter-L2 ones were
/// no faster. The whole step's ratio in examples/overlap stayed within the noise. On 512 KiB-L2
/// cores the rule keeps whole-L2 chunks (half of that not measured). Chunks of a quarter of L2 +
/// an L3 share (4.25 MiB) measured 1.30x the local step against 1.12x for 1 MiB ones. Auto
/// chunks the calls of at least 4 L2s of re-read input per rank at P >= 2: measured faster than
/// one collective with 2 ranks on 2 cores, 4096 x 2048 per rank and larger. docs/measurements.md
/// has these measurements.
/// The L2 size the runner plans host chunks for, on every machine alike (the plan must be the
/// same on every rank, whatever CPU each runs on): that of the cores the rule was measured on.
constexpr int64_t kHostRuleL2 = int64_t{1} << 20;

inline Rule host_rule(int64_t l2_bytes) {
  Rule r;
  const int64_t l2 = std::max<int64_t>(int64_t{256} << 10, l2_bytes);
  r.chunk_bytes = std::max(std::min<int64_t>(l2, int64_t{512} << 10), l2 / 2);
  r.min_chunks = 4 * l2 / r.chunk_bytes;
  r.max_chunks = 1024;
  return r;
}

/// What the runner knows when it plans (all agreed on every rank).
struct Shape {
  int64_t rows = 0;         ///< rows of the call
  int64_t columns = 0;      ///< global columns (sum over ranks)
  int ranks = 1;            ///< P
  int64_t reread_bytes = 0; ///< bytes per element the apply re-reads (x: s, x and dy: 2 s)
};

struct Plan {
  int64_t chunks = 1;     ///< collectives of the payload (1: not chunked)
  int64_t chunk_rows = 0; ///< rows per chunk (the last one may have fewer); rows when 1 chunk
  int64_t depth = 1;      ///< chunk sums in flight beyond the one being applied
  int64_t begin(int64_t k) const { return k * chunk_rows; }
  int64_t end(int64_t k, int64_t rows) const { return std::min(rows, (k + 1) * chunk_rows); }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// The plan of a call. Auto: only with rule.auto_chunks, only at P > 1 (at one rank the reduce is the identity and the
/// kernels already make one pass), only when this rank's share of the re-read inputs (the
/// columns spread evenly over the ranks) is at least min_chunks chunks, at most max_chunks.
inline Plan plan(const Shape& s, const Rule& rule, const Request& req) {
  Plan one{1, s.rows};
  if (req.mode == Mode::kOff || s.rows < 2) return one;
  if (req.mode == Mode::kOn && req.rows > 0) {
    const int64_t c = std::min(req.rows, s.rows);
    return {ceil_div(s.rows, c), c};
  }
  const int64_t per_rank_cols = ceil_div(s.columns, std::max(1, s.ranks));
  const int64_t row_bytes = per_rank_cols * s.reread_bytes;
  const int64_t bytes = row_bytes * s.rows;
  if (req.mode == Mode::kAuto &&
      (!rule.auto_chunks || s.ranks < 2 || bytes < rule.min_chunks * rule.chunk_bytes))
    return one;
  int64_t chunks = std::clamp<int64_t>(ceil_div(bytes, rule.chunk_bytes), 2, rule.max_chunks);
  int64_t rows = ceil_div(ceil_div(s.rows, chunks), rule.align_rows) * rule.align_rows;
  if (rows >= s.rows) {  // too few rows for aligned chunks: halves, unaligned (Mode::kOn only)
    if (req.mode == Mode::kAuto) return one;
    rows = ceil_div(s.rows, 2);
  }
  return {ceil_div(s.rows, rows), rows};
}

}  // namespace tpnorm::detail::chunking
