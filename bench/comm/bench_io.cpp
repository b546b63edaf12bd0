// bench_io.cpp — see bench_io.h.
#include "bench_io.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>

namespace tpnorm_bench {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Series::at(double q) const {
  if (v.empty()) return 0;
  std::vector<double> s = v;
  std::sort(s.begin(), s.end());
  return s[static_cast<size_t>(q * (s.size() - 1) + 0.5)];
}

double bare_allreduce_s(tpnorm::Communicator& c, const std::vector<size_t>& values,
                        tpnorm::DType wire, int iters) {
  size_t most = 1;
  for (size_t n : values) most = std::max(most, n);
  std::vector<double> buf(most, 0.0);  // 8 bytes per value: room for any wire dtype
  Series s;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t = now_s();
    for (size_t n : values) c.all_reduce_sum(buf.data(), n, wire);
    t = now_s() - t;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    s.v.push_back(t);
  }
  return s.at(0.5);
}

namespace {

double bare_allgather_s(size_t bytes_per_rank, int iters) {
  int P = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  std::vector<char> mine(bytes_per_rank, 1), all(bytes_per_rank * P);
  Series s;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t = now_s();
    MPI_Allgather(mine.data(), static_cast<int>(bytes_per_rank), MPI_BYTE, all.data(),
                  static_cast<int>(bytes_per_rank), MPI_BYTE, MPI_COMM_WORLD);
    t = now_s() - t;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    s.v.push_back(t);
  }
  return s.at(0.5);
}

// One way across a link: rank 2k sends `bytes` to rank 2k+1 (a last rank of an odd world
// waits). One way, because over TCP a shaped link gives each direction its rate only while
// the other is idle: with both busy, the acknowledgements queue behind the data and each
// direction reaches about half (see docs/benchmark.md, "Against a known link").
double bare_one_way_s(size_t bytes, int iters) {
  int P = 1, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  std::vector<char> buf(bytes, 1);
  Series s;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t = now_s();
    if (r % 2 == 0 && r + 1 < P)
      MPI_Send(buf.data(), static_cast<int>(bytes), MPI_BYTE, r + 1, 0, MPI_COMM_WORLD);
    else if (r % 2 == 1)
      MPI_Recv(buf.data(), static_cast<int>(bytes), MPI_BYTE, r - 1, 0, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
    t = now_s() - t;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    s.v.push_back(t);
  }
  return s.at(0.5);
}

}  // namespace

Fits fit_here(tpnorm::Communicator& c, int iters, bool with_allgather) {
  Fits f;
  std::vector<std::pair<double, double>> ar, ag;
  for (size_t bytes = 64; bytes <= (1u << 20); bytes *= 4)
    ar.push_back({static_cast<double>(bytes),
                  bare_allreduce_s(c, {bytes / sizeof(double)}, tpnorm::DType::F64, iters)});
  f.allreduce = fit_allreduce_link(c.size(), ar);
  std::vector<std::pair<double, double>> steps;
  for (size_t bytes = 1u << 18; bytes <= (4u << 20); bytes *= 2)
    steps.push_back({static_cast<double>(bytes), bare_one_way_s(bytes, iters)});
  f.beta_bw = fit_line(steps).second;
  if (with_allgather) {
    for (size_t bytes = 64; bytes <= (1u << 18); bytes *= 4)
      ag.push_back({static_cast<double>(bytes), bare_allgather_s(bytes, iters)});
    f.allgather = fit_allgather_link(c.size(), ag);
  }
  return f;
}

std::string fmt(double v, const char* f) {
  char b[48];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

void print_heading(const std::vector<Field>& row) {
  std::string line = "#";
  bool first = true;
  for (const Field& f : row) {
    if (f.width == 0) continue;
    const int w = first ? (f.width > 0 ? f.width - 1 : f.width + 1) : f.width;
    char b[64];
    std::snprintf(b, sizeof b, "%s%*s", first ? "" : " ", w, f.heading);
    line += b;
    first = false;
  }
  std::printf("%s\n", line.c_str());
}

std::FILE* open_append(const std::string& path) {
  std::FILE* out = std::fopen(path.c_str(), "a");
  if (!out) {
    std::fprintf(stderr, "tpnorm_bench: cannot write %s\n", path.c_str());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return out;
}

void write_row(const std::vector<Field>& row, const std::string& csv, const std::string& json) {
  bool first = true;
  for (const Field& f : row) {
    if (f.width == 0) continue;
    std::printf("%s%*s", first ? "" : " ", f.width, f.value.c_str());
    first = false;
  }
  std::printf("\n");
  if (!csv.empty()) {
    std::FILE* out = open_append(csv);
    if (std::ftell(out) == 0)
      for (size_t i = 0; i < row.size(); ++i)
        std::fprintf(out, "%s%s", row[i].name, i + 1 < row.size() ? "," : "\n");
    for (size_t i = 0; i < row.size(); ++i)
      std::fprintf(out, "%s%s", row[i].value.c_str(), i + 1 < row.size() ? "," : "\n");
    std::fclose(out);
  }
  if (!json.empty()) {  // one object per line; the launcher wraps the lines in a list
    std::FILE* out = open_append(json);
    for (size_t i = 0; i < row.size(); ++i)
      std::fprintf(out, "%s\"%s\": %s%s%s%s", i ? ", " : "{", row[i].name, row[i].text ? "\"" : "",
                   row[i].value.c_str(), row[i].text ? "\"" : "", i + 1 < row.size() ? "" : "}\n");
    std::fclose(out);
  }
}

}  // namespace tpnorm_bench
