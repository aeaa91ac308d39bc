#!/usr/bin/env python3
"""Lists the library's top-level modules, what each imports from the others (`crate::x` paths in non-test code),
and every edge that lies on a cycle; exits 1 if there is one. A stand-in for `cargo modules dependencies
--acyclic`, which needs rust-analyzer's crates to build.

    python3 scripts/module_cycles.py [-v]
"""
import collections
import glob
import os
import re
import sys



def crate_modules(text):
    """The top-level modules named by `crate::` paths, those in `crate::{a, b::c}` groups included."""
    found = re.findall(r"crate::([a-z_][a-z0-9_]*)", text)
    for group in re.finditer(r"crate::\{", text):
        # The group's items at its own depth, each starting with a module's name.
        depth, items, item = 0, [], ""
        for ch in text[group.end():]:
            if ch == "}" and depth == 0:
                break
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                items.append(item)
                item = ""
            else:
                item += ch
        items.append(item)
        for it in items:
            head = re.match(r"\s*([a-z_][a-z0-9_]*)", it)
            if head and head.group(1) != "self":
                found.append(head.group(1))
    return found


root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
uses = collections.defaultdict(lambda: collections.defaultdict(set))
for path in glob.glob(os.path.join(root, "**", "*.rs"), recursive=True):
    rel = os.path.relpath(path, root)
    parts = rel.split(os.sep)
    # The binary's own tree and test-only files are not the library's structure.
    if rel in ("lib.rs", "main.rs") or parts[0] == "cli" or "tests" in parts or rel.endswith("tests.rs"):
        continue
    top = parts[0].removesuffix(".rs")
    text = open(path, encoding="utf-8").read()
    text = re.split(r"#\[cfg\(test\)\]\s*mod tests \{", text)[0]
    text = re.sub(r"//[^\n]*", "", text)
    for module in crate_modules(text):
        if module != top:
            uses[top][module].add(rel)

graph = {module: set(targets) for module, targets in uses.items()}


def reaches(start, goal, seen):
    if start == goal:
        return True
    seen.add(start)
    return any(reaches(n, goal, seen) for n in graph.get(start, ()) if n not in seen)


if "-v" in sys.argv:
    for module in sorted(graph):
        print(f"{module} -> {', '.join(sorted(graph[module]))}")
cyclic = [(a, b) for a in sorted(graph) for b in sorted(graph[a]) if reaches(b, a, set())]
for a, b in cyclic:
    print(f"cycle: {a} -> {b} ({', '.join(sorted(uses[a][b]))})")
print(f"{len(graph)} modules, {sum(len(t) for t in graph.values())} edges, {len(cyclic)} on a cycle")
sys.exit(1 if cyclic else 0)
