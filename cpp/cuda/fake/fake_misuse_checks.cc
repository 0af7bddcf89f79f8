// The misuse suite of CUDA, cuBLASLt and NCCL (MisuseChecks) and the
// watchdog's abort racing an enqueue (LeaseRace): fake_checks.h.
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/log.h"
#include "cuda/base/check.h"
#include "cuda/base/driver.h"
#include "cuda/clique/cuda_clique.h"
#include "cuda/fake/fake_checks.h"
#include "cuda/fake/fake_harness.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/fused/fused_gemm.h"
#include "cuda/fused/fused_gemm_launch.h"
#include "cuda/kernels/kernels.h"
#include "cuda/transport/nccl_comms.h"
#include "cuda/watchdog.h"

namespace jo::fake {

Status LeaseRace(bool hold_lease, LeaseRaceOutcome* out) {
  Config config;
  config.devices = 2;
  ResetExecutorAndFake(config);
  cuda::ErrorContext ctx;
  ctx.op = "lease_race";
  ncclUniqueId id{};
  ncclGetUniqueId(&id);
  cuda::NcclComms comms;
  const Status made = comms.Create(
      {0, 1}, id, std::chrono::steady_clock::now() + std::chrono::seconds(10), "test", ctx);
  if (!made.ok()) return Internal("lease_race: NcclComms::Create failed: " + made.message());
  std::mutex mu;
  std::condition_variable cv;
  int stage = 0;  // 1: the enqueue thread has its communicators; 2: Abort returned
  auto wait_for = [&](int s) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return stage >= s; });
  };
  auto reach = [&](int s) {
    std::lock_guard<std::mutex> lock(mu);
    stage = s;
    cv.notify_all();
  };
  int64_t aborts_when_abort_returned = 0;
  std::thread enqueue([&] {
    cuda::NcclComms::Lease lease;
    if (!comms.Acquire(0, ctx, &lease).ok()) return reach(1);
    const std::vector<ncclComm_t> mine = lease.ForStreams(3);
    if (!hold_lease) lease.Drop();
    reach(1);
    wait_for(2);
    cudaSetDevice(0);
    for (ncclComm_t comm : mine) {
      ncclResult_t state = ncclSuccess;
      if (comm != nullptr) (void)ncclCommGetAsyncError(comm, &state);
    }
    lease.Drop();
  });
  wait_for(1);
  std::thread watchdog([&] {
    comms.Abort();  // starts the aborts on threads of their own: await them here
    (void)comms.AwaitAborts(std::chrono::steady_clock::now() + std::chrono::seconds(10));
    aborts_when_abort_returned = Counters()["ncclCommAbort"];
  });
  watchdog.join();
  reach(2);
  enqueue.join();
  (void)comms.AwaitAborts(std::chrono::steady_clock::now() + std::chrono::seconds(10));
  cuda::NcclComms::Lease again;
  const Status late = comms.Acquire(0, ctx, &again);
  out->aborts_when_abort_returned = aborts_when_abort_returned;
  out->aborts_at_end = Counters()["ncclCommAbort"];
  out->acquire_after_abort = late.ok() ? std::string() : late.message();
  out->errors = Errors();
  return OkStatus();
}

Status StuckAbort(bool stuck, StuckAbortOutcome* out) {
  Config config;
  config.devices = 2;
  ResetExecutorAndFake(config);
  cuda::ErrorContext ctx;
  ctx.op = "stuck_abort";
  ncclUniqueId id{};
  ncclGetUniqueId(&id);
  constexpr std::chrono::milliseconds kTimeout(200);
  auto comms = std::make_shared<cuda::NcclComms>(kTimeout);
  const Status made = comms->Create(
      {0, 1}, id, std::chrono::steady_clock::now() + std::chrono::seconds(10), "test", ctx);
  if (!made.ok()) return Internal("stuck_abort: NcclComms::Create failed: " + made.message());
  const cuda::DriverApi* drv = nullptr;
  JO_CHECK(cuda::LoadDriver(&drv));
  cudaSetDevice(0);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void* buf = Malloc(0, 64);
  {
    cuda::NcclComms::Lease lease;
    JO_CHECK(comms->Acquire(0, ctx, &lease));
    const ncclComm_t comm = lease.ForStreams(2)[1];
    ncclSend(buf, 16, ncclFloat32, 1, comm, s);  // nobody receives: in flight until aborted
    JO_CHECK(cuda::AwaitNccl(comm, std::chrono::steady_clock::now() + std::chrono::seconds(10),
                             "ncclSend", &ctx));
  }
  auto* flag = static_cast<uint32_t*>(Malloc(0, 4));
  if (stuck)
    drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), 1,
                             CU_STREAM_WAIT_VALUE_GEQ);
  const std::string before = LastWarning();
  comms->Abort();  // each ncclCommAbort on a thread of its own
  cuda::WatchAborts(comms, "stuck_abort clique", kTimeout);
  if (!stuck) (void)comms->AwaitAborts(std::chrono::steady_clock::now() + std::chrono::seconds(10));
  cuda::AdvanceWatchdogClock(kTimeout + std::chrono::milliseconds(100));
  out->warning = LastWarning() != before ? LastWarning() : std::string();
  *flag = 1;  // the device's other work completes: the abort returns
  if (!comms->AwaitAborts(std::chrono::steady_clock::now() + std::chrono::seconds(10)))
    return Internal("stuck_abort: the aborts did not return once the flag was raised");
  out->errors = Errors();
  return OkStatus();
}

