// The fake GPU (see fake_runtime.h): streams mapped onto a device's hardware
// work queues, the scheduler that starts queue heads and completes kernels
// in flight, and the handler join check.
//
// The rule modelled (CUDA programming guide, "CUDA Environment Variables":
// CUDA_DEVICE_MAX_CONNECTIONS sets the number of compute and copy engine
// concurrent connections, i.e. work queues, from the host to each device,
// default 8; driver API reference, "Stream Memory Operations": a blocked
// wait can deadlock the application because the scheduler may serialise
// tasks in an order the waits do not express): a device's streams share
// its work queues; each queue is a FIFO of the tasks enqueued on its
// streams, in the order the host enqueued them, and starts only its head.
// A head that cannot start — its flag or event wait is unmet, or its stream's
// previous task (an NCCL kernel waiting for its peers) is still in flight —
// blocks every task behind it, whatever their stream. A started kernel that
// waits for peers does not block the queue, only its own stream.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

#include "cuda/fake/fake_internal.h"
#include "cuda/fake/fake_waits.h"

namespace jo::fake {
namespace {

// This thread's open handler (BeginHandler): every stream it enqueued on,
// with the sequence number of its last task there.
thread_local cudaStream_t t_handler = nullptr;
thread_local std::map<CUstream_st*, std::pair<int64_t, std::string>>* t_touched = nullptr;

std::vector<std::deque<CUstream_st*>>& QueuesOf(const CUstream_st* st) {
  auto& queues = S().queues[{st->process, st->device}];
  if (queues.empty()) queues.resize(static_cast<size_t>(S().connections));
  return queues;
}

void Complete(CUstream_st* s) { ++s->completed; }

// SMs of a device no persistent kernel holds.
int FreeSms(const std::pair<int, int>& where) {
  const auto held = S().sms_held.find(where);
  return S().config.sms - (held == S().sms_held.end() ? 0 : held->second);
}

// Whether kernel `task` finds the SMs it needs on `where` (a persistent kernel holds the SMs
// of its launch until it ends; a kernel needs one free SM, a persistent one all it holds).
// Reports, once, a kernel with an SM budget that could start now beside a persistent kernel
// but finds fewer SMs free than its grid is sized to: its blocks would wait for that kernel.
bool SmsFor(FakeTask& task, const std::pair<int, int>& where) {
  if (!task.sms) return true;
  State& s = S();
  const int free = FreeSms(where);
  const bool beside = free < s.config.sms;  // a persistent kernel holds some of them
  if (beside && task.sm_budget > free && !task.budget_reported && task.ready()) {
    task.budget_reported = true;
    Fail(task.what + " is sized to " + std::to_string(task.sm_budget) +
         " SMs, but the persistent kernel beside it leaves " + std::to_string(free) +
         " of the device's " + std::to_string(s.config.sms) +
         " free: its blocks wait for that kernel to end (the GPU distributes a grid's blocks to "
         "SMs with available capacity: CUDA programming guide, \"Hardware Implementation\"), "
         "so it no longer overlaps it. Launch the persistent kernel on sm_count = SMs - budget");
  }
  return free >= std::max(task.holds_sms, 1);
}

// One step of the GPU: completes a kernel in flight or starts a queue head.
// `random`: pick among the possible steps with the seeded generator (Drain),
// else the first (host polls: no generator draws that depend on thread timing).
bool Step(bool random) {
  State& s = S();
  for (;;) {
    std::vector<CUstream_st*> finishing, starting;
    const int64_t effects = s.side_effects;
    for (auto& st : s.streams)
      if (st->running && st->running->done()) finishing.push_back(st.get());
    if (!s.traps.empty()) {  // a polled kernel trapped: its device's work ends here
      const auto traps = std::move(s.traps);
      s.traps.clear();
      for (const auto& [device, code, why] : traps) Poison(device, code, why);
      return true;
    }
    for (auto& [where, queues] : s.queues) {
      for (auto& queue : queues) {
        if (queue.empty()) continue;
        CUstream_st* head = queue.front();
        FakeTask& next = head->tasks.front();
        if (head->running || !SmsFor(next, where)) continue;  // no SM free for it
        if (next.ready()) starting.push_back(head);
      }
    }
    const size_t options = finishing.size() + starting.size();
    if (options == 0) {
      if (s.side_effects != effects) continue;  // a kernel in flight made progress
      return false;
    }
    size_t pick = 0;
    if (random) pick = std::uniform_int_distribution<size_t>(0, options - 1)(s.rng);
    if (pick < finishing.size()) {
      CUstream_st* st = finishing[pick];
      std::unique_ptr<FakeTask> task = std::move(st->running);
      Complete(st);
      return true;
    }
    CUstream_st* st = starting[pick - finishing.size()];
    auto& queue = QueuesOf(st)[static_cast<size_t>(st->queue)];
    queue.pop_front();
    FakeTask task = std::move(st->tasks.front());
    st->tasks.pop_front();
    if (task.sms && !task.persistent && FreeSms({st->process, st->device}) < s.config.sms)
      ++s.counters["kernels beside a persistent kernel"];  // for tests: the overlap happened
    task.run();
    if (task.done) {
      st->running = std::make_unique<FakeTask>(std::move(task));
    } else {
      Complete(st);
    }
    return true;
  }
}

bool Idle() {
  for (auto& st : S().streams)
    if (!st->tasks.empty() || st->running) return false;
  return true;
}

std::string Describe(const CUstream_st* st) {
  return (st->process != 0 ? "process " + std::to_string(st->process) + " " : std::string()) +
         "device " + std::to_string(st->device) + " stream " + std::to_string(st->id);
}

// The deadlock report: for each queue, the head that cannot start and what
// waits behind it; the kernels in flight that never complete.
std::string DeadlockReport() {
  State& s = S();
  std::string text = "deadlock: no work queue can progress (CUDA_DEVICE_MAX_CONNECTIONS=" +
                     std::to_string(s.connections) + " work queues per device);";
  for (auto& [where, queues] : s.queues)
    for (size_t q = 0; q < queues.size(); ++q) {
      const auto& queue = queues[q];
      if (queue.empty()) continue;
      const CUstream_st* head = queue.front();
      const FakeTask& front = head->tasks.front();
      const bool no_sms = front.sms && FreeSms(where) < std::max(front.holds_sms, 1);
      text += " [device " + std::to_string(where.second) + " queue " + std::to_string(q) + ": " +
              Describe(head) + " blocked at " + head->tasks.front().what +
              (no_sms ? " (a kernel: a persistent kernel holds every SM it needs)" : "") +
              (head->running ? " (behind its " + head->running->what + " in flight)" : "");
      if (queue.size() > 1) {
        // The first task behind the head from another stream: what the shared queue holds up.
        for (size_t i = 1; i < queue.size(); ++i)
          if (queue[i] != head) {
            text += "; behind it in this queue: " + Describe(queue[i]) + " " +
                    queue[i]->tasks.front().what;
            break;
          }
        text += "; " + std::to_string(queue.size() - 1) + " task(s) behind it";
      }
      text += "]";
    }
  for (auto& st : s.streams)
    if (st->running && st->tasks.empty())
      text += " [" + Describe(st.get()) + ": " + st->running->what + " in flight, never matched]";
  return text;
}

// Work that will never run (a hung or dead GPU): dropped from the streams and
// work queues of `device` (-1: every device); its events report a failure to
// whoever polls them.
void DropWork(int device) {
  State& s = S();
  for (auto& st : s.streams) {
    if (device >= 0 && st->device != device) continue;
    for (FakeTask& task : st->tasks)
      if (task.records != nullptr) task.records->abandoned = true;
    if (st->running && st->running->records != nullptr) st->running->records->abandoned = true;
    st->tasks.clear();
    st->running.reset();
  }
  for (auto& [where, queues] : s.queues) {
    if (device >= 0 && where.second != device) continue;
    for (auto& queue : queues) queue.clear();
  }
  for (auto it = s.sms_held.begin(); it != s.sms_held.end();)
    it = device >= 0 && it->first.second != device ? std::next(it) : s.sms_held.erase(it);
}

}  // namespace

void Poison(int device, cudaError_t code, const std::string& why) {
  Lock lock(S().mu);
  Fail("sticky error on device " + std::to_string(device) + ": " + why);
  S().sticky.emplace(device, std::make_pair(code, why));
  DropWork(device);  // the context's queued work never runs
}

void PoisonWhenPolled(int device, cudaError_t code, std::string why) {
  Lock lock(S().mu);
  S().traps.emplace_back(device, code, std::move(why));
}

int ConnectionsFromEnvironment() {
  const char* text = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (text == nullptr || *text == '\0') return 8;  // the driver's default
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < 1 || v > 32) return 8;  // documented range: 1..32
  return static_cast<int>(v);
}

