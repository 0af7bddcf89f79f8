// The fake NCCL: communicators (by unique id or split, blocking or not),
// groups and send/recv matched in order with rendezvous semantics.
//
// Rules enforced, from the NCCL documentation
// (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/):
//  * a non-blocking communicator whose call answered ncclInProgress must be
//    polled (ncclCommGetAsyncError) until ncclSuccess before its next call
//    (API, ncclCommGetAsyncError; usage, "Nonblocking Group Operation");
//  * a communicator's operations start in the order they were issued,
//    whatever stream they were issued on: NCCL serialises a communicator
//    (usage, "Using multiple NCCL communicators concurrently": operations
//    must be issued in the same order on all ranks; one communicator's
//    kernels never run concurrently), so two streams sharing one
//    communicator complete only in the host's issue order;
//  * ncclCommAbort and ncclCommDestroy free the communicator: any later use
//    is a use after free (API, "ncclCommAbort", "ncclCommDestroy");
//  * a non-blocking communicator is finalized (ncclCommFinalize) and polled
//    until ncclSuccess before ncclCommDestroy (usage, "Finalizing a
//    communicator" and "Destroying a communicator");
//  * the first send/recv of a communicator to a peer connects to that peer,
//    which waits for the device: NCCL sets up point-to-point connections when
//    a group first needs them (NCCL source, src/group.cc: ncclPreconnectFunc
//    -> ncclTransportP2pSetup, which allocates the connection's buffers in
//    device memory; NCCL_RUNTIME_CONNECT in the environment-variable docs
//    defers even the collectives' connections to their first use), and
//    allocating device memory synchronizes the device (usage, "Using multiple
//    NCCL communicators concurrently": operations of two communicators in
//    flight "could break at any time ... if some calls used inside NCCL
//    collectives were to perform a device synchronization (e.g. allocate some
//    CUDA memory dynamically)"). The fake waits in ncclGroupEnd (fake_waits.h
//    WaitForDevice); for a non-blocking communicator NCCL returns
//    ncclInProgress there and its caller's poll cannot succeed earlier. Such a
//    group is refused on a handler's enqueue path.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cuda/fake/fake_internal.h"
#include "cuda/fake/fake_waits.h"

using jo::fake::Count;
using jo::fake::Fail;
using jo::fake::Lock;
using jo::fake::RtFail;
using jo::fake::S;
using jo::fake::t_device;
using jo::fake::t_last;

// ================================ NCCL ================================

const char* ncclGetErrorString(ncclResult_t r) {
  Count("ncclGetErrorString");
  return r == ncclSuccess ? "no error" : "fake NCCL error (see fake errors)";
}
const char* ncclGetLastError(ncclComm_t) {
  Count("ncclGetLastError");
  return "";
}
ncclResult_t ncclGetVersion(int* v) {
  Count("ncclGetVersion");
  *v = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  Lock lock(S().mu);
  Count("ncclCommInitAll");
  const int clique = S().next_clique++;
  for (int r = 0; r < ndev; ++r) {
    if (!jo::fake::ValidDevice(devlist[r])) {
      Fail("ncclCommInitAll: bad device");
      return ncclInvalidArgument;
    }
    auto c = std::make_unique<ncclComm>();
    c->clique = clique;
    c->rank = r;
    c->nranks = ndev;
    c->device = devlist[r];
    comms[r] = c.get();
    S().comms.push_back(std::move(c));
  }
  return ncclSuccess;
}

// ncclGetUniqueId: distinct bytes per call and per OS process (pid, counter).
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  Lock lock(S().mu);
  Count("ncclGetUniqueId");
  std::memset(id->internal, 0, sizeof(id->internal));
  const std::string text = "fake-nccl-id pid=" + std::to_string(::getpid()) +
                           " n=" + std::to_string(S().next_unique_id++);
  std::memcpy(id->internal, text.data(), std::min(text.size(), sizeof(id->internal)));
  return ncclSuccess;
}

