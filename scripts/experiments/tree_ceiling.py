"""How much tree drafts could gain over chains, before any tree is built: an oracle over replayed
rounds, timed on the target's measured cost curve.

Strict decoding is deterministic, so with the target's greedy answer known each round of a
prompt-lookup run is replayed without the model (scripts/experiments/replay.py). At each position,
prompt lookup finds every earlier occurrence of the context's longest suffix n-gram (up to
`--branches` of the most recent); their continuations, merged into a trie, are the tree's
nodes. A chain is the most recent occurrence's continuation alone, as flylocal drafts today. A
round of m draft nodes costs one decode of m + 1 rows, t(m + 1) from the curve (a tree's mask
changes which rows attend to which, not how many weights are read: the cost of a
bandwidth-bound step). It accepts the longest path of chosen nodes the answer agrees with.

Policies, in decode time against plain decoding:
- "expected gain": nodes taken best first by their probability of being reached (the level's
  measured acceptance per token, times the share of the occurrences that continue that way),
  as many as maximize expected tokens per second, (1 + expected accepted) / t(m + 1). The chain
  does the same on its one branch. Its acceptance per level is measured on the same prompts, in
  hindsight, for both.
- "every node, up to N": the whole trie, breadth first, cut at N nodes, with no choice (a fixed
  shape).
- "oracle": drafts exactly the tokens that will be accepted; for the tree, from the branch that
  agrees longest. No drafter reaches it: it is the ceiling of each shape.

With `--draft NAME`, the same oracles for a draft model. Its predictions along the answer come
from one teacher-forced pass (exact while its drafts agree with the answer, which is all an
oracle drafts); a chain follows its first choice, a tree also its second wherever that is the
answer's token. A round of a draft tokens costs a draft steps, t_d(1) each, and t(a + 1).

    .venv/bin/python scripts/experiments/tree_ceiling.py [--target NAME] [--raw] [--per-category 8]
        [--skip 8] [--max-tokens 128] [--rows 33] [--row-cost X] [--shorter N] [--draft NAME] [--answers FILE.npz] [--exact]

Answered (docs/benchmarks.md, "How far prompt lookup, and trees, can go", 2026-12-05): on the stand-in, trees of
prompt-lookup drafts reached 2.693x plain decoding against the chain's 2.648 by expected gain
(oracles 3.574 and 3.245: 1.10x), a draft model's oracles 1.04x; on the default target trees
came in 0.1% of rounds. Under the 1.15x a tree would have to reach, trees are not built
(docs/design.md, "Tree drafts: measured, not built").
"""

from __future__ import annotations

import argparse
import collections
import heapq
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
import replay


class Trie:
    """Continuations merged by prefix. Node i (0 is the root, no token) has `token[i]`,
    `parent[i]`, `count[i]` (continuations through it), `first[i]` (whether the most recent
    occurrence of the longest n-gram continues through it) and `level[i]` (the longest n-gram
    whose occurrence continues through it)."""

    def __init__(self, branches: list[tuple[np.ndarray, int]]):
        self.token, self.parent, self.count, self.first = [-1], [-1], [len(branches)], [True]
        self.level = [max((n for _, n in branches), default=0)]
        self.children: list[dict[int, int]] = [{}]
        for b, (branch, n) in enumerate(branches):
            node = 0
            for tok in branch.tolist():
                child = self.children[node].get(tok)
                if child is None:
                    child = len(self.token)
                    self.children[node][tok] = child
                    self.token.append(tok)
                    self.parent.append(node)
                    self.count.append(0)
                    self.first.append(b == 0)
                    self.level.append(n)
                    self.children.append({})
                self.count[child] += 1
                node = child

    def bucket(self, node: int) -> int:
        """The node's row in the acceptance table: its level, whether the most recent occurrence
        continues through it, and the share of its parent's continuations it carries."""
        share = self.count[node] / self.count[self.parent[node]]
        return (self.level[node] * 2 + self.first[node]) * (len(SHARES) + 1) + int(np.searchsorted(SHARES, share))

    def breadth_first(self) -> list[int]:
        """The nodes by depth, then by the order they were made in."""
        out, level = [], [0]
        while level:
            level = [c for node in level for c in self.children[node].values()]
            out += level
        return out

    def agree(self, truth: np.ndarray, chosen: set[int] | None = None) -> int:
        """How far the answer `truth` descends through the (chosen) nodes."""
        node, depth = 0, 0
        for tok in truth.tolist():
            child = self.children[node].get(tok)
            if child is None or (chosen is not None and child not in chosen):
                break
            node, depth = child, depth + 1
        return depth


SHARES = np.array([0.25, 0.5, 0.999])     # share buckets: < 1/4, < 1/2, < 1, all


