#include "core/issue_order.h"

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "core/build.h"
#include "core/call.h"
#include "core/signature_cache.h"

namespace jo {
namespace {

bool IsNccl(OpKind kind) { return kind == OpKind::kSend || kind == OpKind::kRecv; }

using Message = std::tuple<int32_t, int32_t, int32_t>;  // (sender, receiver, tag)
constexpr int32_t kAllReduceTag = -1;  // an AllReduce's "messages" (NCCL tags are >= 0)

// One rank of the play.
struct Player {
  Program program;
  std::vector<IssueUnit> units;
  std::vector<std::deque<int32_t>> queues;  // per stream: its units not issued yet
  std::vector<bool> in_flight;              // per stream: an NCCL group not yet matched
  std::set<int32_t> recorded;               // events
  std::vector<IssueUnit> order;
  std::vector<int32_t> rounds;  // per unit of `order`: the round it was issued in
};

// An NCCL group launched and not yet matched by its peers.
struct Launched {
  int32_t rank = 0;
  int32_t stream = 0;
  std::vector<Message> sends, recvs;
};

class Play {
 public:
  explicit Play(std::vector<Player> players) : p_(std::move(players)) {}

  Status Run() {
    for (;;) {
      bool progress = false;
      for (size_t r = 0; r < p_.size(); ++r) progress |= IssueWhatCanRun(static_cast<int32_t>(r));
      // A fused GEMM's releases come one block per round after its issue, in its order: what
      // waits for a later block is issued later, so work that needs only early blocks (the
      // reduction of a reduce-scatter's first round) is not queued behind it.
      ++round_;
      while (!releases_.empty() && releases_.begin()->first <= round_) {
        new_flags_.insert(releases_.begin()->second);
        releases_.erase(releases_.begin());
        progress = true;
      }
      // The round's effects reach the peers.
      flags_.insert(new_flags_.begin(), new_flags_.end());
      sends_.insert(new_sends_.begin(), new_sends_.end());
      recvs_.insert(new_recvs_.begin(), new_recvs_.end());
      new_flags_.clear();
      new_sends_.clear();
      new_recvs_.clear();
      for (auto it = launched_.begin(); it != launched_.end();) {
        if (!Matched(*it)) {
          ++it;
          continue;
        }
        p_[static_cast<size_t>(it->rank)].in_flight[static_cast<size_t>(it->stream)] = false;
        it = launched_.erase(it);
        progress = true;
      }
      if (Done()) return OkStatus();
      if (!progress) return Blocked();
    }
  }

  std::vector<std::vector<IssueUnit>> Orders() const {
    std::vector<std::vector<IssueUnit>> out;
    for (const Player& player : p_) out.push_back(player.order);
    return out;
  }

  std::vector<std::vector<int32_t>> Rounds() const {
    std::vector<std::vector<int32_t>> out;
    for (const Player& player : p_) out.push_back(player.rounds);
    return out;
  }

 private:
  bool Ready(int32_t r, int32_t unit) const {
    const Player& me = p_[static_cast<size_t>(r)];
    const Op& op = me.program.ops[static_cast<size_t>(me.units[static_cast<size_t>(unit)].begin)];
    if (op.kind == OpKind::kWait) return flags_.count({r, op.id}) > 0;
    if (op.kind == OpKind::kStreamWait) return me.recorded.count(op.id) > 0;
    if (op.kind == OpKind::kFusedGemm) {
      // Every flag the kernel waits for was raised by what the peers issued
      // before: the kernel, which holds every SM, never waits for work issued
      // after it on any rank (docs/gpu-internals.md §5).
      const FusedBlocks& f = op.fused;
      for (int32_t b = 0; b < f.rows.count(); ++b)
        if (f.Waits(b) && flags_.count({r, f.wait_flags + b}) == 0) return false;
    }
    return true;
  }

