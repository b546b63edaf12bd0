// micro_peers.cpp — the peers table's problems (peers.h), tpnorm's result on them, the check of
// a peer's output, and the flags of tpnorm_micro that serve bench/cpu/peers.py (--peers, read by
// micro_main.cpp, registers the peers' benchmarks next to tpnorm's; without it only tpnorm's run):
//   --peers_info           prints one line per peer library: LIB<TAB>its version, or why it is
//                          not in this build; then exits
//   --peers_ref=DIR        writes tpnorm's result on every problem that --peers_filter=REGEX
//   [--peers_filter=REGEX]  matches (on "OP/PASS/SHAPE") into DIR, for peers_torch.py, and
//                          DIR/manifest.txt listing them (a line per output: problem, layout,
//                          output, file, values, sampling); then exits
// A reference file holds one output as raw float32. Outputs of the input's size are sampled:
// kRuns runs of kRunLen contiguous values at offsets i * (n - len) / (kRuns - 1) (so the first
// and the last value, and the middle one where two threads split the work, are in it); the
// per-row and per-channel outputs are written whole. oneDNN (in this binary) is checked on
// every value.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <regex>
#include <stdexcept>

#include "peers.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/norm.h"

namespace tpnorm_perf {

constexpr int64_t kRuns = 257, kRunLen = 1024;

std::string Problem::shape() const {
  std::string s = std::to_string(dims[0]);
  for (size_t i = 1; i < dims.size(); ++i) s += "x" + std::to_string(dims[i]);
  return s;
}
int64_t Problem::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}
int64_t Problem::channels() const { return layout == "NCHW" ? dims[1] : dims.back(); }
int64_t Problem::bytes() const {
  return (backward() ? 3 : 2) * numel() * static_cast<int64_t>(sizeof(float));
}
std::string Problem::tpnorm_name(int threads) const {
  return op + "/" + pass + "/" + shape() + "/threads:" + std::to_string(threads);
}

const std::vector<Problem>& peer_problems() {
  static const std::vector<Problem> v = [] {
    std::vector<Problem> p;
    for (const char* op : {"LayerNorm", "RMSNorm"})
      for (std::vector<int64_t> d : {std::vector<int64_t>{16384, 4096}, {65536, 1024}, {4096, 512}})
        for (const char* pass : {"forward", "backward"}) p.push_back({op, pass, "rows", d});
    for (const char* layout : {"NCHW", "NHWC"})
      for (const char* pass : {"forward", "backward"})
        p.push_back({"SyncBN", pass, layout,
                     std::string(layout) == "NCHW" ? std::vector<int64_t>{32, 64, 56, 56}
                                                   : std::vector<int64_t>{32, 56, 56, 64}});
    return p;
  }();
  return v;
}

PeerInputs::PeerInputs(const Problem& p) {
  fill_inputs(p.numel(), x, dy);
  const int64_t c = p.op == "SyncBN" ? p.channels() : p.h();
  gamma.resize(c);
  beta.resize(c);
  for (int64_t i = 0; i < c; ++i) {
    gamma[i] = 1.0f + static_cast<float>((i * 7) & 15) / 32.0f;
    beta[i] = static_cast<float>((i * 5) & 7) / 8.0f - 0.5f;
  }
}

const Floats& PeerResult::get(const std::string& name) const {
  for (const auto& [k, v] : out)
    if (k == name) return v;
  throw std::runtime_error("no output " + name);
}

PeerResult tpnorm_result(const Problem& p, const PeerInputs& in, int threads) {
  using tpnorm::Shape;
  using tpnorm::view;
  auto comm = tpnorm::make_single_communicator();
  PeerResult r;
  const int64_t n = p.numel();
  Floats y(n), dx(n);
  if (p.op != "SyncBN") {
    const bool ln = p.op == "LayerNorm";
    const Shape s{p.rows(), p.h()}, hs{p.h()}, rs{p.rows()};
    Floats mean(p.rows()), rstd(p.rows()), dgamma(p.h()), dbeta(p.h());
    tpnorm::NormOptions o;
    o.eps = kPeerEps;
    o.num_threads = threads;
    if (ln)
      tpnorm::layer_norm_forward(*comm, view(in.x.data(), s), view(in.gamma.data(), hs),
                                 view(in.beta.data(), hs), view(y.data(), s), view(mean.data(), rs),
                                 view(rstd.data(), rs), o);
    else
      tpnorm::rms_norm_forward(*comm, view(in.x.data(), s), view(in.gamma.data(), hs),
                               view(y.data(), s), view(rstd.data(), rs), o);
    if (!p.backward()) {
      r.out.push_back({"y", std::move(y)});
      if (ln) r.out.push_back({"mean", mean});
      r.out.push_back({"rstd", rstd});
      return r;
    }
    if (ln)
      tpnorm::layer_norm_backward(*comm, view(in.dy.data(), s), view(in.x.data(), s),
                                  view(in.gamma.data(), hs), view(mean.data(), rs),
                                  view(rstd.data(), rs), view(dx.data(), s),
                                  view(dgamma.data(), hs), view(dbeta.data(), hs), o);
    else
      tpnorm::rms_norm_backward(*comm, view(in.dy.data(), s), view(in.x.data(), s),
                                view(in.gamma.data(), hs), view(rstd.data(), rs),
                                view(dx.data(), s), view(dgamma.data(), hs), o);
    r.out.push_back({"dx", std::move(dx)});
    r.out.push_back({"dgamma", std::move(dgamma)});
    if (ln) r.out.push_back({"dbeta", std::move(dbeta)});
    if (ln) r.out.push_back({"mean", std::move(mean)});
    r.out.push_back({"rstd", std::move(rstd)});
    return r;
  }
  const int64_t c = p.channels();
  const Shape xs{p.dims[0], p.dims[1], p.dims[2], p.dims[3]}, cs{c};
  Floats rm(c, 0.0f), rv(c, 1.0f), mean(c), invstd(c), dgamma(c), dbeta(c);
  tpnorm::BatchNormOptions o;
  o.eps = kPeerEps;
  o.num_threads = threads;
  o.layout = p.layout == "NCHW" ? tpnorm::Layout::kNCHW : tpnorm::Layout::kChannelsLast;
  tpnorm::sync_batch_norm_forward(*comm, view(in.x.data(), xs), view(in.gamma.data(), cs),
                                  view(in.beta.data(), cs), view(rm.data(), cs),
                                  view(rv.data(), cs), nullptr, view(y.data(), xs),
                                  view(mean.data(), cs), view(invstd.data(), cs), o);
  if (!p.backward()) {
    r.out.push_back({"y", std::move(y)});
    r.out.push_back({"mean", std::move(mean)});
    r.out.push_back({"invstd", std::move(invstd)});
    return r;
  }
  tpnorm::sync_batch_norm_backward(*comm, view(in.dy.data(), xs), view(in.x.data(), xs),
                                   view(in.gamma.data(), cs), view(mean.data(), cs),
                                   view(invstd.data(), cs), view(dx.data(), xs),
                                   view(dgamma.data(), cs), view(dbeta.data(), cs), o);
  r.out.push_back({"dx", std::move(dx)});
  r.out.push_back({"dgamma", std::move(dgamma)});
  r.out.push_back({"dbeta", std::move(dbeta)});
  r.out.push_back({"mean", std::move(mean)});
  r.out.push_back({"invstd", std::move(invstd)});
  return r;
}

