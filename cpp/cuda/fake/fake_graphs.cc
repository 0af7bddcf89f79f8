// The fake's stream capture and CUDA graphs: what XLA does with a command buffer (it captures
// the work a command-buffer compatible handler enqueues on its stream into a graph, and then
// launches that graph instead of calling the handler: openxla/xla,
// xla/backends/gpu/runtime/command_buffer_cmd.cc and command_buffer_thunk.cc).
//
// Rules modelled, from the CUDA programming guide ("CUDA Graphs": "Creating a Graph Using
// Stream Capture", "Cross-stream Dependencies and Events", "Prohibited and Unhandled
// Operations") and the runtime API reference (cudaStreamBeginCapture, cudaStreamEndCapture,
// cudaGraphInstantiate, cudaGraphLaunch):
//  * work enqueued on a capturing stream is recorded into the capture's graph, not run;
//  * a stream that waits on an event recorded in a capture joins that capture (a fork), and its
//    later work is recorded too; the capture's event records and waits are the graph's edges
//    between its streams ("Cross-stream Dependencies and Events");
//  * every stream that joined must be joined back into the origin stream before the capture
//    ends, else cudaStreamEndCapture fails with cudaErrorStreamCaptureUnjoined ("the capture
//    sequence contains a fork that was not joined to the primary stream", driver_types.h); the
//    fake accepts a join only as the origin's wait on a record made on that stream after its
//    last work (no join through a third stream);
//  * querying the execution status of a captured event is prohibited (fake_runtime.cc);
//  * a graph launch runs every recorded node again with the arguments it was recorded with: a
//    kernel's parameters as copied at its launch, a stream memory operation's value, a copy's
//    addresses — whatever the host computed at capture time is replayed as is, which is why a
//    call whose host side takes an epoch per call must not be captured (docs/gpu-internals.md §7);
//  * a launch runs the origin's nodes on the launch's stream and each other captured stream's
//    nodes on a stream of the executable's own (made at its first launch, on the same device
//    and its work queues, kept for later launches: a launch is ordered after the previous one
//    of the same executable), with the capture's records and waits between them, so branches
//    of the graph run concurrently as they did when captured; the nodes are enqueued in the
//    order they were recorded. Launches of a graph on another device than it was captured on
//    are not modelled (refused).
#include <map>
#include <memory>
#include <string>

#include "cuda/fake/fake_internal.h"

