"""The package's layers: no module imports one of a higher layer, and no imports form a cycle.

Every import counts, also those inside functions (a function-local import that only dodges a cycle is
still an arrow). The order, lowest first (docs/design.md, "Layout"):

    base       units, version, config, documents, machine, grads, fp32_linear: no other oomb module
    kernels    attention/ (kernels, their torch oracles, the backends) except function.py
    kv         kv/ (the paged store and its host tier), context_parallel (which pages a rank owns)
    sparse     sparse (page selection), sparse_fidelity (the share of the history a selection reads)
    step       attention/function.py (the autograd Function that selects pages and calls a backend),
               models, loss, loss_gradient, moe, compiled_layers, parallel
    engine     engine (forward_backward), shared_context (continuations of one context), evaluate (stage 1
               alone) with perplexity and passkey
    planning   planning/ (memory model, fit, the chooser)
    training   training/ (Trainer, `oomb train`, checkpoints, data, presets, the HF Trainer and TRL integration),
               real_model (a small real model, `--model smollm2`), cli_options (the commands' shared option names)
    tools      tools/ (bench, plan, gradcheck, eval, demo, calibrate)
    cli        cli, __main__, and the package root (its public API)
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "oomb"

LAYERS = [
    ("base", ["oomb.units", "oomb.version", "oomb.config", "oomb.documents", "oomb.machine", "oomb.grads",
              "oomb.fp32_linear"]),
    ("kernels", ["oomb.attention"]),
    ("kv", ["oomb.kv", "oomb.context_parallel"]),
    ("sparse", ["oomb.sparse", "oomb.sparse_fidelity"]),
    ("step", ["oomb.attention.function", "oomb.models", "oomb.loss", "oomb.loss_gradient", "oomb.moe",
              "oomb.compiled_layers", "oomb.parallel"]),
    ("engine", ["oomb.engine", "oomb.shared_context", "oomb.evaluate", "oomb.passkey", "oomb.perplexity"]),
    ("planning", ["oomb.planning"]),
    ("training", ["oomb.training", "oomb.real_model", "oomb.cli_options"]),
    ("tools", ["oomb.tools"]),
    ("cli", ["oomb.cli", "oomb.__main__", "oomb"]),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    """Index in LAYERS of the longest prefix naming ``module`` (a package or one module; "oomb" itself names
    only the package root)."""
    best, length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = prefix != "oomb" and module.startswith(prefix + ".")
            if (module == prefix or inside) and len(prefix) > length:
                best, length = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    return best


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The oomb modules ``module`` imports anywhere in its file (``from x import name``: x.name where that is
    a module, else x)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name == "oomb" or name.startswith("oomb."))
    return {name if name in known else name.rpartition(".")[0] for name in found} - {module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, set(modules)) for module, path in modules.items()}


def test_every_module_has_a_layer():
    for module in _modules():
        _layer(module)


def test_no_module_imports_a_higher_layer():
    upward = [f"{module} ({LAYERS[_layer(module)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
              for module, targets in _graph().items() for target in sorted(targets)
              if _layer(target) > _layer(module)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    """Depth-first search over every import (a package's __init__ counts as the package)."""
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)
