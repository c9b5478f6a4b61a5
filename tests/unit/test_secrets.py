"""Which launcher.env names are credentials (trainctl/launch/secrets.py), what is recorded of a credential given
with --set, and the spec rules of launcher.env_passthrough. The runs themselves: tests/dist/test_launch_secrets.py
(local torchrun) and tests/unit/test_launch_slurm_render.py (the batch script, sbatch's environment)."""

from __future__ import annotations

import pytest
from cli_utils import trainctl
from paths import TINY_RECIPE

from trainctl.launch.secrets import looks_like_credential, redact_override

CREDENTIALS = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GHTOKEN", "WANDB_API_KEY", "OPENAI_APIKEY",
               "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "DB_PASSWORD", "PGPASSWORD",
               "SMTP_PASS", "GITHUB_PAT", "NPM_AUTH", "MY_PRIVATE_VALUE", "GOOGLE_APPLICATION_CREDENTIALS",
               "client_secret"]
SETTINGS = ["OMP_NUM_THREADS", "NCCL_DEBUG", "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES",
            "MONKEY_BUSINESS", "KEYBOARD", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "HF_HOME"]


@pytest.mark.parametrize("name", CREDENTIALS)
def test_credential_names(name: str) -> None:
    assert looks_like_credential(name)


@pytest.mark.parametrize("name", SETTINGS)
def test_setting_names(name: str) -> None:
    assert not looks_like_credential(name)


def test_a_credential_given_with_set_is_recorded_redacted() -> None:
    assert redact_override("launcher.env.HF_TOKEN=abc") == "launcher.env.HF_TOKEN=<redacted>"
    assert redact_override("launcher.env={HF_TOKEN: abc}") == "launcher.env=<redacted>"
    assert redact_override("launcher.env.NCCL_DEBUG=INFO") == "launcher.env.NCCL_DEBUG=INFO"
    assert redact_override("train.steps=9") == "train.steps=9"


@pytest.mark.parametrize(("sets", "needle"), [
    (["launcher.env_passthrough=[9LIVES]"], "launcher.env_passthrough = '9LIVES': not an environment variable "
                                            "name"),
    (["launcher.env_passthrough=[HF_TOKEN]", "launcher.env.HF_TOKEN=x"],
     "launcher.env_passthrough = 'HF_TOKEN': also set in launcher.env. Fix: keep one"),
])
def test_passthrough_rules_exit_2_with_one_line(sets: list[str], needle: str) -> None:
    args = [x for s in sets for x in ("--set", s)]
    out = trainctl("validate", str(TINY_RECIPE), *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert needle in line, line
