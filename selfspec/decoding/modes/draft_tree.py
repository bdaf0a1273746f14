"""A lookup step's draft as a token tree: the places a suffix occurred, merged and scored.

Where the committed text's suffix occurred more than once (in the request's own text, in the
other requests served), the continuations disagree: one chain drafts one guess. SuffixDecoding
(arXiv 2411.04975) drafts a tree out of all of them, each node scored by how often the text
went that way; SGLang's NGRAM drafts a tree by BFS over its trie. Here the continuations (each
with a weight) are merged into a trie, and its nodes are taken best first by

    score(child) = score(node) x confidence x weight(child) / weight(node's children)

(the root scores 1): the chance that the model continues the text down to that node, if each
token follows the majority of the places with probability `confidence` (from the match's
length: a long match is a sure guide, `match_confidence`). Nodes are taken until the budget of
draft tokens is spent or the best left scores below `min_score` (its expected tokens would not
pay for its query token). A parent always scores at least its child, so it is taken first:
the list is in tree order, each node after its parent.
"""

from __future__ import annotations

import heapq


def match_confidence(length: int) -> float:
    """The chance a draft token after a match of `length` tokens is right, n / (n + 1): the
    rule of succession; 0.5 for a 1-token match, 0.89 for 8, 0.97 for 32."""
    return length / (length + 1.0)


def draft_tree(continuations: list[tuple[list[int], float]], budget: int, confidence: float,
               min_score: float = 0.0) -> list[tuple[int, int]]:
    """Up to `budget` nodes (token, parent index; -1 = the pending token) of the best-scored
    tree over `continuations` [(tokens, weight)]."""
    children: list[dict[int, int]] = [{}]  # trie node -> {token: child}; node 0 is the root
    weight, token = [0.0], [-1]
    for cont, w in continuations:
        node = 0
        for t in cont:
            nxt = children[node].get(t)
            if nxt is None:
                nxt = children[node][t] = len(token)
                children.append({})
                weight.append(0.0)
                token.append(t)
            weight[nxt] += w
            node = nxt
    out: list[tuple[int, int]] = []
    heap: list[tuple[float, int, int]] = []  # (-score, trie node, index of its parent in out)

    def push(node: int, score: float, parent: int) -> None:
        total = sum(weight[c] for c in children[node].values())
        for c in children[node].values():
            s = score * confidence * weight[c] / total
            if s >= min_score:
                heapq.heappush(heap, (-s, c, parent))

    push(0, 1.0, -1)
    while heap and len(out) < budget:
        neg, node, parent = heapq.heappop(heap)
        out.append((token[node], parent))
        push(node, -neg, len(out) - 1)
    return out
