"""The page serving.py --http shows at GET /, in a real headless Chromium (the system's, driven
by Playwright; nothing is downloaded): typing a sentence shows its translation, equal to the
JSON API's, and a heatmap with one cell per target piece x source piece, the alignment
highlighted on hover.

`.ci/run` installs Chromium and the playwright package; under CI=true a missing browser fails
the test (tests/conftest.py), elsewhere it is skipped without them.
"""

import json
import os
import sys
import threading
import urllib.request

import pytest

CHROMIUM = os.environ.get('CHROMIUM', '/usr/bin/chromium')
# Headless Chromium as root on a machine without network access: no sandbox, no GPU, and none
# of the background connections it would try at start-up.
CHROMIUM_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
                 '--disable-background-networking', '--disable-component-update', '--disable-sync',
                 '--disable-dev-shm-usage']


def sync_playwright():
  """playwright.sync_api.sync_playwright, or a skip naming what is missing."""
  missing = []
  if not os.access(CHROMIUM, os.X_OK):
    missing.append(f'Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)')
  try:
    from playwright.sync_api import sync_playwright
  except ImportError:
    missing.append("the playwright package (pip install -e '.[test]')")
  if missing:
    message = 'the browser test needs ' + ' and '.join(missing)
    pytest.skip(message)
  return sync_playwright


def open_page(playwright, url: str):
  """A fresh headless Chromium (its own empty profile) showing `url`: (browser, page)."""
  browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
  page = browser.new_page(viewport={'width': 1280, 'height': 860})
  errors = []
  page.on('pageerror', lambda error: errors.append(str(error)))
  page.on('console', lambda message: message.type == 'error' and errors.append(message.text))
  page.goto(url)
  page.errors = errors
  return browser, page


def test_page_translates_and_draws_the_attention(exported_jax, tmp_path):
  playwright_context = sync_playwright()
  sys.path.insert(0, exported_jax)
  try:
    import serving
  finally:
    sys.path.remove(exported_jax)
  translator = serving.ExportedTranslator(exported_jax)
  server = serving.make_http_server(translator, '127.0.0.1', 0, log=open(os.devnull, 'w'))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f'http://127.0.0.1:{server.server_port}'
  sentence = 'Two dogs play in the snow.'
  try:
    with playwright_context() as playwright:
      browser, page = open_page(playwright, url + '/')
      try:
        # /health has answered: the beam size is known.
        page.wait_for_selector('#nbest option', state='attached')
        nbest = int(page.input_value('#nbest'))
        assert nbest == translator.beam_size
        page.click('#source')
        page.keyboard.type(sentence)
        page.click('#translate')
        page.wait_for_selector('#results .translation:not(.pending)', timeout=300_000)
        shown = page.inner_text('#results .translation')

        request = urllib.request.Request(url + '/translate', data=json.dumps(
            {'text': [sentence], 'nbest': nbest, 'attention': True}).encode(), method='POST')
        with urllib.request.urlopen(request, timeout=300) as response:
          api = json.loads(response.read())
        assert shown == api['translations'][0] and shown, (shown, api['translations'])
        best = api['details'][0][0]
        assert page.inner_text('#nbest-list .hypothesis.chosen .text') == best['text']
        assert page.locator('#nbest-list .hypothesis').count() == len(api['details'][0])

        rows, columns = len(best['tokens']), len(best['source_tokens'])
        assert page.locator('#heatmap td.cell').count() == rows * columns
        assert page.locator('#heatmap tbody tr').count() == rows
        assert page.locator('#heatmap thead th.source-piece').all_inner_texts() == (
            best['source_tokens'])
        assert page.locator('#heatmap tbody th').all_inner_texts() == best['tokens']
        # Hovering a target piece outlines the source piece it attends to most.
        last = rows - 1
        page.hover(f'#heatmap tbody tr:nth-child({last + 1}) th')
        highlighted = page.locator('#heatmap td.cell.highlight')
        assert highlighted.count() == 1
        assert highlighted.get_attribute('data-col') == str(best['align'][last])
        assert page.locator('#heatmap th.hover-col').inner_text() == (
            best['source_tokens'][best['align'][last]])
        page.screenshot(path=str(tmp_path / 'page.png'), full_page=True)
        assert os.path.getsize(tmp_path / 'page.png') > 10_000
        assert page.errors == []
      finally:
        browser.close()
  finally:
    server.shutdown()
    server.server_close()
