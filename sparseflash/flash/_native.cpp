// The native short path of a repeated eager sparseflash.attention call, for its host cost: the
// forward, its autograd node and the backward in C++, launching the Triton kernels that the Python
// short path (sparseflash/flash/fast.py) compiled and bound. Built on first use by native.py.
//
// A Launch is one bound Triton kernel: its CUfunction, grid, block and shared memory, and one
// 8-byte slot per kernel parameter (Triton's order: the non-constexpr arguments, then the global
// and profile scratch pointers), with the slots of the call's tensors ("roles") filled per call.
// A Plan is one fast-path entry: the forward Launch and, per layout of the incoming gradient,
// the dQ and dK/dV Launches. Anything the plan has no launch for (a new dO layout, a stream being
// captured, a misaligned address) goes back to Python: `forward` returns None, the backward
// calls the plan's fallback, a Python callable given with the plan (this module imports nothing
// of the Python side).
//
// Roles: forward (q, k, v, o, lse, key_lengths); backward adds (do, delta, dq, dk, dv).
// No CUDA headers: the driver entry points are looked up in libcuda at first use.

#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <type_traits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    CUstream, void**, void**);
using StreamIsCapturingFn = CUresult (*)(CUstream, int*);
using FuncGetParamInfoFn = CUresult (*)(CUfunction, size_t, size_t*, size_t*);
using GetErrorStringFn = CUresult (*)(CUresult, const char**);

// Messages are built without iostreams: on the H100 image (torch 2.11's wheel, the system's
// g++ 13) an std::ostringstream formatting an integer in this module crashed the process.
// Validation returns its message (make_launch gives it, forward a None and `last_error`); the
// backward, which the autograd engine calls and catches, throws std::runtime_error.
inline std::string piece(const char* s) { return s; }
inline std::string piece(const std::string& s) { return s; }
template <typename T>
std::string piece(T v) {
  static_assert(std::is_integral_v<T>, "message pieces are strings or integers");
  return std::to_string(v);
}
template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  ((s += piece(args)), ...);
  return s;
}
#define SF_REQUIRE(cond, ...) \
  do {                        \
    if (!(cond)) return message(__VA_ARGS__); \
  } while (0)

std::string g_last_error;  // the error of the last forward that returned None for one

constexpr int kMaxParams = 96;
constexpr int kFwdRoles = 6;
constexpr int kBwdRoles = 11;

struct Driver {
  LaunchKernelFn launch = nullptr;
  StreamIsCapturingFn is_capturing = nullptr;
  FuncGetParamInfoFn param_info = nullptr;
  GetErrorStringFn error_string = nullptr;

  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) return;
    launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    is_capturing = reinterpret_cast<StreamIsCapturingFn>(dlsym(lib, "cuStreamIsCapturing"));
    param_info = reinterpret_cast<FuncGetParamInfoFn>(dlsym(lib, "cuFuncGetParamInfo"));
    error_string = reinterpret_cast<GetErrorStringFn>(dlsym(lib, "cuGetErrorString"));
  }

  std::string describe(CUresult err) const {
    const char* s = nullptr;
    if (error_string != nullptr) error_string(err, &s);
    return s != nullptr ? std::string(s) : "CUDA driver error " + std::to_string(err);
  }
};

Driver& driver() {
  static Driver d;
  return d;
}

// Launches with function 0 only count (CPU tests of the plumbing).
std::atomic<int64_t> g_dry_launches{0};

struct Launch {
  uint64_t function = 0;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 0;
  unsigned smem = 0;
  std::vector<uint64_t> slots;  // one per kernel parameter: fixed values, 0 where a role goes
  std::vector<std::pair<int, int>> roles;  // (parameter, role)
  int max_role = -1;

  Launch(uint64_t function_, std::vector<int64_t> grid_, int64_t block_, int64_t smem_, std::vector<uint64_t> slots_,
         std::vector<std::pair<int, int>> roles_)
      : function(function_), block(static_cast<unsigned>(block_)), smem(static_cast<unsigned>(smem_)),
        slots(std::move(slots_)), roles(std::move(roles_)) {
    for (int i = 0; i < 3; ++i) grid[i] = static_cast<unsigned>(grid_[i]);
    for (auto& r : roles) max_role = std::max(max_role, r.second);
  }

