"""A list scheduler: builds every rank's compute order by running the pipeline forward in
time and, whenever a rank is free, choosing what it does next by a :class:`Policy`.

Its timeline is the simulator's, so its makespan is the schedule's simulated makespan.
Each stage runs its work in micro-batch order, a forward is admitted only within the
rank's activation cap (with one more unit kept free for a micro-batch that comes back,
``Policy.reserve``), and a W runs only after its B. The rules, and why they keep an order
valid and deadlock-free: docs/optimizer.md, "Method" (list scheduling).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from functools import partial

from ...schedules.ir import Action, Kind
from .deadline import Deadline
from .instance import Instance

__all__ = ["Built", "Policy", "build"]

_new_action = partial(tuple.__new__, Action)


@dataclass(frozen=True)
class Policy:
    """How a free rank chooses its next action.

    The candidates are the next forward and backward of each of its stages whose inputs
    are known (arrived or on their way), its pending W, and, with ``pair``, an FB pair of
    a forward and a backward. As in Giffler and Thompson's active-schedule generation, the
    conflict set is the candidates that can start before the earliest any candidate could
    end; the rank takes the most urgent of those, waiting for it if it has not arrived.

    - ``backward_first``: backwards are more urgent than forwards (else the reverse);
    - ``pair``: 0 never pairs; 1 pairs a forward with a backward's dX (its W later); 2
      with the full backward (BW); a pair is only formed where it is shorter than apart,
      and is then the most urgent candidate;
    - ``eager_w``: run each W right after its B (else a W is the least urgent candidate,
      and the most urgent while a forward waits for memory);
    - ``deep_first``: among forwards, the later stage of the path first (else the one with
      the longer way to go); among backwards, always the longer way to go;
    - ``lead``: a forward whose micro-batch comes back to this rank may run at most this
      many micro-batches ahead of the rank's later stage, beyond the number that fills
      the round trip (None: no limit but memory);
    - ``reserve``: a forward whose micro-batch comes back leaves one unit free for that
      return (deadlock-free); without it the build may deadlock and is then discarded;
    - ``alternate``: after a forward a backward is more urgent, after a backward a
      forward, and after a forward the backward of the same chunk first (1F1B's rhythm
      per chunk; overrides ``backward_first``);
    - ``oldest_first``: among backwards, the oldest micro-batch first (else the one with
      the longer way to go);
    - ``drain_eager_w``: once the rank has no forward left, run each W right after its B.
    """

    backward_first: bool = True
    pair: int = 0
    eager_w: bool = False
    deep_first: bool = True
    lead: int | None = None
    reserve: bool = True
    alternate: bool = False
    oldest_first: bool = False
    drain_eager_w: bool = False


@dataclass
class Built:
    """A built schedule: per rank its compute actions in order, their start and end
    times, the makespan and each rank's peak live activations."""

    ranks: list[list[Action]]
    times: list[list[tuple[float, float]]]
    makespan: float
    peaks: list[int]


def build(
    inst: Instance,
    policy: Policy,
    priority: tuple[list[float], list[float]],
    deadline: Deadline | None = None,
) -> Built | None:
    """Schedule ``inst`` by ``policy``; ``priority`` gives per stage the urgency of its
    forward and of its backward (higher first: the tails of :func:`.bound.tails`).
    Returns None if the ranks deadlock (a cap too small for the placement); raises
    :class:`~.deadline.OutOfTime` once ``deadline`` passes."""
    return _Builder(inst, policy, priority).run(deadline or Deadline(None))


