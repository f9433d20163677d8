"""``ckptdb export``: a committed checkpoint as Hugging Face safetensors, recorded.

Registered on the ``ckptdb`` group when the package loads (see ``__init__``);
the work is :meth:`ckptdb.RunReader.export`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .. import textout as clifmt
from ..exports import FORMATS, ExportResult
from ..exports.writing import DEFAULT_MAX_SHARD_SIZE
from ..reader import RunReader
from . import DB_URL, JSON, ROOT, main


@main.command()
@ROOT
@click.option("--stream", default=None, help="Stream (default: 'model'; 'best' with --best).")
@click.option("--step", type=int, default=None, help="The checkpoint of this step.")
@click.option("--best", "best", is_flag=True, help="The best checkpoint of a top-K stream.")
@click.option("--latest", "latest", is_flag=True, help="The latest checkpoint (the default).")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="safetensors",
    show_default=True,
    help="What to write.",
)
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory to create (absent or empty; never inside the run).",
)
@click.option(
    "--key",
    default=None,
    help="The entry of a saved dict that holds the weights (e.g. model).",
)
@click.option(
    "--max-shard-size",
    default=DEFAULT_MAX_SHARD_SIZE,
    show_default=True,
    help="Split the weights into shards with an index above this size (bytes, 500MB, 2GiB).",
)
@click.option(
    "--trust-pickle",
    is_flag=True,
    help="Unpickle a file holding more than tensors (only files you trust).",
)
@DB_URL
@JSON
def export(
    root: Path,
    stream: str | None,
    step: int | None,
    best: bool,
    latest: bool,
    fmt: str,
    to: Path,
    key: str | None,
    max_shard_size: str,
    trust_pickle: bool,
    db_url: str | None,
    as_json: bool,
) -> None:
    """Export a committed checkpoint as safetensors into a new directory, and record it.

    The checkpoint is verified against its row first. A state dict saved
    with torch.save (--key picks one entry), a Lightning .ckpt, an HF Trainer
    checkpoint-N/ (config and tokenizer copied: from_pretrained(DIR) loads
    it) or a sharded DCP checkpoint (consolidated one tensor at a time).
    The export appears in ckptdb list and is verified by ckptdb check.

    \b
    Example:
      ckptdb export runs/exp1 --best --to exported/best
      ckptdb export runs/exp1 --step 800 --key model --to exported/step800
    """
    chosen = [flag for flag, given in (("--step", step is not None), ("--best", best)) if given]
    if latest:
        chosen.append("--latest")
    if len(chosen) > 1:
        raise click.UsageError(f"give one of --step, --best, --latest (got {' and '.join(chosen)})")
    which: str | int = step if step is not None else "best" if best else "latest"
    with RunReader(root, db_url=db_url) as reader:
        result = reader.export(
            which,
            to=to,
            stream=stream,
            format=fmt,
            key=key,
            max_shard_size=_size(max_shard_size),
            trust_pickle=trust_pickle,
        )
    if as_json:
        click.echo(clifmt.to_json(as_dict(result)))
        return
    _show(result)


def _size(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def as_dict(result: ExportResult) -> dict[str, Any]:
    export = result.export
    return {
        "id": export.id,
        "checkpoint_id": export.checkpoint_id,
        "stream": export.stream,
        "step": export.step,
        "format": export.format,
        "path": str(export.path),
        "size": export.size,
        "hash": export.hash,
        "tensors": export.tensors,
        "files": [vars(f) for f in export.files],
        "skipped": list(result.skipped),
        "aliases": result.aliases,
    }


def _show(result: ExportResult) -> None:
    export = result.export
    click.echo(
        f"exported stream {export.stream!r} step {export.step} to {export.path}: "
        f"{export.tensors} tensor(s), {len(export.files)} file(s), "
        f"{clifmt.human_size(export.size)}"
    )
    for left, kept in sorted(result.aliases.items()):
        click.echo(f"  {left}: the same tensor as {kept}, written once (tied weights)")
    if result.skipped:
        click.echo(f"  left out (not tensors): {', '.join(result.skipped)}")