  // Why these arguments make no launch ("" when they do): the kernel's own parameter list, where
  // the driver can tell it (CUDA 12.4+), must have the slots' count and sizes.
  static std::string check(uint64_t function, const std::vector<int64_t>& grid, int64_t block,
                           const std::vector<uint64_t>& slots, const std::vector<int64_t>& sizes,
                           const std::vector<std::pair<int, int>>& roles) {
    SF_REQUIRE(grid.size() == 3, "Launch: grid must have 3 entries, got ", grid.size());
    for (int64_t g : grid) SF_REQUIRE(g > 0 && g < (int64_t(1) << 31), "Launch: grid entries must be positive");
    SF_REQUIRE(block > 0 && block <= 1024, "Launch: block must be in [1, 1024], got ", block);
    SF_REQUIRE(slots.size() == sizes.size(), "Launch: ", slots.size(), " slots but ", sizes.size(), " sizes");
    SF_REQUIRE(static_cast<int>(slots.size()) <= kMaxParams, "Launch: more than ", kMaxParams, " parameters");
    for (auto& r : roles) {
      SF_REQUIRE(r.first >= 0 && r.first < static_cast<int>(slots.size()), "Launch: role slot out of range");
      SF_REQUIRE(r.second >= 0 && r.second < kBwdRoles, "Launch: role out of range");
    }
    for (size_t i = 0; i < sizes.size(); ++i)
      SF_REQUIRE(sizes[i] == 1 || sizes[i] == 2 || sizes[i] == 4 || sizes[i] == 8, "Launch: parameter ", i,
                 " has size ", sizes[i]);
    if (function == 0) return "";
    Driver& drv = driver();
    SF_REQUIRE(drv.launch != nullptr, "Launch: cuLaunchKernel not found in libcuda.so.1");
    if (drv.param_info != nullptr) {
      size_t n = 0, offset = 0, size = 0;
      while (n <= sizes.size() && drv.param_info(reinterpret_cast<CUfunction>(function), n, &offset, &size) == 0) {
        SF_REQUIRE(n < sizes.size() && static_cast<int64_t>(size) == sizes[n], "Launch: the kernel's parameter ", n,
                   " has ", size, " bytes, the slots say ",
                   n < sizes.size() ? std::to_string(sizes[n]) : std::string("nothing"));
        ++n;
      }
      SF_REQUIRE(n == sizes.size(), "Launch: the kernel has ", n, " parameters, the slots ", sizes.size());
    }
    return "";
  }

  // "" or the driver's error
  std::string run(const uint64_t* ptrs, CUstream stream) const {
    if (function == 0) {
      g_dry_launches.fetch_add(1);
      return "";
    }
    uint64_t values[kMaxParams];
    void* params[kMaxParams];
    const size_t n = slots.size();
    std::memcpy(values, slots.data(), n * sizeof(uint64_t));
    for (const auto& r : roles) values[r.first] = ptrs[r.second];
    for (size_t i = 0; i < n; ++i) params[i] = &values[i];
    const Driver& drv = driver();
    CUresult err = drv.launch(reinterpret_cast<CUfunction>(function), grid[0], grid[1], grid[2], block, 1, 1, smem,
                              stream, params, nullptr);
    return err == 0 ? std::string() : message("sparseflash native launch failed: ", drv.describe(err));
  }

  // The parameter slots as this call would pass them (tests).
  std::vector<uint64_t> pack(const std::vector<uint64_t>& ptrs) const {
    if (static_cast<int>(ptrs.size()) <= max_role) return {};  // too few role addresses
    std::vector<uint64_t> out = slots;
    for (const auto& r : roles) out[r.first] = ptrs[r.second];
    return out;
  }
};

using LaunchPtr = std::shared_ptr<Launch>;

struct BwdLaunches {
  std::vector<int64_t> do_strides;
  LaunchPtr dq, dkdv;
};

struct Plan {
  int64_t device;    // CUDA device index
  LaunchPtr fwd;
  std::vector<BwdLaunches> bwd;
  at::Tensor rows;   // float32 [B, H, Nq], stride 0: empty_like gives the LSE and delta
  bool has_kl;
  // The Python backward for what the plan has no launch for: fallback(do, q, k, v, o, lse,
  // key_lengths) -> (dq, dk, dv). A raw reference, released under the GIL: a plan's last owner
  // may be an autograd node freed on an engine thread that does not hold it.
  PyObject* fallback;

