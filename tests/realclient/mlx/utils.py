"""mlx.utils for the stand-in: the tree helpers mlx-lm's caches call.  A tree
is nested lists, tuples and dicts; anything else is a leaf."""

from __future__ import annotations

from typing import Any, Callable


def tree_map(fn: Callable, tree: Any, *rest: Any, is_leaf: Callable | None = None) -> Any:
    if is_leaf is not None and is_leaf(tree):
        return fn(tree, *rest)
    if isinstance(tree, (list, tuple)):
        out = [tree_map(fn, child, *(r[i] for r in rest), is_leaf=is_leaf)
               for i, child in enumerate(tree)]
        return type(tree)(out) if isinstance(tree, tuple) else out
    if isinstance(tree, dict):
        return {k: tree_map(fn, v, *(r[k] for r in rest), is_leaf=is_leaf)
                for k, v in tree.items()}
    return fn(tree, *rest)


def tree_flatten(tree: Any, prefix: str = "", is_leaf: Callable | None = None) -> list:
    if (is_leaf is None or not is_leaf(tree)) and isinstance(tree, (list, tuple)):
        out = []
        for i, child in enumerate(tree):
            out.extend(tree_flatten(child, f"{prefix}.{i}" if prefix else str(i), is_leaf))
        return out
    if (is_leaf is None or not is_leaf(tree)) and isinstance(tree, dict):
        out = []
        for k, v in tree.items():
            out.extend(tree_flatten(v, f"{prefix}.{k}" if prefix else str(k), is_leaf))
        return out
    return [(prefix, tree)]


def tree_unflatten(pairs: list) -> Any:
    if len(pairs) == 1 and pairs[0][0] == "":
        return pairs[0][1]
    root: dict = {}
    for key, value in pairs:
        node = root
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node):
            return [build(node[str(i)]) for i in range(len(node))]
        return {k: build(v) for k, v in node.items()}

    return build(root)


def tree_reduce(fn: Callable, tree: Any, initializer: Any = None,
                is_leaf: Callable | None = None) -> Any:
    acc = initializer
    for _, leaf in tree_flatten(tree, is_leaf=is_leaf):
        acc = leaf if acc is None else fn(acc, leaf)
    return acc
