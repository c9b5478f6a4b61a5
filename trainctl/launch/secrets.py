"""Credentials in the launch environment: handed to the ranks, never written to the run directory. No torch.

A run directory is read by others (files get the umask's mode, 0644 under 022) and kept for months, so a
value in it is published. Variables reach the ranks two ways (docs/design/launch.md, "Secrets"):

- `launcher.env: {NAME: value}` is written into spec.yaml, launch.sh and job.json, except when NAME looks
  like a credential (`looks_like_credential`): then its value is moved into this process's environment, the
  frozen spec lists NAME under `launcher.env_passthrough` instead, and the CLI says so.
- `launcher.env_passthrough: [NAME, ...]` takes each NAME from the environment trainctl runs in; only the
  name is written. Every launcher hands its own environment on: local torchrun inherits it, sbatch exports it
  to the job (its default `--export=ALL`; Slurm keeps it for requeues), srun to the tasks.

A launch or resume whose passthrough variable is not set stops before anything runs (exit 2).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, MutableMapping

from trainctl.errors import UsageError
from trainctl.spec import RunSpec

# Which names are credentials: the one list (docs/launching.md says it in words, and
# tests/unit/test_hostile_input.py holds the page to it). Case is ignored. Erring towards "credential" costs
# only that the value must be exported again for `trainctl resume`.
# Anywhere in the name: SECRETKEY, MYPASSWORD1, AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS.
CREDENTIAL_ANYWHERE = ("SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "PRIVATE", "APIKEY")
# A whole word of the name (words are split at underscores and digits): WANDB_API_KEY, SMTP_PASS, GITHUB_PAT.
CREDENTIAL_WORDS = ("KEY", "KEYS", "PASS", "AUTH", "PAT", "COOKIE")
# The end of a word: HF_TOKEN, GHTOKEN, TOKEN2; not TOKENIZERS_PARALLELISM.
CREDENTIAL_WORD_ENDINGS = ("TOKEN", "TOKENS")
REDACTED = "<redacted>"


def looks_like_credential(name: str) -> bool:
    upper = name.upper()
    if any(part in upper for part in CREDENTIAL_ANYWHERE):
        return True
    return any(w in CREDENTIAL_WORDS or w.endswith(CREDENTIAL_WORD_ENDINGS) for w in re.split(r"[^A-Z]+", upper))


def credential_names(env: Mapping[str, str]) -> list[str]:
    """The names in `launcher.env` whose values are held back."""
    return [k for k in env if looks_like_credential(k)]


def hold_back(spec: RunSpec, environ: MutableMapping[str, str] | None = None) -> RunSpec:
    """The spec with every credential of `launcher.env` moved to `launcher.env_passthrough`, its value put into
    `environ` (this process's environment by default, which the launchers hand to the ranks); then every
    passthrough variable must be set there (UsageError naming the missing ones)."""
    target = os.environ if environ is None else environ
    lz = spec.launcher
    moved = credential_names(lz.env)
    if moved:
        for name in moved:
            target[name] = lz.env[name]
        launcher = lz.model_copy(update={"env": {k: v for k, v in lz.env.items() if k not in moved},
                                         "env_passthrough": [*lz.env_passthrough,
                                                             *(n for n in moved if n not in lz.env_passthrough)]})
        spec = spec.model_copy(update={"launcher": launcher})
    missing = [n for n in spec.launcher.env_passthrough if n not in target]
    if missing:
        one = len(missing) == 1
        raise UsageError(f"launcher.env_passthrough = {spec.launcher.env_passthrough}: {', '.join(missing)} "
                         f"{'is' if one else 'are'} not set in this environment, where the ranks take "
                         f"{'it' if one else 'them'} from (trainctl never writes a credential to the run "
                         f"directory). Fix: export {missing[0]}=... and run the command again")
    return spec


def redact_override(override: str) -> str:
    """`--set launcher.env.HF_TOKEN=v` as it may be recorded (events.jsonl): the value replaced."""
    key, sep, _ = override.partition("=")
    if sep and key.strip().startswith("launcher.env") and (
            key.strip() == "launcher.env" or looks_like_credential(key.strip().rsplit(".", 1)[-1])):
        return f"{key}={REDACTED}"
    return override


def require_lines(names: Iterable[str], where: str) -> list[str]:
    """bash lines for a launch script: stop with a clear message when a passthrough variable is missing."""
    return [f': "${{{n}:?is not set: launcher.env_passthrough takes it from the environment {where}}}"'
            for n in names]


def export_conflicts(args: Iterable[str], names: list[str]) -> str | None:
    """An `--export=...` among sbatch/srun arguments that would keep passthrough variables from the job."""
    if not names:
        return None
    for a in args:  # always --export=VALUE: the Slurm renderer refuses an option's value as its own item
        if a.startswith("--export="):
            listed = set(a.partition("=")[2].split(","))
            if "ALL" not in listed and not set(names) <= listed:
                return a
    return None
