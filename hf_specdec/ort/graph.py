"""Surgery on an exported decoder graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .layout import LOGITS_TO_KEEP, TREE_MASK, require


def add_logits_to_keep(path: str | Path) -> None:
    """Give the exported decoder an optional input `num_logits_to_keep` (int64 [1], default 0 = every
    position): fed k, the LM head runs on the last k positions only and `logits` is [B, k, V].

    Readers of the Hub layout that do not know the input get every position, as before. A drafter
    needs only the last position's logits, and computing all of them when it catches up on a
    1k-token prompt is ~28 GFLOP of LM head for SmolLM2-135M.
    """
    onnx = require("onnx")  # optional, like onnxruntime
    helper, numpy_helper, TensorProto = onnx.helper, onnx.numpy_helper, onnx.TensorProto

    path = Path(path)
    external = Path(str(path) + ".data").exists()
    model = onnx.load(str(path), load_external_data=external)
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    head = producer.get("logits")
    while head is not None and head.op_type not in ("MatMul", "Gemm"):
        head = producer.get(head.input[0])  # a Cast or bias after the LM head
    if head is None:
        return  # no LM head to find: leave the graph as it is
    hidden = head.input[0]
    graph.input.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]))
    graph.initializer.append(numpy_helper.from_array(np.zeros(1, dtype=np.int64), LOGITS_TO_KEEP))
    graph.initializer.append(
        numpy_helper.from_array(np.array([2**62], dtype=np.int64), "hf_specdec_slice_end")
    )
    graph.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "hf_specdec_slice_axis"))
    start, kept = "hf_specdec_keep_start", "hf_specdec_kept_hidden"
    slice_nodes = [
        helper.make_node("Neg", [LOGITS_TO_KEEP], [start]),  # -0 = 0: every position
        helper.make_node("Slice", [hidden, start, "hf_specdec_slice_end", "hf_specdec_slice_axis"], [kept]),
    ]
    nodes = list(graph.node)
    at = next(i for i, node in enumerate(nodes) if node is head or node == head)
    nodes[at:at] = slice_nodes  # the graph stays in topological order
    head = nodes[at + len(slice_nodes)]
    head.input[0] = kept
    del graph.node[:]
    graph.node.extend(nodes)
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].dim_param = "logits_length"  # no longer the input's length
    onnx.save(model, str(path), save_as_external_data=external, location=path.name + ".data")


def add_tree_mask_default(path: str | Path) -> None:
    """Make the exported decoder's `TREE_MASK` input optional: bool [B, new, past + new], which
    cache columns each new token may see besides what `attention_mask` and causality allow (a tree
    draft's node: its ancestors). Unfed, it is a [1, 1, 1] True that broadcasts: plain decoding, so
    readers of the Hub layout need not know it. Graphs without the input are left as they are.
    """
    onnx = require("onnx")
    helper, numpy_helper = onnx.helper, onnx.numpy_helper
    path = Path(path)
    external = Path(str(path) + ".data").exists()
    model = onnx.load(str(path), load_external_data=external)
    graph = model.graph
    tree = next((i for i in graph.input if i.name == TREE_MASK), None)
    if tree is None:
        return
    # The exporter may read the sizes it shares with other inputs off this one: read them there.
    same_size = {0: ("attention_mask", 0), 1: ("input_ids", 1), 2: ("attention_mask", 1)}
    for node in graph.node:
        if TREE_MASK not in node.input:
            continue
        if node.op_type not in ("Shape", "And"):
            raise RuntimeError(f"{path}: {TREE_MASK} feeds a {node.op_type}; only And broadcasts it.")
        if node.op_type == "Shape":
            attrs = {a.name: a.i for a in node.attribute}
            start = attrs.get("start", 0)
            if attrs.get("end") != start + 1 or start not in same_size:
                raise RuntimeError(f"{path}: {TREE_MASK}'s shape is read as a whole, not size by size.")
            source, dim = same_size[start]
            node.input[0] = source
            del node.attribute[:]
            node.attribute.extend(helper.make_attribute(k, v) for k, v in (("start", dim), ("end", dim + 1)))
    graph.initializer.append(numpy_helper.from_array(np.ones((1, 1, 1), dtype=np.bool_), TREE_MASK))
    for dim, name in zip(tree.type.tensor_type.shape.dim, ("tree_batch", "tree_new", "tree_width")):
        dim.dim_param = name  # not the other inputs' sizes: the default is [1, 1, 1]
    onnx.save(model, str(path), save_as_external_data=external, location=path.name + ".data")