Status LateCall(bool finish, LateCallOutcome* out) {
  Config config;
  config.devices = 1;
  ResetExecutorAndFake(config);
  const cuda::DriverApi* drv = nullptr;
  JO_CHECK(cuda::LoadDriver(&drv));
  auto clique = std::make_shared<cuda::CudaClique>(CliqueKey{4242, 0, 0}, Transport::kP2p,
                                                   std::vector<int>{0}, std::vector<int64_t>{0});
  auto gen = std::make_shared<cuda::Generation>();  // no flags: nothing for Fire to read
  const std::weak_ptr<const cuda::Generation> weak_gen = gen;
  auto events = std::make_shared<cuda::CallEvents>();
  cudaSetDevice(0);
  cudaStream_t xla = nullptr;
  cudaStreamCreateWithFlags(&xla, cudaStreamNonBlocking);
  cudaEventCreateWithFlags(&events->started, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&events->done, cudaEventDisableTiming);
  auto* flag = static_cast<uint32_t*>(Malloc(0, 4));
  cudaEventRecord(events->started, xla);
  drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(xla), reinterpret_cast<CUdeviceptr>(flag), 1,
                           CU_STREAM_WAIT_VALUE_GEQ);
  cudaEventRecord(events->done, xla);
  const auto finished = [&] {  // polls run the fake GPU as far as it can
    cudaSetDevice(0);
    for (int i = 0; i < 1000 && cudaEventQuery(events->done) == cudaErrorNotReady; ++i) {
    }
  };
  cuda::WatchedCall call;
  call.clique = clique;
  call.device = 0;
  call.events = events;
  call.epoch = 1;
  call.gen = gen;
  call.op = "late_call";
  call.timeout = std::chrono::milliseconds(200);
  cuda::SetWatchdogFireHook([&] {
    if (!finish) return;
    *flag = 1;
    finished();   // the fake GPU finishes the call
    gen.reset();  // the clique moves past the generation: the watchdog's reference is the last
  });
  const std::string before = LastWarning();
  cuda::Watch(std::move(call));
  cuda::AdvanceWatchdogClock(std::chrono::milliseconds(300));
  cuda::SetWatchdogFireHook(nullptr);
  out->warning = LastWarning() != before ? LastWarning() : std::string();
  out->broken = clique->BrokenReason();
  out->gen_alive_after_watchdog = !weak_gen.expired();
  out->pending_after = cuda::PendingWatches();
  *flag = 1;
  finished();
  cuda::AdvanceWatchdogClock(std::chrono::milliseconds(40));  // the finished call is dropped
  gen.reset();
  clique.reset();
  out->gen_freed_with_clique = weak_gen.expired();
  cudaEventDestroy(events->started);
  cudaEventDestroy(events->done);
  cudaStreamDestroy(xla);
  out->errors = Errors();
  return OkStatus();
}

