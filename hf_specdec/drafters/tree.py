"""Growing a draft tree by the draft's own confidence (EAGLE-2, Li et al. 2024, "dynamic draft
trees"), shared by drafters that predict a next-token distribution after any prefix: level by
level, expand the frontier nodes with the highest cumulative draft probability into their top-k
children, then keep the most probable nodes up to the budget.

The tree is a deterministic function of the row's context (top-k choices, no draws), which is
what keeps sampling exact: `verify.tree_verify` lets the target sample at each node and descends
only where a child carries the target's own token, so every emitted token is the target's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import GREEDY_CHAINS_AND_TREES, TREES, read_when
from ..core.draft import Draft, DraftRequest
from ..core.fields import check_fields
from ..core.tree import kept_parents, node_depths


@dataclass
class ChainTreeConfig:
    """Settings of a drafter that chains its own predictions and grows trees from them (the `mtp`,
    `assistant` and `medusa` drafters; `eagle`'s and the block drafts' add their own).

    Args:
        min_confidence: stop a greedy chain draft once the draft's probability of its next token
            falls below this, and leave out tree nodes whose path is less probable; 0 leaves the
            cut to the draft-length policy. A sampled chain does not read it.
        tree_top_k: with `SpeculativeConfig(tree=...)`: the children drafted per expanded node and the
            nodes expanded per level (EAGLE-2's top-k); for `medusa`, the guesses per head whose
            combinations make the tree (Medusa's top-k per head). Chains do not read it.
    """

    min_confidence: float = read_when(GREEDY_CHAINS_AND_TREES, 0.0)
    tree_top_k: int = read_when(TREES, 4)

    def __post_init__(self) -> None:
        check_fields(self, ranges={"min_confidence": (0, 1), "tree_top_k": (1, None)})


@dataclass
class _Node:
    token: int
    parent: int  # index into the row's nodes, -1 for a child of the row's last token
    probability: float  # the draft's probability of this token after its parent's path
    cumulative: float  # product of the probabilities down the path: the draft's odds of reaching it
    column: int = -1  # where it was fed among this draft's tree columns; -1 while not fed


@dataclass
class Level:
    """One level of frontier nodes to feed, per row as many as expanded (the rest are holes)."""

    tokens: torch.Tensor  # [B, W]
    valid: torch.Tensor  # [B, W]
    visible: torch.Tensor  # [B, W, F] which of the F tree columns fed so far (this level last) each sees
    parent_columns: torch.Tensor  # [B, W] the tree column each node's parent was fed at; -1: the last token
    depths: torch.Tensor  # [B, W] position after the row's real-token count before this level (see RaggedKV)

    def to(self, device: torch.device) -> Level:
        """The level on `device`, for a draft that computes elsewhere than the target."""
        return Level(*(getattr(self, field.name).to(device) for field in dataclasses.fields(self)))


def grow_tree(
    request: DraftRequest,
    max_tokens: list[int],
    top_k: int,
    min_confidence: float,
    root_logits: torch.Tensor,  # [B, V] the draft's logits after each row's last token
    feed: Callable[[Level], torch.Tensor],  # a level -> the draft's logits after each of its nodes, [B, W, V]
    max_depth: int | None = None,
) -> Draft:
    """A tree of at most `max_tokens[b]` nodes per row, parents before children, and at most
    `max_depth` levels (a block draft predicts that many positions; None: no limit).

    Each level expands, per row, the `top_k` newest nodes of highest cumulative probability that
    could still make the final cut (a node below the budget's worst kept node cannot: its
    descendants are less probable still), each into its `top_k` most probable children. Nodes whose
    cumulative probability falls below `min_confidence` are not proposed. One `feed` per level:
    the tree's depth in draft forwards, as many as a chain of that length.
    """
    batch = len(request.max_tokens)
    nodes: list[list[_Node]] = [[] for _ in range(batch)]
    frontier = [[-1] if n > 0 else [] for n in max_tokens]  # -1: the row's last token
    logits = root_logits[:, None]  # [B, 1, V]
    fed = 0  # tree columns fed so far, holes included: every row has as many
    deepest = max(max_tokens, default=0) if max_depth is None else min(max(max_tokens, default=0), max_depth)
    for depth in range(1, deepest + 1):
        _add_children(request, nodes, frontier, logits, top_k, min_confidence)
        frontier = [
            _worth_expanding(row, depth, top_k, n) if depth < min(n, deepest) else []
            for row, n in zip(nodes, max_tokens)
        ]
        if not any(frontier):
            break
        level = _level(nodes, frontier, fed, request.tokens.device)
        fed += level.tokens.shape[1]
        logits = feed(level)
    return _best(nodes, max_tokens, request.tokens.device)


def _add_children(
    request: DraftRequest,
    nodes: list[list[_Node]],
    frontier: list[list[int]],
    logits: torch.Tensor,  # [B, W, V] after each frontier node
    top_k: int,
    min_confidence: float,
) -> None:
    """Process the logits after each frontier node as the target's will be (the node's own path
    is the context) and add its `top_k` most probable children."""
    where = [(b, i, node) for b, row in enumerate(frontier) for i, node in enumerate(row)]
    if not where:
        return
    contexts = (
        [torch.cat([request.row(b), _path(request, nodes[b], node)], dim=1) for b, _, node in where]
        if request.processor.reads_context
        else []
    )
    row_ids = [request.row_ids[b] for b, _, _ in where]
    raw = logits[[b for b, _, _ in where], [i for _, i, _ in where]]
    probs = request.processor(contexts, row_ids, raw.float()).softmax(dim=-1)  # all -inf rows give NaN
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    for (b, _, node), values, tokens in zip(where, top.values.tolist(), top.indices.tolist()):
        reach = 1.0 if node < 0 else nodes[b][node].cumulative
        for p, token in zip(values, tokens):
            if p > 0 and reach * p >= min_confidence:  # NaN (nothing allowed) fails too
                nodes[b].append(_Node(token, node, p, reach * p))


def _path(request: DraftRequest, row: list[_Node], node: int) -> torch.Tensor:
    """The tokens from the root down to `node` (none for -1), [1, depth]."""
    tokens = []
    while node >= 0:
        tokens.append(row[node].token)
        node = row[node].parent
    return torch.tensor([tokens[::-1]], dtype=request.tokens.dtype, device=request.tokens.device)


def _worth_expanding(row: list[_Node], depth: int, top_k: int, budget: int) -> list[int]:
    """The newest level's (unfed) nodes to expand: the `top_k` most probable whose descendants
    could still rank among the `budget` best nodes."""
    depths = node_depths([n.parent for n in row])
    newest = [i for i, n in enumerate(row) if n.column < 0 and depths[i] == depth]
    newest.sort(key=lambda i: -row[i].cumulative)
    if len(row) >= budget:
        cut = sorted((n.cumulative for n in row), reverse=True)[budget - 1]
        newest = [i for i in newest if row[i].cumulative > cut]
    return newest[:top_k]


def _level(nodes: list[list[_Node]], frontier: list[list[int]], before: int, device: torch.device) -> Level:
    """Lay out the frontier as one forward's columns, after the `before` tree columns fed earlier."""
    batch, width = len(nodes), max(len(f) for f in frontier)
    # Filled on the host as lists (a tensor written element by element costs more than the rest).
    tokens = [[0] * width for _ in range(batch)]
    valid = [[False] * width for _ in range(batch)]
    depths = [[0] * width for _ in range(batch)]
    parent_columns = [[-1] * width for _ in range(batch)]
    seen_rows, seen_nodes, seen_columns = [], [], []  # where `visible` is True: node i of row b sees a column
    for b, row in enumerate(frontier):
        real_fed = sum(n.column >= 0 for n in nodes[b])  # counted in the row's length already
        node_depth = node_depths([n.parent for n in nodes[b]])
        for i, node in enumerate(row):
            nodes[b][node].column = before + i
            tokens[b][i], valid[b][i] = nodes[b][node].token, True
            ancestor = node
            while ancestor >= 0:
                seen_rows.append(b)
                seen_nodes.append(i)
                seen_columns.append(nodes[b][ancestor].column)
                ancestor = nodes[b][ancestor].parent
            depths[b][i] = node_depth[node] - 1 - real_fed
            if nodes[b][node].parent >= 0:
                parent_columns[b][i] = nodes[b][nodes[b][node].parent].column
    visible = torch.zeros(batch, width, before + width, dtype=torch.bool)
    visible[seen_rows, seen_nodes, seen_columns] = True
    return Level(
        torch.tensor(tokens, dtype=torch.long, device=device),
        torch.tensor(valid, dtype=torch.bool, device=device),
        visible.to(device),
        torch.tensor(parent_columns, dtype=torch.long, device=device),
        torch.tensor(depths, dtype=torch.long, device=device),
    )


def _best(nodes: list[list[_Node]], budgets: list[int], device: torch.device) -> Draft:
    """Each row's `budget` most probable nodes, most probable first. That order has parents first (a
    child is never more probable than its parent, and ties go to the earlier node, the parent), and
    makes any prefix of the nodes the best tree of its size: what the draft-length policy's cut
    keeps and what it learns per node (`policy.TreeAcceptance`)."""
    kept = []
    for row, budget in zip(nodes, budgets):
        kept.append(sorted(range(len(row)), key=lambda i: (-row[i].cumulative, i))[:budget])
    width = max((len(k) for k in kept), default=0)
    tokens = [[0] * width for _ in nodes]
    parents = [[-1] * width for _ in nodes]
    confidence = [[0.0] * width for _ in nodes]
    for b, (row, keep) in enumerate(zip(nodes, kept)):
        parents[b][: len(keep)] = kept_parents([n.parent for n in row], keep)
        for new, old in enumerate(keep):
            tokens[b][new] = row[old].token
            confidence[b][new] = row[old].probability
    return Draft(
        torch.tensor(tokens, dtype=torch.long, device=device).reshape(len(nodes), width),
        [len(k) for k in kept],
        None,
        torch.tensor(confidence, dtype=torch.float32, device=device).reshape(len(nodes), width),
        parents=torch.tensor(parents, dtype=torch.long, device=device).reshape(len(nodes), width),
    )
