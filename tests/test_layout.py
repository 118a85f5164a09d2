"""The package layout: no file outside jmp_train/_src reaches into another
module's private names (issue 12's AST count)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _reaches(path: pathlib.Path) -> list[str]:
  """`mod._name` on an imported jmp_train module, and `from jmp_train.x
  import _name`, in one file."""
  tree = ast.parse(path.read_text())
  modules, found = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules |= {
        a.asname or a.name.split(".")[0]
        for a in node.names
        if a.name.startswith("jmp_train")
      }
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
      "jmp_train"
    ):
      for a in node.names:
        if a.name.startswith("_") and not a.name.startswith("__"):
          found.append(f"{node.lineno}: from {node.module} import {a.name}")
        else:
          modules.add(a.asname or a.name)
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and node.attr.startswith("_")
      and not node.attr.startswith("__")
    ):
      base = node.value
      while isinstance(base, ast.Attribute):
        base = base.value
      if isinstance(base, ast.Name) and base.id in modules:
        found.append(f"{node.lineno}: {ast.unparse(node)}")
  return found


def test_the_counter_sees_a_private_reach(tmp_path):
  probe = tmp_path / "probe.py"
  probe.write_text(
    "from jmp_train import fp8\nfrom jmp_train.x import _y\nfp8._states\n"
  )
  assert _reaches(probe) == [
    "2: from jmp_train.x import _y",
    "3: fp8._states",
  ]


def test_no_private_reaches_outside_src():
  files = [
    p
    for folder in ("jmp_train", "tests", "examples", "benchmarks")
    for p in (ROOT / folder).rglob("*.py")
    if "_src" not in p.relative_to(ROOT).parts
  ]
  assert len(files) > 30
  found = {str(p.relative_to(ROOT)): r for p in files if (r := _reaches(p))}
  assert found == {}
