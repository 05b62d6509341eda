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
#include <list>
#include <memory>
#include <optional>
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

// Typical context growth per prompt and depth (the policy's `growth` switch); mirrors
// areal_libra/cmlfq/drift.py GrowthTable exactly: same sums in the same order, same LRU eviction by last
// update, so both tree cores scale a request by the same factor.
class GrowthCore {
 public:
  explicit GrowthCore(int64_t max_prompts = 100000, int max_depth = 64)
      : max_prompts_(max_prompts), max_depth_(max_depth) {
    if (max_prompts < 1 || max_depth < 1) throw std::invalid_argument("need max_prompts >= 1, max_depth >= 1");
  }

  void clear() {
    by_prompt_.clear();
    order_.clear();
    global_.clear();
  }

  // contexts: the trajectory's context at its start and after each tool return.
  void add(const std::string& prompt, int64_t prompt_tokens, const std::vector<int64_t>& contexts, double scale) {
    auto it = by_prompt_.find(prompt);
    if (it == by_prompt_.end()) {
      if (static_cast<int64_t>(by_prompt_.size()) >= max_prompts_) {
        by_prompt_.erase(order_.front());
        order_.pop_front();
      }
      order_.push_back(prompt);
      it = by_prompt_.emplace(prompt, Entry{Rows(), std::prev(order_.end())}).first;
    } else {
      order_.splice(order_.end(), order_, it->second.pos);  // most recently updated last
    }
    const size_t n = std::min(contexts.size(), static_cast<size_t>(max_depth_) + 1);
    for (size_t d = 1; d < n; ++d) {
      const double v = static_cast<double>(contexts[d] - prompt_tokens) / scale;
      put(it->second.rows, d, v);
      put(global_, d, v);
    }
  }

  // Mean growth at `depth` over the prompt's samples that reached it, else over all prompts; nullptr: none.
  const double* typical_ptr(const std::string& prompt, int64_t depth, double* out) const {
    if (depth < 0) return nullptr;
    auto it = by_prompt_.find(prompt);
    if (it != by_prompt_.end() && static_cast<size_t>(depth) < it->second.rows.size() &&
        it->second.rows[depth].second > 0) {
      *out = it->second.rows[depth].first / static_cast<double>(it->second.rows[depth].second);
      return out;
    }
    if (static_cast<size_t>(depth) < global_.size() && global_[depth].second > 0) {
      *out = global_[depth].first / static_cast<double>(global_[depth].second);
      return out;
    }
    return nullptr;
  }

  std::optional<double> typical(const std::string& prompt, int64_t depth) const {
    double v;
    if (typical_ptr(prompt, depth, &v) == nullptr) return std::nullopt;
    return v;
  }

  int64_t prompt_count() const { return static_cast<int64_t>(by_prompt_.size()); }

 private:
  using Rows = std::vector<std::pair<double, int64_t>>;  // per depth: (sum, count)
  struct Entry {
    Rows rows;
    std::list<std::string>::iterator pos;
  };

  static void put(Rows& rows, size_t depth, double v) {
    if (rows.size() <= depth) rows.resize(depth + 1, {0.0, 0});
    rows[depth].first += v;
    rows[depth].second += 1;
  }

  int64_t max_prompts_;
  int max_depth_;
  std::unordered_map<std::string, Entry> by_prompt_;
  std::list<std::string> order_;  // least recently updated first
  Rows global_;
};

