// One deliberate misuse per rule of fake_waits.cc (and its control): a host call
// that waits for the GPU while the GPU waits for work only that host thread (or
// one waiting too) would enqueue. Each must be reported as a deadlock, never hang.
#include <cublasLt.h>
#include <cuda.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/base/driver.h"
#include "cuda/fake/fake_checks.h"
#include "cuda/fake/fake_harness.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/fake/fake_waits.h"
#include "cuda/gemm/gemm.h"
#include "cuda/kernels/kernels.h"

namespace jo::fake {

cudaStream_t StreamOn(int device) {
  cudaSetDevice(device);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  return s;
}

void ExchangeOnce(ncclComm_t comms[2]) {
  for (int r = 0; r < 2; ++r) {
    cudaStream_t s = StreamOn(r);
    void* buf = Malloc(r, 8);
    cudaSetDevice(r);
    ncclGroupStart();
    ncclSend(buf, 1, ncclFloat32, 1 - r, comms[r], s);
    ncclRecv(static_cast<float*>(buf) + 1, 1, ncclFloat32, 1 - r, comms[r], s);
    ncclGroupEnd();
  }
}

cublasLtMatmulHeuristicResult_t FirstAlgo(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                          cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                          cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d_layout,
                                          uint32_t align) {
  cublasLtMatmulPreference_t p = nullptr;
  cublasLtMatmulPreferenceCreate(&p);
  if (align > 0)
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      cublasLtMatmulPreferenceSetAttribute(p, attr, &align, sizeof(align));
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  cublasLtMatmulAlgoGetHeuristic(h, d, a, b, c, d_layout, p, 1, &r, &found);
  return r;
}

namespace {

const cuda::DriverApi* Driver() {
  const cuda::DriverApi* drv = nullptr;
  (void)cuda::LoadDriver(&drv);
  return drv;
}

// A wait on `device` for a flag nobody has written yet (on a new stream, or `s`); returns the
// flag.
CUdeviceptr PendingWait(int device, cudaStream_t s = nullptr) {
  if (s == nullptr) s = StreamOn(device);
  void* flag = Malloc(device, 4);
  Driver()->cuStreamWaitValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag),
                                1, CU_STREAM_WAIT_VALUE_GEQ);
  return reinterpret_cast<CUdeviceptr>(flag);
}

void Raise(int device, CUdeviceptr flag) {
  cudaStream_t s = StreamOn(device);
  Driver()->cuStreamWriteValue32(reinterpret_cast<CUstream>(s), flag, 1,
                                 CU_STREAM_WRITE_VALUE_DEFAULT);
}

// A 4x4 float32 GEMM on `s` through cuBLASLt (the executor's attributes).
void Gemm(cudaStream_t s, int device) {
  cublasLtHandle_t h = nullptr;
  cublasLtCreate(&h);
  cublasLtMatmulDesc_t d = nullptr;
  cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasLtMatrixLayout_t l = nullptr;
  cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, 4, 4, 4);
  const cublasLtMatmulHeuristicResult_t r = FirstAlgo(h, d, l, l, l, l, 16);
  void* a = Malloc(device, 64);
  void* out = Malloc(device, 64);
  const float one = 1.0f, zero = 0.0f;
  cublasLtMatmul(h, d, &one, a, l, a, l, &zero, out, l, out, l, &r.algo, nullptr, 0, s);
}

void Vmm(int device, CUmemGenericAllocationHandle* handle, CUdeviceptr* va, size_t* bytes) {
  const cuda::DriverApi* drv = Driver();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t granularity = 0;
  drv->cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  *bytes = granularity;
  drv->cuMemCreate(handle, granularity, &prop, 0);
  drv->cuMemAddressReserve(va, granularity, granularity, 0, 0);
  drv->cuMemMap(*va, granularity, 0, *handle, 0);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  drv->cuMemSetAccess(*va, granularity, &access, 1);
}

cuda::BlockArgs AddArgs(int device) {
  cuda::BlockArgs b;
  b.dst = Malloc(device, 64);
  b.src = Malloc(device, 64);
  b.batch = 1;
  b.m = 1;
  b.n = 16;
  b.src_ld = b.dst_ld = 16;
  return b;
}

}  // namespace