namespace jo::fake {

namespace {

CUgraph_st* CaptureOf(cudaStream_t s, const std::string& what) {
  auto it = S().capturing.find(s->capture);
  if (it != S().capturing.end()) return it->second;
  Fail(what + " was enqueued on a capturing stream whose capture is unknown");
  return nullptr;
}

// Why the capture of `graph` cannot end: a stream that joined it and was not joined back into
// the origin after its last work ("" if none).
std::string Unjoined(const CUgraph_st& graph) {
  std::map<const CUstream_st*, size_t> last_work;  // per stream: after its last non-record node
  for (size_t i = 0; i < graph.nodes.size(); ++i)
    if (graph.nodes[i].kind != CUgraph_st::Node::kRecord) last_work[graph.nodes[i].stream] = i + 1;
  for (const auto& [stream, after] : last_work) {
    if (stream == graph.origin) continue;
    bool joined = false;
    for (const auto& wait : graph.nodes) {
      if (wait.kind != CUgraph_st::Node::kWait || wait.stream != graph.origin) continue;
      for (size_t i = after; i < graph.nodes.size() && !joined; ++i)
        joined = graph.nodes[i].kind == CUgraph_st::Node::kRecord &&
                 graph.nodes[i].stream == stream && graph.nodes[i].event == wait.event;
    }
    if (!joined)
      return "device " + std::to_string(stream->device) + " stream " + std::to_string(stream->id);
  }
  return "";
}

}  // namespace

void RecordIntoCapture(cudaStream_t s, FakeTask task) {
  CUgraph_st* graph = CaptureOf(s, "a task (" + task.what + ")");
  if (graph == nullptr) return;
  CUgraph_st::Node node;
  node.stream = s;
  node.task = std::move(task);
  graph->nodes.push_back(std::move(node));
}

void RecordEventIntoCapture(cudaEvent_t e, cudaStream_t s) {
  CUgraph_st* graph = CaptureOf(s, "an event record");
  if (graph == nullptr) return;
  e->captured = s->capture;
  e->captured_record = graph->records++;
  CUgraph_st::Node node;
  node.kind = CUgraph_st::Node::kRecord;
  node.stream = s;
  node.event = e->captured_record;
  graph->nodes.push_back(std::move(node));
}

void WaitIntoCapture(cudaStream_t s, cudaEvent_t e) {
  CUgraph_st* graph = CaptureOf(s, "an event wait");
  if (graph == nullptr) return;
  CUgraph_st::Node node;
  node.kind = CUgraph_st::Node::kWait;
  node.stream = s;
  node.event = e->captured_record;
  graph->nodes.push_back(std::move(node));
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
  const auto it = S().capturing.find(capture);
  CUgraph_st* made = it == S().capturing.end() ? nullptr : it->second;
  if (made == nullptr || made->origin != s)
    return RtFail(cudaErrorStreamCaptureUnmatched,
                  "cudaStreamEndCapture: the capture was not begun on this stream");
  for (auto& st : S().streams)
    if (st->capture == capture) st->capture = 0;
  S().capturing.erase(capture);
  if (graph != nullptr) *graph = nullptr;
  const std::string unjoined = jo::fake::Unjoined(*made);
  if (!unjoined.empty())
    return RtFail(cudaErrorStreamCaptureUnjoined,
                  "cudaStreamEndCapture: " + unjoined +
                      " joined the capture and was not joined back into the origin stream "
                      "(CUDA programming guide, \"Cross-stream Dependencies and Events\"; "
                      "cudaErrorStreamCaptureUnjoined)");
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
  made->graph.origin = graph->origin;
  made->graph.nodes = graph->nodes;
  made->graph.records = graph->records;
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
  if (s->device != graph.device || s->process != graph.process)
    return RtFail(cudaErrorInvalidValue,
                  "cudaGraphLaunch: a graph captured on device " + std::to_string(graph.device) +
                      " launched on a stream of device " + std::to_string(s->device));
  if (const cudaError_t sticky = jo::fake::StickyError(s->device); sticky != cudaSuccess)
    return sticky;
  // The executable's own streams and events, made at its first launch.
  for (const auto& node : graph.nodes) {
    if (node.stream == graph.origin || exec->lanes.count(node.stream) != 0) continue;
    auto lane = std::make_unique<CUstream_st>();
    lane->device = graph.device;
    lane->process = graph.process;
    lane->id = S().stream_ids++;
    jo::fake::MapOntoQueue(lane.get());
    exec->lanes[node.stream] = lane.get();
    S().streams.push_back(std::move(lane));
  }
  while (static_cast<int>(exec->events.size()) < graph.records) {
    auto event = std::make_unique<CUevent_st>();
    event->device = graph.device;
    exec->events.push_back(event.get());
    S().events.push_back(std::move(event));
  }
  for (const auto& node : graph.nodes) {
    CUstream_st* on = node.stream == graph.origin ? s : exec->lanes.at(node.stream);
    switch (node.kind) {
      case CUgraph_st::Node::kTask: {
        FakeTask again = node.task;
        again.what = "graph replay: " + node.task.what;
        jo::fake::Push(on, std::move(again));
        break;
      }
      case CUgraph_st::Node::kRecord:
        jo::fake::RecordEvent(exec->events.at(static_cast<size_t>(node.event)), on);
        break;
      case CUgraph_st::Node::kWait:
        jo::fake::WaitEvent(on, exec->events.at(static_cast<size_t>(node.event)));
        break;
    }
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
