"""The project's modules import each other without a cycle (read from their import statements)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def module_names() -> dict[str, pathlib.Path]:
  """'train', 'model.decoding', 'configs.tiny', ... -> file, for every project module."""
  files = [*ROOT.glob('*.py'), *ROOT.glob('model/*.py'), *ROOT.glob('configs/*.py'),
           *ROOT.glob('benchmarks/*.py')]
  names = {}
  for path in files:
    parts = path.relative_to(ROOT).with_suffix('').parts
    names['.'.join(parts[:-1]) if parts[-1] == '__init__' else '.'.join(parts)] = path
  return names


def imports_of(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
  """Project modules that `path` imports anywhere (function-level imports included)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names if alias.name in modules)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        submodule = f'{node.module}.{alias.name}'
        if submodule in modules:
          found.add(submodule)
        elif node.module in modules:
          found.add(node.module)
  return found


def test_no_import_cycle_among_the_project_modules():
  modules = module_names()
  graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
  assert graph['decode'] and 'train' not in graph['decode']
  assert 'train' not in graph['translation'] and 'decode' not in graph['train']
  state: dict[str, str] = {}

  def visit(name: str, trail: list[str]) -> None:
    state[name] = 'open'
    for target in sorted(graph[name]):
      assert state.get(target) != 'open', f'import cycle: {" -> ".join(trail + [target])}'
      if target not in state:
        visit(target, trail + [target])
    state[name] = 'done'

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])


def test_the_model_package_has_no_file_io_or_tensorflow():
  for path in ROOT.glob('model/*.py'):
    text = path.read_text(encoding='utf-8')
    assert 'tensorflow' not in text and 'open(' not in text, path
