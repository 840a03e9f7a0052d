"""Automatic detection of a shared prefix among ONNX models, and splitting at it.

Prefix batching (Nexus section 6.1) runs the layers that several models have in common once for
a merged batch and only the model-specific remainder per model. Nexus asked the operator to declare
the shared layers; here they are found from the graphs and weights.

How it works
------------
Every tensor of a model gets a *structural hash* (a Merkle hash): a graph input is hashed from its
position and type, an initializer from its dtype, shape and contents, and a node's outputs from the
node's op type, domain, attributes and the hashes of its inputs. Names never enter a hash, so two
separately exported models (different node and tensor names) that compute the same function of
their inputs with the same weights give that tensor the same hash; one differing weight or
attribute changes the hash of everything downstream.

A tensor ``c`` is a *cut point* of a model when every path from the graph inputs to the graph
outputs passes through it (``c`` dominates the outputs in the data-flow graph). Then the model
splits into a prefix (graph inputs -> ``c``) and a suffix (``c`` -> outputs) whose composition is
the original model. The cut points of a model form a chain from its inputs to its outputs; they are
computed with a dominator tree in linear time.

The shared prefix of several models is the deepest cut point whose hash appears in all of them;
the hash, shortened, is the ``prefix_id``. Because cut points depend on one model alone, each model
can be summarised once at upload time by :func:`prefix_signature` (the prefix ids of its cut
points), and the model database can group models by :func:`common_prefix_id` of their signatures
without loading them; :func:`split_at` then splits each model on its own, and
:func:`find_shared_prefix` does the whole job for a set of models in memory.

Limits: a cut is a single tensor (a suffix that also reads the raw input, e.g. ``Shape(input)``,
makes that cut invalid and an earlier one is chosen); a node with subgraph attributes (If, Loop,
Scan) is hashed with its subgraph's serialized form, which includes names, so such nodes match
only when the subgraphs are written identically.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence, Union

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

ModelLike = Union[onnx.ModelProto, bytes, bytearray, memoryview]

# prefix ids are this many hex digits of the SHA-256 structural hash (128 bits).
PREFIX_ID_HEX = 32
PREFIX_PRODUCER = "nexus-onnx-prefix"


# --- public types -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSplit:
    """One model split at a cut point: ``suffix(prefix(x)) == model(x)``.

    ``prefix`` takes the model's graph inputs (same names, same order) and gives one output named
    ``cut_tensor``; ``suffix`` takes one input named ``cut_tensor`` and gives the model's outputs.
    Weight bytes count initializers and Constant-node tensors in each part.
    """

    prefix_id: str
    cut_tensor: str
    prefix: bytes
    suffix: bytes
    prefix_weight_bytes: int
    suffix_weight_bytes: int
    prefix_node_count: int
    source_cut_name: str  # the cut tensor's name in the original model


@dataclass(frozen=True)
class PrefixSplit:
    """Several models split at their longest shared prefix.

    ``prefix`` is one standalone model (graph inputs -> ``cut_tensor``); ``suffixes[name]`` maps
    ``cut_tensor`` to model ``name``'s original outputs. For memory accounting the prefix is
    counted once: ``prefix_weight_bytes`` plus the sum of ``suffix_weight_bytes``.
    ``source_cut_names[name]`` is the cut tensor's name inside the original model ``name``.
    """

    prefix_id: str
    cut_tensor: str
    prefix: bytes
    suffixes: dict[str, bytes]
    prefix_weight_bytes: int
    suffix_weight_bytes: dict[str, int]
    prefix_node_count: int = 0
    source_cut_names: dict[str, str] = field(default_factory=dict)

    @property
    def total_weight_bytes(self) -> int:
        """Weights held when the group is served with the prefix shared."""
        return self.prefix_weight_bytes + sum(self.suffix_weight_bytes.values())


# --- hashing helpers --------------------------------------------------------------------------


def _h(*parts: object) -> bytes:
    """SHA-256 over length-prefixed parts (bytes, str, int, float, None, or tuples of them)."""
    digest = hashlib.sha256()

    def feed(p: object) -> None:
        if isinstance(p, (bytes, bytearray, memoryview)):
            b = bytes(p)
            digest.update(b"b%d:" % len(b))
            digest.update(b)
        elif isinstance(p, str):
            b = p.encode()
            digest.update(b"s%d:" % len(b))
            digest.update(b)
        elif isinstance(p, bool):
            digest.update(b"B1" if p else b"B0")
        elif isinstance(p, int):
            digest.update(b"i%d;" % p)
        elif isinstance(p, float):
            digest.update(b"f" + float(p).hex().encode() + b";")
        elif p is None:
            digest.update(b"N;")
        elif isinstance(p, (tuple, list)):
            digest.update(b"(%d:" % len(p))
            for q in p:
                feed(q)
            digest.update(b")")
        else:  # pragma: no cover - programming error
            raise TypeError(f"cannot hash {type(p).__name__}")

    for part in parts:
        feed(part)
    return digest.digest()


def _tensor_nbytes(t: TensorProto) -> int:
    n = int(np.prod(t.dims, dtype=np.int64)) if len(t.dims) else 1
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except Exception:  # unusual types (e.g. 4-bit): fall back to the stored size
        return len(t.raw_data) or n
    return n * itemsize


def _tensor_content_hash(t: TensorProto) -> bytes:
    """Hash of a tensor's type, shape and values; independent of name and storage field."""
    if t.data_location == TensorProto.EXTERNAL:
        raise ValueError(
            f"tensor {t.name!r} keeps its data in an external file; load the model with its "
            "external data (onnx.load(path)) before prefix analysis"
        )
    if t.data_type == TensorProto.STRING:
        content: bytes = _h(tuple(bytes(s) for s in t.string_data))
    elif t.raw_data:
        content = t.raw_data  # raw_data is little-endian by the ONNX spec
    else:
        arr = numpy_helper.to_array(t)
        little = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        content = np.ascontiguousarray(little).tobytes()
    return _h(b"tensor", t.data_type, tuple(int(d) for d in t.dims), content)


