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
    "distributed": {"reference", "routing", "experts"},
    "nn": {"reference", "routing", "experts", "distributed"},
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
