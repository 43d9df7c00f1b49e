"""Reference balanced assignment: an auction warm start, then cycle cancelling with
Floyd-Warshall over the experts (Kool et al., 004_62bca7777c830867.txt, Appendix D.2).

Problem (eq 4 with s = a / tau + g, or BASE layers' scores):
    maximise  sum_i s[i, z_i]   subject to   #{i : z_i = j} <= capacity  for every expert j.

The C++ kernel (csrc/cpu/balanced_assignment.cpp) runs the same algorithm with the same arithmetic
(float64, the same visiting orders and tie rules), so on inputs with a unique optimum the two agree
exactly, and on ties both return an optimal assignment (tests check optimality against scipy).
Written for reading, not for speed: loops over tokens and experts in Python.
"""

import heapq
import math

import torch

# The auction is only a warm start (cycle cancelling makes the result exact), so its parameters are
# tuned for speed: one phase at eps = spread / 32768 (spread = max(s) - min(s)) from zero prices;
# if that has not finished after 4 bids per token, it restarts from prices = the column means of s.
# Chosen by measured CPU time of the C++ kernel (one thread, the minimum of repeated runs) at
# (4096, 64), (8192, 64), (16384, 128) on randn, integer, all-equal, per-expert-bias, Gumbel-
# perturbed log-softmax, low-rank and one-dominant-expert scores (docs/balanced_assignment.md).
# The earlier schedule (eps = spread / 16, then / 8192, restarting from scratch) fought price wars
# of ~factor bids per token on tied scores (integer or equal: 300-1400 ms at these sizes); zero
# prices cost nothing on ties but many small bids when experts differ in popularity, where
# column-mean prices start near the right level. The paper's eps = 1.0 leaves thousands of cycles
# to cancel (issue 7).
EPS_DIV = 32768.0
BID_BUDGET = 4
# Cycles whose cost is above -TOL_REL * max(1, max|s|) are not cancelled: float64 rounding noise.
TOL_REL = 1e-12


def auction_epsilon(spread: float, tol: float) -> float:
    """spread / EPS_DIV, but never below the cycle tolerance: on scores that are nearly equal and
    large (spread 1e-9 at magnitude 1e6), spread / EPS_DIV is below the float64 spacing of the
    prices after a column-mean restart, price + eps == price, and the auction bids forever. With
    eps >= tol the warm start is within n * tol of the optimum, which cycle cancelling removes."""
    return max(spread / EPS_DIV, tol)


def auction(s: list[list[float]], capacity: int, prices: list[float], eps: float, budget: float) -> list[int] | None:
    """The auction (Bertsekas, tokens bid for expert slots) from `prices`, updated in place.

    Each unassigned token (FIFO queue, initially 0..n-1) bids for its best expert j1 by value
    s[i][j] - price[j] (ties to the lower j): bid = price[j1] + (best - second best) + eps. An
    expert keeps its `capacity` highest bids (on equal bids the lower token index stays); when full,
    its price is its lowest kept bid. Returns z [n], or None if `budget` bids did not finish it.
    """
    n, k = len(s), len(s[0])
    z = [-1] * n
    holders: list[list[tuple[float, int]]] = [[] for _ in range(k)]  # min-heaps of (bid, -token)
    queue = list(range(n))
    head = 0
    while head < len(queue):
        if head >= budget:
            return None
        i = queue[head]
        head += 1
        j1, v1, v2 = -1, -math.inf, -math.inf
        for j in range(k):
            v = s[i][j] - prices[j]
            if v > v1:
                j1, v1, v2 = j, v, v1
            elif v > v2:
                v2 = v
        gap = v1 - v2 if k > 1 else 0.0
        bid = prices[j1] + gap + eps
        heapq.heappush(holders[j1], (bid, -i))
        z[i] = j1
        if len(holders[j1]) > capacity:
            _, neg = heapq.heappop(holders[j1])
            z[-neg] = -1
            queue.append(-neg)
        if len(holders[j1]) == capacity:
            prices[j1] = holders[j1][0][0]
    return z


def column_means(s: list[list[float]]) -> list[float]:
    """mean over tokens of s[i][j] per expert, summed in token order (as the C++ kernel does)."""
    k = len(s[0])
    total = [0.0] * k
    for row in s:
        for j in range(k):
            total[j] += row[j]
    return [t / len(s) for t in total]


def move_costs(s, z, k):
    """d[j][j'] = min over tokens i in j of s[i][j] - s[i][j'] (Appendix D.2) and the argmin token
    (ties to the lower token index); d[j][j] = 0; +inf from an expert holding no token."""
    d = [[math.inf] * k for _ in range(k)]
    arg = [[-1] * k for _ in range(k)]
    for i, j in enumerate(z):
        for jp in range(k):
            c = s[i][j] - s[i][jp]
            if c < d[j][jp]:
                d[j][jp], arg[j][jp] = c, i
    for j in range(k):
        d[j][j] = 0.0
    return d, arg


def graph(d, counts, capacity, slack):
    """The k (+1) node residual graph. With spare capacity (slack), node F = k stands for the free
    slots: j -> F costs 0 if expert j has a free slot (it may receive one more token), F -> j costs
    0 if j holds a token (it may give one away). A negative cycle through F is an improving chain
    of moves that ends in a free slot, so "no negative cycle" is exactly optimality."""
    k = len(d)
    N = k + 1 if slack else k
    w = [[math.inf] * N for _ in range(N)]
    for a in range(k):
        for b in range(k):
            w[a][b] = d[a][b]
    if slack:
        for j in range(k):
            w[j][k] = 0.0 if counts[j] < capacity else math.inf
            w[k][j] = 0.0 if counts[j] > 0 else math.inf
        w[k][k] = 0.0
    return w


