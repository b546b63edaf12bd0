# test_package_layers.py — the Python package imports only downward: each module of tpnorm
# imports only from the layers below its own (ARCHITECTURE.md, "The Python package"), so there is
# no import circle and a reader finds an op's Python by going down the layers. Read from the
# source files' import statements (ast), all of them, function-level imports included.
import ast
import os

import tpnorm

# Bottom to top; a module may import from the layers below its own only.
LAYERS = [
    {"_tpnorm", "_build", "_autograd"},  # the C++ module, what the build wrote
    {"comm"},                            # communicators
    {"_eager"},                          # per op: allocate outputs, make the C++ call
    {"library"},                         # the torch.library ops
    {"functional", "norm_classes"},      # the public functions (dispatch); model classes probed
    {"dtensor"},                         # DTensor inputs
    {"batched", "modules"},              # K row norms; torch.nn modules
    {"parallel"},                        # ParallelStyles, full state dicts, Mamba-2 mixers
    {"__init__", "__main__"},            # the package's face
]


def _layer(name):
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    return None


def _imports(path):
    """The tpnorm modules `path` imports (relative imports of the package)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out |= {a.name for a in node.names}
    return out


def test_every_module_imports_only_downward():
    pkg = os.path.dirname(tpnorm.__file__)
    report = []
    for fn in sorted(os.listdir(pkg)):
        if not fn.endswith(".py"):
            continue
        me = fn[:-3]
        mine = _layer(me)
        if mine is None:
            report.append(f"{me}: in no layer of LAYERS (place it)")
            continue
        for dep in sorted(_imports(os.path.join(pkg, fn))):
            theirs = _layer(dep)
            if theirs is None or theirs >= mine:
                report.append(f"{me} (layer {mine}) imports {dep} (layer {theirs})")
    assert not report, "\n".join(report)
