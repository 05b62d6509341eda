// C++ core of the C-MLFQ causal prefix tree (areal_libra/cmlfq/tree.py is the wrapper;
// areal_libra/cmlfq/_pytree.py is the pure-Python fallback and must give identical results).
//
// A global root plus one root per prompt id; a node per ordered sequence of tool-return state ids.
// Each node keeps the total sample count and a ring buffer of the last `window` remaining lengths
// (mean = sum / n, quantiles nearest-rank on the sorted window, cached until the next insert).
// Every operation advances a tick and stamps the nodes it walks; when the node count passes
// max_nodes, whole subtrees are evicted in (tick, serial) order down to 90% of the cap.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

struct Node {
  int64_t serial = 0;
  int32_t parent = -1;
  int32_t state = -1;
  int32_t depth = 0;
  bool alive = false;
  bool is_prompt_root = false;
  std::string prompt;
  std::vector<std::pair<int32_t, int32_t>> children;  // (state id, node index); few per node
  int64_t count = 0;
  std::vector<int64_t> ring;  // capacity = window
  int32_t head = 0;           // index of the oldest sample once the ring is full
  int64_t wsum = 0;
  int64_t tick = 0;
  std::vector<int64_t> sorted;  // cached sorted window and its prefix sums, rebuilt after an insert
  std::vector<int64_t> prefix;
  bool sorted_ok = false;

  int32_t child(int32_t s) const {
    for (const auto& c : children)
      if (c.first == s) return c.second;
    return -1;
  }
};

class TreeCore {
 public:
  TreeCore(int min_samples, int window, int64_t max_nodes)
      : min_samples_(min_samples), window_(window), max_nodes_(max_nodes) {
    if (window < 1 || min_samples < 1 || max_nodes < 2)
      throw std::invalid_argument("need window >= 1, min_samples >= 1, max_nodes >= 2");
    clear();
  }

  void clear() {
    nodes_.clear();
    free_.clear();
    prompts_.clear();
    alive_ = 0;
    tick_ = 0;
    serial_ = 0;
    root_ = new_node(-1, -1, nullptr);
  }

  int64_t node_count() const { return alive_; }

  void insert(const std::string& prompt, const std::vector<int32_t>& states,
              const std::vector<int64_t>& remaining) {
    if (remaining.size() != states.size() + 1)
      throw std::invalid_argument("remaining must have one more entry than states");
    ++tick_;
    insert_path(root_, states, remaining);
    auto it = prompts_.find(prompt);
    int32_t proot;
    if (it == prompts_.end()) {
      proot = new_node(-1, -1, &prompt);
      prompts_.emplace(prompt, proot);
    } else {
      proot = it->second;
    }
    insert_path(proot, states, remaining);
    if (alive_ > max_nodes_) evict();
  }

  struct Result {
    double mean = 0.0;
    int64_t p90 = 0, count = 0, pq = 0;
    int32_t depth = 0;
    bool from_global = true;
  };