def branches(context: np.ndarray, max_ngram: int, depth: int, limit: int, shorter: int) -> list[tuple[np.ndarray, int]]:
    """(continuation of up to `depth` tokens, n) for the `limit` most recent earlier occurrences
    of the context's longest suffix n-gram, most recent first; then, `shorter` > 0, those of
    the n-gram one token shorter not already there, down to `shorter` sizes below."""
    from flylocal.decoding.drafters.pld import find_matches

    out, seen = [], set()
    ends, n = find_matches(context, max_ngram)
    for size in range(n, max(n - shorter, 1) - 1, -1) if n else ():
        if size < n:
            ends, _ = find_matches(context, size)
        for e in ends[::-1]:
            if len(out) >= limit:
                return out
            if e not in seen:
                seen.add(e)
                out.append((context[e + 1: e + 1 + depth], size))
    return out


def expected_gain(trie: Trie, accept: np.ndarray, cost: np.ndarray, chain: bool) -> tuple[set[int], int]:
    """(nodes, branches used) maximizing (1 + expected accepted) / t(nodes + 1), taken best first
    by their probability of being reached (`accept` [buckets]: a node's, given its parent's);
    `chain`: only the most recent occurrence's nodes."""
    heap = [(-accept[trie.bucket(c)], c) for c in trie.children[0].values() if not chain or trie.first[c]]
    heapq.heapify(heap)
    taken, expected = [], 0.0
    best, best_rate = 0, 1.0 / cost[0]
    while heap and len(taken) + 1 < len(cost):
        neg, node = heapq.heappop(heap)
        taken.append(node)
        expected += -neg
        rate = (1 + expected) / cost[len(taken)]
        if rate > best_rate:
            best, best_rate = len(taken), rate
        for c in trie.children[node].values():
            if not chain or trie.first[c]:
                heapq.heappush(heap, (neg * accept[trie.bucket(c)], c))
    chosen = set(taken[:best])
    leaves = sum(1 for n in chosen if not any(c in chosen for c in trie.children[n].values()))
    return chosen, leaves


def top2(runtime, full: np.ndarray, chunk: int = 64) -> np.ndarray:
    """[len(full), 2] the model's first and second choice after each prefix of `full` (row i:
    after full[: i + 1]), teacher-forced."""
    runtime.reset()
    out = []
    for start in range(0, len(full), chunk):
        logits = runtime.decode(full[start: start + chunk], logits_from=0)
        two = np.argpartition(-logits, 1, axis=1)[:, :2]
        first = np.take_along_axis(logits, two, axis=1).argmax(axis=1)
        out.append(np.where(first[:, None] == 0, two, two[:, ::-1]))
    runtime.reset()
    return np.concatenate(out)


