"""The house stays one-way and plugins stay one place.

1. No code outside the spec definitions compares a training engine's, rollout backend's, advantage
   estimator's or algorithm's name: it asks the spec (rlframe.plugins, rlframe.algos.registry,
   rlframe/config/algorithms.py). The scan reads every module's syntax tree for a comparison (==,
   !=, in, not in) with a registered name, or of a `strategy`, `backend` or `adv_estimator` value
   with a string.
2. Imports run one way, bottom to top (LAYERS): a module imports only from its own layer or below,
   lazily inside a function too. The single controller imports no trainer, workers import nothing
   of the driver's application, config imports no worker.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlframe"

# Where plugin names may be written down and compared: the specs and registries themselves.
SPEC_FILES = {
    "rlframe/plugins/registry.py", "rlframe/plugins/engines.py", "rlframe/plugins/backends.py",
    "rlframe/algos/registry.py", "rlframe/config/algorithms.py",
}


def _is_spec_file(rel: str) -> bool:
    return rel in SPEC_FILES or rel.endswith(("/spec.py", "_spec.py"))


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        yield rel, ast.parse(path.read_text(), filename=rel)


def _plugin_names() -> set[str]:
    from rlframe.algos.registry import ADVANTAGE_ESTIMATORS
    from rlframe.config.algorithms import ALGORITHMS
    from rlframe.plugins import ROLLOUT_BACKENDS, TRAIN_ENGINES

    return set(TRAIN_ENGINES.names()) | set(ROLLOUT_BACKENDS.names()) | set(ADVANTAGE_ESTIMATORS.names()) | set(ALGORITHMS)


def _strings(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _names_a_plugin_key(node) -> bool:
    """`x.strategy`, `x.backend`, `x.adv_estimator`, `row["strategy"]`, `strategy` ..."""
    keys = ("strategy", "backend", "adv_estimator")
    if isinstance(node, ast.Attribute):
        return node.attr in keys
    if isinstance(node, ast.Name):
        return node.id in keys
    if isinstance(node, ast.Subscript):
        return _strings(node.slice) & set(keys) != set()
    return False


# Values of those keys that are no plugin's name: rollout.backend's "auto" (the registry's choice), and
# torch.distributed's process-group backends (another meaning of the word)
NOT_PLUGINS = {"auto", "nccl", "gloo"}


def name_comparisons(tree, names: set[str]) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literal = set().union(*(_strings(s) for s in sides))
        if literal & names or (literal - NOT_PLUGINS and any(_names_a_plugin_key(s) for s in sides)):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_code_compares_a_plugin_name():
    names = _plugin_names()
    found = [f"{rel}:{line}: {text}" for rel, tree in _modules() if not _is_spec_file(rel)
             for line, text in name_comparisons(tree, names)]
    assert not found, "compare a spec's traits, not a plugin's name:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for():
    """The scan is not vacuous: each kind of comparison it forbids is found in a snippet."""
    names = {"fsdp", "vllm", "gae"}
    for snippet in ('x = cfg.actor.strategy == "fsdp"', 'y = backend in ("vllm", "hf")', 'z = "gae" != est',
                    'w = row["strategy"] == "new_engine"', 'v = cfg.rollout.backend == "mine"'):
        assert name_comparisons(ast.parse(snippet), names), snippet
    assert not name_comparisons(ast.parse('spec = engine_spec(cfg.actor.strategy); x = spec.lora'), names)


# Layers, bottom to top: a module may import from its own layer and the ones below.
LAYERS = [
    ("rlframe.utils", "rlframe.protocol", "rlframe.plugins", "rlframe.algos", "rlframe.resharding"),
    ("rlframe.config", "rlframe.data", "rlframe.rewards", "rlframe.agents"),
    ("rlframe.single_controller",),
    ("rlframe.workers", "rlframe.agents.openai_endpoint"),
    ("rlframe.controller.lifecycle", "rlframe.controller.cpu_precision"),
    ("rlframe.controller.trainers", "rlframe.controller.preflight", "rlframe.plan", "rlframe.export"),
    ("rlframe.controller.run", "rlframe.controller"),
    ("rlframe.main", "rlframe.cli", "rlframe.jobs", "rlframe"),
]


def layer_of(module: str) -> int:
    """The layer of a dotted module name: its longest prefix in LAYERS."""
    best, level = "", None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, level = p, i
    if level is None:
        raise AssertionError(f"{module} is in no layer of tests/test_architecture.py's LAYERS: give it one")
    return level


def imports_of(rel: str, tree) -> list[tuple[int, str]]:
    """(line, imported rlframe module) of every import statement, at any depth."""
    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
    package = module if rel.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("rlframe")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("rlframe"):
                continue
            # `from rlframe.controller import trainers` imports the submodule
            out += [(node.lineno, f"{base}.{a.name}") if _is_module(f"{base}.{a.name}") else (node.lineno, base)
                    for a in node.names]
    return out


def _is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_imports_run_one_way():
    upward = []
    for rel, tree in _modules():
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        here = layer_of(module)
        for line, target in imports_of(rel, tree):
            if layer_of(target) > here:
                upward.append(f"{rel}:{line}: {module} (layer {here}) imports {target} (layer {layer_of(target)})")
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_every_module_has_a_layer():
    for rel, _ in _modules():
        layer_of(rel[:-3].replace("/", ".").removesuffix(".__init__"))


@pytest.mark.parametrize("module, imported, upward", [
    ("rlframe.single_controller.worker_group", "rlframe.controller.trainers.ppo", True),
    ("rlframe.workers.actor", "rlframe.single_controller.dispatch", False),
    ("rlframe.config.validate", "rlframe.workers.engines.fsdp.engine", True),
    ("rlframe.algos.kl", "rlframe.config.ranges", True),
])
def test_the_layers_order_what_the_design_says(module, imported, upward):
    assert (layer_of(imported) > layer_of(module)) is upward
