// What every executor does with one call's identity, whatever runs it: the
// signature all ranks of a clique must agree on, and the debug print of the
// plan.
#pragma once

#include <string>

#include "core/clique.h"
#include "core/program.h"

namespace jo {

// The call as every rank of a clique must see it (everything but the rank):
// ranks that disagree on it at the same epoch are running different calls.
std::string CallSignature(const Problem& q);

// JAXOVERLAP_LOG=debug: prints each distinct plan once (rank 0 prints it);
// `executor` names who runs it ("host", "cuda").
void LogPlanOnce(const Program& program, const CliqueKey& key, const char* executor);

}  // namespace jo