std::string compare(const std::string& name, const float* got, const Floats& ref) {
  double scale = 1, worst = 0;
  int64_t at = 0;
  for (float v : ref) scale = std::max(scale, std::fabs(static_cast<double>(v)));
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(d <= worst)) {  // NaN counts as the worst
      worst = std::isnan(d) ? INFINITY : d;
      at = static_cast<int64_t>(i);
    }
  }
  if (worst <= kPeerTol * scale) return "";
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s: max |peer - tpnorm| = %.3g at [%lld] (peer %.6g, tpnorm %.6g), "
                "tolerance %.3g", name.c_str(), worst, static_cast<long long>(at),
                static_cast<double>(got[at]), static_cast<double>(ref[at]), kPeerTol * scale);
  return buf;
}

namespace {

std::vector<std::pair<std::string, std::string>>& infos() {
  static std::vector<std::pair<std::string, std::string>> v;
  return v;
}

// The flag's value when argv[i] is "--NAME=VALUE", else nullptr.
const char* flag(const char* arg, const char* name) {
  const size_t n = std::strlen(name);
  return std::strncmp(arg, name, n) == 0 && arg[n] == '=' ? arg + n + 1 : nullptr;
}

int write_refs(const std::string& dir, const std::string& filter) {
  const std::regex re(filter);
  const std::string manifest = dir + "/manifest.txt";
  std::FILE* m = std::fopen(manifest.c_str(), "w");
  if (!m) {
    std::fprintf(stderr, "tpnorm_micro: cannot write %s\n", manifest.c_str());
    return 1;
  }
  std::fprintf(m, "# problem layout output file n sampled(runs,len or 0)  eps=%g tol=%g\n",
               kPeerEps, kPeerTol);
  for (const Problem& p : peer_problems()) {
    const std::string key = p.op + "/" + p.pass + "/" + p.shape();
    if (!std::regex_search(key, re)) continue;
    const PeerInputs in(p);
    const PeerResult r = tpnorm_result(p, in);
    for (const auto& [name, v] : r.out) {
      std::string file = key + "." + name + ".f32";
      std::replace(file.begin(), file.end(), '/', '_');
      const int64_t n = static_cast<int64_t>(v.size());
      const bool sampled = n == p.numel() && n > kRuns * kRunLen;
      std::FILE* f = std::fopen((dir + "/" + file).c_str(), "wb");
      if (!f) return 1;
      if (sampled) {
        for (int64_t i = 0; i < kRuns; ++i)
          std::fwrite(v.data() + i * (n - kRunLen) / (kRuns - 1), sizeof(float), kRunLen, f);
      } else {
        std::fwrite(v.data(), sizeof(float), v.size(), f);
      }
      std::fclose(f);
      std::fprintf(m, "%s %s %s %s %lld %s\n", key.c_str(), p.layout.c_str(), name.c_str(),
                   file.c_str(),
                   static_cast<long long>(n),
                   sampled ? (std::to_string(kRuns) + "," + std::to_string(kRunLen)).c_str() : "0");
    }
  }
  std::fclose(m);
  return 0;
}

}  // namespace

void add_peer_info(const std::string& lib, const std::string& text) {
  infos().push_back({lib, text});
}

// Handles the peers' flags (above); false when there are none (the benchmarks run).
bool peers_command(int argc, char** argv, int& rc) {
  const char* ref = nullptr;
  std::string filter = ".";
  bool info = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--peers_info") == 0) info = true;
    if (const char* v = flag(argv[i], "--peers_ref")) ref = v;
    if (const char* v = flag(argv[i], "--peers_filter")) filter = v;
  }
  if (info) {
#ifdef TPNORM_PEER_ONEDNN_SKIPPED
    add_peer_info("oneDNN", "skipped: " TPNORM_PEER_ONEDNN_SKIPPED);
#endif
    for (const auto& [lib, text] : infos()) std::printf("%s\t%s\n", lib.c_str(), text.c_str());
    rc = 0;
    return true;
  }
  if (!ref) return false;
  rc = write_refs(ref, filter);
  return true;
}

}  // namespace tpnorm_perf