// ncclCommInitRank: ranks giving the same id join one clique (the fake's
// NCCL world is this process, so "other processes" are other callers here).
// Each rank joins once; nranks must agree. Unlike NCCL it does not block
// until every rank has joined: the fake's send/recv rendezvous in Drain()
// is what would hang on a missing rank.
static ncclResult_t InitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                             bool nonblocking);

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  Lock lock(S().mu);
  Count("ncclCommInitRank");
  return InitRank(comm, nranks, id, rank, false);
}

// Non-blocking (config->blocking == 0): the communicator is usable only once
// every rank of the id has joined (ncclCommGetAsyncError says when), so a
// rank whose peers never come waits — as long as its caller lets it.
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  Lock lock(S().mu);
  Count("ncclCommInitRankConfig");
  const bool nonblocking = config != nullptr && config->blocking == 0;
  const ncclResult_t r = InitRank(comm, nranks, id, rank, nonblocking);
  if (r != ncclSuccess || !nonblocking) return r;
  if (jo::fake::t_group_depth > 0) {
    jo::fake::t_group_nonblocking_init = true;
    return ncclSuccess;  // deferred to ncclGroupEnd
  }
  return ncclInProgress;
}

static ncclResult_t InitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                             bool nonblocking) {
  if (nranks < 1 || rank < 0 || rank >= nranks || !jo::fake::ValidDevice(t_device)) {
    Fail("ncclCommInitRank: bad nranks/rank/current device");
    return ncclInvalidArgument;
  }
  const std::string key(id.internal, sizeof(id.internal));
  if (key.rfind("fake-nccl-id", 0) != 0) {
    Fail("ncclCommInitRank: the id was not made by ncclGetUniqueId");
    return ncclInvalidArgument;
  }
  auto [it, fresh] = S().id_cliques.try_emplace(key, S().next_clique, std::set<int>{});
  if (fresh) ++S().next_clique;
  if (!it->second.second.insert(rank).second) {
    Fail("ncclCommInitRank: rank " + std::to_string(rank) + " joined this id twice");
    return ncclInvalidUsage;
  }
  auto c = std::make_unique<ncclComm>();
  c->clique = it->second.first;
  c->rank = rank;
  c->nranks = nranks;
  c->device = t_device;
  c->nonblocking = nonblocking;
  c->joining = nonblocking;
  c->in_progress = nonblocking;
  for (const auto& other : S().comms)
    if (other->clique == c->clique && other->nranks != nranks) {
      Fail("ncclCommInitRank: ranks of one id disagree on nranks");
      return ncclInvalidUsage;
    }
  *comm = c.get();
  S().comms.push_back(std::move(c));
  return ncclSuccess;
}

