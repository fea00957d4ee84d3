"""glibc_malloc: which tunables are added, and the restart that applies them."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from nmt import glibc_malloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_missing_tunables_keeps_the_users_values():
  assert glibc_malloc.missing_tunables({}) == list(glibc_malloc.TUNABLES)
  users = {'GLIBC_TUNABLES': 'glibc.malloc.arena_max=4:glibc.malloc.hugetlb=0'}
  missing = glibc_malloc.missing_tunables(users)
  assert [t.split('=')[0] for t in missing] == ['glibc.malloc.mmap_max',
                                                 'glibc.malloc.trim_threshold']


@pytest.mark.skipif(not sys.platform.startswith('linux') or platform.libc_ver()[0] != 'glibc',
                    reason='the restart only happens on Linux with glibc')
@pytest.mark.parametrize('opt_out, platforms', [(False, ''), (True, ''), (False, 'cpu'),
                                               (False, 'cuda'), (False, 'tpu,cpu')])
def test_restart_sets_the_tunables_once_and_only_on_cpu(tmp_path, opt_out, platforms):
  script = tmp_path / 'prog.py'
  script.write_text(textwrap.dedent(f"""
      import os, sys
      sys.path.insert(0, {ROOT!r})
      print('start', flush=True)
      from nmt import glibc_malloc
      glibc_malloc.reexec_with_malloc_settings()
      print('tunables', os.environ.get('GLIBC_TUNABLES', ''), 'args', sys.argv[1:])
      """))
  env = {k: v for k, v in os.environ.items() if k not in ('GLIBC_TUNABLES', glibc_malloc.OPT_OUT)}
  env['GLIBC_TUNABLES'] = 'glibc.malloc.arena_max=2'
  env.pop('JAX_PLATFORMS', None)
  if platforms:
    env['JAX_PLATFORMS'] = platforms
  if opt_out:
    env[glibc_malloc.OPT_OUT] = '1'
  out = subprocess.run([sys.executable, str(script), 'a', '--b=c'], env=env, check=True,
                       capture_output=True, text=True).stdout.splitlines()
  final = out[-1].split()
  assert final[-2:] == ["['a',", "'--b=c']"]  # Arguments survive the restart.
  tunables = final[1].split(':')
  if opt_out or platforms.split(',')[0] in ('cuda', 'tpu'):  # GPU/TPU runs never restart.
    assert out.count('start') == 1 and tunables == ['glibc.malloc.arena_max=2']
  else:
    # Restarted exactly once; the user's arena_max kept, the other three added.
    assert out.count('start') == 2
    assert tunables == ['glibc.malloc.arena_max=2'] + list(glibc_malloc.TUNABLES[1:])