  Plan(int64_t device_, LaunchPtr fwd_, at::Tensor rows_, bool has_kl_, py::object fallback_)
      : device(device_), fwd(std::move(fwd_)), rows(std::move(rows_)), has_kl(has_kl_),
        fallback(fallback_.release().ptr()) {
    if (fwd != nullptr && fwd->max_role >= kFwdRoles) fwd = nullptr;  // it would read a backward role
  }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  ~Plan() {
    if (fallback != nullptr && Py_IsInitialized()) {  // (after the interpreter is gone: leaked)
      py::gil_scoped_acquire gil;
      Py_DECREF(fallback);
    }
  }

  void add_bwd(std::vector<int64_t> do_strides, LaunchPtr dq, LaunchPtr dkdv) {
    if (dq == nullptr || dkdv == nullptr) return;
    for (auto& b : bwd)
      if (b.do_strides == do_strides) {
        b.dq = std::move(dq);
        b.dkdv = std::move(dkdv);
        return;
      }
    if (bwd.size() >= 8) bwd.erase(bwd.begin());
    bwd.push_back({std::move(do_strides), std::move(dq), std::move(dkdv)});
  }

  const BwdLaunches* find_bwd(at::IntArrayRef strides) const {
    for (const auto& b : bwd)
      if (strides.equals(b.do_strides)) return &b;
    return nullptr;
  }

  int64_t n_bwd() const { return static_cast<int64_t>(bwd.size()); }
};

using PlanPtr = std::shared_ptr<Plan>;

inline uint64_t addr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
}

bool capturing(uint64_t stream) {
  const Driver& drv = driver();
  if (drv.is_capturing == nullptr) return false;
  int status = 0;
  return drv.is_capturing(reinterpret_cast<CUstream>(stream), &status) == 0 && status != 0;
}

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// Autograd nodes are held by std::shared_ptr up to torch 2.12 and by c10::intrusive_ptr after.
using NodePtr = decltype(std::declval<torch::autograd::Edge>().function);
template <class P>
struct NodeMaker;
template <>
struct NodeMaker<std::shared_ptr<torch::autograd::Node>> {
  template <class N>
  static std::shared_ptr<N> make() { return std::make_shared<N>(); }
};
template <>
struct NodeMaker<c10::intrusive_ptr<torch::autograd::Node>> {
  template <class N>
  static c10::intrusive_ptr<N> make() { return c10::make_intrusive<N>(); }
};

struct AttentionBackward : public torch::autograd::Node {
  PlanPtr plan;
  uint64_t stream = 0;
  SavedVariable q_, k_, v_, o_, lse_, kl_;

  std::string name() const override { return "SparseflashAttentionBackward"; }