  Result lookup_stats(const std::string& prompt, const std::vector<int32_t>& states, double q,
                      const std::vector<int64_t>& floors, bool prompt_first) {
    ++tick_;
    int32_t g = walk(root_, states);
    int32_t p = -1;
    auto it = prompts_.find(prompt);
    if (it != prompts_.end()) p = walk(it->second, states);
    Result res;
    int32_t n;
    if (p >= 0 && (prompt_first || g < 0 || nodes_[p].depth >= nodes_[g].depth)) {
      n = p;
      res.from_global = false;
    } else {
      n = g >= 0 ? g : root_;
    }
    Node& node = nodes_[n];
    res.count = node.count;
    res.depth = node.depth;
    const int64_t w = static_cast<int64_t>(node.ring.size());
    if (w > 0) {
      if (!node.sorted_ok) {
        node.sorted = node.ring;
        std::sort(node.sorted.begin(), node.sorted.end());
        node.prefix.assign(w + 1, 0);
        for (int64_t k = 0; k < w; ++k) node.prefix[k + 1] = node.prefix[k] + node.sorted[k];
        node.sorted_ok = true;
      }
      const int64_t floor = static_cast<size_t>(node.depth) < floors.size() ? floors[node.depth] : 0;
      const int64_t lo =
          floor > 0 ? std::lower_bound(node.sorted.begin(), node.sorted.end(), floor) - node.sorted.begin() : 0;
      const int64_t m = w - lo;
      if (m == 0) {
        res.mean = static_cast<double>(floor);
        res.pq = res.p90 = floor;
      } else {
        res.mean = static_cast<double>(node.prefix[w] - node.prefix[lo]) / static_cast<double>(m);
        int64_t r = static_cast<int64_t>(std::ceil(q * static_cast<double>(m))) - 1;
        r = std::min<int64_t>(m - 1, std::max<int64_t>(0, r));
        res.pq = node.sorted[lo + r];
        res.p90 = node.sorted[lo + (9 * m + 9) / 10 - 1];
      }
    }
    return res;
  }

  // floors[d]: how far the trajectory has grown past its decision point at depth d; the statistics of
  // the chosen node are taken over its window samples >= floors[depth] (empty floors: no conditioning).
  // prompt_first: the prompt's deepest trusted node wins even when the global subtree matches deeper.
  py::tuple lookup(const std::string& prompt, const std::vector<int32_t>& states, double q,
                   const std::vector<int64_t>& floors, bool prompt_first) {
    Result r = lookup_stats(prompt, states, q, floors, prompt_first);
    return py::make_tuple(r.mean, r.p90, r.count, r.depth, r.from_global, r.pq);
  }

  // The C-MLFQ bucket rule (areal_libra/cmlfq/policy.py documents it; _pytree.py mirrors it).
  void set_rule(const std::vector<double>& thresholds, bool use_mean, double q, double move_cost, bool overrun,
                bool condition, bool prompt_first) {
    if (thresholds.empty()) throw std::invalid_argument("need at least one bucket threshold");
    th_ = thresholds;
    use_mean_ = use_mean;
    q_ = q;
    move_cost_ = move_cost;
    overrun_ = overrun;
    condition_ = condition;
    prompt_first_ = prompt_first;
  }

  static int bucket_of(const std::vector<double>& th, double x) {
    auto it = std::lower_bound(th.begin(), th.end(), x);
    return std::min<int>(static_cast<int>(it - th.begin()), static_cast<int>(th.size()) - 1);
  }

