"""Token trees: several draft continuations verified in ONE target forward (greedy or sampled).

SpecInfer (Miao et al., 2024) and Medusa (Cai et al., 2024) verify a tree of candidates instead of one
chain: the candidates share their common prefixes, every node attends to the committed prefix and to
its own ancestors only, and the longest path whose every node equals the target's argmax at its
parent is accepted. A verify forward's cost grows with its node count (docs/reference/verify-cost.md),
so a second candidate (another n-gram match next to the trained draft's chain) costs little only while
the tree stays small.

Layout of one round, per row b (node 0 is the current token, at position n_b):
    tokens  [B, N]       nodes 1..N (padding nodes past a row's own: token 0, never accepted)
    parents (host lists) parent node index in 0..N-1 (0 = the current token)
    depth   [B, N+1]     node depth; node j sits at position n_b + depth[b, j]
    anc     [B, N+1, N+1] anc[b, j, i]: node i is node j or one of its ancestors
Every node gets its own cache slot n_b + j; after the round the accepted path's K/V move to the
consecutive slots n_b + 1..n_b + a (the runner's `move`), so the cache stays position-indexed.

Sampling verifies trees too, losslessly: eval.decoder.verify_tree_sample walks the same tree with
SpecInfer's multi-round rejection sampling. A branch is deterministic (a one-hot draft distribution:
n-gram and datastore lookups, a model's argmax chain and runner-ups) or sampled: a model's chain drawn
from its q, each of whose nodes carries q (`q_host`) and is tried first among its siblings, where the
rule's min(1, p/q) and residual need the node's p untouched by other siblings' rejections.
`children()` gives each node's children in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def build_trie(candidates: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Merge candidate continuations (in priority order) into a trie of at most max_nodes nodes.
    -> (tokens, parents) of nodes 1..N in insertion order; parents index 0..N-1 (0: the current
    token), so a parent always comes before its children."""
    tokens, parents = [], []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cand in candidates:
        node = 0
        for tok in cand:
            nxt = children.get((node, tok))
            if nxt is None:
                if len(tokens) >= max_nodes:
                    break
                tokens.append(tok)
                parents.append(node)
                nxt = len(tokens)
                children[(node, tok)] = nxt
            node = nxt
    return tokens, parents


def trie_path(tokens: list[int], parents: list[int], cand: list[int]) -> list[int]:
    """The nodes (1..N) that candidate `cand` runs through in a trie from build_trie, as far as it got in."""
    kids = {(p, t): j for j, (p, t) in enumerate(zip(parents, tokens), start=1)}
    out, node = [], 0
    for tok in cand:
        node = kids.get((node, tok))
        if node is None:
            break
        out.append(node)
    return out


@dataclass
class Tree:
    tokens: torch.Tensor  # [B, N] long (padding nodes: 0)
    depth: torch.Tensor  # [B, N+1] long
    anc: torch.Tensor  # [B, N+1, N+1] bool
    parents_host: list[list[int]]  # per row, its own nodes' parents (no padding)
    tokens_host: list[list[int]]  # per row, its own nodes' tokens (no padding)
    max_depth: int  # host int
    # per row, node -> the draft distribution q [V] it was sampled from (a sampled branch's nodes); else one-hot
    q_host: list[dict[int, torch.Tensor]] | None = None

    @classmethod
    def from_lists(cls, rows: list[tuple], device) -> "Tree":
        """rows: per batch row, (tokens, parents) from build_trie, or (tokens, parents, {node: q [V]}) with a
        sampled branch's nodes; rows are padded to one N."""
        qs = [r[2] if len(r) > 2 else {} for r in rows]
        rows = [(r[0], r[1]) for r in rows]
        # Built as host lists and turned into tensors once: per-node tensor ops cost more than the
        # whole tree is worth at these sizes (tens of nodes).
        N = max((len(t) for t, _ in rows), default=0)
        toks, depths, ancs = [], [], []
        for t, p in rows:
            depth = [0] * (N + 1)
            anc = [[i == j for i in range(N + 1)] for j in range(N + 1)]  # every node sees itself
            for j, pj in enumerate(p, start=1):  # parents come first: one pass fills depth and anc
                depth[j] = depth[pj] + 1
                anc[j] = [a or b for a, b in zip(anc[j], anc[pj])]
            for j in range(len(p) + 1, N + 1):
                depth[j] = 1  # padding nodes: a position past the current token, never accepted
            toks.append(t + [0] * (N - len(t)))
            depths.append(depth)
            ancs.append(anc)
        md = max((max(d) for d in depths), default=0) if N else 0
        as_t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        return cls(as_t(toks, torch.long).view(len(rows), N), as_t(depths, torch.long), as_t(ancs, torch.bool),
                   [p for _, p in rows], [t for t, _ in rows], md, qs if any(qs) else None)

    def mask(self, n: torch.Tensor, s_len: int) -> torch.Tensor:
        """n [B] the current token's position -> attention mask [B, 1, N+1, s_len]: node j of row b
        sees the committed slots 0..n_b-1 and the slots n_b + i of its ancestors i (itself included)."""
        B, N1 = self.depth.shape
        slots = torch.arange(s_len, device=n.device)
        m = (slots[None, None, :] < n[:, None, None]).expand(B, N1, s_len).clone()  # [B, N+1, S]
        cols = (n[:, None] + torch.arange(N1, device=n.device))[:, None, :].expand(B, N1, N1)
        return m.scatter_(2, cols, self.anc)[:, None]

    def accept_greedy(self, g: list[list[int]]) -> list[tuple[int, int, int]]:
        """g: per row, the target's argmax at every node (host ints, nodes 0..N) -> per row (best: the
        deepest accepted node, whose own token and every ancestor's equal the target's argmax at their
        parent; n_acc: its depth; bonus: the target's argmax after it). On the host: a walk down from
        the root along the child holding the parent's argmax (a trie's siblings hold distinct tokens,
        so there is at most one), a few dict lookups where the same rule as tensor ops costs more in
        small-op dispatch than the round can spare."""
        out = []
        for b, (toks, par) in enumerate(zip(self.tokens_host, self.parents_host)):
            kids = {(p, t): j for j, (p, t) in enumerate(zip(par, toks), start=1)}
            node, depth, gb = 0, 0, g[b]
            while (node, gb[node]) in kids:
                node, depth = kids[(node, gb[node])], depth + 1
            out.append((node, depth, gb[node]))
        return out

    def children(self) -> list[dict[int, list[int]]]:
        """Per row, node -> its children's node indices, on the host: a sampled child first (a node has at
        most one: a trie merges equal tokens), then the others in insertion (priority) order."""
        out = []
        for b, par in enumerate(self.parents_host):
            sampled = self.q_host[b] if self.q_host else {}
            kids: dict[int, list[int]] = {}
            for j, p in enumerate(par, start=1):
                kids.setdefault(p, []).append(j)
            out.append({p: sorted(ch, key=lambda j: j not in sampled) for p, ch in kids.items()})
        return out

    def path(self, b: int, best: int) -> list[int]:
        """Node indices from the root (0) to node `best` of row b, on the host."""
        out, p = [best], self.parents_host[b]
        while out[-1] != 0:
            out.append(p[out[-1] - 1])
        return out[::-1]
