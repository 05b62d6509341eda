// Hot path of the planner's rollout DP (areal_libra/planner/rollout_dp.py, RolloutDP.min_gpus):
// for a makespan target T, the fewest servers per (TP, interval) meeting T (binary search down each
// column of the precomputed cost table, monotone in the server count) and the shortest path over the
// length-sorted sample that covers every request with the fewest GPUs.
// Only comparisons and sums of small integers: results are bit-identical to the numpy fallback.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace py = pybind11;

using Table = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Grid = py::array_t<long, py::array::c_style | py::array::forcecast>;

// tables[i]: shape (K_i, M) cost of grids[i][r] servers of TP tps[i] for each interval (flat index
// b(b-1)/2 + a for [a, b)); tps ascending. Returns (gpus, [(a, b, tp, k), ...]) or (inf, None).
py::tuple min_gpus(const std::vector<Table>& tables, const std::vector<Grid>& grids, const std::vector<long>& tps,
                   double T, long n) {
  const long M = n * (n + 1) / 2;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> best_g(M, inf);
  std::vector<long> best_tp(M, 0), best_k(M, 0);
  for (size_t t = 0; t < tables.size(); ++t) {
    auto tab = tables[t].unchecked<2>();
    auto grid = grids[t].unchecked<1>();
    const long K = tab.shape(0);
    if (tab.shape(1) != M) throw std::invalid_argument("table width does not match the interval count");
    if (grid.shape(0) != K) throw std::invalid_argument("grid length does not match the table height");
    const long tp = tps[t];
    for (long j = 0; j < M; ++j) {
      long lo = 0, hi = K;
      while (lo < hi) {
        long mid = (lo + hi) / 2;
        if (tab(mid, j) <= T) hi = mid;
        else lo = mid + 1;
      }
      if (lo >= K) continue;
      const long k = grid(lo);
      double g = static_cast<double>(k * tp);
      if (g < best_g[j]) {  // ties keep the smaller TP (tables come in ascending TP)
        best_g[j] = g;
        best_tp[j] = tp;
        best_k[j] = k;
      }
    }
  }
  std::vector<double> f(n + 1, inf);
  std::vector<long> arg(n + 1, 0);
  f[0] = 0.0;
  for (long b = 1; b <= n; ++b) {
    const long s = b * (b - 1) / 2;
    double best = f[0] + best_g[s];
    long ba = 0;
    for (long a = 1; a < b; ++a) {
      double v = f[a] + best_g[s + a];
      if (v < best) {
        best = v;
        ba = a;
      }
    }
    f[b] = best;
    arg[b] = ba;
  }
  if (!std::isfinite(f[n])) return py::make_tuple(inf, py::none());
  py::list groups;
  std::vector<std::tuple<long, long, long, long>> rev;
  for (long b = n; b > 0;) {
    long a = arg[b];
    long j = b * (b - 1) / 2 + a;
    rev.emplace_back(a, b, best_tp[j], best_k[j]);
    b = a;
  }
  for (auto it = rev.rbegin(); it != rev.rend(); ++it)
    groups.append(py::make_tuple(std::get<0>(*it), std::get<1>(*it), std::get<2>(*it), std::get<3>(*it)));
  return py::make_tuple(f[n], groups);
}

PYBIND11_MODULE(_rollout_dp, m) {
  m.doc() = "Rollout DP probe (fewest GPUs meeting a makespan target) for areal_libra.planner";
  m.attr("API") = 2;  // bumped whenever min_gpus changes; a stale build is ignored by the Python side
  m.def("min_gpus", &min_gpus, py::arg("tables"), py::arg("grids"), py::arg("tps"), py::arg("T"), py::arg("n"));
}
