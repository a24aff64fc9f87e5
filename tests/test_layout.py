"""The package's shape, checked from its source: the layering (nothing imports a package above it), no import
of another package's private names, and no module over 500 lines."""
import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "moeblaze"
# each package may import the ones listed (and the root modules config and launch); the order is the layering
ALLOWED = {
    "reference": set(),
    "routing": {"reference"},
    "experts": {"reference", "routing"},
    "nn": {"reference", "routing", "experts"},
    "distributed": {"reference", "routing", "experts", "nn"},
    "integrations": {"reference", "routing", "experts", "distributed", "nn"},
    "bench": {"reference", "routing", "experts", "distributed", "nn", "integrations"},
    "cli": {"reference", "routing", "experts", "distributed", "nn", "integrations", "bench"},
}


def _imports(path: pathlib.Path):
    """(target module parts under moeblaze, imported names) of every moeblaze import in one file."""
    here = path.relative_to(SRC).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[:-node.level])
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "moeblaze":
                target = node.module.split(".")[1:]
            else:
                continue
            yield target, [a.name for a in node.names]


def test_layering_and_no_private_imports_across_packages():
    bad = []
    for path in SRC.rglob("*.py"):
        package = path.relative_to(SRC).parts[0]
        for target, names in _imports(path):
            top = target[0] if target else ""
            if package in ALLOWED and top in ALLOWED and top != package and top not in ALLOWED[package]:
                bad.append(f"{path.relative_to(SRC)} imports {'.'.join(target)} (above {package})")
            if top != package:
                bad += [f"{path.relative_to(SRC)} imports private {'.'.join(target)}.{n}" for n in names
                        if n.startswith("_") and n != "__version__"]
    assert not bad, bad


def test_no_module_over_500_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


PUBLIC = ["moeblaze", "moeblaze.nn", "moeblaze.experts", "moeblaze.routing", "moeblaze.distributed",
          "moeblaze.reference"]


def test_no_public_function_takes_more_than_8_positional_parameters():
    """Past the tensors, options are keyword-only: no function or method in src/ whose name (and class) is public
    takes more than 8 parameters that may be passed positionally. GPU kernels (@jit) are exempt: their pointers,
    strides and constexprs are positional by nature."""

    def jit(fn) -> bool:
        return any(ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith("jit") for d in fn.decorator_list)

    wide, seen = [], 0
    for path in sorted(SRC.rglob("*.py")):
        scopes = [(ast.parse(path.read_text()), "")]
        while scopes:
            scope, prefix = scopes.pop()
            for node in ast.iter_child_nodes(scope):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    scopes.append((node, f"{node.name}."))
                elif (isinstance(node, ast.FunctionDef) and (node.name == "__init__" or not node.name.startswith("_"))
                      and not jit(node)):
                    seen += 1
                    args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                    if len(args) > 8:
                        wide.append(f"{path.relative_to(SRC)}: {prefix}{node.name}{tuple(args)}")
    assert seen > 300, seen  # the walk reached the package
    assert not wide, wide


def test_nothing_outside_the_package_imports_its_private_names():
    """scripts/, tools/ and benchmarks/ use moeblaze as a user does: through public names only."""
    root = SRC.parents[1]
    bad, seen = [], 0
    for folder in ("scripts", "tools", "benchmarks"):
        for path in (root / folder).rglob("*.py"):
            seen += 1
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "moeblaze":
                    bad += [f"{path.relative_to(root)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
                    bad += [f"{path.relative_to(root)}: {node.module}" for part in node.module.split(".")
                            if part.startswith("_")]
    assert seen > 5, seen
    assert not bad, bad


def test_import_moeblaze_loads_the_library_only():
    """`import moeblaze` loads neither torch nor any part of the package (the `moeblaze` command sets OpenMP's
    options before torch loads); its first name used loads the layers, the op, the routing and the reference: not
    the benchmark harness, the command line, the integrations or torch.distributed's side (each imports its own,
    when asked for)."""
    import subprocess
    import sys

    code = ("import sys, moeblaze; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'moeblaze')));"
            "moeblaze.MoELayer; print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('moeblaze.')}))")
    before, loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout.splitlines()
    assert before == "['moeblaze']", before
    for package in ("bench", "cli", "integrations", "distributed"):
        assert f"'{package}'" not in loaded, loaded
    assert "'experts'" in loaded and "'nn'" in loaded, loaded


def test_the_public_api_states_its_arguments_and_what_it_returns():
    """Every function and class that a public package exports (its __all__) documents each of its parameters under
    "Args:" (by name: none missing, none that is not a parameter), and the functions and modules what they return
    ("Returns:")."""
    import importlib
    import importlib.util
    import inspect
    import re

    import torch

    problems, seen = [], set()
    integrations = [f"moeblaze.integrations.{host}" for host in ("transformers", "torchtitan", "megatron")
                    if importlib.util.find_spec(host)]  # each where its host is installed (the [test] extra)
    for name in PUBLIC + ["moeblaze.configs"] + integrations:
        module = importlib.import_module(name)
        for export in module.__all__:
            obj = getattr(module, export)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            doc = inspect.getdoc(obj) or ""
            if "Args:" not in doc:
                problems.append(f"{name}.{export}: no Args:")
                continue
            block = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
            named = {n for line in block.splitlines() if (m := re.match(r"^    (\w+(?:, \w+)*):", line))
                     for n in m.group(1).split(", ")}
            params = {p.name for p in inspect.signature(obj).parameters.values()
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
            if params - named:
                problems.append(f"{name}.{export}: Args: misses {sorted(params - named)}")
            if named - params:
                problems.append(f"{name}.{export}: Args: names {sorted(named - params)}, not parameters")
            if (inspect.isfunction(obj) or issubclass(obj, torch.nn.Module)) and "Returns:" not in doc:
                problems.append(f"{name}.{export}: no Returns:")
    assert len(seen) >= 30, len(seen)
    assert not problems, problems
