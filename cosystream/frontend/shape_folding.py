"""Shape folding for the ONNX-in-torch runner (frontend/onnx_torch.py): which nodes of a plan follow from the
constants and the graph inputs' shapes alone, and a bounded cache of their values per input shape.

A real export computes its shapes in the graph (Shape, Gather, Unsqueeze, Concat, ConstantOfShape, Equal,
Where, ...): about as many nodes as it has compute nodes, each a host-side torch call. Their values depend
on the input shapes only, so a call with a shape seen before takes them from here, and a new shape
recomputes only those its change reaches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cosystream.frontend.onnx_torch import _Node

FOLD_CACHE_SHAPES = 32  # input shapes whose folded shape arithmetic is kept (least recently used dropped)
MAX_COMPARED_NUMEL = 1024  # recomputed shape values up to this size are compared with the reference's


def _shape_distance(a: tuple, b: tuple) -> int | None:
    """Sum of the absolute differences of two fold keys' dimensions; None when their inputs differ otherwise."""
    if len(a) != len(b):
        return None
    total = 0
    for (name_a, shape_a, dtype_a), (name_b, shape_b, dtype_b) in zip(a, b, strict=True):
        if name_a != name_b or dtype_a != dtype_b or len(shape_a) != len(shape_b):
            return None
        total += sum(abs(x - y) for x, y in zip(shape_a, shape_b, strict=True))
    return total


# Inputs whose values (not only shapes) set an operator's output shape. Every other supported operator's output
# shape follows from its inputs' shapes (and its attributes) alone; tests/frontend/test_shape_folding.py lists
# them, so an operator added to the runner must be placed here or there.
SHAPE_ARGUMENTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Tile": (1,), "ConstantOfShape": (0,),
    "Range": (0, 1, 2), "Pad": (1, 3), "Split": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "ReduceMean": (1,),
    "ReduceSum": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,), "ReduceL2": (1,),
}


def shape_determined(nodes: Sequence[_Node], constants: set[str], inputs: set[str], outputs: set[str]) -> list[bool]:
    """Per node: are its results fixed by the constants and the graph inputs' shapes alone? True for a node that
    reads only such values, and for a Shape node whose input's shape is fixed by them (not one whose shape an
    input's values set, as a mask of `max(lengths)` frames); graph outputs excluded (a caller may keep them)."""
    known = set(constants)  # values fixed by the input shapes
    shaped = set(constants) | set(inputs)  # tensors whose shapes are
    flags = []
    for node in nodes:
        names = [n for n in node.inputs if n]
        if node.op_type == "Shape":
            static = bool(names) and names[0] in shaped
        else:
            static = all(n in known for n in names)
        static = static and not any(n in outputs for n in node.outputs)
        arguments = SHAPE_ARGUMENTS.get(node.op_type, ())
        shape_fixed = static or (all(n in shaped for n in names) and all(
            node.inputs[i] in known for i in arguments if i < len(node.inputs) and node.inputs[i]))
        if static:
            known.update(n for n in node.outputs if n)
        if shape_fixed:
            shaped.update(n for n in node.outputs if n)
        flags.append(static)
    return flags


@dataclass
class FoldedShapes:
    """The shape arithmetic of one input shape: every shape-determined value, and the shape each Shape node
    read (to tell, for a new input shape, which of these values stay the same)."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    shapes_read: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class CallStats:
    """What the last call ran: operator calls (each one host-side torch call or more), shape-determined values
    taken from the fold cache or from the folding of another shape, whether the input shape was cached, and whether
    the call replayed a CUDA graph instead (frontend/padded_graphs.py: no operator ran on the host)."""

    ops_run: int = 0
    values_reused: int = 0
    shape_cached: bool = False
    replayed: bool = False


class ShapeFolding:
    """The shape-determined nodes of a plan, evaluated once per input shape (an LRU of FOLD_CACHE_SHAPES shapes).

    A shape not cached yet runs the whole plan, but a shape-determined node whose inputs did not change from
    the folding of the nearest cached shape (a Shape node that reads the same shape, nodes that read only
    values equal to that folding's) takes that folding's value instead of running: a new prompt length
    re-derives only the values that depend on the length. Every value is the one the plain interpretation
    gives (the same ops on equal inputs).
    """

    def __init__(self, static: list[bool], capacity: int = FOLD_CACHE_SHAPES) -> None:
        self.static = static
        self.capacity = capacity
        self._cache: OrderedDict[tuple, FoldedShapes] = OrderedDict()
        self._lock = threading.Lock()  # calls of one graph may run on several threads

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, key: tuple) -> FoldedShapes | None:
        with self._lock:
            folded = self._cache.get(key)
            if folded is not None:
                self._cache.move_to_end(key)
            return folded

    def put(self, key: tuple, folded: FoldedShapes) -> None:
        with self._lock:
            self._cache[key] = folded
            self._cache.move_to_end(key)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)

    def reference_for(self, key: tuple) -> FoldedShapes | None:
        """The folding a new input shape reuses unchanged values from: the cached one of the nearest input shape
        (a prompt a few frames longer shares nearly all its shape arithmetic; one across a segment or
        stride boundary of the graph less). None: nothing cached."""
        best, best_distance = None, None
        with self._lock:
            entries = list(self._cache.items())
        for cached, folded in entries:
            distance = _shape_distance(key, cached)
            if distance is not None and (best_distance is None or distance < best_distance):
                best, best_distance = folded, distance
        return best


def same_value(value: torch.Tensor, reference: FoldedShapes | None, name: str) -> bool:
    """Is a recomputed shape value what the reference folding had (a shape's channel count, when only the
    length changed)? Then nodes that read it need not run again. Compared on the CPU only, and only small."""
    if reference is None:
        return False
    before = reference.values.get(name)
    return (before is not None and value.is_cpu and before.is_cpu and value.numel() <= MAX_COMPARED_NUMEL
            and value.dtype == before.dtype and torch.equal(value, before))


def unchanged(index: int, names: tuple[str, ...], folded: FoldedShapes, reference: FoldedShapes,
               changed: set[str]) -> bool:
    """Does shape-determined node `index` give what it gave in the reference folding? A Shape node does when it
    read the same shape; any other when none of its inputs was recomputed for this shape."""
    if index in folded.shapes_read:
        return reference.shapes_read.get(index) == folded.shapes_read[index]
    return not any(name in changed for name in names)
