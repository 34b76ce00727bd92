"""Prompt-prefix state cache: the token paths of recent prompts in a radix tree, and at some of its nodes a
checkpoint (the recurrent state after that prefix, and the last position's logits).

An RWKV sequence's whole memory is its fixed-size state, so a prompt that starts with a prefix some earlier prompt
went through can start from that prefix's state instead of token 0. Checkpoints are made where a prefill chunk
ends: at each prompt's end, at fixed intervals inside long prompts, and at the point where a new prompt leaves the
path of earlier ones (the tree knows those paths even where it holds no state: the second prompt with a shared
instruction is prefilled in two chunks, the instruction first, and every later one starts after it). A prompt
that is a whole checkpoint's prefix needs no prefill at all: its first token is sampled from the stored logits.

Checkpoints live in two tiers with byte caps, least recently used first out: the device (next to the slots) and
host memory (pinned); a device checkpoint pushed out moves to the host tier, a host one is dropped. This module
is plain Python: the tensors are the runner's (``engine.runner``), opaque here.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Checkpoint:
    """A prefix's state: ``payload`` is the runner's (tensors), ``nbytes`` its size, ``on_device`` its tier."""
    payload: object
    nbytes: int
    on_device: bool
    has_logits: bool
    node: Node | None = None
    shared: bool = False  # offered to the shared tier (on_shared) already, or taken from it
    divergence: bool = False  # made where prompts leave each other's path (or taken from the shared tier)
    superseded: bool = False  # a longer checkpoint on its path was made after it (see PrefixCache._make_room)


@dataclass(eq=False)
class Node:
    edge: list[int]  # the tokens from the parent to here (a list: compared against prompt slices, lists)
    parent: Node | None
    depth: int  # tokens from the root to the end of ``edge``
    children: dict[int, Node] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    pending: bool = False  # a chunk launched this step ends here: its checkpoint is being made
    used: int = 0


@dataclass
class Plan:
    """Where a new prompt starts: ``tokens`` of it come from ``checkpoint``, its first chunk ends at ``split_at``
    (a checkpoint is made there), or it ``wait``s a step for a checkpoint being made that covers more of it."""
    tokens: int = 0
    checkpoint: Checkpoint | None = None
    split_at: int | None = None
    wait: bool = False


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    tokens_saved: int = 0
    checkpoints_made: int = 0
    demoted: int = 0
    dropped: int = 0


class PrefixCache:
    """The tree and the tiers. The runner passes ``demote(payload) -> payload`` (a device checkpoint copied to
    host memory, its device storage given back) and ``release(payload)`` (a dropped checkpoint's storage given
    back), and may pass ``can_demote() -> bool``: False while a copy to the host now would have to wait for
    earlier ones (the checkpoint pushed out is dropped instead). ``min_tokens``: no checkpoint for shorter
    prefixes; ``interval``: checkpoints every that many tokens inside long prompts (0: none); ``max_path_tokens``:
    the tree's stored paths, bounded."""

    def __init__(self, device_bytes: int, host_bytes: int, demote: Callable[[object], object] | None = None,
                 release: Callable[[object], None] | None = None, min_tokens: int = 32, interval: int = 0,
                 max_path_tokens: int = 4_000_000, can_demote: Callable[[], bool] | None = None):
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self.demote = demote
        self.can_demote = can_demote
        self.release = release
        self.min_tokens = max(1, min_tokens)
        self.interval = interval
        self.max_path_tokens = max_path_tokens
        self._roots: dict[str | None, Node] = {}  # a tree per initial state (None: the zero state)
        self.stats = CacheStats()
        self._tick = itertools.count(1)
        self._path_tokens = 0
        self._tiers: dict[bool, OrderedDict[int, Checkpoint]] = {True: OrderedDict(), False: OrderedDict()}
        self._used_bytes = {True: 0, False: 0}
        self._pending: list[Node] = []
        # on_shared(checkpoint, prefix, root): a checkpoint proved shared (made where prompts diverge, or hit),
        # once each; the worker offers it to the cross-worker tier (worker.shared_states)
        self.on_shared: Callable[[Checkpoint, list[int], str | None], None] | None = None
        # on_added(prefix, root): a checkpoint was made (the worker advertises what it holds, for routing)
        self.on_added: Callable[[list[int], str | None], None] | None = None

    # -- planning (the scheduler) -----------------------------------------------------------------

    def plan(self, prompt: list[int], use_checkpoints: bool = True, root: str | None = None) -> Plan:
        """Where ``prompt`` starts (from the initial state ``root``; None: the zero state). A checkpoint at the
        prompt's full length counts only with its logits (a prefill of at least one token gives them otherwise).
        ``use_checkpoints`` False: no start from a checkpoint (prompt logprobs score every position), only the
        split that makes one."""
        self.stats.lookups += 1
        tick = next(self._tick)
        plan = Plan()
        node, matched = self._root(root), 0
        pending_beyond = False
        while matched < len(prompt):
            child = node.children.get(prompt[matched])
            if child is None:
                break
            common = _common_prefix(child.edge, prompt, matched)
            if common < len(child.edge):  # the prompt leaves this path inside the edge
                matched += common
                break
            matched += common
            node = child
            node.used = tick
            if node.pending:
                pending_beyond = True
            cp = node.checkpoint
            if use_checkpoints and cp is not None and (node.depth < len(prompt) or cp.has_logits):
                plan.tokens, plan.checkpoint, pending_beyond = node.depth, cp, False
        if pending_beyond:
            plan.wait = True
            return plan
        if plan.checkpoint is not None:
            self.stats.hits += 1
            self.stats.tokens_saved += plan.tokens
            self._touch(plan.checkpoint)
            self._offer(plan.checkpoint, prompt[:plan.tokens], root)
        # the prompt leaves an earlier prompt's path past the checkpoint it starts from: make one there
        if matched >= self.min_tokens and plan.tokens < matched < len(prompt):
            plan.split_at = matched
        return plan

    def longest(self, prompt: list[int], root: str | None = None) -> int:
        """How many of ``prompt``'s tokens a checkpoint covers now (a look only: no stats, no recency)."""
        node, matched, best = self._roots.get(root), 0, 0
        while node is not None and matched < len(prompt):
            node = node.children.get(prompt[matched])
            if node is None or _common_prefix(node.edge, prompt, matched) < len(node.edge):
                break
            matched += len(node.edge)
            cp = node.checkpoint
            if cp is not None and (matched < len(prompt) or cp.has_logits):
                best = matched
        return best

    def chunk_end(self, start: int, end: int, prompt_len: int) -> int:
        """Where a chunk from ``start`` that would end at ``end`` ends: at the next interval boundary past
        ``start``, if it crosses one before the prompt's end."""
        if self.interval <= 0:
            return end
        boundary = (start // self.interval + 1) * self.interval
        return boundary if boundary < min(end, prompt_len) and boundary >= self.min_tokens else end

    def makes_checkpoint(self, end: int, prompt_len: int, split_at: int | None) -> bool:
        """Whether a chunk ending at ``end`` leaves a checkpoint."""
        if end < self.min_tokens:
            return False
        return end == prompt_len or end == split_at or (self.interval > 0 and end % self.interval == 0)

    def expect(self, prefix: list[int], root: str | None = None) -> None:
        """A chunk ending after ``prefix`` is launched this step: later prompts on its path wait for it."""
        node = self._insert_path(prefix, root)
        node.pending = True
        self._pending.append(node)

    def step_done(self) -> None:
        """The step's chunks are launched: nothing is pending any more (a chunk that made no checkpoint, an
        aborted one, leaves its path and no state)."""
        for node in self._pending:
            node.pending = False
        self._pending.clear()

    # -- checkpoints (the runner) -----------------------------------------------------------------

    def add(self, prefix: list[int], nbytes: int, has_logits: bool, store: Callable[[], object],
            root: str | None = None, shared: bool = False, from_shared_tier: bool = False) -> Checkpoint | None:
        """The device state after ``prefix`` (replacing an older one there): room is made in the device tier (its
        least recently used checkpoints moved to the host tier or dropped), then ``store()`` copies the state and
        returns its payload. None where it cannot fit at all. ``shared``: prompts diverge here (so it is offered
        to the shared tier); ``from_shared_tier``: it came from there (never offered back)."""
        if nbytes > self.device_bytes:
            return None
        node = self._insert_path(prefix, root)
        node.pending = False
        if node.checkpoint is not None:
            if node.checkpoint.has_logits and not has_logits:  # the one there serves more: keep it
                node.used = next(self._tick)
                self._touch(node.checkpoint)
                return node.checkpoint
            self._remove(node.checkpoint)
        self._supersede_above(node)  # first: a finished answer's own prompt end is dropped, not copied, for room
        self._make_room(True, nbytes)
        cp = Checkpoint(store(), nbytes, on_device=True, has_logits=has_logits, node=node, shared=from_shared_tier,
                        divergence=shared or from_shared_tier)
        node.checkpoint = cp
        node.used = next(self._tick)
        self._tiers[True][id(cp)] = cp
        self._used_bytes[True] += nbytes
        self.stats.checkpoints_made += 1
        if self.on_added is not None:
            self.on_added(prefix, root)
        if shared:
            self._offer(cp, prefix, root)
        return cp

    def bytes_used(self, on_device: bool) -> int:
        return self._used_bytes[on_device]

    def checkpoints(self, on_device: bool) -> int:
        return len(self._tiers[on_device])

    def clear(self) -> None:
        for tier in self._tiers.values():
            for cp in list(tier.values()):
                self._remove(cp)

    # -- internals --------------------------------------------------------------------------------

    def _offer(self, cp: Checkpoint, prefix: list[int], root: str | None) -> None:
        if cp.shared or self.on_shared is None:
            return
        cp.shared = True
        try:
            self.on_shared(cp, prefix, root)
        except Exception:  # the shared tier is an optimisation: serving goes on without it
            log.exception("could not offer a checkpoint to the shared tier")

    def _touch(self, cp: Checkpoint) -> None:
        self._tiers[cp.on_device].move_to_end(id(cp))

    def _make_room(self, on_device: bool, nbytes: int) -> None:
        """Least recently used checkpoints out of a tier until ``nbytes`` more fit: the device tier's to the host
        tier (where it has room for them), the host tier's dropped. A superseded checkpoint (a longer one on its
        path was made after it: a prompt's end once its answer's is kept, a chat turn's once the next turn's is)
        is dropped from the device tier rather than copied to the host: every later prompt on that path starts
        from the longer one, and the copy (a whole state over PCIe) is what moving it would cost. Divergence
        points stay: prompts that leave the path there need them. A checkpoint pushed out while the copies to the
        host are behind (``can_demote``: a burst of new checkpoints, such as a batch's wave of finished lines) is
        dropped too: the host tier takes what the copies carry without holding up the steps."""
        tier, cap = self._tiers[on_device], self.device_bytes if on_device else self.host_bytes
        while tier and self._used_bytes[on_device] + nbytes > cap:
            cp = next(iter(tier.values()))
            worth_moving = cp.divergence or not cp.superseded
            if (on_device and self.demote is not None and cp.nbytes <= self.host_bytes and worth_moving
                    and (self.can_demote is None or self.can_demote())):
                self._move_to_host(cp)
            else:
                self._remove(cp)

    @staticmethod
    def _supersede_above(node: Node) -> None:
        """The checkpoints on ``node``'s path above it are superseded by the one just made there."""
        above = node.parent
        while above is not None:
            if above.checkpoint is not None:
                above.checkpoint.superseded = True
            above = above.parent

    def _move_to_host(self, cp: Checkpoint) -> None:
        self._make_room(False, cp.nbytes)
        del self._tiers[True][id(cp)]
        self._used_bytes[True] -= cp.nbytes
        cp.payload = self.demote(cp.payload)
        cp.on_device = False
        self._tiers[False][id(cp)] = cp
        self._used_bytes[False] += cp.nbytes
        self.stats.demoted += 1

    def _remove(self, cp: Checkpoint) -> None:
        tier = self._tiers[cp.on_device]
        if tier.pop(id(cp), None) is not None:
            self._used_bytes[cp.on_device] -= cp.nbytes
            self.stats.dropped += 1
            if self.release is not None:
                self.release(cp.payload)
        if cp.node is not None and cp.node.checkpoint is cp:
            cp.node.checkpoint = None
        cp.payload = None

    def _root(self, key: str | None) -> Node:
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = Node([], None, 0)
        return root

    def _insert_path(self, tokens: list[int], root: str | None = None) -> Node:
        """The node at exactly ``len(tokens)`` on the path of ``tokens`` (made, and edges split, as needed)."""
        node, at = self._root(root), 0
        tick = next(self._tick)
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                leaf = Node(list(tokens[at:]), node, len(tokens), used=tick)
                node.children[tokens[at]] = leaf
                self._path_tokens += len(leaf.edge)
                node = leaf
                break
            common = _common_prefix(child.edge, tokens, at)
            if common < len(child.edge):
                child = self._split(child, common)
            at += common
            node = child
            node.used = tick
        if self._path_tokens > self.max_path_tokens:
            self._prune_paths(keep=node)
        return node

    @staticmethod
    def _split(node: Node, k: int) -> Node:
        """Cut ``node``'s edge after ``k`` tokens: a new node there, ``node`` below it."""
        parent = node.parent
        mid = Node(node.edge[:k], parent, node.depth - len(node.edge) + k, used=node.used)
        parent.children[node.edge[0]] = mid
        node.edge = node.edge[k:]
        node.parent = mid
        mid.children[node.edge[0]] = node
        return mid

    def _prune_paths(self, keep: Node) -> None:
        """Drop least recently used leaves (and their checkpoints) until the paths fit in 90% of the bound."""
        leaves = []
        stack = list(self._roots.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.parent is not None:
                leaves.append(n)
        leaves.sort(key=lambda n: n.used)
        for leaf in leaves:
            if self._path_tokens <= 0.9 * self.max_path_tokens:
                break
            node = leaf
            while node.parent is not None and not node.children and node is not keep and not node.pending:
                if node.checkpoint is not None:
                    self._remove(node.checkpoint)
                parent = node.parent
                del parent.children[node.edge[0]]
                self._path_tokens -= len(node.edge)
                node = parent


def _common_prefix(edge: list[int], tokens: list[int], at: int) -> int:
    """How many of ``edge``'s tokens ``tokens`` repeats from ``at``. Slices are compared (in C) and the first
    mismatch is found by halving: a chat's history is thousands of tokens, walked on every turn."""
    n = len(edge)
    if n <= len(tokens) - at:
        if edge == tokens[at:at + n]:
            return n
    else:
        n = len(tokens) - at
        if edge[:n] == tokens[at:]:
            return n
    lo, hi = 0, n  # edge[:lo] matches; the first mismatch is before hi
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if edge[lo:mid] == tokens[at + lo:at + mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and edge[lo] == tokens[at + lo]:
        lo += 1
    return lo