  // scale != 1: the request's remaining lengths are `scale` times the tree's (the policy's drift and growth
  // switches): its contexts (rounded half to even, as Python's round) and the thresholds are divided by it,
  // so the rule runs in the tree's units.
  py::tuple decide(const std::string& prompt, const std::vector<int32_t>& ids, int64_t ctx,
                   const std::vector<int64_t>& dctx_in, int current, bool placing, double scale) {
    if (th_.empty()) throw std::invalid_argument("set_rule() first");
    if (!(scale > 0)) throw std::invalid_argument("scale must be > 0");
    std::vector<double> scaled;
    if (scale != 1.0) {
      scaled.resize(th_.size());
      for (size_t i = 0; i < th_.size(); ++i) scaled[i] = th_[i] / scale;
    }
    const std::vector<double>& th = scale != 1.0 ? scaled : th_;
    std::vector<int64_t> dctx_scaled;
    if (scale != 1.0) {
      ctx = static_cast<int64_t>(std::nearbyint(static_cast<double>(ctx) / scale));
      dctx_scaled.resize(dctx_in.size());
      for (size_t i = 0; i < dctx_in.size(); ++i)
        dctx_scaled[i] = static_cast<int64_t>(std::nearbyint(static_cast<double>(dctx_in[i]) / scale));
    }
    const std::vector<int64_t>& dctx = scale != 1.0 ? dctx_scaled : dctx_in;
    current = std::max(0, std::min(current, static_cast<int>(th.size()) - 1));
    const bool cond = condition_ && dctx.size() == ids.size() + 1;
    std::vector<int64_t> floors;
    if (cond) {
      floors.resize(dctx.size());
      for (size_t i = 0; i < dctx.size(); ++i) floors[i] = ctx - dctx[i];
    }
    Result r = lookup_stats(prompt, ids, use_mean_ ? 0.5 : q_, floors, prompt_first_ && cond);
    if (r.count == 0) return py::make_tuple(current, r.from_global);
    // Predicted final length = context at the node's decision point + its remaining length.
    const double base = static_cast<double>(cond ? dctx[r.depth] : ctx);
    const int b_center = bucket_of(th, base + (use_mean_ ? r.mean : static_cast<double>(r.pq)));
    if (placing) return py::make_tuple(b_center, r.from_global);
    int target = current;
    if (b_center == bucket_of(th, base + static_cast<double>(r.p90)))
      target = b_center;
    else if (overrun_ && static_cast<double>(ctx) > th[current])
      target = b_center;
    if (target != current && move_cost_ > 0 &&
        (base + r.mean) - static_cast<double>(ctx) < move_cost_ * static_cast<double>(ctx))
      target = current;
    return py::make_tuple(target, r.from_global);
  }

  int64_t lookup_raw(const std::string& prompt, const std::vector<int32_t>& states, double q,
                     const std::vector<int64_t>& floors, bool prompt_first) {
    Result r = lookup_stats(prompt, states, q, floors, prompt_first);
    return r.p90 + r.pq + r.count;
  }

