// The misuse suite of the fused GEMM + reduce-scatter's reduction beside the kernel
// (ReduceMisuseChecks, fake_checks.h): a reduction that reads a block of the kernel's
// output before its release, and one that finds fewer SMs free than it is sized to.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "cuda/base/check.h"
#include "cuda/base/driver.h"
#include "cuda/fake/fake_checks.h"
#include "cuda/fake/fake_harness.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/fused/fused_gemm.h"
#include "cuda/kernels/kernels.h"

namespace jo::fake {

std::map<std::string, std::string> ReduceMisuseChecks() {
  std::map<std::string, std::string> out;
  // One device of 8 SMs, one work queue (the issue order is the start order). Its fused GEMM
  // computes two blocks of 1024 rows (8 tiles each, 16 units: more than the device has SMs) and
  // releases each once stored; a Reduce on another stream sums block 0 and a block of its own
  // into y, sized to 2 SMs (what the GEMM leaves when launched on 6).
  enum class How {
    kControl,     // waits for block 0's release; the GEMM leaves it 2 SMs
    kNoWait,      // reads block 0 without waiting for its release
    kCopyNoWait,  // copies block 0 out (the copy engine) without waiting for its release
    kNoSms,       // waits, but the GEMM was launched on every SM
  };
  auto run = [&](const std::string& name, How how) {
    Config config;
    config.devices = 1;
    config.sms = 8;
    config.connections = 1;
    ResetExecutorAndFake(config);
    cudaSetDevice(0);
    const cuda::DriverApi* drv = nullptr;
    if (!cuda::LoadDriver(&drv).ok()) return;
    cuda::ErrorContext ctx;
    ctx.op = "reduce misuse check";
    constexpr int64_t kRows = 1024, kK = 16, kN = 16, kEs = 2;
    cudaStream_t gemm = StreamOn(0), reduce = StreamOn(0);
    static const int32_t kSequence[2] = {0, 1};
    cuda::FusedGemmArgs f;
    f.types = {DType::kBF16, DType::kBF16, DType::kBF16};
    f.m = 2 * kRows;
    f.n = kN;
    f.k = kK;
    f.a = Malloc(0, f.m * kK * kEs, 0x3c);  // bf16 1.2 everywhere
    f.lda = kK;
    f.b = Malloc(0, kK * kN * kEs, 0x3c);
    f.ldb = kN;
    f.d = Malloc(0, f.m * kN * kEs);
    f.ldd = kN;
    f.blocks = fused::RowBlocks{2, 1, kRows};
    f.sequence = kSequence;
    f.key = fused::OrderKey::kFirstDeparture;
    auto* flags = static_cast<uint32_t*>(Malloc(0, 2 * sizeof(uint32_t)));
    f.release_flags = flags;
    f.counters = static_cast<uint32_t*>(Malloc(0, cuda::fused_kernel::Launch::CounterBytes(2)));
    f.epoch = 1;
    f.sm_count = how == How::kNoSms ? config.sms : config.sms - 2;
    (void)cuda::CheckFusedGemm(&f);
    (void)cuda::PrepareFusedGemm(f.types, cuda::FusedKernel::kSm90, ctx);
    cuda::ReduceArgs r;
    r.dtype = DType::kBF16;
    r.dst = Malloc(0, kRows * kN * kEs);
    r.batch = 1;
    r.m = kRows;
    r.n = kN;
    r.dst_ld = kN;
    r.sources = {{f.d, 0, kN}, {Malloc(0, kRows * kN * kEs, 0x3c), 0, kN}};
    r.sms = 2;
    (void)cuda::PrepareReduce(r, ctx);
    (void)cuda::LaunchFusedGemm(f, gemm, ctx);
    if (how != How::kNoWait && how != How::kCopyNoWait)
      drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(reduce),
                               reinterpret_cast<CUdeviceptr>(flags), 1, CU_STREAM_WAIT_VALUE_GEQ);
    if (how == How::kCopyNoWait)
      cudaMemcpyAsync(r.dst, f.d, kRows * kN * kEs, cudaMemcpyDefault, reduce);
    else
      (void)cuda::LaunchReduce(r, reduce, ctx);
    Drain();
    const auto errors = Errors();
    out[name] = errors.empty() ? "" : errors.front();
  };
  run("a reduction beside the fused GEMM, after its release, on the SMs it leaves (control)",
      How::kControl);
  run("a block reduced before its release", How::kNoWait);
  run("a block copied out before its release", How::kCopyNoWait);
  run("a reduction sized to SMs the fused GEMM does not leave", How::kNoSms);
  ResetExecutorAndFake(Config());
  return out;
}

}  // namespace jo::fake
