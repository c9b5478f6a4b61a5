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
