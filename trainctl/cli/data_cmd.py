"""`trainctl data prepare`: turn a text file into a token file the trainer reads."""

from __future__ import annotations

from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import make_console
from trainctl.data_prep import BYTE_VOCAB, ITEMSIZE, prepare

data_app = typer.Typer(help="Prepare training data (token files).", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def prepare_cmd(
    text_file: Path = typer.Argument(..., help="UTF-8 text to tokenize (trainctl ships data/sample.txt).",
                                     show_default=False),
    out: Path = typer.Argument(..., help="Token file to write, e.g. tokens.bin.", show_default=False),
    dtype: str = typer.Option("uint16", "--dtype", help="Token dtype: uint16 or uint32."),
) -> None:
    """Tokenize TEXT_FILE byte by byte (vocab 256) into the flat token file OUT (nanoGPT/Megatron format)."""
    result = prepare(text_file, out, dtype)
    console = make_console()
    size = result.tokens * ITEMSIZE[result.dtype]
    console.print(f"[green]wrote[/green] {result.tokens:,} tokens ({size:,} bytes, {result.dtype}) to {result.path}")
    console.print(f"byte-level tokenizer: set model.vocab >= {BYTE_VOCAB}. Paste into your spec:")
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

    from trainctl.data_check import ITEMSIZE as SCAN_ITEMSIZE
    from trainctl.data_check import other_dtype_fits, scan, uint32_read_as_uint16
    from trainctl.errors import UsageError

    if dtype not in SCAN_ITEMSIZE:
        raise UsageError(f"--dtype {dtype!r}: use uint16 or uint32")
    if not token_file.is_file():
        raise UsageError(f"{token_file}: no such file", hint="pass the token file `data.path` names")
    size = token_file.stat().st_size
    if size % SCAN_ITEMSIZE[dtype]:
        raise UsageError(f"{token_file}: {size} bytes is not a whole number of {dtype} tokens",
                         hint="check --dtype")
    console = make_console()
    t0 = time.perf_counter()
    with Progress(TextColumn("scanning"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("scan", total=max(1, size // SCAN_ITEMSIZE[dtype]))
        result = scan(token_file, dtype, vocab, progress=lambda done, _total: bar.update(task, completed=done))
    dt = time.perf_counter() - t0
    console.print(f"{token_file}: {result.count:,} {dtype} tokens, min {result.min}, max {result.max} "
                  f"(scanned {size / 1e9:.2f} GB in {dt:.2f} s, {size / 1e9 / max(dt, 1e-9):.2f} GB/s)")
    if result.out_of_range == 0:
        if uint32_read_as_uint16(token_file, dtype):
            console.print("[red]every second token is 0[/red]: the file looks like uint32 tokens; try --dtype uint32")
            raise typer.Exit(1)
        console.print(f"[green]ok[/green]: every id is < vocab {vocab}")
        return
    console.print(f"[red]{result.out_of_range:,} ids are >= vocab {vocab}[/red]; the first is "
                  f"{result.first_bad_id} at token offset {result.first_bad_offset:,} "
                  f"(byte {result.first_bad_offset * SCAN_ITEMSIZE[dtype]:,})")
    other = other_dtype_fits(token_file, dtype, vocab)
    if other:
        console.print(f"the file reads as valid {other} tokens: try --dtype {other} (data.dtype: {other})")
    raise typer.Exit(1)
