"""The levers for a layout whose data-parallel communication is exposed: reduce the gradients in bf16
(parallel.grad_reduce_dtype) or compress them with PowerSGD (parallel.grad_compression), each priced by the
same Evaluator as the layout itself, so the predicted saving is the difference of two estimates."""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainctl.plan.estimate import Candidate, Estimate, Evaluator

DP_EXPOSED_SHARE = 0.20  # exposed DP communication above this share of the step: the DP_EXPOSED warning
LEVER_RANK = 4  # the PowerSGD rank proposed (Vogels et al. 2019 train at rank 1-4 to the uncompressed accuracy)


@dataclass(frozen=True)
class Lever:
    setting: str  # what to write in the spec
    step_time: float  # the layout's predicted step with it
    saving_s: float  # predicted seconds saved per step
    dp_bytes: float  # DP bytes per GPU per step with it

    def as_dict(self, before: float) -> dict[str, float | str]:
        return {"setting": self.setting, "step_time_s": self.step_time, "saving_s": self.saving_s,
                "saving_fraction": self.saving_s / before if before else 0.0, "dp_bytes": self.dp_bytes}

    def text(self, before: float) -> str:
        return f"{self.setting}: step {self.step_time:.3g} s (-{self.saving_s / before:.0%})"


class Levers:
    """Evaluators of the context with each lever pulled (made once, shared by every layout asked about)."""

    def __init__(self, ev: Evaluator) -> None:
        ctx = ev.ctx
        self.ev = ev
        self.bf16 = (ev.reduction_variant(True, None)
                     if not ctx.grad_reduce_bf16 and ctx.powersgd_rank is None else None)
        self.powersgd = ev.reduction_variant(False, LEVER_RANK) if ctx.powersgd_rank is None else None

    def exposed(self, est: Estimate) -> bool:
        step = est.step_time
        return bool(step) and est.dp_exposed_time is not None and est.dp_exposed_time > DP_EXPOSED_SHARE * step

    def for_layout(self, est: Estimate) -> list[Lever]:
        """The levers that shorten this layout's step (and still fit), best first; [] when its exposed DP
        communication is not above DP_EXPOSED_SHARE of the step."""
        if not self.exposed(est):
            return []
        assert est.step_time is not None
        c = est.cand
        out = []
        if self.bf16 is not None:
            out.append(self._lever(self.bf16, c, "parallel.grad_reduce_dtype: bf16", est.step_time))
        if self.powersgd is not None:
            zero1 = replace(c, zero=min(c.zero, 1))  # PowerSGD compresses the plain-DP and ZeRO-1 all-reduce
            setting = (f"parallel.grad_compression: {{powersgd: {{rank: {LEVER_RANK}}}}}"
                       + (" with parallel.zero: 1" if c.zero > 1 else ""))
            out.append(self._lever(self.powersgd, zero1, setting, est.step_time))
        return sorted((x for x in out if x is not None and x.saving_s > 0), key=lambda x: x.step_time)

    @staticmethod
    def bound(step: float | None, exposed: float) -> bool:
        """A layout's exposed DP time (Evaluator.score_dp) is above DP_EXPOSED_SHARE of its step."""
        return bool(step) and exposed > DP_EXPOSED_SHARE * (step or 0.0)

    def best_pulled(self, bound: list[tuple[Candidate, float]], capacity: float | None, beat: float | None
                    ) -> tuple[Candidate, Lever] | None:
        """The fastest (layout, lever) over DP-bound layouts ((candidate, step less its exposed DP time), as --auto
        collects them while it ranks: a lever that changes the training numerics is proposed only where it is
        what makes a layout fast) that could step faster than `beat`, priced with the fast score as --auto ranks;
        the saving is against the same layout without the lever. None when there is none."""
        cands = [c for c, floor in bound if beat is None or floor < beat]
        best: tuple[float, Candidate, Evaluator, str] | None = None
        for ev, setting in ((self.bf16, "parallel.grad_reduce_dtype: bf16"),
                            (self.powersgd, f"parallel.grad_compression: {{powersgd: {{rank: {LEVER_RANK}}}}}")):
            if ev is None:
                continue
            for c in cands:
                if ev is self.powersgd and c.zero > 1:
                    continue
                step, mem = ev.score(c)
                if step and (capacity is None or mem <= capacity) and (best is None or step < best[0]):
                    best = (step, c, ev, setting)
        if best is None:
            return None
        step, c, ev, setting = best
        plain = self.ev.evaluate(c, detail=False)
        if not self.exposed(plain):
            return None
        assert plain.step_time is not None
        lever = self._lever(ev, c, setting, plain.step_time)
        return (c, lever) if lever is not None and lever.saving_s > 0 else None

    @staticmethod
    def _lever(ev: Evaluator, c: Candidate, setting: str, before: float) -> Lever | None:
        e = ev.evaluate(c, detail=False)
        if e.step_time is None or not e.fits:
            return None
        return Lever(setting, e.step_time, before - e.step_time, e.comm_bytes["dp"] + e.comm_bytes.get("expert_dp", 0))