  // Benchmark helper: median wall time (ns) of `repeat` passes over the queries, per lookup, measured in
  // C++ so that the Python call overhead is not part of the figure.
  double time_lookups(const std::vector<std::string>& prompts, const std::vector<std::vector<int32_t>>& states,
                      const std::vector<std::vector<int64_t>>& floors, double q, bool prompt_first, int repeat) {
    if (prompts.size() != states.size() || prompts.size() != floors.size() || prompts.empty())
      throw std::invalid_argument("prompts, states and floors must be non-empty and of equal length");
    std::vector<double> per;
    volatile int64_t sink = 0;
    for (int r = 0; r < repeat; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < prompts.size(); ++i) sink = sink + lookup_raw(prompts[i], states[i], q, floors[i], prompt_first);
      auto t1 = std::chrono::steady_clock::now();
      per.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(prompts.size()));
    }
    std::sort(per.begin(), per.end());
    return per[per.size() / 2];
  }

  py::dict dump() const {
    std::vector<int32_t> order;
    for (int32_t i = 0; i < static_cast<int32_t>(nodes_.size()); ++i)
      if (nodes_[i].alive) order.push_back(i);
    std::sort(order.begin(), order.end(),
              [&](int32_t a, int32_t b) { return nodes_[a].serial < nodes_[b].serial; });
    py::list recs;
    for (int32_t i : order) {
      const Node& n = nodes_[i];
      py::list win;
      const size_t sz = n.ring.size();
      for (size_t k = 0; k < sz; ++k) win.append(n.ring[(n.head + k) % sz]);
      py::object prompt = n.is_prompt_root ? py::object(py::str(n.prompt)) : py::object(py::none());
      int64_t parent = n.parent >= 0 ? nodes_[n.parent].serial : -1;
      py::list rec;
      rec.append(n.serial);
      rec.append(parent);
      rec.append(n.state);
      rec.append(prompt);
      rec.append(n.count);
      rec.append(win);
      rec.append(n.tick);
      recs.append(rec);
    }
    py::dict d;
    d["tick"] = tick_;
    d["serial"] = serial_;
    d["nodes"] = recs;
    return d;
  }

  void restore(const py::dict& d) {
    nodes_.clear();
    free_.clear();
    prompts_.clear();
    alive_ = 0;
    root_ = -1;
    std::unordered_map<int64_t, int32_t> by_serial;
    for (auto item : d["nodes"].cast<py::list>()) {
      auto rec = item.cast<py::sequence>();
      if (rec.size() != 7) throw std::invalid_argument("node record must have 7 fields");
      int64_t serial = rec[0].cast<int64_t>();
      int64_t parent = rec[1].cast<int64_t>();
      int32_t state = rec[2].cast<int32_t>();
      int32_t par = -1;
      if (parent >= 0) {
        auto it = by_serial.find(parent);
        if (it == by_serial.end()) throw std::invalid_argument("node record before its parent");
        par = it->second;
      }
      std::string prompt;
      bool is_prompt = !rec[3].is_none();
      if (is_prompt) prompt = rec[3].cast<std::string>();
      int32_t idx = new_node(par, state, is_prompt ? &prompt : nullptr);
      Node& n = nodes_[idx];
      n.serial = serial;
      n.count = rec[4].cast<int64_t>();
      auto win = rec[5].cast<std::vector<int64_t>>();
      size_t start = win.size() > static_cast<size_t>(window_) ? win.size() - window_ : 0;
      for (size_t k = start; k < win.size(); ++k) {
        n.ring.push_back(win[k]);
        n.wsum += win[k];
      }
      n.tick = rec[6].cast<int64_t>();
      by_serial[serial] = idx;
      if (par >= 0) {
        nodes_[par].children.emplace_back(state, idx);
      } else if (is_prompt) {
        prompts_[prompt] = idx;
      } else {
        root_ = idx;
      }
    }
    if (root_ < 0) throw std::invalid_argument("tree has no global root");
    tick_ = d["tick"].cast<int64_t>();
    serial_ = d["serial"].cast<int64_t>();
  }

 private:
  int32_t new_node(int32_t parent, int32_t state, const std::string* prompt) {
    int32_t idx;
    if (!free_.empty()) {
      idx = free_.back();
      free_.pop_back();
      nodes_[idx] = Node();
    } else {
      idx = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
    }
    Node& n = nodes_[idx];
    n.serial = serial_++;
    n.parent = parent;
    n.state = state;
    n.depth = parent >= 0 ? nodes_[parent].depth + 1 : 0;
    n.alive = true;
    if (prompt != nullptr) {
      n.is_prompt_root = true;
      n.prompt = *prompt;
    }
    n.ring.reserve(std::min(window_, 16));
    ++alive_;
    return idx;
  }

  void add(Node& n, int64_t v) {
    if (static_cast<int>(n.ring.size()) < window_) {
      n.ring.push_back(v);
    } else {
      n.wsum -= n.ring[n.head];
      n.ring[n.head] = v;
      n.head = (n.head + 1) % window_;
    }
    n.wsum += v;
    n.count += 1;
    n.sorted_ok = false;
  }

  void insert_path(int32_t node, const std::vector<int32_t>& states, const std::vector<int64_t>& remaining) {
    nodes_[node].tick = tick_;
    add(nodes_[node], remaining[0]);
    for (size_t i = 0; i < states.size(); ++i) {
      int32_t c = nodes_[node].child(states[i]);
      if (c < 0) {
        c = new_node(node, states[i], nullptr);  // may reallocate nodes_: index, not reference
        nodes_[node].children.emplace_back(states[i], c);
      }
      node = c;
      nodes_[node].tick = tick_;
      add(nodes_[node], remaining[i + 1]);
    }
  }

  int32_t walk(int32_t node, const std::vector<int32_t>& states) {
    nodes_[node].tick = tick_;
    int32_t best = nodes_[node].count >= min_samples_ ? node : -1;
    for (int32_t s : states) {
      node = nodes_[node].child(s);
      if (node < 0) break;
      nodes_[node].tick = tick_;
      if (nodes_[node].count >= min_samples_) best = node;
    }
    return best;
  }

  void drop(int32_t idx) {
    Node& top = nodes_[idx];
    if (top.parent >= 0) {
      auto& ch = nodes_[top.parent].children;
      for (size_t k = 0; k < ch.size(); ++k)
        if (ch[k].second == idx) {
          ch.erase(ch.begin() + k);
          break;
        }
    } else if (top.is_prompt_root) {
      prompts_.erase(top.prompt);
    }
    std::vector<int32_t> stack{idx};
    while (!stack.empty()) {
      int32_t i = stack.back();
      stack.pop_back();
      for (const auto& c : nodes_[i].children) stack.push_back(c.second);
      nodes_[i] = Node();  // frees the ring and children
      free_.push_back(i);
      --alive_;
    }
  }

  void evict() {
    const int64_t low = max_nodes_ * 9 / 10;
    std::vector<int32_t> order;
    order.reserve(alive_);
    for (int32_t i = 0; i < static_cast<int32_t>(nodes_.size()); ++i)
      if (nodes_[i].alive && i != root_) order.push_back(i);
    std::vector<std::pair<std::pair<int64_t, int64_t>, int32_t>> keyed;
    keyed.reserve(order.size());
    for (int32_t i : order) keyed.push_back({{nodes_[i].tick, nodes_[i].serial}, i});
    std::sort(keyed.begin(), keyed.end());
    // A dropped slot can be reused only by a later insert, never during this loop, so the serial
    // check below tells a still-alive node from a freed one.
    for (const auto& k : keyed) {
      if (alive_ <= low) break;
      const Node& n = nodes_[k.second];
      if (n.alive && n.serial == k.first.second) drop(k.second);
    }
  }

  std::vector<double> th_;
  bool use_mean_ = true;
  double q_ = 0.5;
  double move_cost_ = 0.0;
  bool overrun_ = false;
  bool condition_ = true;
  bool prompt_first_ = true;
  int min_samples_;
  int window_;
  int64_t max_nodes_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;
  std::unordered_map<std::string, int32_t> prompts_;
  int32_t root_ = -1;
  int64_t alive_ = 0;
  int64_t tick_ = 0;
  int64_t serial_ = 0;
};

}  // namespace