class _Builder:
    def __init__(self, inst: Instance, policy: Policy, priority: tuple[list[float], list[float]]):
        self.inst, self.policy = inst, policy
        self.prio_f, self.prio_b = priority
        n, ranks = len(inst.rank), inst.num_ranks
        self.nf, self.nb = [0] * n, [0] * n
        self.fend: list[list[float]] = [[] for _ in range(n)]
        self.bend: list[list[float]] = [[] for _ in range(n)]
        self.pending_w: list[deque[int]] = [deque() for _ in range(n)]
        self.live, self.peak = [0] * ranks, [0] * ranks
        self.free_at = [0.0] * ranks
        self.actions: list[list[Action]] = [[] for _ in range(ranks)]
        self.times: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]
        self.left = [sum(3 * len(inst.mbs[s]) for s in own) for own in inst.stages_of]
        self.heap: list[tuple[float, int, int]] = []
        self.version = [0] * ranks
        self.wake_at = [float("inf")] * ranks
        self.channels: dict[tuple, deque] = {}
        self.lat = inst.cost.latency
        self.revisit = [self._revisit(s) for s in range(n)]
        self.lead = [self._lead(s) for s in range(n)]
        for r in range(ranks):
            self._wake(r, 0.0)

    def _revisit(self, s: int) -> int | None:
        """The next stage of the path on the same rank as ``s``."""
        inst, q = self.inst, self.inst.next[s]
        while q is not None and inst.rank[q] != inst.rank[s]:
            q = inst.next[q]
        return q

    def _lead(self, s: int) -> int | None:
        """How many micro-batches stage ``s`` may forward ahead of its revisit: enough to
        fill the round trip, plus the policy's ``lead``."""
        inst, later = self.inst, self.revisit[s]
        if later is None or self.policy.lead is None:
            return None
        trip, q = 0.0, s
        while q != later:
            trip += inst.f[q] + (self.lat if inst.next_remote[q] else 0.0)
            q = inst.next[q]
        fill = math.ceil(trip / inst.f[s] - 1e-9) if inst.f[s] > 0 else 1
        return max(1, fill + self.policy.lead)

    # -- events ---------------------------------------------------------------------
    def _wake(self, r: int, t: float) -> None:
        self.version[r] += 1
        self.wake_at[r] = t
        heapq.heappush(self.heap, (t, self.version[r], r))

    def _notify(self, r: int, arrival: float) -> None:
        t = max(arrival, self.free_at[r])
        if t < self.wake_at[r]:
            self._wake(r, t)

    def run(self, deadline: Deadline) -> Built | None:
        heap = self.heap
        while heap:
            deadline.check()
            t, version, r = heapq.heappop(heap)
            if version != self.version[r]:
                continue
            self.wake_at[r] = float("inf")
            if self.left[r]:
                self._decide(r, t)
        if any(self.left):
            return None
        makespan = max((ts[-1][1] for ts in self.times if ts), default=0.0)
        return Built(self.actions, self.times, makespan, self.peak)

    # -- readiness ------------------------------------------------------------------
    def _f_ready(self, s: int) -> float | None:
        inst, k = self.inst, self.nf[s]
        if k == len(inst.mbs[s]):
            return None
        q = inst.prev[s]
        if q is None:
            return 0.0
        if k >= self.nf[q]:
            return None
        if inst.shared_channels and inst.prev_remote[s]:
            queue = self.channels.get(("F", inst.f_channel[s]))
            if not queue or queue[0] != (s, k):
                return None
        return self.fend[q][k] + (self.lat if inst.prev_remote[s] else 0.0)

    def _b_ready(self, s: int) -> float | None:
        inst, k = self.inst, self.nb[s]
        if k >= self.nf[s]:
            return None
        q = inst.next[s]
        if q is None:
            return self.fend[s][k]
        if k >= self.nb[q]:
            return None
        if inst.shared_channels and inst.next_remote[s]:
            queue = self.channels.get(("B", inst.b_channel[s]))
            if not queue or queue[0] != (s, k):
                return None
        return self.bend[q][k] + (self.lat if inst.next_remote[s] else 0.0)

    def _admits(self, r: int, s: int) -> bool:
        inst = self.inst
        need = 1
        if inst.revisits[s]:
            need = 2 if self.policy.reserve else 1
            later = self.revisit[s]
            if self.lead[s] is not None and self.nf[s] - self.nf[later] >= self.lead[s]:
                return False
        return self.live[r] + need <= inst.caps[r]

    # -- the choice -----------------------------------------------------------------
    def _decide(self, r: int, t: float) -> None:
        inst, pol = self.inst, self.policy
        own = inst.stages_of[r]
        forwards, backwards, blocked = [], [], False
        for s in own:
            ready = self._f_ready(s)
            if ready is not None:
                if self._admits(r, s):
                    forwards.append((s, ready))
                else:
                    blocked = True
            ready = self._b_ready(s)
            if ready is not None:
                backwards.append((s, ready))
        backward_first, last_chunk = pol.backward_first, -1
        if pol.alternate and self.actions[r]:
            last = self.actions[r][-1]
            backward_first = last.kind is Kind.F
            last_chunk = last.chunk if backward_first else -1
        f_class, b_class = (1, 2) if backward_first else (2, 1)
        sign = -1.0 if pol.deep_first else 1.0
        # Candidates: (urgency, ready time, duration, what, stages); the most urgent of
        # those that can start before the earliest any candidate could end wins.
        cands = [
            ((f_class, sign * self.prio_f[s]), ready, inst.f[s], "F", s, -1)
            for s, ready in forwards
        ]
        for s, ready in backwards:
            age = -inst.mbs[s][self.nb[s]] if pol.oldest_first else 0
            tie = (b_class, inst.chunk[s] == last_chunk, age, self.prio_b[s])
            cands.append((tie, ready, inst.b[s], "B", s, -1))
        if pol.pair:
            bw = pol.pair == 2
            for sf, rf in forwards:
                for sb, rb in backwards:
                    if inst.pair_pays(sf, sb, bw):
                        urgency = (4, self.prio_b[sb] + self.prio_f[sf])
                        cands.append((urgency, max(rf, rb), inst.pair[(sf, sb, bw)], "P", sf, sb))
        w_class = 3 if blocked else 0
        for s in own:
            if self.pending_w[s]:
                cands.append(((w_class, len(self.pending_w[s])), t, inst.w[s], "W", s, -1))
        if not cands:
            return  # sleep until a message for this rank is sent (_notify wakes it)
        soonest = min((ready if ready > t else t) + d for _, ready, d, _, _, _ in cands)
        best = None
        for c in cands:
            if (c[1] < soonest or c[1] <= t) and (best is None or c[0] > best[0]):
                best = c
        if best[1] > t:
            self._wake(r, best[1])
            return
        what = best[3]
        if what == "F":
            self._run_f(r, t, best[4])
        elif what == "B":
            self._run_b(r, t, best[4])
        elif what == "W":
            self._run_w(r, t, best[4])
        else:
            self._run_pair(r, t, best[4], best[5], pol.pair == 2)

    # -- running actions ------------------------------------------------------------
    def _append(self, r: int, action: Action, t: float, duration: float) -> float:
        end = t + duration
        self.actions[r].append(action)
        self.times[r].append((t, end))
        self.free_at[r] = end
        self._wake(r, end)
        return end

    def _alloc(self, r: int) -> None:
        self.live[r] += 1
        if self.live[r] > self.peak[r]:
            self.peak[r] = self.live[r]

    def _forward_done(self, s: int, end: float) -> None:
        inst, k = self.inst, self.nf[s]
        self.fend[s].append(end)
        self.nf[s] = k + 1
        q = inst.next[s]
        if q is not None:
            if inst.next_remote[s]:
                if inst.shared_channels:
                    self.channels.setdefault(("F", inst.f_channel[q]), deque()).append((q, k))
                self._notify(inst.rank[q], end + self.lat)
        else:
            self._notify(inst.rank[s], end)

    def _backward_done(self, s: int, end: float) -> None:
        inst, k = self.inst, self.nb[s]
        self.bend[s].append(end)
        self.nb[s] = k + 1
        q = inst.prev[s]
        if q is not None and inst.prev_remote[s]:
            if inst.shared_channels:
                self.channels.setdefault(("B", inst.b_channel[q]), deque()).append((q, k))
            self._notify(inst.rank[q], end + self.lat)

    def _consume(self, s: int, forward: bool) -> None:
        inst = self.inst
        if not inst.shared_channels:
            return
        if forward and inst.prev_remote[s]:
            self.channels[("F", inst.f_channel[s])].popleft()
        if not forward and inst.next_remote[s]:
            self.channels[("B", inst.b_channel[s])].popleft()

    def _f_action(self, s: int) -> Action:
        inst = self.inst
        return _new_action((Kind.F, s, inst.mbs[s][self.nf[s]], inst.chunk[s], ()))

    def _b_action(self, s: int, kind: Kind) -> Action:
        inst = self.inst
        return _new_action((kind, s, inst.mbs[s][self.nb[s]], inst.chunk[s], ()))

    def _run_f(self, r: int, t: float, s: int) -> None:
        self._consume(s, True)
        self._alloc(r)
        end = self._append(r, self._f_action(s), t, self.inst.f[s])
        self._forward_done(s, end)
        self.left[r] -= 1

    def _run_b(self, r: int, t: float, s: int) -> None:
        inst = self.inst
        self._consume(s, False)
        k = self.nb[s]
        end = self._append(r, self._b_action(s, Kind.B), t, inst.b[s])
        self._backward_done(s, end)
        self.left[r] -= 1
        if self.policy.eager_w or (self.policy.drain_eager_w and self._drained(r)):
            self.live[r] -= 1
            self._append(
                r, _new_action((Kind.W, s, inst.mbs[s][k], inst.chunk[s], ())), end, inst.w[s]
            )
            self.left[r] -= 1
        else:
            self.pending_w[s].append(k)

    def _drained(self, r: int) -> bool:
        inst = self.inst
        return all(self.nf[s] == len(inst.mbs[s]) for s in inst.stages_of[r])

    def _run_w(self, r: int, t: float, s: int) -> None:
        inst = self.inst
        k = self.pending_w[s].popleft()
        self.live[r] -= 1
        self._append(r, _new_action((Kind.W, s, inst.mbs[s][k], inst.chunk[s], ())), t, inst.w[s])
        self.left[r] -= 1

    def _run_pair(self, r: int, t: float, sf: int, sb: int, bw: bool) -> None:
        inst = self.inst
        self._consume(sf, True)
        self._consume(sb, False)
        forward = self._f_action(sf)
        backward = self._b_action(sb, Kind.BW if bw else Kind.B)
        k = self.nb[sb]
        self._alloc(r)
        end = self._append(r, Action.overlapped(forward, backward), t, inst.pair[(sf, sb, bw)])
        if bw:
            self.live[r] -= 1
            self.left[r] -= 1
        else:
            self.pending_w[sb].append(k)
        self._forward_done(sf, end)
        self._backward_done(sb, end)
        self.left[r] -= 2