  // Issues, on rank r, every unit that can run, preferring list order.
  bool IssueWhatCanRun(int32_t r) {
    Player& me = p_[static_cast<size_t>(r)];
    bool issued = false;
    for (;;) {
      int32_t best = -1;
      for (size_t s = 0; s < me.queues.size(); ++s) {
        if (me.in_flight[s] || me.queues[s].empty()) continue;
        const int32_t unit = me.queues[s].front();
        if ((best < 0 || unit < best) && Ready(r, unit)) best = unit;
      }
      if (best < 0) return issued;
      const IssueUnit& unit = me.units[static_cast<size_t>(best)];
      const Op& first = me.program.ops[static_cast<size_t>(unit.begin)];
      me.queues[static_cast<size_t>(first.stream)].pop_front();
      me.order.push_back(unit);
      me.rounds.push_back(static_cast<int32_t>(round_));
      issued = true;
      if (first.kind == OpKind::kRecord) me.recorded.insert(first.id);
      if (first.kind == OpKind::kSignal) new_flags_.insert({first.peer, first.id});
      if (first.kind == OpKind::kFusedGemm && first.fused.release_flags >= 0)
        for (size_t k = 0; k < first.fused.sequence.size(); ++k)
          releases_.emplace(round_ + 1 + static_cast<int64_t>(k),
                            std::make_pair(r, first.fused.release_flags + first.fused.sequence[k]));
      if (first.kind == OpKind::kAllReduce) {
        // The one-launch all-reduce: a kernel that completes once every rank launched its own
        // (it waits for every peer's flags), a rendezvous like an NCCL group with every peer.
        Launched group;
        group.rank = r;
        group.stream = first.stream;
        for (int32_t peer = 0; peer < me.program.problem.nranks; ++peer) {
          if (peer == r) continue;
          group.sends.emplace_back(r, peer, kAllReduceTag);
          group.recvs.emplace_back(peer, r, kAllReduceTag);
          new_sends_.emplace(r, peer, kAllReduceTag);
          new_recvs_.emplace(peer, r, kAllReduceTag);
        }
        me.in_flight[static_cast<size_t>(first.stream)] = true;
        launched_.push_back(std::move(group));
      }
      if (IsNccl(first.kind)) {
        Launched group;
        group.rank = r;
        group.stream = first.stream;
        for (int32_t i = unit.begin; i < unit.end; ++i) {
          const Op& op = me.program.ops[static_cast<size_t>(i)];
          if (op.kind == OpKind::kSend) {
            group.sends.emplace_back(r, op.peer, op.id);
            new_sends_.emplace(r, op.peer, op.id);
          } else {
            group.recvs.emplace_back(op.peer, r, op.id);
            new_recvs_.emplace(op.peer, r, op.id);
          }
        }
        me.in_flight[static_cast<size_t>(first.stream)] = true;
        launched_.push_back(std::move(group));
      }
    }
  }

  // NCCL send/recv are rendezvous: a group completes once every peer it
  // sends to and receives from has launched the matching group.
  bool Matched(const Launched& group) const {
    for (const Message& m : group.sends)
      if (!recvs_.count(m)) return false;
    for (const Message& m : group.recvs)
      if (!sends_.count(m)) return false;
    return true;
  }

  bool Done() const {
    if (!launched_.empty() || !releases_.empty()) return false;
    for (const Player& player : p_)
      for (const auto& queue : player.queues)
        if (!queue.empty()) return false;
    return true;
  }

  Status Blocked() const {
    std::string where;
    for (size_t r = 0; r < p_.size(); ++r) {
      const Player& me = p_[r];
      for (size_t s = 0; s < me.queues.size(); ++s) {
        if (me.queues[s].empty() && !me.in_flight[s]) continue;
        std::string what = me.in_flight[s]
                               ? "an NCCL group or AllReduce its peers never match"
                               : ToString(me.program.ops[static_cast<size_t>(
                                     me.units[static_cast<size_t>(me.queues[s].front())].begin)]);
        where += "; rank " + std::to_string(r) + " stream " + std::to_string(s) + ": " + what;
      }
    }
    return Internal(Summary(p_.front().program) +
                    ": the programs cannot complete with one work queue per device" + where);
  }

