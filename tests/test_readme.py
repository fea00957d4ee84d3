"""The Python examples of README.md and docs/*.md run as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]


def python_blocks() -> list[tuple[pathlib.Path, int, str]]:
  """Every ```python block of the pages: (page, its number in the page, its code)."""
  return [(page, number, code) for page in PAGES for number, code in enumerate(
      re.findall(r'```python\n(.*?)```', page.read_text(encoding='utf-8'), re.DOTALL))]


def test_the_docs_have_python_examples():
  assert len(python_blocks()) >= 2


@pytest.mark.parametrize('page, number, code', python_blocks(),
                         ids=[f'{page.name}-{number}' for page, number, _ in python_blocks()])
def test_python_example_runs(page, number, code):
  namespace: dict = {}
  where = f'{page.relative_to(ROOT)}, python block {number}'
  exec(compile(code, where, 'exec'), namespace)  # noqa: S102 - the docs' own code.
  if 'sequences' in namespace:  # A search's results.
    sequences, scores = namespace['sequences'], namespace['scores']
    assert sequences.ndim == 3 and scores.shape == sequences.shape[:2]
    assert (sequences[..., 0] != 0).all()  # Every output starts with a real token.