// (grown / typical) ** exponent with the ratio clipped to [1/cap, cap]; 1 when nothing is known
// (drift.py growth_factor).
double growth_factor(double grown, const double* typical, double exponent, double cap = 4.0) {
  if (exponent == 0 || typical == nullptr || *typical <= 0 || grown <= 0) return 1.0;
  return std::pow(std::min(cap, std::max(1.0 / cap, grown / *typical)), exponent);
}

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
    rcache_.clear();
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
  // Whether a move pays for its re-prefill is not the core's business: the policy prices it with the Cost
  // Evaluator (cmlfq/migration.py) from the predicted remaining length the decision returns.
  void set_rule(const std::vector<double>& thresholds, bool use_mean, double q, bool overrun,
                bool condition, bool prompt_first) {
    if (thresholds.empty()) throw std::invalid_argument("need at least one bucket threshold");
    th_ = thresholds;
    use_mean_ = use_mean;
    q_ = q;
    overrun_ = overrun;
    condition_ = condition;
    prompt_first_ = prompt_first;
  }

  static int bucket_of(const std::vector<double>& th, double x) {
    auto it = std::lower_bound(th.begin(), th.end(), x);
    return std::min<int>(static_cast<int>(it - th.begin()), static_cast<int>(th.size()) - 1);
  }

  // The request's multiplier on the tree's remaining lengths (the policy's drift and growth switches),
  // installed once per step boundary: drift level exp(rate * (routed step - ref)) (drift.py LengthDrift),
  // times the growth factor against `growth`'s typical growth at the request's depth (exponent 0: off).
  void set_scaling(bool drift, double rate, bool has_ref, int64_t ref, bool past_ok,
                   std::shared_ptr<GrowthCore> growth, double growth_exp) {
    drift_ = drift;
    rate_ = rate;
    has_ref_ = has_ref;
    ref_ = ref;
    past_ok_ = past_ok;
    growth_ = std::move(growth);
    growth_exp_ = growth_ ? growth_exp : 0.0;
  }

  double scale_of(const std::string& prompt, int64_t step, int64_t depth, int64_t ctx, int64_t prompt_tokens) const {
    double scale = 1.0;
    if (drift_ && has_ref_) {
      // routed step: never one whose outcomes are visible (drift.py routed_step); level(ref) = 1.
      const int64_t routed = (step > ref_ || past_ok_) ? step : ref_ + 1;
      scale = std::exp(rate_ * static_cast<double>(routed - ref_));
    }
    if (growth_exp_ != 0 && depth > 0) {
      double typ;
      const double* t = growth_->typical_ptr(prompt, depth, &typ);
      scale *= growth_factor(static_cast<double>(ctx - prompt_tokens) / scale, t, growth_exp_);
    }
    return scale;
  }

  // One C-MLFQ decision: the request's scale (set_scaling), then the rule in the tree's units: contexts
  // (rounded half to even, as Python's round) and thresholds divided by the scale. depth: the request's
  // tool returns so far (growth is read there; ids may be shorter, e.g. a placement).
  // *remaining: the centre's predicted remaining length (mean remaining past the current context, in the
  // request's own tokens, i.e. times the scale; 0 when nothing is known).
  int decide_bucket(const std::string& prompt, const std::vector<int32_t>& ids, int64_t ctx,
                    const std::vector<int64_t>& dctx_in, int current, bool placing, int64_t step, int64_t depth,
                    int64_t prompt_tokens, bool* from_global, double* remaining) {
    if (th_.empty()) throw std::invalid_argument("set_rule() first");
    const double scale = (drift_ || growth_exp_ != 0) ? scale_of(prompt, step, depth, ctx, prompt_tokens) : 1.0;
    if (!(scale > 0)) throw std::invalid_argument("scale must be > 0");
    const std::vector<double>* thp = &th_;
    const std::vector<int64_t>* dctxp = &dctx_in;
    if (scale != 1.0) {
      scaled_th_.resize(th_.size());
      for (size_t i = 0; i < th_.size(); ++i) scaled_th_[i] = th_[i] / scale;
      thp = &scaled_th_;
      ctx = static_cast<int64_t>(std::nearbyint(static_cast<double>(ctx) / scale));
      scaled_dctx_.resize(dctx_in.size());
      for (size_t i = 0; i < dctx_in.size(); ++i)
        scaled_dctx_[i] = static_cast<int64_t>(std::nearbyint(static_cast<double>(dctx_in[i]) / scale));
      dctxp = &scaled_dctx_;
    }
    const std::vector<double>& th = *thp;
    const std::vector<int64_t>& dctx = *dctxp;
    current = std::max(0, std::min(current, static_cast<int>(th.size()) - 1));
    const bool cond = condition_ && dctx.size() == ids.size() + 1;
    floors_.clear();
    if (cond) {
      floors_.resize(dctx.size());
      for (size_t i = 0; i < dctx.size(); ++i) floors_[i] = ctx - dctx[i];
    }
    Result r = lookup_stats(prompt, ids, use_mean_ ? 0.5 : q_, floors_, prompt_first_ && cond);
    *from_global = r.from_global;
    *remaining = 0.0;
    if (r.count == 0) return current;
    // Predicted final length = context at the node's decision point + its remaining length.
    const double base = static_cast<double>(cond ? dctx[r.depth] : ctx);
    *remaining = std::max(0.0, (base + r.mean) - static_cast<double>(ctx)) * scale;
    const int b_center = bucket_of(th, base + (use_mean_ ? r.mean : static_cast<double>(r.pq)));
    if (placing) return b_center;
    int target = current;
    if (b_center == bucket_of(th, base + static_cast<double>(r.p90)))
      target = b_center;
    else if (overrun_ && static_cast<double>(ctx) > th[current])
      target = b_center;
    return target;
  }

  py::tuple decide(const std::string& prompt, const std::vector<int32_t>& ids, int64_t ctx,
                   const std::vector<int64_t>& dctx, int current, bool placing, int64_t step, int64_t depth,
                   int64_t prompt_tokens) {
    bool from_global = true;
    double remaining = 0.0;
    int b = decide_bucket(prompt, ids, ctx, dctx, current, placing, step, depth, prompt_tokens, &from_global,
                          &remaining);
    return py::make_tuple(b, from_global, remaining);
  }

  // Payload size classes of the return-state cache key (PrefixTree.return_ids' key).
  void set_sizes(int64_t small, int64_t medium) {
    small_ = small;
    medium_ = medium;
    rcache_.clear();
  }

  // Forget the cached return states (the wrapper re-interned its states or changed the state mapping).
  void clear_return_cache() { rcache_.clear(); }

  // resolver() -> the wrapper's mapping tool -> state id (or None once the wrapper is gone): a
  // weakref.WeakMethod, so that the core holds no reference cycle back to its wrapper.
  void set_resolver(py::object resolver) { resolver_ = std::move(resolver); }

  // The per-decision entry point: one call with the policy's RequestInfo. Reads the request's fields,
  // maps its tool returns to state ids through a cache keyed like PrefixTree.return_ids (tool name, size
  // class, raw status; a miss asks `resolve(tool)`, the wrapper's Python mapping, and only known states
  // are cached), then decides as decide() does. placing: a first placement (no tool states looked up).
  py::tuple decide_request(py::handle req, int current, bool placing) {
    static PyObject* const a_prompt = PyUnicode_InternFromString("prompt_id");
    static PyObject* const a_tools = PyUnicode_InternFromString("tool_returns");
    static PyObject* const a_ctx = PyUnicode_InternFromString("context_tokens");
    static PyObject* const a_dctx = PyUnicode_InternFromString("decision_contexts");
    static PyObject* const a_step = PyUnicode_InternFromString("step");
    static PyObject* const a_ptok = PyUnicode_InternFromString("prompt_tokens");
    PyObject* r = req.ptr();
    // The tool states first: a cache miss runs Python (the resolver), so nothing is kept in the scratch
    // buffers across it; after it only plain attribute reads and C++ run until the decision is made.
    py::object tools = attr(r, a_tools);
    py::object tseq = py::reinterpret_steal<py::object>(PySequence_Fast(tools.ptr(), "tool_returns must be a sequence"));
    if (!tseq) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(tseq.ptr());
    const std::vector<int32_t>* ids = &ids_buf_;
    std::vector<int32_t> slow;
    ids_buf_.clear();
    if (!placing) {
      PyObject** items = PySequence_Fast_ITEMS(tseq.ptr());
      for (Py_ssize_t i = 0; i < n; ++i) {
        int32_t id;
        if (cached_id(items[i], &id)) {
          ids_buf_.push_back(id);
          continue;
        }
        slow.assign(ids_buf_.begin(), ids_buf_.end());
        for (Py_ssize_t k = i; k < n; ++k) slow.push_back(return_id(items[k]));
        ids = &slow;
        break;
      }
    }
    py::object prompt = attr(r, a_prompt);
    Py_ssize_t plen = 0;
    const char* pchars = PyUnicode_AsUTF8AndSize(prompt.ptr(), &plen);
    if (pchars == nullptr) throw py::error_already_set();
    prompt_buf_.assign(pchars, static_cast<size_t>(plen));
    const int64_t ctx = as_int(attr(r, a_ctx).ptr());
    const int64_t step = as_int(attr(r, a_step).ptr());
    const int64_t ptok = as_int(attr(r, a_ptok).ptr());
    read_ints(attr(r, a_dctx).ptr(), &dctx_buf_);
    bool from_global = true;
    double remaining = 0.0;
    int b = decide_bucket(prompt_buf_, *ids, ctx, dctx_buf_, current, placing, step, n, ptok, &from_global,
                          &remaining);
    return py::make_tuple(b, from_global, remaining);
  }

  double scale(const std::string& prompt, int64_t step, int64_t depth, int64_t ctx, int64_t prompt_tokens) const {
    return scale_of(prompt, step, depth, ctx, prompt_tokens);
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
    rcache_.clear();
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
  static py::object attr(PyObject* o, PyObject* name) {
    PyObject* v = PyObject_GetAttr(o, name);
    if (v == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(v);
  }

  static int64_t as_int(PyObject* v) {
    const long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
    return static_cast<int64_t>(x);
  }

  static void read_ints(PyObject* seq, std::vector<int64_t>* out) {
    py::object f = py::reinterpret_steal<py::object>(PySequence_Fast(seq, "expected a sequence of ints"));
    if (!f) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(f.ptr());
    PyObject** items = PySequence_Fast_ITEMS(f.ptr());
    out->resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) (*out)[i] = as_int(items[i]);
  }

  // The return-state cache key of a tool return (name, size class, raw status) into *key; false when a
  // field has an unexpected type (then only the resolver can say).
  bool return_key(PyObject* tool, std::string* key) const {
    static PyObject* const a_name = PyUnicode_InternFromString("name");
    static PyObject* const a_payload = PyUnicode_InternFromString("payload_tokens");
    static PyObject* const a_status = PyUnicode_InternFromString("status");
    py::object name = attr(tool, a_name), payload = attr(tool, a_payload), status = attr(tool, a_status);
    if (!PyUnicode_Check(name.ptr()) || !PyUnicode_Check(status.ptr()) || !PyLong_Check(payload.ptr())) return false;
    Py_ssize_t nl = 0, sl = 0;
    int overflow = 0;
    const char* nc = PyUnicode_AsUTF8AndSize(name.ptr(), &nl);
    const char* sc = nc != nullptr ? PyUnicode_AsUTF8AndSize(status.ptr(), &sl) : nullptr;
    const long long p = PyLong_AsLongLongAndOverflow(payload.ptr(), &overflow);
    if (nc == nullptr || sc == nullptr || overflow != 0) {
      PyErr_Clear();  // e.g. a lone surrogate: the resolver decides
      return false;
    }
    const char cls = p <= small_ ? 0 : (p <= medium_ ? 1 : 2);
    const uint32_t len = static_cast<uint32_t>(nl);
    key->clear();
    key->append(reinterpret_cast<const char*>(&len), sizeof(len));
    key->append(nc, static_cast<size_t>(nl));
    key->push_back(cls);
    key->append(sc, static_cast<size_t>(sl));
    return true;
  }

  bool cached_id(PyObject* tool, int32_t* id) {
    if (!return_key(tool, &key_buf_)) return false;
    auto it = rcache_.find(key_buf_);
    if (it == rcache_.end()) return false;
    *id = it->second;
    return true;
  }

  // State id of one tool return, asking the resolver on a cache miss; only known states (id >= 0) are
  // cached (unknown ones may become known).
  int32_t return_id(PyObject* tool) {
    std::string key;
    const bool keyed = return_key(tool, &key);
    if (keyed) {
      auto it = rcache_.find(key);
      if (it != rcache_.end()) return it->second;
    }
    if (!resolver_) throw std::invalid_argument("set_resolver() first");
    py::object resolve = resolver_();
    if (resolve.is_none()) throw std::invalid_argument("the tree wrapper is gone");
    const int32_t id = resolve(py::handle(tool)).cast<int32_t>();
    if (keyed && id >= 0) rcache_.emplace(std::move(key), id);
    return id;
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
  bool overrun_ = false;
  bool condition_ = true;
  bool prompt_first_ = true;
  bool drift_ = false;
  double rate_ = 0.0;
  bool has_ref_ = false;
  int64_t ref_ = 0;
  bool past_ok_ = false;
  std::shared_ptr<GrowthCore> growth_;
  double growth_exp_ = 0.0;
  std::vector<double> scaled_th_;  // per-decision scratch (the core is used under the caller's lock)
  std::vector<int64_t> scaled_dctx_;
  std::vector<int64_t> floors_;
  std::string prompt_buf_, key_buf_;
  std::vector<int32_t> ids_buf_;
  std::vector<int64_t> dctx_buf_;
  int64_t small_ = 500, medium_ = 5000;
  std::unordered_map<std::string, int32_t> rcache_;
  py::object resolver_;
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
  py::class_<GrowthCore, std::shared_ptr<GrowthCore>>(m, "GrowthCore")
      .def(py::init<int64_t, int>(), py::arg("max_prompts") = 100000, py::arg("max_depth") = 64)
      .def("clear", &GrowthCore::clear)
      .def("add", &GrowthCore::add, py::arg("prompt_id"), py::arg("prompt_tokens"), py::arg("contexts"),
           py::arg("scale") = 1.0)
      .def("typical", &GrowthCore::typical, py::arg("prompt_id"), py::arg("depth"))
      .def("prompt_count", &GrowthCore::prompt_count);
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
           py::arg("overrun"), py::arg("condition"), py::arg("prompt_first"))
      .def("set_scaling", &TreeCore::set_scaling, py::arg("drift"), py::arg("rate"), py::arg("has_ref"),
           py::arg("ref"), py::arg("past_ok"), py::arg("growth"), py::arg("growth_exp"))
      .def("scale", &TreeCore::scale, py::arg("prompt"), py::arg("step"), py::arg("depth"), py::arg("ctx"),
           py::arg("prompt_tokens"))
      .def("set_sizes", &TreeCore::set_sizes, py::arg("small"), py::arg("medium"))
      .def("clear_return_cache", &TreeCore::clear_return_cache)
      .def("set_resolver", &TreeCore::set_resolver, py::arg("resolver"))
      .def("decide_request", &TreeCore::decide_request, py::arg("req"), py::arg("current"), py::arg("placing"))
      .def("decide", &TreeCore::decide, py::arg("prompt"), py::arg("ids"), py::arg("ctx"), py::arg("dctx"),
           py::arg("current"), py::arg("placing"), py::arg("step"), py::arg("depth"), py::arg("prompt_tokens"))
      .def("dump", &TreeCore::dump)
      .def("restore", &TreeCore::restore);
}
