"""`trainctl data prepare`: turn a text file into a token file the trainer reads."""

from __future__ import annotations

from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import escape, make_console
from trainctl.fileio import write_errors_as_usage

data_app = typer.Typer(help="Prepare training data (token files).", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def prepare_cmd(
    text_file: Path = typer.Argument(..., help="UTF-8 text (documents separated by blank lines) or .jsonl (one "
                                     "document per line); trainctl ships data/sample.txt.", show_default=False),
    out: Path = typer.Argument(..., help="Token file to write (with --format megatron: the dataset prefix).",
                               show_default=False),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="A local Hugging Face tokenizer.json; "
                                          "without it, the byte-level tokenizer (vocab 256)."),
    fmt: str = typer.Option("flat", "--format", help="flat (nanoGPT .bin) or megatron (.bin + .idx)."),
    dtype: str | None = typer.Option(None, "--dtype", help="Token dtype (default: uint16, or the smallest that "
                                     "holds the tokenizer's vocabulary)."),
    eot: str | None = typer.Option(None, "--eot", help="End-of-text token appended to each document (default: "
                                   "the tokenizer's <|endoftext|>, </s>, ...)."),
    json_key: str = typer.Option("text", "--json-key", help="Field of each .jsonl line holding the text."),
) -> None:
    """Tokenize TEXT_FILE into a token file the trainer reads (nanoGPT/Megatron formats)."""
    from trainctl.data.files import ITEMSIZE
    from trainctl.data.prep import prepare, prepare_with_tokenizer
    from trainctl.errors import UsageError

    if fmt not in ("flat", "megatron"):
        raise UsageError(f"--format {fmt!r}: use flat or megatron")
    if tokenizer is None and fmt == "megatron":
        raise UsageError("--format megatron needs --tokenizer (documents end with its end-of-text token)")
    if tokenizer is None and eot is not None:
        raise UsageError("--eot needs --tokenizer: the byte-level tokenizer separates documents by a blank line")
    with write_errors_as_usage(f"output {out}"):  # what the check before cannot foresee: a full disk, a lost mount
        if tokenizer is not None:
            result = prepare_with_tokenizer(text_file, out, tokenizer, fmt=fmt, dtype=dtype, eot=eot,
                                            json_key=json_key)
        else:
            result = prepare(text_file, out, dtype or "uint16", json_key=json_key)
    console = make_console()
    size = result.tokens * ITEMSIZE[result.dtype]
    console.print(f"[green]wrote[/green] {result.documents:,} documents, {result.tokens:,} tokens ({size:,} bytes, "
                  f"{result.dtype}, {result.format}) to {escape(str(result.path))}")
    console.print(f"{'tokenizer' if tokenizer else 'byte-level tokenizer'}: set model.vocab >= {result.vocab}. "
                  "Paste into your spec:")
    print(result.spec_block())  # plain print: no rich markup or wrapping in the pasteable block


@data_app.command("check")
def check_cmd(
    token_file: Path = typer.Argument(..., help="Flat token file (nanoGPT/Megatron .bin).", show_default=False),
    vocab: int = typer.Option(..., "--vocab", min=1, help="The model's vocabulary size (model.vocab).",
                              show_default=False),
    dtype: str = typer.Option("uint16", "--dtype", help="Token dtype: uint16 or uint32."),
) -> None:
    """Check EVERY token of TOKEN_FILE against the vocabulary: count, min, max, ids out of range and where.
    Exit 0 when all ids are < VOCAB, 1 when some are not, 2 for a missing file or a bad option."""
    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from trainctl.data.check import other_dtype_fits, scan, uint32_read_as_uint16
    from trainctl.data.files import ITEMSIZE, open_token_file
    from trainctl.errors import UsageError
    from trainctl.units import decimal_size, dur

    if dtype not in ("uint16", "uint32"):
        raise UsageError(f"--dtype {dtype!r}: use uint16 or uint32")
    tf = open_token_file(token_file, "auto", dtype)  # a Megatron prefix names its own dtype
    token_file, dtype = tf.path, tf.dtype
    size = token_file.stat().st_size
    console = make_console()
    t0 = time.perf_counter()
    with Progress(TextColumn("scanning"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeRemainingColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:  # piped: it would leave a blank line, not a bar
        task = bar.add_task("scan", total=max(1, tf.count))
        result = scan(token_file, dtype, vocab, progress=lambda done, _total: bar.update(task, completed=done))
    dt = time.perf_counter() - t0
    console.print(f"{escape(str(token_file))}: {result.count:,} {dtype} tokens, min {result.min}, max {result.max} "
                  f"(scanned {decimal_size(size)} in {dur(dt)}, {decimal_size(size / max(dt, 1e-9))}/s)")
    if result.out_of_range == 0:
        if tf.format == "flat" and uint32_read_as_uint16(token_file, dtype):
            console.print("[red]every second token is 0[/red]: the file looks like uint32 tokens; try --dtype uint32")
            raise typer.Exit(1)
        console.print(f"[green]ok[/green]: every id is < vocab {vocab}")
        return
    console.print(f"[red]{result.out_of_range:,} ids are outside 0..{vocab - 1}[/red]; the first is "
                  f"{result.first_bad_id} at token offset {result.first_bad_offset:,} "
                  f"(byte {result.first_bad_offset * ITEMSIZE[dtype]:,})")
    other = other_dtype_fits(token_file, dtype, vocab) if tf.format == "flat" else None
    if other:
        console.print(f"the file reads as valid {other} tokens: try --dtype {other} (data.dtype: {other})")
    raise typer.Exit(1)
