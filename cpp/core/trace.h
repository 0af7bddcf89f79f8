// Timelines of native calls, for the overlap report and Chrome/Perfetto
// traces (jaxoverlap/_profile.py). While recording is on, an executor logs
// one CallSpan per call of a rank, with one OpSpan per op of its program:
// which op, on which stream, for which shard and sub-chunk, and when it
// started, when what it waited for was there, and when it ended. Off (the
// default), recording costs one relaxed atomic load per call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/program.h"

namespace jo {

struct OpSpan {
  int32_t index = 0;  // position in the program's op list
  int32_t stream = 0;
  OpKind kind = OpKind::kGemm;
  int32_t shard = -1, sub = -1, peer = -1;  // peer: Send/Recv/Signal/Wait's, a p2p Copy's target
  int64_t bytes = 0;     // what it moved or multiplied out (batch * m * n * element)
  int64_t start_ns = 0;  // it was reached on its stream
  int64_t ready_ns = 0;  // what it waited for was there (a flag, a message); = start otherwise
  int64_t end_ns = 0;
};

struct CallSpan {
  std::string executor;  // "host" or "cuda"
  std::string clique;    // "clique 0x.../site 3/group 0"
  int64_t epoch = 0;
  Problem problem;  // with the rank
  int64_t start_ns = 0, end_ns = 0;
  bool ok = true;
  std::vector<OpSpan> ops;
};

void SetRecording(bool on);
bool Recording();
int64_t NowNs();  // steady clock, as every span uses
void LogCall(CallSpan span);
std::vector<CallSpan> TakeCalls();  // and forget them

}  // namespace jo