void ResetQueues() {
  S().queues.clear();
  S().traps.clear();
  S().streams_made.clear();
  S().connections =
      S().config.connections > 0 ? S().config.connections : ConnectionsFromEnvironment();
}

int Connections() {
  Lock lock(S().mu);
  return S().connections;
}

bool PersistentKernelPending(int process, int device) {
  for (const auto& st : S().streams) {
    if (st->process != process || st->device != device) continue;
    if (st->running && st->running->persistent) return true;
    for (const FakeTask& task : st->tasks)
      if (task.persistent) return true;
  }
  return false;
}

void MapOntoQueue(CUstream_st* st) {
  int& made = S().streams_made[{st->process, st->device}];
  st->queue = made++ % S().connections;
}

void Push(cudaStream_t s, FakeTask task) {
  if (s->capture != 0) {  // recorded into the capture's graph, not run now (fake_graphs.cc)
    RecordIntoCapture(s, std::move(task));
    return;
  }
  ++s->enqueued;
  s->clock[s] = s->enqueued;
  if (t_touched != nullptr) (*t_touched)[s] = {s->enqueued, task.what};
  s->tasks.push_back(std::move(task));
  QueuesOf(s)[static_cast<size_t>(s->queue)].push_back(s);
  NoteHostActivity();  // a host thread waiting for the GPU may now get what it waits for
}