  std::vector<Player> p_;
  std::set<std::pair<int32_t, int32_t>> flags_, new_flags_;  // (rank whose flag, id)
  std::set<Message> sends_, recvs_, new_sends_, new_recvs_;  // launched
  std::vector<Launched> launched_;
  int64_t round_ = 0;  // the rounds played so far (a round: every rank issues what it can)
  std::multimap<int64_t, std::pair<int32_t, int32_t>> releases_;  // round -> (rank, flag)
};

}  // namespace

std::vector<IssueUnit> IssueUnits(const Program& program) {
  const std::vector<Op>& ops = program.ops;
  std::vector<IssueUnit> units;
  for (size_t i = 0; i < ops.size();) {
    size_t end = i + 1;
    if (IsNccl(ops[i].kind))
      while (end < ops.size() && IsNccl(ops[end].kind) && ops[end].bundle == ops[i].bundle &&
             ops[end].stream == ops[i].stream)
        ++end;
    units.push_back({static_cast<int32_t>(i), static_cast<int32_t>(end)});
    i = end;
  }
  return units;
}

namespace {

// Every rank's order and rounds, per call signature.
struct Plays {
  std::vector<std::vector<IssueUnit>> orders;
  std::vector<std::vector<int32_t>> rounds;
};

Status PlayOf(const Problem& problem, std::shared_ptr<const Plays>* out) {
  // Never destroyed: handlers may run at exit.
  static auto* cache = new SignatureCache<Plays>;
  const std::string signature = CallSignature(problem);
  JO_REQUIRE(problem.rank >= 0 && problem.rank < problem.nranks,
             "IssueOrder: rank " + std::to_string(problem.rank) + " outside [0, " +
                 std::to_string(problem.nranks) + ")");
  if (auto hit = cache->Find(signature)) {
    *out = hit;
    return OkStatus();
  }
  std::vector<Player> players(static_cast<size_t>(problem.nranks));
  for (int32_t r = 0; r < problem.nranks; ++r) {
    Player& player = players[static_cast<size_t>(r)];
    Problem q = problem;
    q.rank = r;
    JO_CHECK(BuildProgram(q, &player.program));
    player.units = IssueUnits(player.program);
    const size_t streams = static_cast<size_t>(player.program.num_streams);
    player.queues.resize(streams);
    player.in_flight.assign(streams, false);
    for (size_t u = 0; u < player.units.size(); ++u) {
      const Op& op = player.program.ops[static_cast<size_t>(player.units[u].begin)];
      JO_ASSERT(op.stream >= 0 && static_cast<size_t>(op.stream) < streams);
      player.queues[static_cast<size_t>(op.stream)].push_back(static_cast<int32_t>(u));
    }
  }
  Play play(std::move(players));
  JO_CHECK(play.Run());
  Plays plays{play.Orders(), play.Rounds()};
  cache->Add(signature, plays);
  *out = std::make_shared<const Plays>(std::move(plays));
  return OkStatus();
}

}  // namespace

Status IssueOrder(const Problem& problem, std::vector<IssueUnit>* order) {
  std::shared_ptr<const Plays> plays;
  JO_CHECK(PlayOf(problem, &plays));
  *order = plays->orders[static_cast<size_t>(problem.rank)];
  return OkStatus();
}

Status IssueRounds(const Problem& problem, std::vector<int32_t>* rounds) {
  std::shared_ptr<const Plays> plays;
  JO_CHECK(PlayOf(problem, &plays));
  *rounds = plays->rounds[static_cast<size_t>(problem.rank)];
  return OkStatus();
}

}  // namespace jo
