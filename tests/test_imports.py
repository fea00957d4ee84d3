"""The project's layout holds: no import cycle, the model package free of file I/O and
TensorFlow, the generic searches free of the Transformer and of CPU code, the library package
free of the commands and recipes, and no library module over 500 lines."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMANDS = ('train', 'decode', 'export', 'serving', 'plot_attention', 'average')
MAX_LINES = 500


def module_names() -> dict[str, pathlib.Path]:
  """'train', 'model.search', 'nmt.runs', 'configs.tiny', ... -> file, for every project module."""
  files = [*ROOT.glob('*.py'), *ROOT.glob('model/**/*.py'), *ROOT.glob('nmt/*.py'),
           *ROOT.glob('configs/*.py'), *ROOT.glob('benchmarks/*.py')]
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


def import_graph() -> dict[str, set[str]]:
  modules = module_names()
  return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_no_import_cycle_among_the_project_modules():
  graph = import_graph()
  assert graph['decode'] and 'train' not in graph['decode'] and 'decode' not in graph['train']
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
  for path in ROOT.glob('model/**/*.py'):
    text = path.read_text(encoding='utf-8')
    assert 'tensorflow' not in text and 'open(' not in text, path


def test_generic_searches_import_neither_the_transformer_nor_cpu_code():
  assert import_graph()['model.search'] <= {'model.tokens'}


def test_libraries_import_no_command_recipe_or_pipeline():
  graph = import_graph()
  for name, targets in graph.items():
    if name.startswith(('nmt', 'model')):
      outside = {t for t in targets if not t.startswith(('nmt', 'model'))}
      assert not outside, f'{name} imports {sorted(outside)}'


def test_library_and_command_modules_stay_under_500_lines():
  for name, path in module_names().items():
    if name.startswith(('benchmarks', 'configs')):
      continue
    lines = len(path.read_text(encoding='utf-8').splitlines())
    assert lines <= MAX_LINES, f'{path.relative_to(ROOT)}: {lines} lines'


def test_the_root_holds_commands_and_the_design_card_only():
  modules = {path.stem for path in ROOT.glob('*.py')}
  assert modules == {*COMMANDS, 'input_pipeline'}, sorted(modules)