namespace {

// A communicator the caller may still use: not null, not freed.
bool Usable(ncclComm_t comm, const char* what) {
  if (comm == nullptr) {
    Fail(std::string(what) + ": null communicator");
    return false;
  }
  if (comm->aborted || comm->destroyed) {
    Fail(std::string(what) + " on a communicator (rank " + std::to_string(comm->rank) +
         ") already freed by " + (comm->aborted ? "ncclCommAbort" : "ncclCommDestroy") +
         ": a use after free (NCCL API: both free the communicator's resources)");
    return false;
  }
  return true;
}

int64_t PendingGroups(const ncclComm* comm) { return comm->groups_issued - comm->groups_done; }

}  // namespace

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  Lock lock(S().mu);
  Count("ncclCommSplit");
  if (!Usable(comm, "ncclCommSplit")) return ncclInvalidArgument;
  if (comm->in_progress) {
    Fail("ncclCommSplit on a non-blocking communicator whose last call is still in progress");
    return ncclInvalidUsage;
  }
  ++comm->splits;
  if (color == NCCL_SPLIT_NOCOLOR) {
    *newcomm = nullptr;
    return ncclSuccess;
  }
  // The n-th split of every rank of the parent meets the others' n-th split
  // of the same colour (the fake supports one colour per split: every rank).
  if (key < 0 || key >= comm->nranks) {
    Fail("ncclCommSplit: the fake models keys 0..nranks-1 (every rank one colour)");
    return ncclInvalidArgument;
  }
  auto [it, fresh] =
      S().split_cliques.try_emplace({comm->clique, comm->splits, color}, S().next_clique);
  if (fresh) ++S().next_clique;
  const bool nonblocking = config != nullptr ? config->blocking == 0 : comm->nonblocking;
  auto c = std::make_unique<ncclComm>();
  c->clique = it->second;
  c->rank = key;
  c->nranks = comm->nranks;
  c->device = comm->device;
  c->nonblocking = nonblocking;
  c->joining = nonblocking;
  c->in_progress = nonblocking;
  *newcomm = c.get();
  S().comms.push_back(std::move(c));
  if (!nonblocking) return ncclSuccess;
  if (jo::fake::t_group_depth > 0) {
    jo::fake::t_group_nonblocking_init = true;
    return ncclSuccess;  // answered by ncclGroupEnd
  }
  return ncclInProgress;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  Lock lock(S().mu);
  Count("ncclCommFinalize");
  if (!Usable(comm, "ncclCommFinalize")) return ncclInvalidArgument;
  comm->finalizing = true;
  if (!comm->nonblocking) {
    if (!jo::fake::RunUntil([comm] { return PendingGroups(comm) == 0; })) {
      Fail("ncclCommFinalize (blocking) would wait forever for the communicator's operations");
      return ncclInternalError;
    }
    return ncclSuccess;
  }
  comm->in_progress = true;
  return ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  Lock lock(S().mu);
  Count("ncclCommDestroy");
  if (!Usable(comm, "ncclCommDestroy")) return ncclInvalidArgument;
  if (comm->nonblocking && (!comm->finalizing || PendingGroups(comm) > 0 || comm->in_progress)) {
    Fail("ncclCommDestroy of a non-blocking communicator (rank " + std::to_string(comm->rank) +
         ") that was not finalized, or whose finalization was not awaited (NCCL: call "
         "ncclCommFinalize and poll ncclCommGetAsyncError until ncclSuccess first)");
    return ncclInvalidUsage;
  }
  comm->destroyed = true;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  Count("ncclCommGetAsyncError");
  // A connection in progress: the poll sees ncclInProgress until it is done; the fake waits for
  // that here (a deadlock is reported, and the communicator fails, when it never can be).
  std::function<bool()> connecting;
  std::string what;
  {
    Lock lock(S().mu);
    if (state == nullptr || !Usable(comm, "ncclCommGetAsyncError")) return ncclInvalidArgument;
    connecting = comm->connecting;
    what = comm->connecting_to;
  }
  if (connecting) {
    const bool connected = jo::fake::WaitFor(connecting, what);
    Lock lock(S().mu);
    comm->connecting = nullptr;
    if (!connected) {
      *state = ncclSystemError;
      return ncclSuccess;
    }
    comm->connected.insert(comm->connecting_peers.begin(), comm->connecting_peers.end());
    comm->connecting_peers.clear();
  }
  Lock lock(S().mu);
  if (comm->joining) {
    int joined = 0;
    for (const auto& other : S().comms) joined += other->clique == comm->clique;
    if (joined == comm->nranks) comm->joining = false;
  }
  bool flushing = false;
  if (comm->finalizing) {  // the host polls: the fake GPU runs what it can meanwhile
    jo::fake::RunUntil([comm] { return PendingGroups(comm) == 0; });
    flushing = PendingGroups(comm) > 0;
  }
  comm->in_progress = comm->joining || flushing;  // a group's connection set-up completes at once
  *state = comm->in_progress ? ncclInProgress : ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  {
    Lock lock(S().mu);
    Count("ncclCommAbort");
    if (!Usable(comm, "ncclCommAbort")) return ncclInvalidArgument;
    // Its queued and running groups complete at once (their kernels exit) and
    // transfer nothing.
    comm->aborted = true;
  }
  // Then it frees its device memory: that waits for the device (fake_waits.cc).
  return jo::fake::AwaitOtherCommunicators(comm) ? ncclSuccess : ncclInternalError;
}

ncclResult_t ncclGroupStart() {
  Count("ncclGroupStart");
  ++jo::fake::t_group_depth;
  return ncclSuccess;
}