def split_negative_cycle(walk, w, tol):
    """A simple cycle of cost < -tol inside the closed walk `walk` (node list, last -> first
    implied), or None. A closed walk of negative cost decomposes into simple cycles, at least one
    of them negative."""
    stack, pos = [], {}
    for v in walk + [walk[0]]:
        if v in pos:
            cyc = stack[pos[v] :]
            cost = sum(w[cyc[t]][cyc[(t + 1) % len(cyc)]] for t in range(len(cyc)))
            if cost < -tol:
                return cyc
            for u in cyc[1:]:
                del pos[u]
            del stack[pos[v] + 1 :]
        else:
            pos[v] = len(stack)
            stack.append(v)
    return None


def path(nxt, u, v):
    """Nodes of the recorded shortest path u -> v, without v; None if it has more than N nodes
    (nxt pointers in a loop: impossible with exact shortest paths, a guard against hanging on
    float64 noise, as append_path in csrc/include/moe_kernels/balanced_assignment.h)."""
    N = len(nxt)
    out = [u]
    while nxt[u][v] != v:
        u = nxt[u][v]
        if u < 0 or len(out) == N:
            return None
        out.append(u)
    return out


def floyd_warshall_cycles(w, tol):
    """Floyd-Warshall with path reconstruction that stops relaxing through a node m as soon as m
    closes a negative cycle (dist[u][m] + dist[m][u] < -tol with intermediates < m, all still exact
    shortest paths). Such a cycle is taken if it is node-disjoint from the ones taken before, its
    nodes are then blocked, and m is skipped, so one pass returns several disjoint negative cycles.

    Returns (cycles, dist, nxt); with no cycle, dist is the all-pairs shortest-path matrix.
    """
    N = len(w)
    dist = [row[:] for row in w]
    nxt = [[v if w[u][v] < math.inf else -1 for v in range(N)] for u in range(N)]
    blocked = [False] * N
    cycles = []
    for m in range(N):
        if blocked[m]:
            continue
        closing = [u for u in range(N) if u != m and not blocked[u] and dist[u][m] + dist[m][u] < -tol]
        if closing:
            for u in closing:
                there, back = path(nxt, u, m), path(nxt, m, u)
                if there is None or back is None:
                    continue
                walk = there + back
                if any(blocked[v] for v in walk):
                    continue
                cyc = split_negative_cycle(walk, w, tol)
                if cyc is not None:
                    cycles.append(cyc)
                    for v in cyc:
                        blocked[v] = True
                    break
            blocked[m] = True  # never relax through a node on a negative cycle
            continue
        for u in range(N):
            if dist[u][m] == math.inf:
                continue
            for v in range(N):
                if dist[u][m] + dist[m][v] < dist[u][v]:
                    dist[u][v] = dist[u][m] + dist[m][v]
                    nxt[u][v] = nxt[u][m]
    return cycles, dist, nxt


def solve(s: list[list[float]], capacity: int):
    """Returns (z [n], value, dist [N][N] all-pairs shortest move costs at the optimum)."""
    n, k = len(s), len(s[0])
    flat = [x for row in s for x in row]
    spread = (max(flat) - min(flat)) if flat else 0.0
    spread = spread if spread > 0 else 1.0
    tol = TOL_REL * max(1.0, max((abs(x) for x in flat), default=0.0))
    eps = auction_epsilon(spread, tol)
    z = auction(s, capacity, [0.0] * k, eps, BID_BUDGET * n) if n else []
    if z is None:
        z = auction(s, capacity, column_means(s), eps, math.inf)
    slack = n < capacity * k
    while True:
        counts = [0] * k
        for j in z:
            counts[j] += 1
        d, arg = move_costs(s, z, k)
        w = graph(d, counts, capacity, slack)
        cycles, dist, _ = floyd_warshall_cycles(w, tol)
        if not cycles:
            break
        # Disjoint cycles: each expert gives away at most one token, so every move is the argmin
        # of its edge as computed, and the gains add up.
        for cyc in cycles:
            for t in range(len(cyc)):
                a, b = cyc[t], cyc[(t + 1) % len(cyc)]
                if a < k and b < k:
                    z[arg[a][b]] = b
    value = sum(s[i][z[i]] for i in range(n))
    return z, value, dist


def balanced_assignment(scores: torch.Tensor, capacity: int):
    """Exact capacity-constrained assignment.

    Args:
      scores: [n, k] floating point, finite (else ValueError). capacity: int with capacity * k >= n.
    Returns:
      (experts [n] int64, value 0-dim float64 = sum_i scores[i, experts[i]] in float64,
       distances [k, k] float64: d*, the cheapest cost of moving one token from expert j to j'
       through any chain of moves (including chains ending in a free slot), at the optimum;
       +inf where no chain exists).
    """
    n, k = scores.shape
    s = scores.detach().double().cpu().tolist()
    if not all(math.isfinite(x) for row in s for x in row):
        raise ValueError("balanced_assignment: scores must be finite (no NaN or inf)")
    z, value, dist = (
        solve(s, capacity) if n else ([], 0.0, [[0.0 if a == b else math.inf for b in range(k)] for a in range(k)])
    )
    return (
        torch.tensor(z, dtype=torch.int64, device=scores.device),
        torch.tensor(value, dtype=torch.float64, device=scores.device),
        torch.tensor([row[:k] for row in dist[:k]], dtype=torch.float64, device=scores.device).reshape(k, k),
    )
