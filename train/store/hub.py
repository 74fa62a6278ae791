"""Hugging Face Hub ids: ``hf:ORG/NAME[@REVISION]`` read from the Hub's cache, exports pushed.

``hf:X`` names a local folder when X is one (it always wins), else a Hub repository,
fetched with ``huggingface_hub.snapshot_download`` into the Hub's standard cache
(``HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``): only the files a checkpoint
needs, config.json, the tokenizer's files and the safetensors weights (the planner: only
config.json). ``HF_HUB_OFFLINE=1`` reads the cache alone and ``HF_TOKEN`` authenticates,
as everywhere in the Hugging Face libraries, which read both themselves.
:func:`push` uploads a ``train.export`` folder. Every failure is a ``UsageError`` of
one line.

Nothing here imports jax: ``train/run/config.py`` resolves ``--init-from`` through it.
``huggingface_hub`` is the optional extra ``hub`` (``pip install 'dion-jax[hub]'``).
"""
from __future__ import annotations

import functools
import os
import re

from train.cli import UsageError

# The files of a Hugging Face tokenizer (and the generation defaults beside them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                   "tokenizer.model")
CHECKPOINT_FILES = ("config.json", *TOKENIZER_FILES, "*.safetensors", "model.safetensors.index.json")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_INSTALL = "pip install 'dion-jax[hub]'"


def repo_id(spec: str) -> tuple[str, str | None] | None:
  """``(ORG/NAME, REVISION or None)`` when ``spec`` has the form of a Hub id, else None."""
  name, _, revision = spec.partition("@")
  if not _REPO_ID.match(name) or ("@" in spec and not revision):
    return None
  return name, revision or None


def run_name(spec: str) -> str:
  """The name a run started from ``hf:spec`` takes: the folder's or the repository's."""
  ids = None if os.path.isdir(spec) else repo_id(spec)
  return ids[0].split("/")[1] if ids else os.path.basename(os.path.normpath(spec))


def local_dir(spec: str, weights: bool = True) -> str:
  """The local folder of ``hf:spec``: ``spec`` itself (absolute) when it is a folder or does
  not look like a Hub id (the caller then says it does not exist), else the cached snapshot
  of the repository, fetched when missing. ``weights=False``: config.json only."""
  ids = None if os.path.isdir(spec) else repo_id(spec)
  if ids is None:
    return os.path.abspath(spec)
  return _snapshot(*ids, CHECKPOINT_FILES if weights else ("config.json",))


@functools.lru_cache(maxsize=None)
def _snapshot(name: str, revision: str | None, patterns: tuple[str, ...]) -> str:
  try:
    import huggingface_hub
    from huggingface_hub import constants, errors
  except ImportError:
    raise UsageError(f"hf:{name}: no local folder of that name, and reading Hub ids needs huggingface_hub:"
                     f" {_INSTALL}, or download the checkpoint into a folder and pass hf:DIR") from None
  where = f"hf:{name}" + (f"@{revision}" if revision else "")
  try:
    return huggingface_hub.snapshot_download(name, revision=revision, allow_patterns=list(patterns))
  except errors.GatedRepoError:
    raise UsageError(f"{where}: the repository is gated; accept its terms on the Hub and set HF_TOKEN") from None
  except errors.RepositoryNotFoundError:
    raise UsageError(f"{where}: no such repository on the Hub (nor a local folder {name}); check the name,"
                     " or set HF_TOKEN for a private one") from None
  except errors.RevisionNotFoundError:
    raise UsageError(f"{where}: the repository has no revision {revision}") from None
  except errors.LocalEntryNotFoundError:
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
    raise UsageError(f"{where}: not in the Hugging Face cache {constants.HF_HUB_CACHE} and {why}; fetch it once"
                     " with a network (or point HF_HUB_CACHE at a cache that holds it), or pass a local folder"
                     " hf:DIR") from None
  except errors.HfHubHTTPError as e:
    raise UsageError(f"{where}: the Hub answered {str(e).splitlines()[0]}") from None


def _api():
  try:
    from huggingface_hub import HfApi
  except ImportError:
    raise UsageError(f"--push-to-hub needs huggingface_hub: {_INSTALL}") from None
  return HfApi()


def check_repo(repo: str) -> None:
  """Raises UsageError unless ``repo`` names a repository, ORG/NAME (no revision)."""
  if repo_id(repo) is None or "@" in repo:
    raise UsageError(f"--push-to-hub {repo}: expected ORG/NAME, a Hub model repository")


def push(folder: str, repo: str, private: bool = False) -> str:
  """Uploads ``folder`` (a ``train.export`` checkpoint) to the model repository ``repo``
  (created when missing) as one commit; returns the commit's URL."""
  check_repo(repo)
  api = _api()
  from huggingface_hub import errors

  try:
    api.create_repo(repo, private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo, folder_path=folder,
                               commit_message=f"Upload {os.path.basename(os.path.normpath(folder))} (dion-jax train.export)")
  except errors.HfHubHTTPError as e:
    raise UsageError(f"--push-to-hub {repo}: the Hub answered {str(e).splitlines()[0]}; set HF_TOKEN to a token"
                     " that may write there") from None
  return getattr(commit, "commit_url", str(commit))
