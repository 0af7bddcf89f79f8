// Host calls that wait for the GPU, as the fake models them (fake_waits.cc).
//
// Internal to the fake: the API files call these where the real call waits.
// Every function here must be called WITHOUT the fake's lock held: a wait
// lets the other host threads (ranks) go on enqueueing meanwhile.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <functional>

#include <string>

namespace jo::fake {

// Waits until every task enqueued on `device` (of this thread's played
// process) before the call has completed, as cudaMalloc / cudaFree and the
// VMM unmap / release calls do. False, with a deadlock recorded, when that
// can never happen: the GPU cannot progress and no other host thread can
// enqueue what it needs (every one is waiting too, or gone).
// `settle`: see fake_waits.cc (threads that are not a rank's, e.g. concurrent aborts).
bool WaitForDevice(int device, const std::string& call, bool settle = false);

// cudaMalloc and cudaFree of `device`'s memory: WaitForDevice, and the same for every device
// with peer access to `device` (its memory is mapped into theirs). See fake_waits.cc.
bool WaitForMemoryOf(int device, const std::string& call);

// What WaitForDevice waits for: every task enqueued on `device` (of this thread's played
// process) before now has completed, or was dropped. Without the lock held.
std::function<bool()> DeviceWorkBefore(int device);

// Waits until `done` holds, as WaitForDevice does (false, with the deadlock recorded as `what`
// "would wait forever", when it never can).
bool WaitFor(const std::function<bool()>& done, const std::string& what);

// Waits until the task `seq` (1-based) of stream `s` has completed, as a device-to-host copy into
// pageable memory does; false as above (the copy dropped).
bool WaitForTask(cudaStream_t s, int64_t seq, const std::string& call);

// Lazy loading: the first use of `function` on `device` loads it, which may
// wait for the device (WaitForDevice); false as above. Eager loading (and
// every later use): true at once.
bool LoadFunction(int device, const std::string& function, const std::string& call);

// ncclCommAbort of `comm` (already marked aborted: its own kernels exit):
// waits until no other communicator's kernel runs on its device.
bool AwaitOtherCommunicators(ncclComm_t comm);

// Refuses (a recorded misuse) `api` when this thread is inside a handler that
// has already enqueued work and `api` is not one of the calls allowed there.
void CheckEnqueuePath(const char* api);

// Config::host_jitter: a seeded pause of this host thread (a rank's), so
// that the ranks' threads run at uneven speeds. Never with the lock held.
void Jitter();

// Host threads inside one of the waits above now (tests: "this thread waits for the GPU").
int ThreadsWaitingForGpu();

// Something a waiting host thread may be waiting for happened (work enqueued,
// a host thread left).
void NoteHostActivity();

// Forgets which functions are loaded (Reset).
void ResetWaits();

// From the scheduler (fake_queues.cc): whether this thread is inside a handler
// that has enqueued work; the deadlock report of the queues; dropping all work
// (a hung GPU: its events report a failure).
bool HandlerEnqueued();
std::string DescribeStuckWork();
void DropAllWork();

}  // namespace jo::fake
