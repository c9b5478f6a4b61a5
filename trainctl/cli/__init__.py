"""The `trainctl` command (typer): parse, call one function of a lower layer, print with rich, exit codes.

    app.py            the typer app, error handling and exit codes; every *_cmd.py registers on it
    options.py        options shared by every command that reads a spec; the embedded default spec
    console.py        the one way a command makes a rich Console; jsonout.py the one way it prints --json
    *_cmd.py          one command or command group each (launch, resume, plan, calibrate, mfu-report, ...)

No torch at import: a command that trains or measures imports it in its own body.
"""
