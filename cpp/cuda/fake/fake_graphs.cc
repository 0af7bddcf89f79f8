// The fake's stream capture and CUDA graphs: what XLA does with a command buffer (it captures
// the work a command-buffer compatible handler enqueues on its stream into a graph, and then
// launches that graph instead of calling the handler: openxla/xla,
// xla/backends/gpu/runtime/command_buffer_cmd.cc and command_buffer_thunk.cc).
//
// Rules modelled, from the CUDA programming guide ("CUDA Graphs": "Creating a Graph Using
// Stream Capture"; "Prohibited and Unhandled Operations") and the runtime API reference
// (cudaStreamBeginCapture, cudaGraphInstantiate, cudaGraphLaunch):
//  * work enqueued on a capturing stream is recorded into the capture's graph, not run; a
//    stream waiting on an event recorded in the capture joins it (fake_runtime.cc);
//  * querying the execution status of a captured event is prohibited (fake_runtime.cc);
//  * a graph launch runs every recorded node again with the arguments it was recorded with: a
//    kernel's parameters as copied at its launch, a stream memory operation's value, a copy's
//    addresses — whatever the host computed at capture time is replayed as is, which is why a
//    call whose host side takes an epoch per call must not be captured (docs/gpu-internals.md §7);
//  * the nodes of one launch run in their recorded order on the launch's stream; graphs
//    recorded from several streams are not modelled (a launch of one is refused, naming the
//    other stream), nor are launches of a graph on another device than it was captured on.
#include <string>

#include "cuda/fake/fake_internal.h"

namespace jo::fake {

void RecordIntoCapture(cudaStream_t s, FakeTask task) {
  auto it = S().capturing.find(s->capture);
  if (it == S().capturing.end()) {
    Fail("a task (" + task.what + ") was enqueued on a capturing stream whose capture is unknown");
    return;
  }
  CUgraph_st* graph = it->second;
  if (s != graph->origin && graph->other_stream.empty())
    graph->other_stream =
        "device " + std::to_string(s->device) + " stream " + std::to_string(s->id);
  graph->tasks.push_back(std::move(task));
}

}  // namespace jo::fake

using jo::fake::Count;
using jo::fake::Lock;
using jo::fake::RtFail;
using jo::fake::S;

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  Count("cudaStreamBeginCapture");
  Lock lock(S().mu);
  if (!jo::fake::StreamOk(s, "cudaStreamBeginCapture") || s->capture != 0)
    return RtFail(cudaErrorIllegalState, "cudaStreamBeginCapture");
  s->capture = S().next_capture++;
  auto graph = std::make_unique<CUgraph_st>();
  graph->capture = s->capture;
  graph->process = s->process;
  graph->device = s->device;
  graph->origin = s;
  S().capturing[s->capture] = graph.get();
  S().graphs.push_back(std::move(graph));
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  Count("cudaStreamEndCapture");
  Lock lock(S().mu);
  if (!jo::fake::StreamOk(s, "cudaStreamEndCapture") || s->capture == 0)
    return RtFail(cudaErrorIllegalState, "cudaStreamEndCapture");
  const uint64_t capture = s->capture;
  for (auto& st : S().streams)
    if (st->capture == capture) st->capture = 0;
  const auto it = S().capturing.find(capture);
  CUgraph_st* made = it == S().capturing.end() ? nullptr : it->second;
  S().capturing.erase(capture);
  if (graph != nullptr) *graph = made;
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  Count("cudaGraphInstantiate");
  Lock lock(S().mu);
  bool known = false;
  for (const auto& g : S().graphs) known = known || g.get() == graph;
  if (!known || exec == nullptr) return RtFail(cudaErrorInvalidValue, "cudaGraphInstantiate");
  auto made = std::make_unique<CUgraphExec_st>();
  made->graph.capture = graph->capture;
  made->graph.process = graph->process;
  made->graph.device = graph->device;
  made->graph.tasks = graph->tasks;
  made->graph.other_stream = graph->other_stream;
  *exec = made.get();
  S().graph_execs.push_back(std::move(made));
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  Count("cudaGraphLaunch");
  Lock lock(S().mu);
  bool known = false;
  for (const auto& e : S().graph_execs) known = known || e.get() == exec;
  if (!known || !jo::fake::StreamOk(s, "cudaGraphLaunch"))
    return RtFail(cudaErrorInvalidValue, "cudaGraphLaunch: unknown executable graph or stream");
  const CUgraph_st& graph = exec->graph;
  if (!graph.other_stream.empty())
    return RtFail(cudaErrorNotSupported,
                  "cudaGraphLaunch: a graph recorded from several streams (" + graph.other_stream +
                      ") is not modelled by the fake");
  if (s->device != graph.device || s->process != graph.process)
    return RtFail(cudaErrorInvalidValue,
                  "cudaGraphLaunch: a graph captured on device " + std::to_string(graph.device) +
                      " launched on a stream of device " + std::to_string(s->device));
  if (const cudaError_t sticky = jo::fake::StickyError(s->device); sticky != cudaSuccess)
    return sticky;
  for (const FakeTask& task : graph.tasks) {
    FakeTask again = task;
    again.what = "graph replay: " + task.what;
    jo::fake::Push(s, std::move(again));
  }
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t) {
  Count("cudaGraphExecDestroy");
  return cudaSuccess;  // kept until Reset
}

cudaError_t cudaGraphDestroy(cudaGraph_t) {
  Count("cudaGraphDestroy");
  return cudaSuccess;  // kept until Reset
}
