// loops.h — the two loops every CPU norm kernel is made of, over a contiguous run of h
// elements: block_sums (two float sums, accumulated in W across blocks) and write_row
// (an element formula to an output, with optional streaming stores and prefetching).
// Formulas are generic lambdas f(j, V{}) over V = vf (the lanes at j) or float (element j).
#pragma once

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "kernels/cpu/simd.h"

namespace tpnorm::kernels::cpu {

/// OpenMP threads for `work` independent items: the caller's request (0: the OpenMP default),
/// never more than the items, at least one.
inline int thread_count(int requested, int64_t work) {
  const int t = requested > 0 ? requested : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, work)));
}

/// The exact split of a mean into float head + float tail: kernels form x - mean as
/// (x - head) - tail, whose first difference is exact or one rounding of a small number, so
/// xhat keeps float accuracy even when |mean| is 1e4 times the standard deviation.
template <class S>
inline void split_mean(S mean, float& head, float& tail) {
  head = static_cast<float>(mean);
  tail = static_cast<float>(static_cast<double>(mean) - static_cast<double>(head));
}

/// Two lane-wise values of a term.
template <class V>
struct Two {
  V a, b;
};

/// How far ahead of the element being read the kernels prefetch their inputs (into L2): a
/// constant distance; prefetching a whole 16 KiB row ahead measured slower at one thread.
constexpr int64_t kAheadBytes = 4096;

/// Elements per float32 block of block_sums: two chains of 16 vectors per lane, so each lane's
/// float sum has at most 16 roundings before the block's sum is added in W.
constexpr int64_t kBlock = 32 * vf::L;

/// (s1, s2) = sums over j < h of term(j, V{}) -> Two<V>: float32 lanes within a block of
/// kBlock elements, W across blocks. Two independent accumulators per sum, so the adds are not
/// one latency-bound chain.
/// pf1/pf2 (may be null): inputs prefetched one vector per vector summed (see write_row).
template <class W, class Term, class P = float>
inline void block_sums(int64_t h, Term term, W& s1, W& s2, const P* pf1 = nullptr,
                       const P* pf2 = nullptr) {
  constexpr int64_t L = vf::L;
  W a1 = 0, a2 = 0;
  for (int64_t j0 = 0; j0 < h; j0 += kBlock) {
    const int64_t j1 = std::min(h, j0 + kBlock);
    vf u0 = vsplat(0), v0 = vsplat(0), u1 = vsplat(0), v1 = vsplat(0);
    int64_t j = j0;
    for (; j + 2 * L <= j1; j += 2 * L) {
      if (pf1) __builtin_prefetch(pf1 + j, 0, 2), __builtin_prefetch(pf1 + j + L, 0, 2);
      if (pf2) __builtin_prefetch(pf2 + j, 0, 2), __builtin_prefetch(pf2 + j + L, 0, 2);
      const Two<vf> p = term(j, vf{}), q = term(j + L, vf{});
      u0 += p.a;
      v0 += p.b;
      u1 += q.a;
      v1 += q.b;
    }
    for (; j + L <= j1; j += L) {
      const Two<vf> p = term(j, vf{});
      u0 += p.a;
      v0 += p.b;
    }
    float f1 = hsum(u0 + u1), f2 = hsum(v0 + v1);
    for (; j < j1; ++j) {
      const Two<float> p = term(j, 0.0f);
      f1 += p.a;
      f2 += p.b;
    }
    a1 += f1;
    a2 += f2;
  }
  s1 = a1;
  s2 = a2;
}

/// Cache `index` of cpu0 in bytes as sysfs states it ("32768K"), or 0 when it cannot be read.
inline int64_t sysfs_cache_bytes(int index) {
  const std::string path =
      "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size";
  int64_t b = 0;
  if (std::FILE* f = std::fopen(path.c_str(), "r")) {
    long v = 0;
    char unit = 0;
    if (std::fscanf(f, "%ld%c", &v, &unit) >= 1)
      b = v * (unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : 1);
    std::fclose(f);
  }
  return b;
}

/// The last-level cache in bytes: sysfs first (glibc's sysconf can report 320 MiB for a virtual
/// machine's 32 MiB L3, which disabled streaming for every benchmark shape), then sysconf, then
/// 32 MiB.
inline int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    int64_t b = sysfs_cache_bytes(3);
    if (b <= 0) b = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return b > 0 ? b : int64_t{32} << 20;
  }();
  return bytes;
}

/// The per-core L2 in bytes: sysfs, else 1 MiB. (SyncBatchNorm's fused path and the chunk
/// rule size what they keep in cache by it.)
inline int64_t l2_cache_bytes() {
  static const int64_t bytes = [] {
    const int64_t b = sysfs_cache_bytes(2);
    return b > 0 ? b : int64_t{1} << 20;
  }();
  return bytes;
}

/// Whether an output should bypass the caches, given the bytes the kernel touches (inputs and
/// output): streaming stores skip the read-for-ownership of each output line and leave the
/// cache to the inputs (which a two-pass kernel reads again), but only pay off when the working
/// set cannot stay in the last-level cache anyway. float32 only (fp16/bf16 store lane by lane).
template <class T>
bool stream_output(int64_t working_set_bytes) {
  return std::is_same_v<T, float> && working_set_bytes >= last_level_cache_bytes();
}

/// dst[j] = value(j) for j < h. stream: streaming stores straight from registers (the caller
/// ends the batch with stream_fence()). pf1/pf2 (may be null): inputs the caller reads next
/// (kAheadBytes on), prefetched one vector per vector written, so that their memory reads
/// overlap this row's arithmetic and writes instead of following them.
template <class T, class Value>
inline void write_row(T* dst, int64_t h, bool stream, const T* pf1, const T* pf2, Value value) {
  constexpr int64_t L = vf::L;
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (stream)
      for (; j < h && (reinterpret_cast<uintptr_t>(dst + j) & 63) != 0; ++j)
        dst[j] = value(j, 0.0f);
  }
  for (; j + L <= h; j += L) {
    if (pf1) __builtin_prefetch(pf1 + j, 0, 2);
    if (pf2) __builtin_prefetch(pf2 + j, 0, 2);
    const vf v = value(j, vf{});
    if constexpr (std::is_same_v<T, float>) {
      if (stream) {
        vstream(dst + j, v);
        continue;
      }
    }
    store_as(dst + j, v);
  }
  for (; j < h; ++j) store_as(dst + j, value(j, 0.0f));
}

}  // namespace tpnorm::kernels::cpu