def runs(agree: np.ndarray) -> np.ndarray:
    """[n] how many consecutive True values start at each index of `agree`."""
    out = np.zeros(len(agree) + 1, dtype=np.int64)
    for i in range(len(agree) - 1, -1, -1):
        out[i] = out[i + 1] + 1 if agree[i] else 0
    return out[:-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(replay.harness.ROOT / "data" / "spec_bench"))
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--raw", action="store_true", help="ask 'Question: ...\\nAnswer:' (a base model)")
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--skip", type=int, default=8, help="leave out the first N prompts of each group")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, default=33, help="the largest decode a round may use")
    ap.add_argument("--depth", type=int, default=16, help="the longest branch")
    ap.add_argument("--branches", type=int, default=16, help="occurrences merged into the tree")
    ap.add_argument("--shorter", type=int, default=0, help="also occurrences of n-grams up to N tokens shorter")
    ap.add_argument("--row-cost", type=float, help="instead of the measured curve, t(n) = t(1) (1 + X (n - 1)): "
                                                   "what a row would cost on other hardware (a GPU: about 0.01)")
    ap.add_argument("--draft", help="a draft model whose chain and tree oracles to add")
    ap.add_argument("--answers", help="a .npz file the greedy answers are kept in (read when it exists)")
    ap.add_argument("--exact", action="store_true", help="the batch-invariant build")
    args = ap.parse_args()

    from flylocal.llama import kernels
    kernels.choose(args.exact)
    from flylocal.loader import load
    from flylocal.settings import Settings

    models = load(Settings(target=args.target, drafter="none", verifier="strict", max_tokens=args.max_tokens))
    items = replay.answers(models, args.prompts, args.per_category, args.skip, args.raw, args.answers)
    cost = replay.curve(models.target, items[0][1], args.rows if args.row_cost is None else 1)
    if args.row_cost is not None:
        cost = cost[0] * (1 + args.row_cost * np.arange(args.rows))
    models.close()
    draft_runs = None
    if args.draft:      # [item] (chain, tree) agreement runs at each answer position
        drafts = load(Settings(target=args.draft, drafter="none", verifier="strict"))
        step = replay.curve(drafts.target, items[0][1], 1)[0]
        draft_runs = []
        for _, full, n0 in items:
            choice = top2(drafts.target, full)[n0 - 1: len(full) - 1]     # predictions of full[n0:]
            truth = full[n0:]
            draft_runs.append((runs(choice[:, 0] == truth), runs((choice == truth[:, None]).any(axis=1))))
        drafts.close()
    max_ngram = 4
    memo: dict[tuple[int, int], Trie] = {}

    def at(i: int, pos: int) -> Trie:
        if (i, pos) not in memo:
            full = items[i][1]
            memo[i, pos] = Trie(branches(full[:pos], max_ngram, min(args.depth, len(full) - pos - 1),
                                         args.branches, args.shorter))
        return memo[i, pos]

    # How often a node is on the answer's path given its parent is, by bucket, in hindsight.
    hits, tries = np.zeros((max_ngram + 1) * 2 * (len(SHARES) + 1)), np.zeros((max_ngram + 1) * 2 * (len(SHARES) + 1))
    for i, (_, full, n0) in enumerate(items):
        for pos in range(n0, len(full) - 1):
            trie, node = at(i, pos), 0
            for tok in full[pos: pos + args.depth].tolist():
                nxt = trie.children[node].get(tok)
                for c in trie.children[node].values():
                    tries[trie.bucket(c)] += 1
                    hits[trie.bucket(c)] += c == nxt
                if nxt is None:
                    break
                node = nxt
    accept = hits / np.maximum(tries, 1)

    def run(policy) -> tuple[tuple[dict, float], float]:
        per = collections.defaultdict(lambda: [0.0, 0.0])     # group -> plain seconds, seconds
        rounds = branched = 0
        for i, (group, full, n0) in enumerate(items):
            pos, t = n0, 0.0
            while pos < len(full):
                nodes, accepted, leaves = policy(i, pos)
                t += cost[nodes] + (step * nodes if policy.drafted else 0.0)
                pos += accepted + 1
                rounds += 1
                branched += leaves > 1
            per[group][0] += (len(full) - n0) * cost[0]
            per[group][1] += t
        overall = sum(a for a, _ in per.values()) / sum(b for _, b in per.values())
        return ({g: a / b for g, (a, b) in per.items()}, overall), branched / max(rounds, 1)

    def lookup(choose):
        def policy(i, pos):
            trie = at(i, pos)
            chosen = choose(trie)
            leaves = sum(1 for c in chosen if not any(x in chosen for x in trie.children[c].values()))
            return len(chosen), trie.agree(items[i][1][pos: pos + args.depth], chosen), leaves
        policy.drafted = False
        return policy

    def gain(chain: bool):
        return lookup(lambda trie: expected_gain(trie, accept, cost, chain)[0])

    def every(limit: int):
        return lookup(lambda trie: set(trie.breadth_first()[:limit]))

    def oracle(chain: bool):
        def policy(i, pos):
            trie, truth = at(i, pos), items[i][1][pos: pos + args.depth]
            a = trie.agree(truth, {c for c in range(len(trie.token)) if trie.first[c]} if chain else None)
            return a, a, 1
        policy.drafted = False
        return policy

    def draft_oracle(tree: bool):
        def policy(i, pos):
            n0, left = items[i][2], len(items[i][1]) - pos - 1
            a = min(int(draft_runs[i][tree][pos - n0]), args.depth, left) if left > 0 else 0
            return a, a, 1
        policy.drafted = True
        return policy

    rows, shares = [], []
    for name, policy in [("chain, expected gain", gain(True)), ("tree, expected gain", gain(False)),
                         *[(f"tree, every node up to {m}", every(m)) for m in (8, 16, 32) if m < len(cost)],
                         ("chain oracle", oracle(True)), ("tree oracle (best branch)", oracle(False)),
                         *([("draft model: chain oracle", draft_oracle(False)),
                            ("draft model: tree oracle (second choices)", draft_oracle(True))] if draft_runs else [])]:
        result, share = run(policy)
        rows.append((name, result))
        shares.append(share)
    print(f"{args.target}{' raw' if args.raw else ''}, {args.per_category} prompts a group after {args.skip}, "
          f"up to {args.branches} occurrences, depth {args.depth}, rows up to {len(cost)}")
    print("a node's acceptance given its parent's, by n-gram size (most recent occurrence; another), share "
          + " ".join(f"<{b:g}" for b in SHARES) + " 1:")
    for n in range(1, max_ngram + 1):
        row = [(n * 2 + f) * (len(SHARES) + 1) for f in (1, 0)]
        cells = [" ".join(f"{accept[r + j]:.2f}" if tries[r + j]
                          else "-" for j in range(len(SHARES) + 1)) for r in row]
        print(f"  {n}: {cells[0]}; {cells[1]}")
    replay.table(rows, cost, len(items), kernels.mode(), sizes=(1, 2, 3, 5, 9, 17, 33))
    print("rounds with more than one branch: " + ", ".join(f"{name} {s:.1%}" for (name, _), s in zip(rows, shares)))
    speed = {name: result[1] for name, result in rows}
    print(f"prompt lookup, tree / chain, expected gain: "
          f"{speed['tree, expected gain'] / speed['chain, expected gain']:.3f}; "
          f"oracle: {speed['tree oracle (best branch)'] / speed['chain oracle']:.3f}")
    if draft_runs:
        print(f"draft model (a step {1000 * step:.1f} ms), tree / chain, oracle: "
              f"{speed['draft model: tree oracle (second choices)'] / speed['draft model: chain oracle']:.3f}")


if __name__ == "__main__":
    main()