void Push(cudaStream_t s, std::string what, std::function<bool()> ready,
          std::function<void()> run) {
  FakeTask task;
  task.what = std::move(what);
  task.ready = std::move(ready);
  task.run = std::move(run);
  Push(s, std::move(task));
}

void Enqueue(cudaStream_t s, const std::string& what, std::function<void()> run) {
  Lock lock(S().mu);
  Push(s, what, [] { return true; }, std::move(run));
}

void EnqueueKernel(cudaStream_t s, const std::string& what, std::function<void()> run,
                   int sm_budget) {
  Lock lock(S().mu);
  FakeTask task;
  task.what = what;
  task.sms = true;
  task.sm_budget = sm_budget;
  task.ready = [] { return true; };
  task.run = std::move(run);
  Push(s, std::move(task));
}

bool RunUntil(const std::function<bool()>& until) {
  while (!until())
    if (!Step(/*random=*/false)) return until();
  return true;
}

void PassTime(std::chrono::milliseconds step) {
  std::function<void(std::chrono::milliseconds)> pass_time;
  {
    Lock lock(S().mu);
    S().gpu_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(step).count();
    pass_time = S().config.pass_time;
  }
  if (pass_time) pass_time(step);
}

bool Drain() {
  std::unique_lock<std::recursive_mutex> lock(S().mu);
  State& s = S();
  constexpr std::chrono::milliseconds kStep(10);
  std::chrono::milliseconds grace(s.config.pass_time ? s.config.grace_ms : 0);
  for (;;) {
    if (Step(/*random=*/true)) continue;
    if (Idle()) return true;
    if (grace.count() > 0) {
      const auto step = std::min(kStep, grace);
      grace -= step;
      lock.unlock();  // the host's reaction (the watchdog) calls into the fake
      PassTime(step);
      lock.lock();
      continue;
    }
    s.errors.push_back(DeadlockReport());
    DropWork(-1);
    return false;
  }
}

void BeginHandler(cudaStream_t xla) {
  Lock lock(S().mu);
  t_handler = xla;
  delete t_touched;
  t_touched = new std::map<CUstream_st*, std::pair<int64_t, std::string>>();
}

void EndHandler(cudaStream_t xla, const std::string& who) {
  Lock lock(S().mu);
  if (t_touched == nullptr || t_handler != xla) {
    Fail("EndHandler without BeginHandler on this stream");
    return;
  }
  for (const auto& [st, last] : *t_touched) {
    if (st == xla) continue;
    const auto joined = xla->clock.find(st);
    const bool ordered = joined != xla->clock.end() && joined->second >= last.first;
    if (ordered || st->completed >= last.first) continue;
    Fail(who + " returned with work on " + Describe(st) + " (its last task: " + last.second +
         ") neither joined into XLA's stream nor complete: XLA reuses the call's buffers once "
         "the handler's work on its stream is done (https://openxla.org/xla/custom_call), so "
         "every forked stream must be joined back before the handler returns");
  }
  delete t_touched;
  t_touched = nullptr;
  t_handler = nullptr;
}

// The enqueue path begins with the handler's first task on XLA's stream (the fork, or
// the first op of a one-stream program); work on other streams before it is set-up.
bool HandlerEnqueued() { return t_touched != nullptr && t_touched->count(t_handler) > 0; }

std::string DescribeStuckWork() {
  Lock lock(S().mu);
  return DeadlockReport();
}

void DropAllWork() {
  Lock lock(S().mu);
  DropWork(-1);
}

}  // namespace jo::fake
