"""``serve-vllm``'s checks of its own arguments that need neither vLLM nor torch, so that the
command line refuses a mistyped option or path at once (importing vLLM takes 10-20 s on a
CPU box) before it starts the server."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

from .errors import DBSyncError

#: options serve-vllm owns: passing them to vLLM after '--' is a usage error
OWNED_OPTIONS = ("--model", "--host", "--port")


def check_owned_options(extra: Sequence[str]) -> None:
    for flag in OWNED_OPTIONS:
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            raise DBSyncError(f"pass {flag} to serve-vllm itself, not after '--'")


def resolve_model_dir(model: str) -> str:
    """A local directory for ``model``: the path itself, or the Hugging Face cache's snapshot
    for a hub id (never downloads)."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception as exc:
        raise DBSyncError(
            f"cannot find the checkpoint of model {model!r} on this host ({exc}); dbsync needs "
            "its safetensors files to check that published versions fit: pass a local "
            "directory as the model"
        ) from None


def check_model(model: str) -> None:
    """Fail at once, with what to do, when ``model`` names a local path that cannot be a model
    directory, or neither a directory nor a hub id in the local Hugging Face cache (vLLM would
    try it on the hub, with retries, and dbsync needs the checkpoint's files here anyway)."""
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        if not os.path.exists(os.path.join(expanded, "config.json")):
            raise DBSyncError(f"--model {model} has no config.json: pass the directory of a "
                              "Hugging Face checkpoint (config.json, tokenizer, *.safetensors)")
        return
    parent = os.path.dirname(expanded.rstrip(os.sep))
    path_like = (os.path.isabs(expanded) or model.startswith((".", "~"))
                 or expanded.count(os.sep) > 1 or (parent != "" and os.path.isdir(parent))
                 or os.path.exists(expanded))
    if path_like:
        what = "is a file, not a directory" if os.path.exists(expanded) else (
            "no such directory on this host")
        raise DBSyncError(f"--model {model}: {what}; pass the "
                          "directory of a Hugging Face checkpoint (config.json, tokenizer, "
                          "*.safetensors)")
    if importlib.util.find_spec("huggingface_hub") is None:
        return  # (no hub cache to look in: vLLM is missing too, which is said next)
    try:
        resolve_model_dir(model)
    except DBSyncError:
        raise DBSyncError(
            f"--model {model}: no such directory on this host, and no Hugging Face model of "
            "that id in the local cache (dbsync needs the checkpoint's files on this host to "
            "check that versions fit): pass the checkpoint's directory, or download the "
            f"model first (hf download {model})") from None


#: where ``serve-vllm --lora`` writes the adapters it serves, if set (see ``vllm.lora``)
LORA_WORKDIR_ENV = "DBSYNC_LORA_WORKDIR"


def check_lora_workdir() -> None:
    """Raise ``DBSyncError`` if ``$DBSYNC_LORA_WORKDIR`` is set to a directory this process
    cannot create or write (said before vLLM starts, not after)."""
    base = os.environ.get(LORA_WORKDIR_ENV)
    if not base:
        return
    try:
        os.makedirs(base, exist_ok=True)
    except OSError as exc:
        raise DBSyncError(f"{LORA_WORKDIR_ENV}={base}: cannot create it ({exc.strerror or exc});"
                          " give a directory this user may write, or unset it") from None
    if not os.access(base, os.W_OK | os.X_OK):
        raise DBSyncError(f"{LORA_WORKDIR_ENV}={base} is not writable by this user (uid "
                          f"{os.geteuid()}); give a directory it may write, or unset it")
