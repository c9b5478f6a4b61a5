"""Which device a rank trains on: the spec's cluster.gpu decides together with what CUDA sees, so a CPU recipe
on a GPU machine stays on the CPU (its 8 ranks would otherwise ask for 8 GPUs) and a GPU spec on a machine
without one still runs, on the CPU."""

from __future__ import annotations

import pytest
import torch
from spec_utils import TINY, deep_update

from trainctl.runtime.parallel.process_groups import runs_on_gpu
from trainctl.spec.loader import validate_spec


@pytest.mark.parametrize(("gpu", "cuda", "expected"), [
    ("cpu", True, False), ("cpu", False, False), ("h100-sxm", True, True), ("h100-sxm", False, False)])
def test_cluster_gpu_and_cuda_decide_the_device(gpu: str, cuda: bool, expected: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    spec = validate_spec(deep_update(TINY, {"cluster": {"gpu": gpu}}))
    assert runs_on_gpu(spec) is expected
