"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'


def python_blocks() -> list[str]:
  return re.findall(r'```python\n(.*?)```', README.read_text(encoding='utf-8'), re.DOTALL)


def test_readme_python_examples_run():
  blocks = python_blocks()
  assert len(blocks) >= 2
  for block in blocks:
    namespace: dict = {}
    exec(compile(block, str(README), 'exec'), namespace)  # noqa: S102 - the README's own code.
    sequences, scores = namespace['sequences'], namespace['scores']
    assert sequences.ndim == 3 and scores.shape == sequences.shape[:2]
    assert (sequences[..., 0] != 0).all()  # Every output starts with a real token.