PYBIND11_MODULE(_prefix_tree, m) {
  m.doc() = "C++ core of the C-MLFQ causal prefix tree (see areal_libra/cmlfq/tree.py)";
  py::class_<TreeCore>(m, "TreeCore")
      .def(py::init<int, int, int64_t>(), py::arg("min_samples"), py::arg("window"), py::arg("max_nodes"))
      .def("clear", &TreeCore::clear)
      .def("node_count", &TreeCore::node_count)
      .def("insert", &TreeCore::insert, py::arg("prompt"), py::arg("states"), py::arg("remaining"))
      .def("lookup", &TreeCore::lookup, py::arg("prompt"), py::arg("states"), py::arg("q") = 0.5,
           py::arg("floors") = std::vector<int64_t>(), py::arg("prompt_first") = false)
      .def("time_lookups", &TreeCore::time_lookups, py::arg("prompts"), py::arg("states"), py::arg("floors"),
           py::arg("q") = 0.5, py::arg("prompt_first") = false, py::arg("repeat") = 5)
      .def("set_rule", &TreeCore::set_rule, py::arg("thresholds"), py::arg("use_mean"), py::arg("q"),
           py::arg("move_cost"), py::arg("overrun"), py::arg("condition"), py::arg("prompt_first"))
      .def("decide", &TreeCore::decide, py::arg("prompt"), py::arg("ids"), py::arg("ctx"), py::arg("dctx"),
           py::arg("current"), py::arg("placing"), py::arg("scale") = 1.0)
      .def("dump", &TreeCore::dump)
      .def("restore", &TreeCore::restore);
}
