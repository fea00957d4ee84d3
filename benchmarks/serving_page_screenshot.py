"""A screenshot of the page `serving.py --http` shows at GET /, for the docs: the system's
headless Chromium (driven by Playwright, nothing downloaded) translates a few sentences with
an exported model, chooses the first and hovers one of its target pieces.

  python -m benchmarks.serving_page_screenshot --model exported --output docs/serving_page.png \
      [--sentences "A man is riding a bike.|Two dogs play in the snow."] [--hover 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from tests.test_serving_page import CHROMIUM, CHROMIUM_ARGS


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', required=True, help='a folder written by export.py --format jax')
  parser.add_argument('--output', required=True, help='the PNG to write')
  parser.add_argument('--sentences', default='A man in a blue shirt is riding a bike.|'
                      'Two dogs play in the snow.|A girl sits on a bench in the park.',
                      help="'|'-separated sentences to type")
  parser.add_argument('--hover', type=int, default=1, help='the target piece to hover')
  args = parser.parse_args(argv)
  from playwright.sync_api import sync_playwright
  sys.path.insert(0, args.model)
  import serving
  translator = serving.ExportedTranslator(args.model)
  server = serving.make_http_server(translator, '127.0.0.1', 0, log=open(os.devnull, 'w'))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    with sync_playwright() as playwright:
      browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
      page = browser.new_page(viewport={'width': 1280, 'height': 760})
      page.goto(f'http://127.0.0.1:{server.server_port}/')
      page.wait_for_selector('#nbest option', state='attached')
      page.click('#source')
      page.keyboard.type('\n'.join(args.sentences.split('|')))
      page.click('#translate')
      page.wait_for_function('document.querySelectorAll("#results .translation.pending")'
                             '.length === 0', timeout=600_000)
      page.click('#results li:first-child')
      page.hover(f'#heatmap tbody tr:nth-child({args.hover + 1}) th')
      page.screenshot(path=args.output, full_page=True)
      browser.close()
  finally:
    server.shutdown()
    server.server_close()
  print(f'wrote {args.output}')


if __name__ == '__main__':
  main()