// The first send/recv of a communicator to a peer connects to it, which waits for the device
// (see the top of this file): a blocking communicator here, in ncclGroupEnd; a non-blocking one
// after ncclGroupEnd returned (NCCL's own thread), which its caller sees as ncclInProgress until
// the device work the connection waits for is done (ncclCommGetAsyncError waits for it). False,
// with the deadlock recorded, when a blocking connection's wait never ends.
static bool Connect(const std::vector<jo::fake::NcclP2p>& ops) {
  std::map<ncclComm_t, std::set<std::pair<int, bool>>> fresh;
  {
    Lock lock(S().mu);
    for (const auto& op : ops)
      if (op.comm->connected.count({op.peer, op.send}) == 0)
        fresh[op.comm].insert({op.peer, op.send});
  }
  if (fresh.empty()) return true;
  jo::fake::CheckEnqueuePath(
      "ncclGroupEnd connecting to a new peer (NCCL allocates the connection's device memory)");
  for (auto& [comm, peers] : fresh) {
    int device = 0, rank = 0;
    bool nonblocking = false;
    {
      Lock lock(S().mu);
      device = comm->device;
      rank = comm->rank;
      nonblocking = comm->nonblocking;
    }
    const std::string what = "NCCL connecting rank " + std::to_string(rank) + " to peer " +
                             std::to_string(peers.begin()->first) + " on device " +
                             std::to_string(device) +
                             " (it allocates the connection's buffers: it waits for every work "
                             "queue of the device)";
    std::function<bool()> done = jo::fake::DeviceWorkBefore(device);
    if (nonblocking) {
      Lock lock(S().mu);
      comm->connecting = std::move(done);
      comm->connecting_to = what;
      comm->connecting_peers.insert(peers.begin(), peers.end());
      continue;
    }
    if (!jo::fake::WaitFor(done, what + " in ncclGroupEnd")) return false;
    Lock lock(S().mu);
    comm->connected.insert(peers.begin(), peers.end());
  }
  return true;
}

