"""A multi-tenant radix tree over request text, the memory behind ``cache_aware``.

The tree approximates what each engine's prefix cache holds: every string inserted under a tenant
(an :class:`~trio_pdrouter.endpoints.Endpoint`, or anything hashable) makes that tenant own every
prefix of the string, and :meth:`RadixTree.match` answers "which tenant owns the longest prefix of
this text".

Theory of operation
-------------------

* Edges are compressed: a node carries a non-empty ``label`` and its children are keyed by the first
  character of their labels, so a walk costs one dict lookup and one C-level string comparison per
  node, and O(len(text)) overall.
* Each node maps the tenants that own its label to a last-use *stamp*, a logical counter bumped
  once per :meth:`~RadixTree.insert` (the tree never reads a clock). Ownership is closed under
  ancestors (whoever owns a node owns its parent) and stamps never increase going down, because an
  insert stamps every node on its path.
* All characters of one label share the same owners and stamps: an insert that diverges or ends
  inside a label splits it first. So a tenant's *retained prefixes* are exactly the strings
  spelled from the root to any character of a node it owns, each with that node's stamp.
* :meth:`~RadixTree.evict` drops a tenant's retained prefixes oldest-stamp first and, among equal
  stamps (one path), longest first, until at most the budget remains. It pops least-recently-used
  leaves from a per-tenant heap; a parent becomes a leaf only after its last owned child went, and
  the last leaf is cut inside its label if needed, so a tenant keeps its most recently used
  prefixes up to ``budget`` bytes (exactly ``budget`` unless the cut falls inside a multi-byte
  character, which goes whole).
* Eviction never walks the whole tree (at vllm-router's default budget of 2**25 chars per endpoint
  a walk would stall the event loop for seconds). Each tenant keeps a heap of its leaves, filled
  as they appear: an insert queues the node it ended at, an eviction queues the parent it turned
  into a leaf. Entries are refreshed lazily: a popped entry whose node was touched since is pushed
  again with its current stamp, one whose node is no longer a leaf is dropped. A node is queued at
  most once per tenant, so heaps stay no larger than the tree.
* Each node counts, per tenant, how many of its children that tenant owns, so "is this a leaf for
  the tenant" is O(1) even under a system prompt with thousands of continuations. Per-tenant
  counts are maintained on every change, so checking budgets is O(tenants).
* Budgets and counts are in bytes: what a tenant owns is the UTF-8 size of its labels (each node
  keeps its label's, computed when a label is made: O(1) for ASCII, one encode otherwise), so
  the budget bounds memory whatever the script. Matching and stamps stay in characters.
* :meth:`~RadixTree.insert` returns an :class:`Inserted` mark, with which
  :meth:`~RadixTree.retract` undoes it (the engine refused the request, so its cache never held
  the text): the tenant loses what that insert gave it, back to what it held before, except
  where a later insert re-stamped the path (the text is still wanted there). The stamps of the
  part the tenant held before stay refreshed (an older stamp is not kept anywhere).

The tree is pure and synchronous; callers serialise access (trio runs it on one thread).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from collections.abc import Set as AbstractSet
from typing import Generic, TypeVar

from ._labels import common_len, head_chars, utf8

__all__ = ["Inserted", "RadixTree"]

T = TypeVar("T", bound=Hashable)


#: What one :meth:`RadixTree.insert` did: ``(stamp, held)``, its stamp and how many leading
#: characters of its text the tenant owned already. (A plain tuple: a NamedTuple cost 0.8 µs an
#: insert, measured.)
Inserted = tuple[int, int]


class _Node(Generic[T]):
    __slots__ = ("below", "children", "label", "parent", "size", "stamps")

    def __init__(self, label: str, parent: _Node[T] | None, size: int) -> None:
        self.label = label
        #: UTF-8 bytes of ``label``.
        self.size = size
        # None once the node has left the tree (evicted or merged into its child).
        self.parent = parent
        self.children: dict[str, _Node[T]] = {}
        # tenant -> stamp of the last insert through this node
        self.stamps: dict[T, int] = {}
        # tenant -> how many children it owns (absent when none: the node is its leaf)
        self.below: dict[T, int] = {}


def _add_below(node: _Node[T], tenant: T, delta: int) -> None:
    count = node.below.get(tenant, 0) + delta
    if count:
        node.below[tenant] = count
    else:
        del node.below[tenant]


class RadixTree(Generic[T]):
    """Which tenant has seen the longest prefix of a text, with per-tenant LRU eviction.

    >>> tree: RadixTree[str] = RadixTree()
    >>> _ = tree.insert("hello world", "a")
    >>> _ = tree.insert("help me", "b")
    >>> tree.match("hello there")
    (6, 'a')
    >>> tree.match("hello there", eligible={"b"})
    (3, 'b')
    >>> tree.evict(4)  # each tenant keeps its 4 most recently used prefix bytes
    10
    >>> tree.match("hello there")
    (4, 'a')
    """

    def __init__(self) -> None:
        self._root: _Node[T] = _Node("", None, 0)
        # tenant -> UTF-8 bytes it owns
        self._bytes: dict[T, int] = {}
        self._clock = 0
        self._seq = 0
        # Per tenant: a heap of (stamp when queued, seq, node) over nodes that are or were its
        # leaves, and the nodes that have a live entry in it, with that entry's seq (entries
        # of nodes merged away or retracted since are garbage: not live).
        self._queue: dict[T, list[tuple[int, int, _Node[T]]]] = {}
        self._queued: dict[T, dict[_Node[T], int]] = {}
        # Garbage entries may pile up to this many before a heap is filtered.
        self._garbage_slack = 1024

    # -- queries -----------------------------------------------------------------------------

    def tenant_bytes(self, tenant: T) -> int:
        """UTF-8 bytes of text ``tenant`` currently owns (0 for an unknown tenant)."""
        return self._bytes.get(tenant, 0)

    def tenants(self) -> dict[T, int]:
        """Every tenant known to the tree, with its byte count."""
        return dict(self._bytes)

    def match(self, text: str, eligible: AbstractSet[T] | None = None) -> tuple[int, T | None]:
        """Longest prefix of ``text`` owned by an ``eligible`` tenant (all tenants if ``None``).

        Returns ``(matched_chars, tenant)``: the tenant is the eligible one with the longest match,
        and among those the most recently used for that prefix. ``(0, None)`` when no eligible
        tenant owns even the first character. Does not refresh any stamp (only inserts do).
        """
        node = self._root
        pos = 0
        end = len(text)
        best: _Node[T] | None = None
        matched = 0
        while pos < end:
            child = node.children.get(text[pos])
            if child is None:
                break
            # Ownership only shrinks going down, so once no eligible tenant owns a node, no
            # deeper node can help.
            if eligible is not None and eligible.isdisjoint(child.stamps):
                break
            k = common_len(child.label, text, pos)
            best = child
            matched = pos + k
            if k < len(child.label):
                break
            node = child
            pos += k
        if best is None:
            return 0, None
        stamps = best.stamps
        owners = stamps if eligible is None else [t for t in stamps if t in eligible]
        return matched, max(owners, key=stamps.__getitem__)

    def match_each(self, text: str, eligible: AbstractSet[T]) -> dict[T, int]:
        """For each ``eligible`` tenant, the length of the longest prefix of ``text`` it owns
        (0 when none): one walk down the text's path, each tenant's figure set at the deepest
        node it owns. Does not refresh any stamp."""
        return self.match_with_each(text, eligible)[0]

    def match_with_each(
        self, text: str, eligible: AbstractSet[T]
    ) -> tuple[dict[T, int], int, T | None]:
        """:meth:`match_each`, and :meth:`match` over ``eligible``, from the same one walk."""
        out = dict.fromkeys(eligible, 0)
        node = self._root
        pos = 0
        end = len(text)
        best: _Node[T] | None = None
        matched = 0
        while pos < end:
            child = node.children.get(text[pos])
            if child is None or eligible.isdisjoint(child.stamps):
                break
            k = common_len(child.label, text, pos)
            best = child
            matched = pos + k
            for tenant in child.stamps:
                if tenant in out:
                    out[tenant] = matched
            if k < len(child.label):
                break
            node = child
            pos += k
        if best is None:
            return out, 0, None
        stamps = best.stamps
        owners = [t for t in stamps if t in eligible]
        return out, matched, max(owners, key=stamps.__getitem__)

    # -- updates -----------------------------------------------------------------------------

    def insert(self, text: str, tenant: T) -> Inserted:
        """Record that ``tenant`` has seen ``text``: it now owns every prefix, stamped newest.
        The mark returned undoes it (:meth:`retract`)."""
        if tenant not in self._bytes:
            self._bytes[tenant] = 0
            self._queue[tenant] = []
            self._queued[tenant] = {}
        if not text:
            return self._clock, 0
        self._clock += 1
        stamp = self._clock
        node = self._root
        pos = 0
        end = len(text)
        added = 0  # bytes
        held = end  # characters the tenant owned already: up to the first node it did not
        while pos < end:
            first = text[pos]
            child = node.children.get(first)
            if child is None:
                label = text[pos:]
                child = _Node(label, node, len(label) if label.isascii() else utf8(label))
                node.children[first] = child
                k = end - pos
            else:
                k = common_len(child.label, text, pos)
                if k < len(child.label):
                    child = self._split(child, k)
            if tenant not in child.stamps:
                if held == end:
                    held = pos
                added += child.size
                _add_below(node, tenant, 1)
            child.stamps[tenant] = stamp
            node = child
            pos += k
        self._bytes[tenant] += added
        if tenant not in node.below:
            self._enqueue(tenant, node)
        return stamp, held

    def retract(self, text: str, tenant: T, mark: Inserted) -> int:
        """Undo the insert of ``text`` under ``tenant`` that returned ``mark``; return the bytes
        the tenant lost.

        The tenant keeps the first ``held`` characters of ``mark`` (it owned them before) and
        every node a later insert stamped again; it loses the rest of the text's path, deepest
        first, while each node is still its leaf with ``mark``'s stamp. Eviction or removal since
        only leaves less to undo. The cost is O(len(text)).
        """
        stamp_of_insert, held = mark
        if tenant not in self._bytes or len(text) <= held:
            return 0
        path: list[tuple[_Node[T], int]] = []  # the nodes wholly on the text's path, and starts
        node = self._root
        pos = 0
        end = len(text)
        while pos < end:
            child = node.children.get(text[pos])
            if child is None or common_len(child.label, text, pos) < len(child.label):
                break
            path.append((child, pos))
            node = child
            pos += len(child.label)
        removed = 0
        touched: list[_Node[T]] = []
        for node, start in reversed(path):
            if start + len(node.label) <= held:
                break  # held before the insert
            stamp = node.stamps.get(tenant)
            if stamp is None:
                continue  # evicted since
            if stamp != stamp_of_insert or tenant in node.below:
                break  # stamped again since, or it leads to text the tenant keeps
            if start < held:
                self._split(node, held - start)  # ``node`` is the tail, not held before
            parent = node.parent
            assert parent is not None
            del node.stamps[tenant]
            _add_below(parent, tenant, -1)
            self._queued[tenant].pop(node, None)  # its entry is garbage now
            if node.stamps:
                touched.append(node)
            else:
                self._detach(node)
                touched.append(parent)
            if parent is not self._root and tenant not in parent.below:
                self._enqueue(tenant, parent)
            removed += node.size
            if start < held:
                break
        self._bytes[tenant] -= removed
        self._compact(touched)
        return removed

    def remove_tenant(self, tenant: T) -> None:
        """Forget ``tenant`` entirely (its endpoint went away). Unknown tenants are ignored."""
        if self._bytes.pop(tenant, None) is None:
            return
        del self._queue[tenant]
        del self._queued[tenant]
        touched: list[_Node[T]] = []
        owned = self._root.below.pop(tenant, 0)
        stack = [c for c in self._root.children.values() if tenant in c.stamps] if owned else []
        while stack:
            node = stack.pop()
            del node.stamps[tenant]
            owned = node.below.pop(tenant, 0)
            if not node.stamps:
                # Children own a subset of their parent's tenants, so the whole subtree is empty.
                parent = node.parent
                assert parent is not None
                self._detach(node)
                touched.append(parent)
                continue
            touched.append(node)
            if owned:
                stack.extend(c for c in node.children.values() if tenant in c.stamps)
        self._compact(touched)

    def evict(self, max_bytes_per_tenant: int, max_steps: int | None = None) -> int:
        """Trim every tenant to at most ``max_bytes_per_tenant`` bytes; return bytes removed.

        A tenant over budget loses its least recently used prefixes first, longest first among
        equally recent ones, and keeps ``max_bytes_per_tenant`` bytes (less by the rest of a
        multi-byte character the cut would split). Tenants within budget are untouched. The
        cost is proportional to what is evicted, not to the tree size.
        ``max_steps`` bounds the work of one call (nodes examined), so a caller on an event loop
        can evict in slices; :meth:`over_budget` tells whether another slice is needed.
        """
        budget = max(0, max_bytes_per_tenant)
        steps = max_steps if max_steps is not None else -1
        removed = 0
        touched: list[_Node[T]] = []
        for tenant, size in self._bytes.items():
            excess = size - budget
            heap = self._queue[tenant]
            queued = self._queued[tenant]
            while excess > 0 and heap and steps != 0:
                steps -= 1
                stamp, seq, node = heapq.heappop(heap)
                if queued.get(node) != seq:
                    continue  # garbage
                del queued[node]
                current = node.stamps.get(tenant)
                if node.parent is None or current is None or tenant in node.below:
                    continue  # merged away, or no longer this tenant's leaf
                if current != stamp:
                    self._enqueue(tenant, node)  # used since it was queued: requeue, newer
                    continue
                size = node.size
                keep = head_chars(node.label, size - excess) if size > excess else 0
                if keep:
                    # Keep the head of this label, drop only its tail; ``node`` stays the tail
                    # so other tenants' entries for it remain valid.
                    self._split(node, keep)
                    size = node.size
                parent = node.parent
                del node.stamps[tenant]
                _add_below(parent, tenant, -1)
                if node.stamps:
                    touched.append(node)
                else:
                    self._detach(node)
                    touched.append(parent)
                if parent is not self._root and tenant not in parent.below:
                    self._enqueue(tenant, parent)
                excess -= size
                removed += size
                self._bytes[tenant] -= size
            # Drop garbage entries once they dominate the heap.
            if len(heap) > 2 * len(queued) + self._garbage_slack:
                heap[:] = [entry for entry in heap if queued.get(entry[2]) == entry[1]]
                heapq.heapify(heap)
        self._compact(touched)
        return removed

    def over_budget(self, max_bytes_per_tenant: int) -> bool:
        """Whether any tenant holds more than ``max_bytes_per_tenant`` bytes."""
        return any(size > max_bytes_per_tenant for size in self._bytes.values())

    # -- internals ---------------------------------------------------------------------------

    def _enqueue(self, tenant: T, node: _Node[T]) -> None:
        queued = self._queued[tenant]
        if node not in queued:
            queued[node] = self._seq
            heapq.heappush(self._queue[tenant], (node.stamps[tenant], self._seq, node))
            self._seq += 1

    def _iter_nodes(self) -> Iterator[_Node[T]]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split(self, node: _Node[T], k: int) -> _Node[T]:
        """Cut ``node``'s label after ``k`` chars; return the new head (``node`` is the tail)."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.label)
        label = node.label[:k]
        head: _Node[T] = _Node(label, parent, len(label) if label.isascii() else utf8(label))
        head.stamps = dict(node.stamps)
        head.below = dict.fromkeys(node.stamps, 1)
        parent.children[head.label[0]] = head
        node.label = node.label[k:]
        node.size -= head.size
        node.parent = head
        head.children[node.label[0]] = node
        return head

    def _detach(self, node: _Node[T]) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.label[0]]
        node.parent = None

    def _compact(self, nodes: list[_Node[T]]) -> None:
        """Fold each node into its only child when both have the same owners and stamps.

        Removals can leave chains of single-child nodes; folding them keeps walks short. The
        child survives (it may be queued as a leaf); the parent leaves the tree.
        """
        for start in nodes:
            node = start
            while node.parent is not None and len(node.children) == 1:
                (child,) = node.children.values()
                if child.stamps != node.stamps:
                    break
                parent = node.parent
                child.label = node.label + child.label
                child.size += node.size
                child.parent = parent
                parent.children[child.label[0]] = child
                for tenant in node.stamps:
                    self._queued[tenant].pop(node, None)
                node.parent = None
                node.children = {}
                node = child

    def _check_invariants(self) -> None:
        """Assert the structural invariants (for tests)."""
        counts: dict[T, int] = {}
        for node in self._iter_nodes():
            assert node.label, "empty label"
            assert node.size == utf8(node.label), "stale label size"
            assert node.stamps, "node without owners"
            parent = node.parent
            assert parent is not None and parent.children[node.label[0]] is node
            below: dict[T, int] = {}
            for child in node.children.values():
                for t in child.stamps:
                    below[t] = below.get(t, 0) + 1
            assert node.below == below, "stale child-ownership counts"
            for t, stamp in node.stamps.items():
                if parent is not self._root:
                    assert t in parent.stamps, "ownership not closed under ancestors"
                    assert parent.stamps[t] >= stamp, "stamp grows going down"
                counts[t] = counts.get(t, 0) + node.size
                if t not in node.below:
                    assert node in self._queued[t], "a leaf is not queued for eviction"
        for t, n in self._bytes.items():
            assert counts.get(t, 0) == n, (t, counts.get(t, 0), n)
            live = [e for e in self._queue[t] if self._queued[t].get(e[2]) == e[1]]
            assert len(live) == len(self._queued[t]), "a queued node has no live entry"
            assert all(n.parent is not None for n in self._queued[t]), "a queued node left"
            assert all(s <= e.stamps.get(t, s) for s, _, e in live), "entry newer than node"
        assert set(counts) <= set(self._bytes)
