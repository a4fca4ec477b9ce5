"""``goodput stage``: copy an S3 prefix (or a directory) onto FSx and build the training dataset there."""

from __future__ import annotations

import json
from pathlib import Path

import click


class _RichProgress:
    """``components.stage.dataset.StageProgress`` drawn with rich: files and bytes, with the transfer rate.

    The bars appear on the first ``start``: an error found before the stage begins is the only output."""

    def __init__(self, progress):
        self.progress = progress
        self.files = self.bytes = None

    def __enter__(self) -> "_RichProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.files is not None:
            self.progress.stop()

    def start(self, files: int | None, nbytes: int | None) -> None:
        # First call while listing (totals unknown), second with the totals once the listing is complete.
        if self.files is None:
            self.progress.start()
            self.files = self.progress.add_task("objects", total=files)
            self.bytes = self.progress.add_task("bytes", total=nbytes)
        else:
            self.progress.update(self.files, total=files)
            self.progress.update(self.bytes, total=nbytes, visible=bool(nbytes))

    def tokenizing(self, files: int) -> None:
        self.files = self.progress.add_task("tokenize", total=files)   # later file counts are files tokenized

    def advance(self, files: int = 0, nbytes: int = 0) -> None:
        if files:
            self.progress.update(self.files, advance=files)
        if nbytes:
            self.progress.update(self.bytes, advance=nbytes)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("source")
@click.option("--fsx-root", default="fsx", show_default=True, type=click.Path(path_type=Path),
              help="The FSx mount (a local directory outside the cluster).")
@click.option("--name", required=True, help="Dataset name: the dataset lands in FSX_ROOT/datasets/NAME/VERSION/.")
@click.option("--version", "version", required=True, help="Dataset version.")
@click.option("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS).")
@click.option("--concurrency", default=32, show_default=True,
              help="Parallel GETs of small objects, and as many again of parts of large objects.")
@click.option("--retry-mode", type=click.Choice(["standard", "adaptive"]), default="standard", show_default=True,
              help="botocore retry mode for throttling and 5xx; adaptive also slows down after SlowDown.")
@click.option("--max-attempts", default=10, show_default=True, help="Attempts per request, the first included.")
@click.option("--val-percent", default=5, show_default=True,
              help="When the source has no splits of its own: the share of documents in the validation split, "
                   "drawn by a hash of each document's id (else its file's path and position).")
@click.option("--val-tokens", type=click.IntRange(min=1), default=None,
              help="Instead of --val-percent: about this many tokens of documents in the validation split, drawn by "
                   "the same hash against a share chosen from the source's estimated tokens (recorded in the "
                   "manifest's split_source). Only for a source without splits of its own.")
@click.option("--train-glob", default="",
              help="Comma-separated globs of the training split's files; overrides the source's own splits.")
@click.option("--val-glob", default="",
              help="Comma-separated globs of the validation split's files (alone: every other file trains).")
@click.option("--batch-bytes", default=4 * 1024 * 1024, show_default=True,
              help="Text a tokenizer process holds at once (a batch, or a long document's piece): the bound on "
                   "the stage's memory per process, whatever a file's size or a document's length.")
@click.option("--no-verify-etag", is_flag=True, help="Skip the MD5/ETag check (needed for SSE-KMS buckets).")
@click.option("--tokenizer", default="bytes", show_default=True,
              help="bytes (one token per byte), a tokenizer.json or Hugging Face model directory (or s3:// one), "
                   "or bpe:VOCAB to train a byte-level BPE on the staged text.")
@click.option("--format", "data_format", type=click.Choice(["auto", "text", "jsonl", "parquet"]), default="auto",
              show_default=True, help="File format; auto goes by name: .jsonl[.gz|.zst], .parquet, else text.")
@click.option("--text-field", default="text", show_default=True, help="JSONL field holding a document.")
@click.option("--text-column", default="text", show_default=True, help="Parquet column holding a document.")
@click.option("--include", default="", help="Comma-separated globs of paths to stage, e.g. 'data/*.parquet'.")
@click.option("--exclude", default="", help="Comma-separated globs of paths to leave out.")
@click.option("--bad-records", "bad_record_policy", type=click.Choice(["skip", "fail"]), default="skip",
              show_default=True, help="skip: leave bad records out and report them; fail: stop at the first.")
@click.option("--on-refused", "refused_key_policy", type=click.Choice(["fail", "skip"]), default="fail",
              show_default=True, help="Keys that would land outside the destination: fail before anything is "
                                      "written, or skip them (reported).")
@click.option("--workers", type=int, default=None, help="Tokenizer processes (default: one per core).")
@click.option("--fsx-dra", is_flag=True,
              help="The dataset's raw/ is linked to the bucket (FSx data repository association): preload it "
                   "with `lfs hsm_restore` instead of copying.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (for scripts).")