def _subgraphs(attr: AttributeProto) -> list[onnx.GraphProto]:
    if attr.type == AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []


def _outer_refs(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes."""
    defined = {i.name for i in graph.input}
    defined |= {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    refs: set[str] = set()
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                refs.add(name)
        for attr in node.attribute:
            for sub in _subgraphs(attr):
                refs |= {r for r in _outer_refs(sub) if r not in defined}
        defined.update(o for o in node.output if o)
    return refs


def _attr_key(attr: AttributeProto) -> tuple:
    """Canonical, name-free description of one attribute value."""
    t = attr.type
    if attr.ref_attr_name:
        return (attr.name, "ref", attr.ref_attr_name)
    if t == AttributeProto.FLOAT:
        return (attr.name, t, float(attr.f))
    if t == AttributeProto.INT:
        return (attr.name, t, int(attr.i))
    if t == AttributeProto.STRING:
        return (attr.name, t, bytes(attr.s))
    if t == AttributeProto.TENSOR:
        return (attr.name, t, _tensor_content_hash(attr.t))
    if t == AttributeProto.FLOATS:
        return (attr.name, t, tuple(float(v) for v in attr.floats))
    if t == AttributeProto.INTS:
        return (attr.name, t, tuple(int(v) for v in attr.ints))
    if t == AttributeProto.STRINGS:
        return (attr.name, t, tuple(bytes(v) for v in attr.strings))
    if t == AttributeProto.TENSORS:
        return (attr.name, t, tuple(_tensor_content_hash(v) for v in attr.tensors))
    if t in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
        # Subgraphs are compared by their serialized form (names included): conservative.
        return (
            attr.name,
            t,
            tuple(g.SerializeToString(deterministic=True) for g in _subgraphs(attr)),
        )
    # SPARSE_TENSOR(S), TYPE_PROTO(S): deterministic serialization of the value (name cleared).
    copy = AttributeProto()
    copy.CopyFrom(attr)
    copy.name = ""
    copy.doc_string = ""
    return (attr.name, t, copy.SerializeToString(deterministic=True))


def _type_key(vi: onnx.ValueInfoProto) -> tuple:
    tt = vi.type.tensor_type
    dims = tuple(int(d.dim_value) if d.HasField("dim_value") else "?" for d in tt.shape.dim)
    return (int(tt.elem_type), dims if tt.HasField("shape") else None)


# --- per-model analysis -----------------------------------------------------------------------


def _load(model: ModelLike, label: str) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        proto = model
    elif isinstance(model, (bytes, bytearray, memoryview)):
        if len(model) == 0:
            raise ValueError(f"model {label!r}: empty bytes are not an ONNX model")
        try:
            proto = onnx.load_from_string(bytes(model))
        except Exception as exc:
            raise ValueError(f"model {label!r}: not a parseable ONNX model ({exc})") from None
    else:
        raise ValueError(
            f"model {label!r}: expected onnx.ModelProto or bytes, got {type(model).__name__}"
        )
    if len(proto.graph.node) == 0 or len(proto.graph.output) == 0:
        raise ValueError(f"model {label!r}: not a valid ONNX model (graph has no nodes or outputs)")
    try:
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise ValueError(f"model {label!r}: invalid ONNX model: {exc}") from None
    return proto


class _Analysis:
    """Structural hashes, topological order and cut points of one model."""

    def __init__(self, model: onnx.ModelProto, label: str) -> None:
        self.model = model
        self.label = label
        g = model.graph
        self.initializers: dict[str, TensorProto] = {t.name: t for t in g.initializer}
        sparse = {s.values.name: s for s in g.sparse_initializer}
        self.graph_inputs: list[str] = [
            i.name for i in g.input if i.name not in self.initializers and i.name not in sparse
        ]
        self.outputs: list[str] = [o.name for o in g.output]

        self.tensor_hash: dict[str, bytes] = {}
        inputs_by_name = {i.name: i for i in g.input}
        for pos, name in enumerate(self.graph_inputs):
            self.tensor_hash[name] = _h(b"input", pos, _type_key(inputs_by_name[name]))
        for name, t in self.initializers.items():
            self.tensor_hash[name] = _tensor_content_hash(t)
        for name, s in sparse.items():
            copy = onnx.SparseTensorProto()
            copy.CopyFrom(s)
            copy.values.name = ""
            copy.indices.name = ""
            self.tensor_hash[name] = _h(b"sparse", copy.SerializeToString(deterministic=True))

        functions = {
            (f.domain, f.name): _h(b"function", f.SerializeToString(deterministic=True))
            for f in model.functions
        }

        self.nodes: list[onnx.NodeProto] = self._toposort(list(g.node))
        # All inputs a node reads: explicit ones and those its subgraphs read from this scope.
        self.node_reads: list[list[str]] = []
        self.producer: dict[str, int] = {}
        self.node_hash: list[bytes] = []
        for k, node in enumerate(self.nodes):
            implicit: set[str] = set()
            for attr in node.attribute:
                for sub in _subgraphs(attr):
                    implicit |= _outer_refs(sub)
            explicit = [i for i in node.input if i]
            implicit_sorted = sorted(implicit - set(explicit))
            self.node_reads.append(explicit + implicit_sorted)
            key = (
                node.domain or "",
                node.op_type,
                getattr(node, "overload", "") or "",
                tuple(sorted((_attr_key(a) for a in node.attribute), key=lambda k: k[0])),
                tuple(self._hash_of(i, node) if i else b"" for i in node.input),
                tuple((n, self._hash_of(n, node)) for n in implicit_sorted),
                functions.get((node.domain or "", node.op_type)),
            )
            nh = _h(b"node", key)
            self.node_hash.append(nh)
            for j, out in enumerate(node.output):
                if out:
                    self.tensor_hash[out] = _h(b"out", nh, j)
                    self.producer[out] = k

        self._compute_dependence()
        self._compute_cuts()
        self._type_cache: dict[str, onnx.TypeProto] | None = None

    def _hash_of(self, name: str, node: onnx.NodeProto) -> bytes:
        try:
            return self.tensor_hash[name]
        except KeyError:
            raise ValueError(
                f"model {self.label!r}: node {node.name or node.op_type!r} reads undefined "
                f"tensor {name!r}"
            ) from None

    def _toposort(self, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
        """Stable topological order (the file's order when it is already topological)."""
        available = set(self.tensor_hash)
        producer: dict[str, int] = {}
        for k, n in enumerate(nodes):
            for o in n.output:
                if o:
                    producer[o] = k
        deps: list[set[int]] = []
        for n in nodes:
            reads = {i for i in n.input if i}
            for attr in n.attribute:
                for sub in _subgraphs(attr):
                    reads |= _outer_refs(sub)
            deps.append({producer[r] for r in reads if r in producer and r not in available})
        # Kahn's algorithm, always taking the ready node that comes first in the file.
        users: list[list[int]] = [[] for _ in nodes]
        missing = [len(d) for d in deps]
        for k, d in enumerate(deps):
            for p in d:
                users[p].append(k)
        ready = [k for k, m in enumerate(missing) if m == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            k = heapq.heappop(ready)
            order.append(k)
            for u in users[k]:
                missing[u] -= 1
                if missing[u] == 0:
                    heapq.heappush(ready, u)
        if len(order) != len(nodes):
            raise ValueError(f"model {self.label!r}: the graph has a cycle")
        return [nodes[k] for k in order]

    def _compute_dependence(self) -> None:
        dep = set(self.graph_inputs)
        for k, node in enumerate(self.nodes):
            if any(r in dep for r in self.node_reads[k]):
                dep.update(o for o in node.output if o)
        self.input_dependent = dep

    def _compute_cuts(self) -> None:
        """Cut points: input-dependent tensors that dominate every graph output."""
        source = "\x00source"
        idom: dict[str, str] = {}
        depth: dict[str, int] = {source: 0}
        for name in self.graph_inputs:
            idom[name] = source
            depth[name] = 1

        def lca(a: str, b: str) -> str:
            while a != b:
                if depth[a] >= depth[b]:
                    a = idom[a]
                else:
                    b = idom[b]
            return a

        def lca_all(names: Iterable[str]) -> str | None:
            result: str | None = None
            for n in names:
                result = n if result is None else lca(result, n)
            return result

        for k, node in enumerate(self.nodes):
            preds = [r for r in self.node_reads[k] if r in self.input_dependent]
            if not preds:
                continue
            d = lca_all(preds)
            assert d is not None
            for out in node.output:
                if out:
                    idom[out] = d
                    depth[out] = depth[d] + 1
        dep_outputs = [o for o in self.outputs if o in self.input_dependent]
        chain: list[str] = []
        if dep_outputs:
            node = lca_all(dep_outputs)
            while node is not None and node != source:
                chain.append(node)
                node = idom[node]
        # From the inputs toward the outputs; graph inputs themselves are no useful cut.
        self.cuts: list[str] = [c for c in reversed(chain) if c in self.producer]
        self.cut_by_hash: dict[bytes, str] = {self.tensor_hash[c]: c for c in self.cuts}

    # --- closures and splitting -----------------------------------------------------------

    def closure(
        self,
        targets: Iterable[str],
        stop: str | None = None,
        skip: set[int] | frozenset[int] = frozenset(),
    ) -> list[int]:
        """Indices (topological order) of the nodes needed to compute ``targets``.

        ``stop`` is treated as given (its producer and ancestors are not followed through it);
        nodes in ``skip`` are treated as already computed.
        """
        needed: set[int] = set()
        stack = [t for t in targets if t != stop]
        seen: set[str] = set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            k = self.producer.get(name)
            if k is None or k in needed or k in skip:
                continue
            needed.add(k)
            for r in self.node_reads[k]:
                if r != stop:
                    stack.append(r)
        return sorted(needed)

    def weight_bytes(self, node_ids: Iterable[int]) -> int:
        inits: set[str] = set()
        total = 0
        for k in node_ids:
            node = self.nodes[k]
            for r in self.node_reads[k]:
                if r in self.initializers:
                    inits.add(r)
            if node.op_type == "Constant" and (node.domain or "") in ("", "ai.onnx"):
                for a in node.attribute:
                    if a.type == AttributeProto.TENSOR:
                        total += _tensor_nbytes(a.t)
        return total + sum(_tensor_nbytes(self.initializers[n]) for n in inits)

    def cut_type(self, name: str) -> onnx.TypeProto | None:
        if self._type_cache is None:
            cache: dict[str, onnx.TypeProto] = {}
            try:
                inferred = onnx.shape_inference.infer_shapes(self.model)
                value_infos = list(inferred.graph.value_info)
            except Exception:
                value_infos = []
            for vi in list(self.model.graph.value_info) + value_infos + list(
                self.model.graph.output
            ):
                if vi.type.tensor_type.elem_type != TensorProto.UNDEFINED:
                    cache[vi.name] = vi.type
            self._type_cache = cache
        return self._type_cache.get(name)

    def prefix_id(self, cut: str) -> str:
        return self.tensor_hash[cut].hex()[:PREFIX_ID_HEX]

    def prefix_weight_bytes(self, cut: str) -> int:
        return self.weight_bytes(self.closure([cut]))

    def split(self, cut: str) -> ModelSplit:
        pid = self.prefix_id(cut)
        cut_type = self.cut_type(cut)
        if cut_type is None:
            raise ValueError(
                f"model {self.label!r}: the type of cut tensor {cut!r} cannot be inferred"
            )
        all_names = set(self.tensor_hash) | {n.name for n in self.nodes}
        canon = f"prefix_{pid[:16]}"
        while canon in all_names:
            canon += "_"

        prefix_ids = self.closure([cut])
        suffix_ids = self.closure(self.outputs, stop=cut)
        bad = [r for k in suffix_ids for r in self.node_reads[k] if r in self.graph_inputs]
        bad += [o for o in self.outputs if o in self.graph_inputs]
        if bad:  # pragma: no cover - guaranteed by dominance
            raise ValueError(f"model {self.label!r}: {cut!r} is not a cut point")

        prefix_bytes = self._build_prefix(prefix_ids, cut, canon, cut_type)
        suffix_bytes = self._build_suffix(suffix_ids, cut, canon, cut_type)
        return ModelSplit(
            prefix_id=pid,
            cut_tensor=canon,
            prefix=prefix_bytes,
            suffix=suffix_bytes,
            prefix_weight_bytes=self.weight_bytes(prefix_ids),
            suffix_weight_bytes=self.weight_bytes(suffix_ids),
            prefix_node_count=len(prefix_ids),
            source_cut_name=cut,
        )

    def _make_model(
        self,
        graph_name: str,
        nodes: list[onnx.NodeProto],
        inputs: list[onnx.ValueInfoProto],
        outputs: list[onnx.ValueInfoProto],
        initializers: list[TensorProto],
        value_info: list[onnx.ValueInfoProto],
    ) -> bytes:
        graph = helper.make_graph(
            nodes, graph_name, inputs, outputs, initializer=initializers, value_info=value_info
        )
        model = onnx.ModelProto()
        model.ir_version = self.model.ir_version
        model.opset_import.extend(self.model.opset_import)
        model.functions.extend(self.model.functions)
        model.producer_name = PREFIX_PRODUCER
        model.graph.CopyFrom(graph)
        return model.SerializeToString(deterministic=True)

    def _build_prefix(
        self, ids: list[int], cut: str, canon: str, cut_type: onnx.TypeProto
    ) -> bytes:
        """The prefix with canonical names, so equal prefix ids give equal prefix graphs."""
        has_subgraphs = any(_subgraphs(a) for k in ids for a in self.nodes[k].attribute)
        rename: dict[str, str] = {n: n for n in self.graph_inputs}
        init_order: list[str] = []
        nodes: list[onnx.NodeProto] = []
        for pos, k in enumerate(ids):
            src = self.nodes[k]
            node = onnx.NodeProto()
            node.CopyFrom(src)
            node.doc_string = ""
            if not has_subgraphs:
                node.name = f"prefix/n{pos}"
                del node.input[:]
                for i in src.input:
                    if i and i in self.initializers and i not in rename:
                        rename[i] = f"prefix/w{len(init_order)}"
                        init_order.append(i)
                    node.input.append(rename[i] if i else "")
                del node.output[:]
                for j, o in enumerate(src.output):
                    if o:
                        rename[o] = f"prefix/t{pos}_{j}"
                    node.output.append(rename[o] if o else "")
            else:
                for r in self.node_reads[k]:
                    if r in self.initializers and r not in init_order:
                        init_order.append(r)
            nodes.append(node)
        if has_subgraphs:
            rename = {n: n for n in self.tensor_hash}
        cut_local = rename[cut]
        nodes.append(helper.make_node("Identity", [cut_local], [canon], name="prefix/cut"))
        inits = []
        for name in init_order:
            t = TensorProto()
            t.CopyFrom(self.initializers[name])
            t.name = rename[name]
            t.doc_string = ""
            inits.append(t)
        used_inputs = {r for k in ids for r in self.node_reads[k]}
        inputs = [i for i in self.model.graph.input if i.name in self.graph_inputs]
        inputs = [i for i in inputs if i.name in used_inputs]
        out = helper.make_value_info(canon, cut_type)
        return self._make_model("prefix", nodes, inputs, [out], inits, [])

    def _build_suffix(
        self, ids: list[int], cut: str, canon: str, cut_type: onnx.TypeProto
    ) -> bytes:
        nodes = [helper.make_node("Identity", [canon], [cut], name=f"{canon}/in")]
        reads: set[str] = set()
        produced = {cut}
        for k in ids:
            nodes.append(self.nodes[k])
            reads.update(self.node_reads[k])
            produced.update(o for o in self.nodes[k].output if o)
        reads.update(self.outputs)
        inits = [self.initializers[n] for n in self.initializers if n in reads]
        value_info = [
            vi for vi in self.model.graph.value_info if vi.name in produced and vi.name != cut
        ]
        out_names = set(self.outputs)
        value_info = [vi for vi in value_info if vi.name not in out_names]
        inp = helper.make_value_info(canon, cut_type)
        return self._make_model(
            self.model.graph.name or "suffix",
            nodes,
            [inp],
            list(self.model.graph.output),
            inits,
            value_info,
        )

    def cumulative_prefix_weights(self) -> list[int]:
        """Prefix weight bytes at each cut, in one pass (prefixes of cut points are nested)."""
        seen_nodes: set[int] = set()
        seen_inits: set[str] = set()
        total = 0
        result = []
        for c in self.cuts:
            new_nodes = self.closure([c], skip=seen_nodes)
            for k in new_nodes:
                seen_nodes.add(k)
                node = self.nodes[k]
                for r in self.node_reads[k]:
                    if r in self.initializers and r not in seen_inits:
                        seen_inits.add(r)
                        total += _tensor_nbytes(self.initializers[r])
                if node.op_type == "Constant" and (node.domain or "") in ("", "ai.onnx"):
                    total += sum(
                        _tensor_nbytes(a.t)
                        for a in node.attribute
                        if a.type == AttributeProto.TENSOR
                    )
            result.append(total)
        return result

    def signature(self, min_prefix_weight_bytes: int) -> list[str]:
        result = []
        for c, weight in zip(self.cuts, self.cumulative_prefix_weights()):
            if weight < min_prefix_weight_bytes:
                continue
            if self.cut_type(c) is None:
                continue
            result.append(self.prefix_id(c))
        return result


# --- public API -------------------------------------------------------------------------------


def prefix_cuts(model: ModelLike) -> tuple[list[tuple[str, int]], int]:
    """(prefix id, weight bytes of the prefix) at every cut of ``model`` from its inputs outwards
    (cuts whose tensor type is unknown are left out), and the model's total weight bytes."""
    a = _Analysis(_load(model, "model"), "model")
    cuts = [(a.prefix_id(c), int(w)) for c, w in zip(a.cuts, a.cumulative_prefix_weights())
            if a.cut_type(c) is not None]
    return cuts, int(a.weight_bytes(range(len(a.nodes))))


def prefix_signature(model: ModelLike, *, min_prefix_weight_bytes: int = 1) -> list[str]:
    """The prefix ids at which ``model`` can be cut, from its inputs toward its outputs.

    Entry ``k`` is the ``prefix_id`` of the prefix ending at the model's ``k``-th cut point (a
    tensor through which all data flows); only prefixes holding at least
    ``min_prefix_weight_bytes`` of weights are listed. Two models share a prefix exactly when
    their signatures intersect, and :func:`common_prefix_id` gives the longest shared one, so a
    model database stores this list per model and matches a new upload without loading models.
    """
    a = _Analysis(_load(model, "model"), "model")
    return a.signature(min_prefix_weight_bytes)


def common_prefix_id(signatures: Sequence[Sequence[str]]) -> str | None:
    """The longest prefix id present in every signature, or None (also for fewer than two)."""
    if len(signatures) < 2:
        return None
    others = [set(s) for s in signatures[1:]]
    for pid in reversed(list(signatures[0])):
        if all(pid in o for o in others):
            return pid
    return None


def split_at(model: ModelLike, prefix_id: str) -> ModelSplit:
    """Split one model at the cut point whose prefix id is ``prefix_id``.

    Models that share the prefix can be split one at a time (e.g. at upload) and give prefixes
    with the same id and the same graph. ValueError if ``prefix_id`` is not a cut of the model.
    """
    a = _Analysis(_load(model, "model"), "model")
    for c in a.cuts:
        if a.prefix_id(c) == prefix_id:
            return a.split(c)
    raise ValueError(f"prefix id {prefix_id!r} is not a cut point of this model")


def find_shared_prefix(
    models: Mapping[str, ModelLike], *, min_prefix_weight_bytes: int = 1
) -> PrefixSplit | None:
    """Find the longest prefix shared by all ``models`` and split every model there.

    Returns None when the models share no cut point whose prefix carries at least
    ``min_prefix_weight_bytes`` of weights (nothing, or only weight-free ops such as a Cast, is
    shared). ValueError for fewer than two models or for a model that is not valid ONNX (the
    message names the model). The prefix graph is taken from the alphabetically first model.
    """
    if len(models) < 2:
        raise ValueError(f"need at least two models to find a shared prefix, got {len(models)}")
    analyses = {name: _Analysis(_load(m, name), name) for name, m in models.items()}
    names = sorted(analyses)
    ref = analyses[names[0]]
    others = [analyses[n] for n in names[1:]]
    chosen: str | None = None
    for c in reversed(ref.cuts):
        h = ref.tensor_hash[c]
        if all(h in o.cut_by_hash for o in others):
            chosen = c
            break
    if chosen is None:
        return None
    # Cut points are nested, so an earlier shared cut would hold even fewer weights.
    if ref.prefix_weight_bytes(chosen) < min_prefix_weight_bytes:
        return None
    # A cut whose type cannot be inferred cannot be an interface: walk back to one that can.
    h = ref.tensor_hash[chosen]
    while any(a.cut_type(a.cut_by_hash[h]) is None for a in analyses.values()):
        idx = ref.cuts.index(ref.cut_by_hash[h])
        earlier = [
            c
            for c in reversed(ref.cuts[:idx])
            if all(ref.tensor_hash[c] in o.cut_by_hash for o in others)
        ]
        if not earlier:
            return None
        h = ref.tensor_hash[earlier[0]]
        if ref.prefix_weight_bytes(ref.cut_by_hash[h]) < min_prefix_weight_bytes:
            return None

    splits = {name: a.split(a.cut_by_hash[h]) for name, a in analyses.items()}
    first = splits[names[0]]
    return PrefixSplit(
        prefix_id=first.prefix_id,
        cut_tensor=first.cut_tensor,
        prefix=first.prefix,
        suffixes={name: splits[name].suffix for name in models},
        prefix_weight_bytes=first.prefix_weight_bytes,
        suffix_weight_bytes={name: splits[name].suffix_weight_bytes for name in models},
        prefix_node_count=first.prefix_node_count,
        source_cut_names={name: splits[name].source_cut_name for name in models},
    )