Status WatchdogQueryRace(WatchdogQueryRaceOutcome* out) {
  Config config;
  config.devices = 1;
  ResetExecutorAndFake(config);
  const cuda::DriverApi* drv = nullptr;
  JO_CHECK(cuda::LoadDriver(&drv));
  auto clique = std::make_shared<cuda::CudaClique>(CliqueKey{4243, 0, 0}, Transport::kP2p,
                                                   std::vector<int>{0}, std::vector<int64_t>{0});
  auto gen = std::make_shared<cuda::Generation>();
  cudaSetDevice(0);
  cudaStream_t xla = nullptr;
  cudaStreamCreateWithFlags(&xla, cudaStreamNonBlocking);
  auto* flag = static_cast<uint32_t*>(Malloc(0, 4));
  // A call stuck on a flag, and another behind it.
  const auto stuck_call = [&](int64_t epoch) {
    auto events = std::make_shared<cuda::CallEvents>();
    cudaEventCreateWithFlags(&events->started, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&events->done, cudaEventDisableTiming);
    cudaEventRecord(events->started, xla);
    drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(xla), reinterpret_cast<CUdeviceptr>(flag),
                             1, CU_STREAM_WAIT_VALUE_GEQ);
    cudaEventRecord(events->done, xla);
    cuda::WatchedCall call;
    call.clique = clique;
    call.device = 0;
    call.events = events;
    call.epoch = epoch;
    call.gen = gen;
    call.op = "query_race";
    call.timeout = std::chrono::seconds(100);  // never fired here
    return call;
  };
  cuda::Watch(stuck_call(1));
  cuda::WatchedCall next = stuck_call(2);
  std::mutex mu;
  std::condition_variable cv;
  bool inside = false, released = false;
  std::thread::id pass_thread;
  SetEventQueryHook([&](cudaEvent_t) {
    std::unique_lock<std::mutex> lock(mu);
    if (std::this_thread::get_id() != pass_thread || inside) return;
    inside = true;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return released; });
  });
  std::thread pass([&] {
    {
      std::lock_guard<std::mutex> lock(mu);
      pass_thread = std::this_thread::get_id();
    }
    cuda::AdvanceWatchdogClock(std::chrono::milliseconds(40));  // one pass: it queries
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return inside; });
    out->query_blocked = inside;
  }
  std::atomic<bool> watched{false};
  std::thread handler([&] {
    cuda::Watch(std::move(next));
    watched = true;
  });
  const auto bound = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (!watched && std::chrono::steady_clock::now() < bound)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  out->watch_waited = !watched;
  {
    std::lock_guard<std::mutex> lock(mu);
    released = true;
    cv.notify_all();
  }
  pass.join();
  handler.join();
  SetEventQueryHook(nullptr);
  *flag = 1;
  Drain();
  cuda::AdvanceWatchdogClock(std::chrono::milliseconds(40));  // the finished calls are dropped
  clique.reset();
  cudaStreamDestroy(xla);
  out->errors = Errors();
  return OkStatus();
}