def stage(source: str, fsx_root: Path, name: str, version: str, endpoint_url: str | None, concurrency: int,
          retry_mode: str, max_attempts: int, val_percent: int, val_tokens: int | None, train_glob: str, val_glob: str,
          batch_bytes: int,
          no_verify_etag: bool, tokenizer: str,
          data_format: str, text_field: str, text_column: str, include: str, exclude: str,
          bad_record_policy: str, refused_key_policy: str, workers: int | None, fsx_dra: bool,
          quiet: bool, as_json: bool) -> None:
    """Stage SOURCE (s3://BUCKET/PREFIX or a directory) into FSX_ROOT/datasets/NAME/VERSION/.

    Objects are fetched in parallel, verified (size, and MD5 where the ETag is one) and renamed into
    place; a rerun skips unchanged objects and resumes an interrupted stage. Keys that would land
    outside the destination are refused (--on-refused). Then the documents are read (text, JSONL,
    Parquet), tokenized on every core, and the token shards and manifest.json are written there.
    Bad records are counted per file and reported (--bad-records). See docs/datasets.md.

    \b
    Examples:
      goodput stage s3://my-bucket/corpus/ --fsx-root /fsx --name corpus --version 1
      goodput stage s3://hf/ds/ --include 'data/*.parquet' --tokenizer bpe:8192 --name ds --version 1
    """
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    from components.stage.dataset import StageError, refused_counts, stage_dataset

    if val_tokens is not None and click.get_current_context().get_parameter_source("val_percent").name != "DEFAULT":
        raise click.UsageError("--val-percent and --val-tokens both size the validation split; give one")
    console = Console(stderr=True)
    columns = [TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn()]
    # Bad arguments raise ValueError before anything is written: the goodput group reports it (one line, exit 2).
    try:
        with _RichProgress(Progress(*columns, console=console, disable=quiet, transient=False)) as progress:
            result = stage_dataset(source, fsx_root, name, version, endpoint_url, max_concurrency=concurrency,
                                   retry_mode=retry_mode, max_attempts=max_attempts, val_percent=val_percent,
                                   verify_etag=not no_verify_etag, fsx_dra=fsx_dra, tokenizer=tokenizer,
                                   data_format=data_format, text_field=text_field, text_column=text_column,
                                   include=include, exclude=exclude, bad_record_policy=bad_record_policy,
                                   refused_key_policy=refused_key_policy, workers=workers, train_glob=train_glob,
                                   val_glob=val_glob, batch_bytes=batch_bytes, val_tokens=val_tokens or 0,
                                   progress=progress)
    except StageError as e:
        if as_json and e.result is not None:
            click.echo(json.dumps(e.result.to_dict()))
        _report_refused(e.result.refused if e.result else [], console.width)
        raise                        # the goodput group prints it as one line (it names the counts), exit 1
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    click.echo(f"{result.dataset_dir}: {result.objects} objects ({result.transferred} transferred, "
               f"{result.transferred_bytes:,} bytes in {result.transfer_s:.1f}s; {result.skipped_unchanged} "
               f"unchanged; {result.removed} removed; {result.excluded} excluded; {result.restored} restored), "
               f"{result.files} files in the dataset, train {result.train_tokens:,} / val {result.val_tokens:,} "
               f"{result.token_dtype} tokens (vocabulary {result.vocab_size:,}; splits {splits_line(result)})"
               + ("" if result.rebuilt else " (unchanged, manifest kept)"), err=as_json)
    bad = result.bad_records or {}
    if bad.get("total"):
        kinds = ", ".join(f"{n} {k}" for k, n in bad["by_kind"].items())
        click.echo(f"warning: {bad['total']} bad records in {bad['files']} files were left out ({kinds}); "
                   f"see bad_records in manifest.json", err=True)
    if result.refused:
        _report_refused(result.refused, console.width)
        click.echo(f"warning: {len(result.refused)} keys were refused and not staged "
                   f"({refused_counts(result.refused)}); the dataset was built without them", err=True)


def splits_line(result) -> str:
    """How the splits were found, in a few words: ``by document, 5%`` or ``layout: validation files``."""
    src = result.split_source or {}
    by = src.get("by", "file")
    if by == "document" and "val_tokens" in src:
        return (f"by document, {src['val_share']:.2%} for validation: val_tokens {src['val_tokens']:,} of about "
                f"{src['estimated_tokens']:,}")
    if by == "document":
        return f"by document, {src['val_percent']}% for validation"
    left = f", {src['left_out_files']} files left out" if src.get("left_out_files") else ""
    if by == "globs":
        return f"by --train-glob/--val-glob{left}"
    found = {"readme": "dataset card", "dataset_info": f"dataset_info ({src.get('declared_in')})"}.get(by, "file names")
    return f"from the source's {found}: {src['val_from']} files for validation{left}"


def _report_refused(refused: list[dict], width: int) -> None:
    from components.stage.dataset import refusal_lines

    for line in refusal_lines(refused, width):
        click.echo(line, err=True)