  void release_variables() override {
    q_.reset_data();
    k_.reset_data();
    v_.reset_data();
    o_.reset_data();
    lse_.reset_data();
    kl_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const at::Tensor& d_o = grads[0];
    if (!d_o.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor q = q_.unpack(), k = k_.unpack(), v = v_.unpack(), o = o_.unpack(), lse = lse_.unpack(),
               kl = kl_.unpack();
    const BwdLaunches* b = nullptr;
    if (d_o.scalar_type() == q.scalar_type() && d_o.device() == q.device() && (plan->fwd->function == 0 ||
                                                                               !capturing(stream)))
      b = plan->find_bwd(d_o.strides());
    if (b != nullptr) {
      at::Tensor delta = at::empty_like(plan->rows), dq = at::empty_like(q), dk = at::empty_like(k),
                 dv = at::empty_like(v);
      uint64_t ptrs[kBwdRoles] = {addr(q), addr(k), addr(v), addr(o), addr(lse), addr(kl), addr(d_o), addr(delta),
                                  addr(dq), addr(dk), addr(dv)};
      uint64_t acc = 0;
      for (uint64_t p : ptrs) acc |= p;
      if ((acc & 15) == 0) {
        std::string err = b->dq->run(ptrs, reinterpret_cast<CUstream>(stream));
        if (err.empty()) err = b->dkdv->run(ptrs, reinterpret_cast<CUstream>(stream));
        if (!err.empty()) throw std::runtime_error(err);  // caught by the autograd engine
        return {dq, dk, dv};
      }
    }
    py::gil_scoped_acquire gil;
    py::object r = py::reinterpret_borrow<py::object>(plan->fallback)(d_o, q, k, v, o, lse,
                                                                      kl.defined() ? py::cast(kl) : py::none());
    auto t = r.cast<std::tuple<at::Tensor, at::Tensor, at::Tensor>>();
    return {std::get<0>(t), std::get<1>(t), std::get<2>(t)};
  }
};

// o of the call, or None when the plan does not take it (a misaligned address): the caller then
// goes the Python way. ``stream``: the current raw CUDA stream of the plan's device.
std::optional<at::Tensor> forward(const PlanPtr& plan, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& kl_opt, uint64_t stream) {
  at::Tensor kl = kl_opt.has_value() ? *kl_opt : at::Tensor();
  if (plan->fwd == nullptr || kl.defined() != plan->has_kl) return std::nullopt;
  if (((addr(q) | addr(k) | addr(v) | addr(kl)) & 15) != 0) return std::nullopt;
  at::Tensor o = at::empty_like(q);
  at::Tensor lse = at::empty_like(plan->rows);
  uint64_t ptrs[kFwdRoles] = {addr(q), addr(k), addr(v), addr(o), addr(lse), addr(kl)};
  if (((ptrs[3] | ptrs[4]) & 15) != 0) return std::nullopt;
  std::string err = plan->fwd->run(ptrs, reinterpret_cast<CUstream>(stream));
  if (!err.empty()) {
    g_last_error = std::move(err);
    return std::nullopt;
  }
  if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    auto node = NodeMaker<NodePtr>::make<AttentionBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
    node->plan = plan;
    node->stream = stream;
    node->q_ = SavedVariable(q, false);
    node->k_ = SavedVariable(k, false);
    node->v_ = SavedVariable(v, false);
    node->lse_ = SavedVariable(lse, false);
    node->kl_ = SavedVariable(kl, false);
    // o is saved through a detached alias (same storage and version counter, no grad_fn): no
    // reference cycle between the node and its output
    node->o_ = SavedVariable(o.detach(), false);
    torch::autograd::set_history(o, node);
  }
  return o;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sparseflash's native short path (sparseflash/flash/native.py)";
  py::class_<Launch, LaunchPtr>(m, "Launch")
      .def("pack", &Launch::pack, py::arg("ptrs"))
      .def_property_readonly("function", [](const Launch& l) { return l.function; });
  py::class_<Plan, PlanPtr>(m, "Plan")
      .def(py::init<int64_t, LaunchPtr, at::Tensor, bool, py::object>(), py::arg("device"), py::arg("fwd"),
           py::arg("rows"), py::arg("has_kl"), py::arg("fallback"))
      .def("add_bwd", &Plan::add_bwd, py::arg("do_strides"), py::arg("dq"), py::arg("dkdv"))
      .def_property_readonly("n_bwd", &Plan::n_bwd)
      .def_readonly("device", &Plan::device)
      .def("forward", [](const PlanPtr& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& kl, uint64_t stream) { return forward(p, q, k, v, kl, stream); },
           py::arg("q"), py::arg("k"), py::arg("v"), py::arg("key_lengths"), py::arg("stream"));
  // a Launch, or the message saying why these arguments make none
  m.def("make_launch", [](uint64_t function, std::vector<int64_t> grid, int64_t block, int64_t smem,
                          std::vector<uint64_t> slots, std::vector<int64_t> sizes,
                          std::vector<std::pair<int, int>> roles) -> py::object {
    std::string err = Launch::check(function, grid, block, slots, sizes, roles);
    if (!err.empty()) return py::str(err);
    return py::cast(std::make_shared<Launch>(function, std::move(grid), block, smem, std::move(slots),
                                             std::move(roles)));
  }, py::arg("function"), py::arg("grid"), py::arg("block"), py::arg("smem"), py::arg("slots"), py::arg("sizes"),
     py::arg("roles"));
  m.def("last_error", []() {
    std::string e = std::move(g_last_error);
    g_last_error.clear();
    return e;
  });
  m.def("dry_launches", []() { return g_dry_launches.load(); });
}