std::map<std::string, std::string> WaitMisuseChecks() {
  std::map<std::string, std::string> out;
  auto check = [&](const std::string& name, const std::function<void()>& body,
                   int module_loading = 1) {
    Config config;
    config.devices = 4;
    config.module_loading = module_loading;
    Reset(config);
    cudaSetDevice(0);
    body();
    Drain();
    const auto errors = Errors();
    out[name] = errors.empty() ? "" : errors.front();
  };
  // A call that waits for every queue of `device`, made behind a wait only this thread would
  // satisfy (the misuse), or after the write the wait needs (the control).
  auto behind_a_wait = [](int device, bool raise_first, const std::function<void()>& call) {
    const CUdeviceptr flag = PendingWait(device);
    if (raise_first) Raise(device, flag);
    call();
    if (!raise_first) Raise(device, flag);
  };
  // The misuse and the control of `api`: body(raise_first).
  auto check_pair = [&](const std::string& api, const std::function<void(bool)>& body) {
    check(api + " behind a wait only this thread would satisfy", [&] { body(false); });
    check(api + " after the write the wait needs (control)", [&] { body(true); });
  };
  // cudaFree / cudaMalloc wait for every queue of the device.
  check_pair("cudaFree", [&](bool raise_first) {
    void* p = Malloc(0, 64);
    behind_a_wait(0, raise_first, [&] {
      cudaSetDevice(0);
      cudaFree(p);
    });
  });
  check_pair("cudaMalloc", [&](bool raise_first) {
    behind_a_wait(0, raise_first, [] {
      cudaSetDevice(0);
      void* p = nullptr;
      cudaMalloc(&p, 64);
    });
  });
  // With peer access on, device 0's memory is mapped into device 1: allocating or freeing it
  // waits for device 1's queues too (the control: the same without peer access).
  auto peer_mapped = [&](bool peer_access, bool free) {
    void* p = Malloc(0, 64);
    if (peer_access) {
      cudaSetDevice(1);
      cudaDeviceEnablePeerAccess(0, 0);
    }
    behind_a_wait(1, false, [&] {
      cudaSetDevice(0);
      if (free) {
        cudaFree(p);
      } else {
        cudaMalloc(&p, 64);
      }
    });
  };
  for (const bool free : {false, true}) {
    const std::string api = free ? "cudaFree" : "cudaMalloc";
    check(api + " of memory a peer maps, behind the peer's wait only this thread would satisfy",
          [&] { peer_mapped(true, free); });
    check(api + " of memory no peer maps, behind another device's wait (control)",
          [&] { peer_mapped(false, free); });
  }
  // A page-locked allocation waits for the device like cudaMalloc (implicit synchronization).
  check_pair("cudaMallocHost", [&](bool raise_first) {
    behind_a_wait(0, raise_first, [] {
      cudaSetDevice(0);
      void* p = nullptr;
      cudaMallocHost(&p, 64);
    });
  });
  check_pair("cudaFreeHost", [&](bool raise_first) {
    cudaSetDevice(0);
    void* p = nullptr;
    cudaMallocHost(&p, 64);
    behind_a_wait(0, raise_first, [&] {
      cudaSetDevice(0);
      cudaFreeHost(p);
    });
  });
  // A device-to-host copy into pageable memory returns only once it has completed; into
  // page-locked memory it is asynchronous.
  auto read_behind_a_wait = [](bool pinned) {
    cudaStream_t s = StreamOn(0);
    void* host = nullptr;
    std::vector<uint32_t> pageable(16);
    if (pinned) cudaMallocHost(&host, 64);
    void* device = Malloc(0, 64);
    const CUdeviceptr flag = PendingWait(0, s);
    cudaSetDevice(0);
    cudaMemcpyAsync(pinned ? host : pageable.data(), device, 64, cudaMemcpyDeviceToHost, s);
    Raise(0, flag);
  };
  check("device-to-host copy into pageable memory behind a wait only this thread would satisfy",
        [&] { read_behind_a_wait(false); });
  check("device-to-host copy into page-locked memory behind the same wait (control)",
        [&] { read_behind_a_wait(true); });
  check_pair("cuMemUnmap", [&](bool raise_first) {
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    size_t bytes = 0;
    Vmm(0, &h, &va, &bytes);
    behind_a_wait(0, raise_first, [&] { Driver()->cuMemUnmap(va, bytes); });
  });
  check_pair("cuMemRelease", [&](bool raise_first) {
    const cuda::DriverApi* drv = Driver();
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 1;
    size_t granularity = 0;
    drv->cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    CUmemGenericAllocationHandle h = 0;
    drv->cuMemCreate(&h, granularity, &prop, 0);
    behind_a_wait(1, raise_first, [&] { drv->cuMemRelease(h); });
  });
  // Lazy loading: the first launch of a kernel on a device loads it, waiting for the device.
  check("first launch of a kernel not loaded (lazy loading)", [] {
    const CUdeviceptr flag = PendingWait(0);
    cudaStream_t s = StreamOn(0);
    (void)cuda::LaunchAddBlock(AddArgs(0), s, cuda::ErrorContext{});
    Raise(0, flag);
  });
  check(
      "first launch with CUDA_MODULE_LOADING=EAGER (control)",
      [] {
        const CUdeviceptr flag = PendingWait(0);
        cudaStream_t s = StreamOn(0);
        (void)cuda::LaunchAddBlock(AddArgs(0), s, cuda::ErrorContext{});
        Raise(0, flag);
      },
      /*module_loading=*/2);
  check("first cuBLASLt matmul of an algorithm (lazy loading)", [] {
    const CUdeviceptr flag = PendingWait(2);
    Gemm(StreamOn(2), 2);
    Raise(2, flag);
  });
  check(
      "first cuBLASLt matmul with CUDA_MODULE_LOADING=EAGER (control)",
      [] {
        const CUdeviceptr flag = PendingWait(2);
        Gemm(StreamOn(2), 2);
        Raise(2, flag);
      },
      /*module_loading=*/2);
  // ncclCommAbort frees memory: it waits for other communicators' kernels on its device.
  auto stuck_send = [](ncclComm_t* a, ncclComm_t* b) {
    int devs[2] = {0, 1};
    ncclCommInitAll(a, 2, devs);
    ncclCommInitAll(b, 2, devs);
    cudaStream_t s = StreamOn(0);
    void* buf = Malloc(0, 64);
    cudaSetDevice(0);
    ncclSend(buf, 16, ncclFloat32, 1, a[0], s);  // never received: in flight until aborted
  };
  check("ncclCommAbort while another communicator's kernel runs on the device", [&] {
    ncclComm_t a[2], b[2];
    stuck_send(a, b);
    ncclCommAbort(b[0]);
    ncclCommAbort(a[0]);
  });
  check("ncclCommAbort of the stuck communicator first (control)", [&] {
    ncclComm_t a[2], b[2];
    stuck_send(a, b);
    ncclCommAbort(a[0]);
    ncclCommAbort(b[0]);
  });
  check("first send/recv to a peer behind a wait only this thread would satisfy", [&] {
    ncclComm_t comms[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(comms, 2, devs);
    const CUdeviceptr flag = PendingWait(0);
    ExchangeOnce(comms);  // rank 0 connects first: behind the wait
    Raise(0, flag);
  });
  check("send/recv to a connected peer behind the same wait (control)", [&] {
    ncclComm_t comms[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(comms, 2, devs);
    ExchangeOnce(comms);  // connected (and run)
    Drain();
    const CUdeviceptr flag = PendingWait(0);
    ExchangeOnce(comms);
    Raise(0, flag);
  });
  // The executor's communicators are non-blocking: ncclGroupEnd returns ncclInProgress and the
  // caller's poll (ncclCommGetAsyncError) cannot see the connection done before the device is.
  check("polling a non-blocking connection behind a wait only this thread would satisfy", [&] {
    ncclUniqueId id{};
    ncclGetUniqueId(&id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comms[2] = {nullptr, nullptr};
    ncclGroupStart();
    for (int r = 0; r < 2; ++r) {
      cudaSetDevice(r);
      ncclCommInitRankConfig(&comms[r], 2, id, r, &config);
    }
    ncclGroupEnd();
    ncclResult_t state = ncclInProgress;
    for (ncclComm_t c : comms) ncclCommGetAsyncError(c, &state);
    const CUdeviceptr flag = PendingWait(0);
    ExchangeOnce(comms);
    ncclCommGetAsyncError(comms[0], &state);  // the connection waits for device 0
    Raise(0, flag);
  });
  check("first send/recv to a peer between a handler's first enqueue and its return", [&] {
    ncclComm_t comms[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(comms, 2, devs);
    cudaStream_t xla = StreamOn(0);
    BeginHandler(xla);
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    cudaEventRecord(e, xla);
    void* buf = Malloc(0, 8);
    cudaSetDevice(0);
    ncclSend(buf, 1, ncclFloat32, 1, comms[0], xla);
    EndHandler(xla, "the handler");
  });
  // Two ranks' host threads: the peer has enqueued a wait that this thread's next enqueue
  // satisfies, and this thread first frees memory on the peer's device (the executor's old
  // order: past buffers freed by whichever rank reserved first).
  auto two_ranks = [](bool raise_first) {
    void* peer_buffer = Malloc(1, 64);
    CUdeviceptr flag = 0;
    std::thread peer([&] {
      HostThread host;
      flag = PendingWait(1);
    });
    peer.join();
    std::thread me([&] {
      HostThread host;
      if (raise_first) Raise(1, flag);
      cudaSetDevice(1);
      cudaFree(peer_buffer);
      if (!raise_first) Raise(1, flag);
    });
    me.join();
  };
  check("cudaFree of a peer's buffer while the peer waits for this thread",
        [&] { two_ranks(false); });
  check("cudaFree of a peer's buffer after this thread's signal (control)",
        [&] { two_ranks(true); });
  // The enqueue path: a call that can wait for the GPU after the handler's first enqueue.
  check("cudaMalloc between a handler's first enqueue and its return", [] {
    cudaStream_t xla = StreamOn(0);
    BeginHandler(xla);
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    cudaEventRecord(e, xla);
    void* p = nullptr;
    cudaMalloc(&p, 64);
    EndHandler(xla, "the handler");
  });
  // Deny by default: every entry point of the fake checks the enqueue path, so a call that is
  // not on the list is refused there whatever it is; a sample of calls that create, destroy or
  // synchronise (none of which the fake makes wait), and a control of listed ones.
  auto on_the_enqueue_path = [](const std::function<void(cudaStream_t)>& body) {
    cudaStream_t xla = StreamOn(0);
    BeginHandler(xla);
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    cudaEventRecord(e, xla);  // the handler's first enqueue
    body(xla);
    EndHandler(xla, "the handler");
  };
  const std::vector<std::pair<std::string, std::function<void(cudaStream_t)>>> refused = {
      {"cudaStreamCreateWithFlags",
       [](cudaStream_t) {
         cudaStream_t s = nullptr;
         cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
       }},
      {"cudaEventCreateWithFlags",
       [](cudaStream_t) {
         cudaEvent_t e = nullptr;
         cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
       }},
      {"cudaEventDestroy", [](cudaStream_t) { cudaEventDestroy(nullptr); }},
      {"cudaStreamDestroy", [](cudaStream_t) { cudaStreamDestroy(nullptr); }},
      {"cudaStreamSynchronize", [](cudaStream_t xla) { cudaStreamSynchronize(xla); }},
      {"cublasLtCreate",
       [](cudaStream_t) {
         cublasLtHandle_t h = nullptr;
         cublasLtCreate(&h);
       }},
      {"cuMemAddressFree", [](cudaStream_t) { Driver()->cuMemAddressFree(0, 0); }},
      {"cuMulticastUnbind", [](cudaStream_t) { Driver()->cuMulticastUnbind(0, 0, 0, 0); }},
  };
  for (const auto& [api, call] : refused)
    check(api + " on the enqueue path", [&, call = call] { on_the_enqueue_path(call); });
  // cuBLASLt's kernel for a matmul: the fake takes the call's form to select it (in or out of
  // place, each matrix's alignment: fake_cublaslt.cc), so a warm-up in another form leaves the
  // call's kernel to load — with lazy loading, on the enqueue path, where it is refused.
  enum class Form { kSame, kLessAligned, kOutOfPlace };
  auto after_a_warm_up = [&](Form form) {
    cudaSetDevice(0);
    cublasLtHandle_t h = nullptr;
    cublasLtCreate(&h);
    cublasLtMatmulDesc_t d = nullptr;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayout_t l = nullptr;
    cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, 4, 4, 64);  // ld 256 bytes: the pointers decide
    const cublasLtMatmulHeuristicResult_t r = FirstAlgo(h, d, l, l, l, l, 16);
    auto* a = static_cast<std::byte*>(Malloc(0, 4096));  // page-aligned
    auto* c = static_cast<std::byte*>(Malloc(0, 4096));
    auto* out = static_cast<std::byte*>(Malloc(0, 4096));
    const float one = 1.0f;
    // The warm-up, at set-up: in place, every pointer 256-byte aligned.
    cublasLtMatmul(h, d, &one, a, l, a, l, &one, out, l, out, l, &r.algo, nullptr, 0, StreamOn(0));
    Drain();
    on_the_enqueue_path([&](cudaStream_t xla) {
      const std::byte* a_call = form == Form::kLessAligned ? a + 16 : a;
      const std::byte* c_call = form == Form::kOutOfPlace ? c : out;
      cublasLtMatmul(h, d, &one, a_call, l, a, l, &one, c_call, l, out, l, &r.algo, nullptr, 0,
                     xla);
    });
  };
  check("cuBLASLt matmul less aligned than its warm-up on the enqueue path",
        [&] { after_a_warm_up(Form::kLessAligned); });
  check("cuBLASLt matmul out of place after an in-place warm-up on the enqueue path",
        [&] { after_a_warm_up(Form::kOutOfPlace); });
  check("cuBLASLt matmul in its warm-up's form on the enqueue path (control)",
        [&] { after_a_warm_up(Form::kSame); });
  check("error strings, ncclGroupStart/End and the current device on the enqueue path (control)",
        [&] {
          on_the_enqueue_path([](cudaStream_t) {
            int device = 0;
            cudaGetDevice(&device);
            cudaSetDevice(device);
            (void)cudaGetErrorString(cudaErrorInvalidValue);
            (void)cudaGetLastError();
            (void)ncclGetErrorString(ncclInvalidUsage);
            ncclGroupStart();
            ncclGroupEnd();
          });
        });
  return out;
}

Status GemmSetUpRace(GemmSetUpRaceOutcome* out) {
  Config config;
  config.devices = 1;
  config.module_loading = 1;  // lazy: the set-up's warm-up loads, and waits, too
  ResetExecutorAndFake(config);
  // A float32 GEMM, m x n x k = 4 x n x 4, on fresh buffers of device 0.
  const auto gemm = [](int64_t n) {
    cuda::GemmArgs g;
    g.m = 4;
    g.n = n;
    g.k = 4;
    g.a = Malloc(0, 4 * 4 * 4);
    g.a_ld = 4;
    g.w = Malloc(0, static_cast<size_t>(4 * n * 4));
    g.w_ld = n;
    g.d = Malloc(0, static_cast<size_t>(4 * n * 4));
    g.d_ld = n;
    return g;
  };
  const cuda::ErrorContext ctx;
  // The rank's pool (clique_state.h) in the executor: here the test's own buffers.
  const auto buffers = [](const cuda::GemmArgs& g) {
    cuda::GemmBuffers b;
    b.workspace = Malloc(0, cuda::kGemmWorkspaceBytes);
    b.warm_workspace = Malloc(0, cuda::kGemmWorkspaceBytes);
    b.warm_bytes = cuda::WarmUpBytes(g);
    b.warm = Malloc(0, b.warm_bytes);
    return b;
  };
  cudaSetDevice(0);
  cudaStream_t xla = StreamOn(0);
  cudaEvent_t started = nullptr;
  cudaEventCreateWithFlags(&started, cudaEventDisableTiming);
  const cuda::GemmArgs ready = gemm(4);
  bool warmed = false;
  const cuda::GemmBuffers ready_buffers = buffers(ready);
  JO_CHECK(cuda::PrepareLtMatmul(0, ready, ready_buffers, ctx, &warmed));
  if (!Drain()) return Internal("GemmSetUpRace: the warm-up did not drain");
  const cuda::GemmArgs fresh = gemm(64);
  const cuda::GemmBuffers fresh_buffers = buffers(fresh);
  const CUdeviceptr flag = PendingWait(0);  // device 0 now waits for the flag
  std::atomic<bool> registered{false}, enqueued{false};
  Status set_up_status, enqueue_status;
  std::thread enqueue([&] {
    HostThread host;  // a rank's thread: the set-up's wait waits while it may still enqueue
    registered = true;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (ThreadsWaitingForGpu() == 0 && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    cudaSetDevice(0);
    BeginHandler(xla);
    cudaEventRecord(started, xla);  // the handler's first enqueue
    enqueue_status = cuda::LtMatmul(0, ready, xla, ready_buffers.workspace, ctx);
    if (enqueue_status.ok()) enqueue_status = cuda::JoinWarmUps(0, xla, ctx);
    enqueued = true;
    EndHandler(xla, "the enqueue");
    Raise(0, flag);
  });
  while (!registered) std::this_thread::yield();
  std::thread set_up([&] {
    HostThread host;
    bool w = false;
    set_up_status = cuda::PrepareLtMatmul(0, fresh, fresh_buffers, ctx, &w);
  });
  const auto bound = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!enqueued && std::chrono::steady_clock::now() < bound)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  out->enqueue_waited = !enqueued;
  if (out->enqueue_waited) Raise(0, flag);  // so that the set-up, then the enqueue, can end
  enqueue.join();
  set_up.join();
  Drain();
  out->set_up = set_up_status.ok() ? "" : set_up_status.message();
  out->enqueue = enqueue_status.ok() ? "" : enqueue_status.message();
  out->errors = Errors();
  return OkStatus();
}

}  // namespace jo::fake