std::map<std::string, std::string> MisuseChecks() {
  std::map<std::string, std::string> out;
  auto check = [&](const std::string& name, auto&& body, int connections = 8) {
    Config config;
    config.devices = 4;
    config.fabric = true;
    config.connections = connections;
    ResetExecutorAndFake(config);
    cudaSetDevice(0);
    body();
    Drain();
    const auto errors = Errors();
    out[name] = errors.empty() ? "" : errors.front();
  };
  check("unmodeled cuBLASLt attribute", [] {
    cublasLtMatmulDesc_t d = nullptr;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const int32_t epilogue = CUBLASLT_EPILOGUE_RELU;
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
  });
  // A valid 4x4 f32 GEMM set-up, then one thing changed.
  auto gemm = [&](int32_t order, int64_t ld_d, bool misalign, bool c_differs) {
    cudaStream_t s = StreamOn(0);
    cublasLtHandle_t h = nullptr;
    cublasLtCreate(&h);
    cublasLtMatmulDesc_t d = nullptr;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayout_t la, lb, lc, ldd;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, 4, 4, 4);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, 4, 4, 4);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, 4, 4, 4);
    cublasLtMatrixLayoutCreate(&ldd, CUDA_R_32F, 4, 4, ld_d);
    cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order));
    const cublasLtMatmulHeuristicResult_t r = FirstAlgo(h, d, la, lb, lc, ldd);
    float* a = static_cast<float*>(Malloc(0, 64 * sizeof(float)));
    float* c = static_cast<float*>(Malloc(0, 64 * sizeof(float)));
    float* dst = static_cast<float*>(Malloc(0, 64 * sizeof(float)));
    const float one = 1.0f;
    cublasLtMatmul(h, d, &one, misalign ? a + 1 : a, la, a, lb, &one, c_differs ? c : dst, lc, dst,
                   ldd, &r.algo, nullptr, 0, s);
  };
  check("row-major layout", [&] { gemm(CUBLASLT_ORDER_ROW, 4, false, false); });
  check("leading dim below rows", [&] { gemm(CUBLASLT_ORDER_COL, 2, false, false); });
  check("misaligned pointer", [&] { gemm(CUBLASLT_ORDER_COL, 4, true, false); });
  check("C != D with different layouts", [&] { gemm(CUBLASLT_ORDER_COL, 8, false, true); });
  // A valid batched 4x4 f32 GEMM promising `align` bytes for every matrix, B's batch
  // stride `b_stride` elements: the promise must hold for leading dims and strides too.
  auto batched = [&](uint32_t align, int64_t b_stride) {
    cudaStream_t s = StreamOn(0);
    cublasLtHandle_t h = nullptr;
    cublasLtCreate(&h);
    cublasLtMatmulDesc_t d = nullptr;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayout_t l[4];
    const int32_t batch = 2;
    for (int i = 0; i < 4; ++i) {
      cublasLtMatrixLayoutCreate(&l[i], CUDA_R_32F, 4, 4, 4);
      const int64_t stride = i == 1 ? b_stride : 16;
      cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                       sizeof(batch));
      cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                       sizeof(stride));
    }
    const cublasLtMatmulHeuristicResult_t r = FirstAlgo(h, d, l[0], l[1], l[2], l[3], align);
    float* a = static_cast<float*>(Malloc(0, 64 * sizeof(float)));
    float* dst = static_cast<float*>(Malloc(0, 64 * sizeof(float)));
    const float one = 1.0f;
    cublasLtMatmul(h, d, &one, a, l[0], a, l[1], &one, dst, l[2], dst, l[3], &r.algo, nullptr, 0,
                   s);
  };
  check("leading dim less aligned than promised", [&] { batched(32, 16); });
  check("batch stride less aligned than promised", [&] { batched(16, 17); });
  check("cublasLt tf32 with bf16", [&] {
    cudaStream_t s = StreamOn(0);
    cublasLtHandle_t h = nullptr;
    cublasLtCreate(&h);
    cublasLtMatmulDesc_t d = nullptr;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F);
    cublasLtMatrixLayout_t l[4];
    for (auto& layout : l) cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, 4, 4, 4);
    const cublasLtMatmulHeuristicResult_t r = FirstAlgo(h, d, l[0], l[1], l[2], l[3]);
    void* a = Malloc(0, 64 * sizeof(float));
    void* dst = Malloc(0, 64 * sizeof(float));
    const float one = 1.0f, zero = 0.0f;
    cublasLtMatmul(h, d, &one, a, l[0], a, l[1], &zero, dst, l[2], dst, l[3], &r.algo, nullptr, 0,
                   s);
  });
  check("copy out of range", [&] {
    cudaStream_t s = StreamOn(0);
    void* a = Malloc(0, 64);
    void* b = Malloc(0, 64);
    cudaMemcpyAsync(static_cast<char*>(b) + 32, a, 64, cudaMemcpyDefault, s);
  });
  check("peer copy without peer access", [&] {
    cudaStream_t s = StreamOn(0);
    void* a = Malloc(0, 64);
    void* b = Malloc(1, 64);
    cudaMemcpyAsync(b, a, 64, cudaMemcpyDefault, s);
  });
  check("wait on an event never recorded", [&] {
    cudaStream_t s = StreamOn(0);
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    cudaStreamWaitEvent(s, e, 0);
  });
  check("flag never raised (deadlock)", [&] {
    const cuda::DriverApi* drv = nullptr;
    (void)cuda::LoadDriver(&drv);
    cudaStream_t s = StreamOn(0);
    void* flag = Malloc(0, 4);
    if (drv != nullptr)
      drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag),
                               1, CU_STREAM_WAIT_VALUE_GEQ);
  });
  check("wait with FLUSH where remote writes cannot be flushed", [&] {
    const cuda::DriverApi* drv = nullptr;
    (void)cuda::LoadDriver(&drv);
    cudaStream_t s = StreamOn(0);
    void* flag = Malloc(0, 4);
    if (drv != nullptr)
      drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag),
                               0, CU_STREAM_WAIT_VALUE_GEQ | CU_STREAM_WAIT_VALUE_FLUSH);
  });
  check("mismatched send/recv sizes", [&] {
    ncclComm_t comms[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(comms, 2, devs);
    cudaStream_t s0 = StreamOn(0), s1 = StreamOn(1);
    void* a = Malloc(0, 64);
    void* b = Malloc(1, 64);
    cudaSetDevice(0);
    ncclSend(a, 16, ncclFloat32, 1, comms[0], s0);
    cudaSetDevice(1);
    ncclRecv(b, 8, ncclFloat32, 0, comms[1], s1);
  });
  check("multicast address outside a multimem kernel", [&] {
    const cuda::DriverApi* drv = nullptr;
    (void)cuda::LoadDriver(&drv);
    if (drv == nullptr) return;
    CUmulticastObjectProp prop{};
    prop.numDevices = 1;
    prop.size = size_t{2} << 20;
    CUmemGenericAllocationHandle mc = 0;
    drv->cuMulticastCreate(&mc, &prop);
    CUdeviceptr va = 0;
    drv->cuMemAddressReserve(&va, prop.size, 0, 0, 0);
    drv->cuMemMap(va, prop.size, 0, mc, 0);
    cudaStream_t s = StreamOn(0);
    void* a = Malloc(0, 64);
    cudaMemcpyAsync(reinterpret_cast<void*>(va), a, 64, cudaMemcpyDefault, s);
  });
  check("IPC mapping touched by a device that did not open it", [&] {
    void* a = Malloc(0, 64);
    cudaIpcMemHandle_t handle{};
    cudaIpcGetMemHandle(&handle, a);
    cudaSetDevice(1);
    void* mapped = nullptr;
    cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess);
    cudaStream_t s = StreamOn(2);
    void* b = Malloc(2, 64);
    cudaMemcpyAsync(b, mapped, 64, cudaMemcpyDefault, s);
  });
  check("cuMemMap mapping touched without cuMemSetAccess", [&] {
    const cuda::DriverApi* drv = nullptr;
    (void)cuda::LoadDriver(&drv);
    if (drv == nullptr) return;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
    const size_t bytes = size_t{2} << 20;
    CUmemGenericAllocationHandle h = 0, imported = 0;
    drv->cuMemCreate(&h, bytes, &prop, 0);
    CUmemFabricHandle fabric{};
    drv->cuMemExportToShareableHandle(&fabric, h, CU_MEM_HANDLE_TYPE_FABRIC, 0);
    drv->cuMemImportFromShareableHandle(&imported, &fabric, CU_MEM_HANDLE_TYPE_FABRIC);
    CUdeviceptr va = 0;
    drv->cuMemAddressReserve(&va, bytes, 0, 0, 0);
    drv->cuMemMap(va, bytes, 0, imported, 0);
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = 1;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    drv->cuMemSetAccess(va, bytes, &desc, 1);  // device 1 only
    cudaStream_t s = StreamOn(2);
    void* b = Malloc(2, 64);
    cudaMemcpyAsync(b, reinterpret_cast<void*>(va), 64, cudaMemcpyDefault, s);
  });
  // Two streams of one device share its only work queue (CUDA_DEVICE_MAX_CONNECTIONS=1):
  // the wait enqueued first blocks the write behind it that would satisfy it.
  auto wait_then_write = [&] {
    const cuda::DriverApi* drv = nullptr;
    (void)cuda::LoadDriver(&drv);
    if (drv == nullptr) return;
    cudaStream_t waits = StreamOn(0), writes = StreamOn(0);
    void* flag = Malloc(0, 4);
    drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(waits), reinterpret_cast<CUdeviceptr>(flag),
                             1, CU_STREAM_WAIT_VALUE_GEQ);
    drv->cuStreamWriteValue32(reinterpret_cast<CUstream>(writes),
                              reinterpret_cast<CUdeviceptr>(flag), 1,
                              CU_STREAM_WRITE_VALUE_DEFAULT);
  };
  check("blocked wait holds up its work queue", wait_then_write, 1);
  check("blocked wait, one work queue per stream (control)", wait_then_write, 8);
  // One communicator on two streams: rank 0 issues a receive on stream A,
  // then a send on stream B; rank 1 the same. Concurrent streams would
  // complete; NCCL serialises a communicator, so each receive waits for a
  // send the peer issued after its own receive.
  check("one communicator on two streams", [&] {
    ncclComm_t comms[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(comms, 2, devs);
    // Connected first (and run), so that only the serialisation is tested.
    ExchangeOnce(comms);
    Drain();
    for (int r = 0; r < 2; ++r) {
      cudaStream_t a = StreamOn(r), b = StreamOn(r);
      void* in = Malloc(r, 64);
      void* out = Malloc(r, 64);
      cudaSetDevice(r);
      ncclRecv(in, 16, ncclFloat32, 1 - r, comms[r], a);
      ncclSend(out, 16, ncclFloat32, 1 - r, comms[r], b);
    }
  });
  check("handler returns with a forked stream not joined", [&] {
    cudaStream_t xla = StreamOn(0), side = StreamOn(0);
    cudaEvent_t fork = nullptr;
    cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
    void* a = Malloc(0, 64);
    void* b = Malloc(0, 64);
    BeginHandler(xla);
    cudaEventRecord(fork, xla);
    cudaStreamWaitEvent(side, fork, 0);
    cudaMemcpyAsync(b, a, 64, cudaMemcpyDefault, side);  // ... and no join back into xla
    EndHandler(xla, "a deliberately broken handler");
  });
  check("communicator used after ncclCommAbort", [&] {
    ncclComm_t comms[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(comms, 2, devs);
    cudaStream_t s = StreamOn(0);
    void* a = Malloc(0, 64);
    ncclCommAbort(comms[0]);  // as a watchdog would, from another thread
    cudaSetDevice(0);
    ncclSend(a, 16, ncclFloat32, 1, comms[0], s);
  });
  check("non-blocking communicator destroyed without finalize", [&] {
    ncclUniqueId id{};
    ncclGetUniqueId(&id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    cudaSetDevice(0);
    ncclCommInitRankConfig(&comm, 1, id, 0, &config);
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) ncclCommGetAsyncError(comm, &state);
    ncclCommDestroy(comm);
  });
  check("host query of an event recorded in a stream capture", [&] {
    cudaStream_t s = StreamOn(0);
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    cudaEventRecord(e, s);
    (void)cudaEventQuery(e);
  });
  check("device synchronisation behind a wait that never ends", [&] {
    const cuda::DriverApi* drv = nullptr;
    (void)cuda::LoadDriver(&drv);
    if (drv == nullptr) return;
    cudaStream_t s = StreamOn(0);
    void* flag = Malloc(0, 4);
    drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), 1,
                             CU_STREAM_WAIT_VALUE_GEQ);
    (void)cudaDeviceSynchronize();
  });
  // The fused GEMM (docs/gpu-internals.md §5) on two GPUs: each one's kernel multiplies two shards
  // of 8 rows, its own in place and the peer's, which the peer copies in (the copy engine) and then
  // flags; the kernel waits for that flag. How each GPU enqueues its part:
  //  * kOutgoingFirst: its outgoing copy and flag, then the kernel, then work on the kernel's
  //    stream that waits for it (the gathered x's copy) - the issue order's rule;
  //  * kKernelFirst: the kernel and the work behind it first, then the outgoing copy: with one
  //    work queue the work behind the kernel holds up the copy the peer's kernel waits for;
  //  * kProducerAfter: the outgoing data made by a kernel (as a multimem store is) enqueued
  //    after the fused GEMM on another stream: it needs SMs, which the fused GEMM holds until
  //    the peer's data arrives, on any number of work queues (rule 1);
  //  * kProducerFirst: that kernel ordered before the fused GEMM by a stream dependency (an
  //    event), as the multicast programs order their own stores (the control; enqueued first
  //    without the event, it might still start after the kernel on another work queue);
  //  * kCopy2DAfter: kKernelFirst with the outgoing copy a 2-D one (cudaMemcpy2DAsync): CUDA
  //    documents no copy engine for it, and run as a kernel it would wait for the SMs the fused
  //    GEMM holds (kKernelFirst on separate work queues is its control: a 1-D copy).
  enum class Fused { kOutgoingFirst, kKernelFirst, kProducerAfter, kProducerFirst, kCopy2DAfter };
  // sm_count: the SMs each fused GEMM holds (every SM of the fake's H100 by default; fewer is
  // the loopback's share of a device).
  auto fused_pair = [&](Fused how, int sm_count = 132) {
    const cuda::DriverApi* drv = nullptr;
    (void)cuda::LoadDriver(&drv);
    if (drv == nullptr) return;
    cuda::ErrorContext ctx;
    ctx.op = "fused misuse check";
    constexpr int64_t kRows = 8, kK = 8, kN = 8;
    const size_t es = 2, shard = kRows * kK * es;
    std::byte* a[2];
    void *x[2], *flags[2];
    cudaStream_t s0[2], s1[2];
    cuda::FusedGemmArgs args[2];
    cuda::BlockArgs add[2];
    static const int32_t kSequence[2][2] = {{0, 1}, {1, 0}};
    for (int d = 0; d < 2; ++d) {
      cudaSetDevice(d);
      cudaDeviceEnablePeerAccess(1 - d, 0);
      s0[d] = StreamOn(d);
      s1[d] = StreamOn(d);
      a[d] = static_cast<std::byte*>(Malloc(d, 2 * shard, 0x3c));  // bf16 1.2 everywhere
      x[d] = Malloc(d, shard, 0x3c);
      flags[d] = Malloc(d, 8);
      cuda::FusedGemmArgs& f = args[d];
      f.types = {DType::kBF16, DType::kBF16, DType::kBF16};
      f.m = 2 * kRows;
      f.n = kN;
      f.k = kK;
      f.a = a[d];
      f.lda = kK;
      f.b = Malloc(d, kK * kN * es, 0x3c);
      f.ldb = kN;
      f.d = Malloc(d, 2 * kRows * kN * es);
      f.ldd = kN;
      f.blocks = fused::RowBlocks{2, 1, kRows};
      f.sequence = kSequence[d];
      f.wait_flags = static_cast<const uint32_t*>(flags[d]);
      f.ready_shard = d;
      f.epoch = 1;
      f.timeout_ns = int64_t{1} << 40;
      f.fault = static_cast<cuda::FusedGemmFault*>(Malloc(d, sizeof(cuda::FusedGemmFault)));
      f.sm_count = sm_count;
      add[d].dtype = DType::kBF16;
      add[d].dst = x[d];
      add[d].src = x[d];
      add[d].batch = 1;
      add[d].m = kRows;
      add[d].n = kK;
      add[d].src_ld = add[d].dst_ld = kK;
      // Set-up: the arguments checked (the tile order made) and the kernels loaded before
      // anything is enqueued.
      (void)cuda::CheckFusedGemm(&f);
      (void)cuda::PrepareFusedGemm(f.types, cuda::FusedKernel::kSm90, ctx);
      (void)cuda::PrepareBlockKernel(cuda::BlockKernel::kAdd, add[d], ctx);
    }
    auto outgoing = [&](int d) {
      cudaSetDevice(d);
      if (how == Fused::kCopy2DAfter) {  // the shard's rows, one pitched copy
        cudaMemcpy2DAsync(a[1 - d] + d * shard, kK * es, x[d], kK * es, kK * es, kRows,
                          cudaMemcpyDefault, s1[d]);
      } else {
        cudaMemcpyAsync(a[1 - d] + d * shard, x[d], shard, cudaMemcpyDefault, s1[d]);
      }
      drv->cuStreamWriteValue32(
          reinterpret_cast<CUstream>(s1[d]),
          reinterpret_cast<CUdeviceptr>(static_cast<uint32_t*>(flags[1 - d]) + d), 1,
          CU_STREAM_WRITE_VALUE_DEFAULT);
    };
    auto kernel = [&](int d) {
      cudaSetDevice(d);
      (void)cuda::LaunchFusedGemm(args[d], s0[d], ctx);
      cudaMemsetAsync(x[d], 0, 2, s0[d]);  // stands for the gathered x's copy after the kernel
    };
    for (int d = 0; d < 2; ++d) {
      cudaSetDevice(d);
      switch (how) {
        case Fused::kOutgoingFirst:
          outgoing(d);
          kernel(d);
          break;
        case Fused::kKernelFirst:
        case Fused::kCopy2DAfter:
          kernel(d);
          outgoing(d);
          break;
        case Fused::kProducerAfter:
          kernel(d);
          (void)cuda::LaunchAddBlock(add[d], s1[d], ctx);
          outgoing(d);
          break;
        case Fused::kProducerFirst: {
          cudaEvent_t made = nullptr;
          cudaEventCreateWithFlags(&made, cudaEventDisableTiming);
          (void)cuda::LaunchAddBlock(add[d], s1[d], ctx);
          cudaEventRecord(made, s1[d]);
          cudaStreamWaitEvent(s0[d], made, 0);
          outgoing(d);
          kernel(d);
          break;
        }
      }
    }
  };
  // The fused kernel's dynamic shared memory (more than 48 KB) granted on device 0 only, then
  // launched on device 1: the grant is per device (the function as loaded in its context). The
  // controls are the fused checks below: PrepareFusedGemm grants it on every device it prepares.
  auto fused_on_device_1 = [&] {
    cuda::ErrorContext ctx;
    ctx.op = "fused shared memory check";
    const void* kernel = cuda::fused_kernel::FunctionBF16();
    const int shared = cuda::fused_kernel::SharedBytesBF16();
    for (int d = 0; d < 2; ++d) {
      cudaSetDevice(d);
      cudaFuncAttributes attr{};
      cudaFuncGetAttributes(&attr, kernel);  // loaded on both
      if (d == 0) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    }
    constexpr int64_t kN = 8;
    cudaStream_t s = StreamOn(1);
    cuda::fused_kernel::Launch l;
    l.m = l.n = l.k = kN;
    l.a = Malloc(1, kN * kN * 2);
    l.b = Malloc(1, kN * kN * 2);
    l.d = Malloc(1, kN * kN * 2);
    l.lda = l.ldb = l.ldd = kN;
    l.blocks = fused::RowBlocks{1, 1, kN};
    l.sm_count = 132;
    (void)cuda::fused_kernel::LaunchBF16(l, s, ctx);
  };
  check("fused GEMM launched on a device without its shared memory grant", fused_on_device_1);
  // A trapping fused GEMM (a replayable call's, Launch::trap) records why a wait gave up in
  // page-locked host memory (cudaMallocHost), which the watchdog reads from the host while the
  // kernel may still run and which stays readable once the trap (PTX ISA, "trap": "Abort
  // execution and generate an interrupt to the host CPU") has left the context its sticky
  // error; a record in device memory is refused at launch. The control: the same launch with
  // its record page-locked, its flag raised, runs through.
  auto fused_trap_record = [&](bool pinned) {
    cuda::ErrorContext ctx;
    ctx.op = "fused trap record check";
    constexpr int64_t kN = 8;
    static const int32_t kOnlyBlock[1] = {0};  // the tile order's sequence
    cuda::FusedGemmArgs f;
    f.m = f.n = f.k = kN;
    f.a = Malloc(0, kN * kN * 2, 0x3c);
    f.b = Malloc(0, kN * kN * 2, 0x3c);
    f.d = Malloc(0, kN * kN * 2);
    f.lda = f.ldb = f.ldd = kN;
    f.blocks = fused::RowBlocks{1, 1, kN};
    f.sequence = kOnlyBlock;
    f.wait_flags = static_cast<const uint32_t*>(Malloc(0, 4, 0x01));  // raised: >= epoch 1
    f.epoch = 1;
    f.timeout_ns = int64_t{1} << 40;
    f.trap = true;
    void* record = nullptr;
    if (pinned)
      (void)cudaMallocHost(&record, sizeof(cuda::FusedGemmFault));
    else
      record = Malloc(0, sizeof(cuda::FusedGemmFault));
    f.fault = static_cast<cuda::FusedGemmFault*>(record);
    f.sm_count = 132;
    (void)cuda::CheckFusedGemm(&f);
    (void)cuda::PrepareFusedGemm(f.types, cuda::FusedKernel::kSm90, ctx);
    cudaStream_t s = StreamOn(0);
    (void)cuda::LaunchFusedGemm(f, s, ctx);
    (void)cudaStreamSynchronize(s);
    if (pinned) (void)cudaFreeHost(record);
  };
  check("a trapping fused GEMM's fault record in device memory", [&] { fused_trap_record(false); });
  check("a trapping fused GEMM's fault record in page-locked host memory (control)",
        [&] { fused_trap_record(true); });
  check(
      "fused GEMM enqueued before its own outgoing copy", [&] { fused_pair(Fused::kKernelFirst); },
      1);
  check(
      "fused GEMM after its own outgoing copy (control)",
      [&] { fused_pair(Fused::kOutgoingFirst); }, 1);
  check("a 2-D peer copy behind the fused GEMM", [&] { fused_pair(Fused::kCopy2DAfter); }, 8);
  check(
      "a 1-D peer copy behind the fused GEMM (control)", [&] { fused_pair(Fused::kKernelFirst); },
      8);
  check(
      "a kernel the fused GEMM waits for, queued behind it",
      [&] { fused_pair(Fused::kProducerAfter); }, 8);
  check(
      "a kernel the fused GEMM waits for, before it (control)",
      [&] { fused_pair(Fused::kProducerFirst); }, 8);
  // A persistent kernel holds the SMs of its launch (sm_count), not the device's others: a
  // kernel behind it on the SMs it leaves free runs (the loopback's ranks share a device so).
  check(
      "a kernel the fused GEMM waits for, queued behind it on SMs it leaves free (control)",
      [&] { fused_pair(Fused::kProducerAfter, 66); }, 8);
  ResetExecutorAndFake(Config());
  return out;
}

}  // namespace jo::fake
