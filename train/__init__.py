"""The training commands: ``python -m train.gpt`` and its companions.

They import the top-level packages beside this one (``data``, ``models``, ``dion_jax``).
With an editable install (``pip install -e .``) those are found by setuptools' finder,
which Python asks only after the path: a folder of the same name in the working
directory (say ``data/`` of the user's files, without ``__init__.py``) would be taken as a
namespace package first. Putting this tree on the path lets the real packages win there:
a regular package beats a namespace folder wherever each lies on the path.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in (os.path.abspath(p or os.curdir) for p in sys.path):
  sys.path.append(_ROOT)