static ncclResult_t FlushGroup() {
  using jo::fake::NcclP2p;
  std::vector<NcclP2p> ops;
  ops.swap(jo::fake::t_group);
  if (!Connect(ops)) return ncclInternalError;
  Lock lock(S().mu);
  std::map<cudaStream_t, std::vector<NcclP2p>> by_stream;
  for (auto& op : ops) by_stream[op.stream].push_back(op);
  for (auto& [stream, list] : by_stream) {
    struct GroupState {
      std::vector<std::pair<ncclComm_t, int64_t>> order;  // per communicator: this group's place
      std::vector<std::shared_ptr<bool>> sends_taken;
      std::vector<bool> recv_done;
      bool aborted() const {
        for (const auto& [comm, seq] : order)
          if (comm->aborted) return true;
        return false;
      }
    };
    auto gs = std::make_shared<GroupState>();
    gs->recv_done.assign(list.size(), false);
    for (const auto& op : list) {
      bool seen = false;
      for (const auto& [comm, seq] : gs->order) seen = seen || comm == op.comm;
      if (!seen) gs->order.emplace_back(op.comm, ++op.comm->groups_issued);
    }
    FakeTask task;
    task.what = "ncclGroup(" + std::to_string(list.size()) + " ops, rank " +
                std::to_string(list.front().comm->rank) + ")";
    task.comm = list.front().comm;
    // NCCL serialises a communicator: this group starts after its earlier ones.
    task.ready = [gs] {
      if (gs->aborted()) return true;
      // NCCL launches the group once connected: its thread connects once the device work the
      // connection waits for is done, whether or not the caller polls.
      for (const auto& [comm, seq] : gs->order)
        if (comm->connecting && !comm->connecting()) return false;
      for (const auto& [comm, seq] : gs->order)
        if (comm->groups_done < seq - 1) return false;
      return true;
    };
    // Started: the sends are posted.
    task.run = [gs, list] {
      if (gs->aborted()) return;
      for (const auto& op : list) {
        if (!op.send) continue;
        auto msg = std::make_shared<jo::fake::Message>();
        const size_t bytes = op.count * jo::fake::NcclSize(op.type);
        msg->data.assign(static_cast<std::byte*>(op.buf), static_cast<std::byte*>(op.buf) + bytes);
        msg->count = op.count;
        msg->type = op.type;
        msg->taken_flag = std::make_shared<bool>(false);
        gs->sends_taken.push_back(msg->taken_flag);
        S().channels[{op.comm->clique, op.comm->rank, op.peer}].push_back(msg);
      }
    };
    // In flight until every receive has data and every send was taken.
    task.done = [gs, list] {
      bool done = true;
      if (!gs->aborted()) {
        for (size_t i = 0; i < list.size(); ++i) {
          const auto& op = list[i];
          if (op.send || gs->recv_done[i]) continue;
          auto& q = S().channels[{op.comm->clique, op.peer, op.comm->rank}];
          if (q.empty()) {
            done = false;
            continue;
          }
          auto msg = q.front();
          q.pop_front();
          if (msg->count != op.count || msg->type != op.type)
            Fail("NCCL: rank " + std::to_string(op.comm->rank) + " receives " +
                 std::to_string(op.count) + " elements from rank " + std::to_string(op.peer) +
                 ", which sent " + std::to_string(msg->count) + " (send/recv pairs mismatched)");
          std::memcpy(op.buf, msg->data.data(),
                      std::min(msg->data.size(), op.count * jo::fake::NcclSize(op.type)));
          *msg->taken_flag = true;
          gs->recv_done[i] = true;
          ++S().side_effects;
        }
        for (const auto& taken : gs->sends_taken) done = done && *taken;
      }
      if (done)
        for (const auto& [comm, seq] : gs->order)
          if (comm->groups_done < seq) comm->groups_done = seq;
      return done;
    };
    task.sms = true;  // NCCL's kernels run on SMs
    jo::fake::Push(stream, std::move(task));
  }
  // Non-blocking communicators answer ncclInProgress (real NCCL may, e.g. while
  // it connects to a new peer): the caller must await them before their next call.
  bool in_progress = false;
  for (auto& op : ops)
    if (op.comm->nonblocking) in_progress = op.comm->in_progress = true;
  return in_progress ? ncclInProgress : ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  Count("ncclGroupEnd");
  if (jo::fake::t_group_depth <= 0) {
    Fail("ncclGroupEnd without ncclGroupStart");
    return ncclInvalidUsage;
  }
  if (--jo::fake::t_group_depth > 0) return ncclSuccess;
  const bool inits = jo::fake::t_group_nonblocking_init;
  jo::fake::t_group_nonblocking_init = false;
  const ncclResult_t flushed = FlushGroup();
  return flushed == ncclSuccess && inits ? ncclInProgress : flushed;
}

static ncclResult_t P2p(bool send, void* buf, size_t count, ncclDataType_t type, int peer,
                        ncclComm_t comm, cudaStream_t s) {
  {
    Lock lock(S().mu);
    Count(send ? "ncclSend" : "ncclRecv");
    const char* what = send ? "ncclSend" : "ncclRecv";
    if (!jo::fake::StreamOk(s, what) || !Usable(comm, what)) return ncclInvalidArgument;
    if (peer < 0 || peer >= comm->nranks || peer == comm->rank || jo::fake::NcclSize(type) == 0) {
      Fail(std::string(what) + ": bad peer or type");
      return ncclInvalidArgument;
    }
    if (s->device != comm->device || t_device != comm->device) {
      Fail(std::string(what) + ": stream/current device differ from the communicator's device");
      return ncclInvalidUsage;
    }
    if (s->capture != 0) {
      Fail(std::string(what) + ": NCCL on a capturing stream is not modelled by the fake");
      return ncclInvalidUsage;
    }
    if (comm->in_progress) {
      Fail(std::string(what) +
           ": on a non-blocking communicator whose last call is still in "
           "progress (await ncclCommGetAsyncError == ncclSuccess first)");
      return ncclInvalidUsage;
    }
    if (!jo::fake::CheckAccess(buf, count * jo::fake::NcclSize(type), comm->device, what))
      return ncclInvalidArgument;
  }
  jo::fake::t_group.push_back({send, buf, count, type, peer, comm, s});
  if (jo::fake::t_group_depth == 0) return FlushGroup();
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  return P2p(true, const_cast<void*>(buf), count, type, peer, comm, s);
}
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  return P2p(false, buf, count, type, peer, comm, s);
}
